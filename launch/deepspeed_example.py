"""dckpt with DeepSpeed ZeRO, on CPU: train at 2 ranks under ZeRO-2, resume at 3 under
ZeRO-3 (DeepSpeed itself refuses both changes).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node=2 launch/deepspeed_example.py --root /tmp/ds --stage 2 --steps 6
    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node=3 launch/deepspeed_example.py --root /tmp/ds --stage 3 --steps 10

The one change from a stock script is ``dckpt_ds.initialize`` in place of
``deepspeed.initialize``. Each ``save_checkpoint`` is one atomic dckpt commit at
ROOT/global_step<N> (then ROOT/latest); the second run's ``load_checkpoint`` takes the
newest committed tag and reads, per parameter, the ranges its new ZeRO-3 partitions
need. CPU notes: DeepSpeed picks gloo with ``DS_ACCELERATOR=cpu``; torch's Adam
(``torch_adam``) avoids DeepSpeed's compiled optimizer; DeepSpeed's shared-memory
all-reduce op (a JIT build, used only for CPU all-reduce speed) is skipped here.
"""
from __future__ import annotations

import argparse
import importlib
import os

import deepspeed
import torch
from torch import nn

from dckpt.integrations import deepspeed as dckpt_ds

p = argparse.ArgumentParser()
p.add_argument("--root", required=True)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
a = p.parse_args()

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # CPU: no JIT op
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
          "zero_optimization": {"stage": a.stage}}


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 1))


torch.manual_seed(0)
if a.stage == 3:
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build()
else:
    model = build()
engine, _, _, _ = dckpt_ds.initialize(model=model, model_parameters=model.parameters(),
                                      config=config, keep_last=2)
rank = torch.distributed.get_rank()
path, client = engine.load_checkpoint(a.root)  # (None, None) on the first run
if path is not None and rank == 0:
    print(f"resumed {os.path.basename(path)} (epoch {client['epoch']}) at step "
          f"{engine.global_steps} on {engine.dp_world_size} ranks, ZeRO-{a.stage}", flush=True)

gen = torch.Generator().manual_seed(1000 + rank)
while engine.global_steps < a.steps:
    x = torch.randn(4, 16, generator=gen)
    loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if rank == 0:
        print(f"step {engine.global_steps} loss {loss.item():.4f}", flush=True)
    if engine.global_steps % a.every == 0:
        engine.save_checkpoint(a.root, client_state={"epoch": engine.global_steps // 10})
engine.destroy()
