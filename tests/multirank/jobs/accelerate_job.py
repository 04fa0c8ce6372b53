"""A tiny training loop with Accelerate on CPU/gloo ranks (torchrun), FSDP2 through the
CPU shim, with dckpt's DckptAccelerator or the stock Accelerator.

    torchrun --nproc-per-node N accelerate_job.py --impl dckpt|stock --root DIR \
        --steps S --every E [--total-limit L] [--resume] [--kill-at STEP --phase P]
        [--raise-rank R --raise-at STEP] [--async-save] [--hook] [--local-root DIR]

Saves go to ROOT/p/checkpoints/checkpoint_<i> (automatic naming). After each save,
rank r writes ROOT/refs/save-<step>-r<r>.pt: the full model and optimizer state, the
scheduler's last_epoch, the registered object, step, iteration, and a probe drawn from
each RNG right after the save. ``--resume``: load_state() first, then the same record
as ROOT/refs/resumed-<world>-r<r>.pt. ``--kill-at S --phase P``: every rank is
SIGKILLed in the save at step S: dckpt at its fault point P (plan, write, commit,
committed, place, rotate); stock (P = hook) in a save pre-hook (the FSDP model and
optimizer already written). ``--raise-rank R --raise-at S``: rank R's pre-hook raises.
``--local-root DIR``: DckptAccelerator(local_root=DIR), the fast tier (the fault point
``committed`` then kills every rank once its own view is written: the local commit is
complete, its durable copy not begun).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--impl", choices=["dckpt", "stock"], required=True)
p.add_argument("--root", default=None)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--every", type=int, default=2)
p.add_argument("--total-limit", type=int, default=None)
p.add_argument("--resume", action="store_true")
p.add_argument("--kill-at", type=int, default=None)
p.add_argument("--phase", default=None)
p.add_argument("--raise-rank", type=int, default=None)
p.add_argument("--raise-at", type=int, default=None)
p.add_argument("--async-save", action="store_true")
p.add_argument("--load-dir", default=None)
p.add_argument("--local-root", default=None)
p.add_argument("--roots", default=None)  # one process, no torchrun: resume each root
a = p.parse_args()

rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
if a.kill_at is not None and a.impl == "dckpt" and a.phase != "hook":
    pass  # armed below, at the save of that step

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import (DistributedType, FullyShardedDataParallelPlugin,  # noqa: E402
                              ProjectConfiguration)

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                        reshard_after_forward=True)
def main(root: str) -> None:
    global model, opt, sched, counter, acc
    pc = ProjectConfiguration(project_dir=os.path.join(root, "p"),
                              automatic_checkpoint_naming=True, total_limit=a.total_limit)
    if a.impl == "dckpt":
        from dckpt.integrations.accelerate import DckptAccelerator

        acc = DckptAccelerator(cpu=True, fsdp_plugin=plugin, project_config=pc,
                               async_save=a.async_save, local_root=a.local_root)
    else:
        acc = Accelerator(cpu=True, fsdp_plugin=plugin, project_config=pc)
    # the CPU shim (issue 45): Accelerate runs FSDP only on accelerators
    if "LOCAL_RANK" in os.environ:  # under torchrun (not --roots: one plain process)
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin


    class Counter:
        """A registered object: a per-rank value (rank 0's is what a checkpoint holds)."""

        def __init__(self):
            self.n, self.rank = 0, rank

        def state_dict(self):
            return {"n": self.n, "rank": self.rank, "hist": [self.n] * 3}

        def load_state_dict(self, sd):
            self.n, self.rank = sd["n"], sd["rank"]


    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    torch.manual_seed(1234 + rank)
    random.seed(rank)
    np.random.seed(rank)


    def full_state() -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)

        o = StateDictOptions(full_state_dict=True, cpu_offload=False,
                             flatten_optimizer_state_dict=True)
        msd = get_model_state_dict(model, options=o)
        osd = get_optimizer_state_dict(model, opt.optimizer, options=o)
        return {"model": {k: v.detach().clone() for k, v in msd.items()},
                "optim": {k: (v.detach().clone() if torch.is_tensor(v) else v)
                          for k, v in osd.items()}}


    def record(name: str) -> None:
        doc = {**full_state(), "sched": sched.scheduler.last_epoch, "counter": counter.n,
               "counter_rank": counter.rank, "step": acc.step,
               "iteration": acc.project_configuration.iteration,
               "probe": [random.random(), float(np.random.rand()), float(torch.rand(1))]}
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        torch.save(doc, os.path.join(root, "refs", f"{name}-r{rank}.pt"))


    def kill_hook(models, weights, output_dir):
        if a.kill_at is not None and a.phase == "hook" and counter.n == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if a.raise_at is not None and counter.n == a.raise_at and rank == a.raise_rank:
            raise RuntimeError(f"injected failure in rank {rank}'s save pre-hook")


    acc.register_save_state_pre_hook(kill_hook)

    if a.resume:
        acc.load_state(a.load_dir)
        record(f"resumed-{world}")
        print(f"RESUMED step={acc.step} iteration={acc.project_configuration.iteration} "
              f"counter={counter.n}", flush=True)

    start = counter.n
    for s in range(start + 1, a.steps + 1):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        if rank == 0:  # the resume tests compare them with an uninterrupted run's, bitwise
            print(f"LOSS {s} {loss.item()!r}", flush=True)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.step += 1
        counter.n = s
        if s % a.every == 0:
            if a.kill_at == s and a.impl == "dckpt" and a.phase != "hook":
                one = a.phase in ("commit", "place", "rotate") or (
                    a.phase == "committed" and not a.local_root)  # fast tier: every rank
                if a.local_root:  # the earlier copies first: "committed" is their point too
                    acc._dckpt_tier.drain()
                os.environ["DCKPT_FAULT"] = f"{a.phase}:{'0' if one else '*'}:kill"
            try:
                where = acc.save_state()
            except Exception as e:
                print(f"SAVE FAILED rank {rank} {type(e).__name__}: {e}", flush=True)
                raise SystemExit(3)
            if a.async_save:
                acc._dckpt.finish()
            record(f"save-{s}")
            print(f"SAVED {s} {where}", flush=True)
    acc.end_training()
    print("DONE", flush=True)


for r in (a.roots.split(',') if a.roots else [a.root]):
    main(r)
sys.stdout.flush()
sys.stderr.flush()
# skip the interpreter's teardown, as trainer_job.py does: gloo's threads racing it abort
# the process now and then ("terminate called without an active exception"); that is
# tracked apart (a job's exit status), not what these tests check
os._exit(0)
