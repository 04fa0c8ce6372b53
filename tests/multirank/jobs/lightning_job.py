"""A tiny Lightning fit on CPU under ModelParallelStrategy (FSDP2), stock or dckpt's.

    python lightning_job.py --strategy dckpt --devices 2 --root DIR --max-steps 6 \
        --every 2 [--top-k 2] [--ckpt-path last|PATH] [--kill-last-at STEP] [--async-save]

Lightning's launcher re-executes this script once per extra device. Checkpoints go to
ROOT/ckpts (ModelCheckpoint, monitor "score" = global step, mode max, save_last=True).
Rank 0 writes ROOT/refs/save-<step>.pt (the full model and optimizer state at each
save, gathered) and ROOT/refs/resumed-<devices>.pt (the state at the start of training,
after a resume, and its global step). ``--kill-last-at S``: the save of last.ckpt at
step S is SIGKILLed after the shard files are written, before the commit (dckpt: at
its vote; stock: in DCP's finish, before .metadata and meta.pt). ``--local-root DIR``:
dckpt's fast tier there; ``--kill-before-copy S``: the durable copies of the saves at
step S stall (the copies before are awaited first), and every rank is SIGKILLed at the
next batch: the fast tier holds step S, the durable names hold step S - every.
``--save-last link``: ModelCheckpoint(save_last="link"). ``--stall-commit-at S``: the
first save at step S stalls in its vote (an asynchronous save returns meanwhile) and
every rank is SIGKILLed at the next batch. ``--fail-last-save-at S``: the save of
last.ckpt at step S fails (an injected I/O error in its vote, every rank).
``--raise-at S``: rank ``--raise-rank`` raises RuntimeError in training_step at global
step S (the others train on). ``--slow-vote SEC``: every save's vote sleeps SEC.
``--slow-stage SEC``: every durable copy of the fast tier sleeps SEC (a durable store
that hangs; local commits are fast).
``--slow-last-vote-at S``: the vote of the save of last.ckpt at step S (and of every
save after it) sleeps 300 s (a store that hangs from then on).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.strategies import ModelParallelStrategy

p = argparse.ArgumentParser()
p.add_argument("--strategy", choices=["dckpt", "stock"], required=True)
p.add_argument("--devices", type=int, default=2)
p.add_argument("--root", required=True)
p.add_argument("--max-steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
p.add_argument("--top-k", type=int, default=2)
p.add_argument("--ckpt-path", default=None)
p.add_argument("--kill-last-at", type=int, default=None)
p.add_argument("--async-save", action="store_true")
p.add_argument("--hidden", type=int, default=16)
p.add_argument("--local-root", default=None)  # dckpt's fast tier
p.add_argument("--dirpath", default=None)  # ModelCheckpoint's (default ROOT/ckpts)
p.add_argument("--tp", type=int, default=1)  # tensor parallel size (devices = dp x tp)
p.add_argument("--kill-before-copy", type=int, default=None)
p.add_argument("--save-last", default="true", choices=["true", "link"])  # ModelCheckpoint's
p.add_argument("--stall-commit-at", type=int, default=None)
p.add_argument("--fail-last-save-at", type=int, default=None)
p.add_argument("--raise-at", type=int, default=None)
p.add_argument("--raise-rank", type=int, default=1)
p.add_argument("--slow-vote", type=float, default=None)
p.add_argument("--slow-stage", type=float, default=None)
p.add_argument("--slow-last-vote-at", type=int, default=None)
args = p.parse_args()


class Net(pl.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if args.tp > 1:  # Megatron-style: colwise then rowwise, then FSDP2 over dp
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("score", float(self.global_step + 1))
        if args.raise_at == self.global_step and self.global_rank == args.raise_rank:
            raise RuntimeError(f"boom at step {self.global_step} on rank {self.global_rank}")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def full_state(trainer, module) -> dict:
    """The whole model and optimizer state, gathered (collective; rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(module, options=opts)
    optim = get_optimizer_state_dict(module, trainer.optimizers[0], options=opts)
    return {"model": model, "optim": optim, "step": trainer.global_step,
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


class Refs(Callback):
    def __init__(self) -> None:
        self.saves: dict[int, int] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        st = full_state(trainer, pl_module)
        step = trainer.global_step
        self.saves[step] = self.saves.get(step, 0) + 1
        if trainer.is_global_zero:
            torch.save(st, os.path.join(args.root, "refs", f"save-{step}.pt"))
        if args.kill_last_at == step and self.saves[step] == 2:  # the save of last.ckpt
            if args.strategy == "dckpt":  # an async top-k save of this step votes first
                trainer.strategy._dckpt.finish()
            arm_kill()
        if args.stall_commit_at == step and self.saves[step] == 1:
            # the async save before this one must have voted first: its commit thread
            # reads the fault too, and stalled there it would hold this save (a hang)
            trainer.strategy._dckpt.finish()
            os.environ["DCKPT_FAULT"] = "vote:*:sleep=600"
        if step in (args.slow_last_vote_at, args.fail_last_save_at) and self.saves[step] == 2:
            # the save before (an async top-k save of this step) commits first, so the
            # fault hits the save of last.ckpt only (every rank calls this: collective)
            trainer.strategy._dckpt.finish()
            os.environ["DCKPT_FAULT"] = ("vote:*:sleep=300" if step == args.slow_last_vote_at
                                         else "vote:*:raise")
        if args.kill_before_copy == step and self.saves[step] == 1:
            trainer.strategy._dckpt.finish(drain=True)  # the copies before: done
            os.environ["DCKPT_FAULT"] = "stage:*:sleep=600"  # read by the copy thread

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in (args.kill_before_copy, args.stall_commit_at):
            # the whole job at once (a node lost): a rank killing only itself races the
            # other, which may still wait in Lightning's barrier after the save and then
            # exit with gloo's error instead of dying by the signal
            os.killpg(os.getpgrp(), signal.SIGKILL)

    def on_train_start(self, trainer, pl_module) -> None:
        st = full_state(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(st, os.path.join(args.root, "refs", f"resumed-{args.devices}.pt"))
        print(f"TRAIN START global_step={trainer.global_step}", flush=True)


def arm_kill() -> None:
    if args.strategy == "dckpt":
        os.environ["DCKPT_FAULT"] = "vote:*:kill"
        return
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def finish(self, *a, **k):  # DCP's coordinator, before it writes .metadata
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.finish = finish


def local_root() -> str | None:
    """``--local-root``, with ``{rank}`` replaced by this process's rank (a node-local
    disk per rank, as on separate nodes; Lightning's launcher sets LOCAL_RANK in the
    processes it starts)."""
    if args.local_root is None:
        return None
    return args.local_root.replace("{rank}", os.environ.get("LOCAL_RANK", "0"))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dckpt").setLevel(logging.INFO)  # the tests read where loads came from
    os.makedirs(os.path.join(args.root, "refs"), exist_ok=True)
    if args.slow_vote:
        os.environ["DCKPT_FAULT"] = f"vote:*:sleep={args.slow_vote}"
    if args.slow_stage:
        os.environ["DCKPT_FAULT"] = f"stage:*:sleep={args.slow_stage}"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    if args.strategy == "dckpt":
        from dckpt.integrations.lightning import DckptModelParallelStrategy

        strategy = DckptModelParallelStrategy(data_parallel_size=args.devices // args.tp,
                                              tensor_parallel_size=args.tp,
                                              async_save=args.async_save,
                                              local_root=local_root())
    else:
        strategy = ModelParallelStrategy(data_parallel_size=args.devices // args.tp,
                                         tensor_parallel_size=args.tp)
    ckpt = ModelCheckpoint(dirpath=args.dirpath or os.path.join(args.root, "ckpts"),
                           monitor="score",
                           mode="max", save_top_k=args.top_k,
                           save_last="link" if args.save_last == "link" else True,
                           every_n_train_steps=args.every,
                           filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_steps=args.max_steps, callbacks=[ckpt, Refs()],
                         logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=args.root)
    model = Net(args.hidden)
    trainer.fit(model, DataLoader(data, batch_size=4), ckpt_path=args.ckpt_path)
    print(f"FIT DONE global_step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
