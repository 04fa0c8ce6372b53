"""A torchrun job: torchtitan's components trained and checkpointed by a manager
(dckpt's DckptCheckpointManager or torchtitan's DCP CheckpointManager), rank 1
SIGKILLed in the middle of the save of step ``--kill-at``.

    torchrun --nproc-per-node=2 titan_job.py BASE RUNDIR --which dckpt|dcp --steps N
        [--kill-at S]

Prints "resumed <step>" after the load and "done <step>" at the end (rank 0)."""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("rundir")
    ap.add_argument("--which", choices=("dckpt", "dcp"), required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill-at", type=int, default=0)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(a.rundir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    from titankit import Parts

    if a.which == "dckpt":
        from dckpt.integrations.torchtitan import DckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer import CheckpointManager as cls
    parts = Parts(seed=0)
    ck = cls.Config(enable=True, interval=2, last_save_model_only=False).build(
        **parts.build_kwargs(a.base))

    def before_save(step: int) -> None:
        if step != a.kill_at:
            return
        if a.which == "dckpt":  # rank 1 dies while writing its shard (dckpt's fault point)
            os.environ["DCKPT_FAULT"] = "write:1:kill"
        elif rank == 1:  # rank 1 dies once its DCP files are written, before .metadata
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            original = FileSystemWriter.write_data

            def write_then_die(self, plan, planner):
                fut = original(self, plan, planner)
                fut.wait()
                os.kill(os.getpid(), signal.SIGKILL)

            FileSystemWriter.write_data = write_then_die

    ck.load()
    if rank == 0:
        print(f"resumed {parts.train_state.step}", flush=True)
    while parts.train_state.step < a.steps:
        parts.train_state.step += 1
        parts.train_step(ck)
        before_save(parts.train_state.step)
        ck.save(parts.train_state.step, last_step=parts.train_state.step == a.steps)
        if rank == 0:
            print(f"saved {parts.train_state.step}", flush=True)
    ck.close()
    if rank == 0:
        print(f"done {parts.train_state.step}", flush=True)
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: with either manager, about one run in
    # ten aborts there ("terminate called without an active exception", rank 1, after
    # "done"), measured on this machine with DCP's manager as with dckpt's: torch's or
    # torchdata's exit, not the checkpoint. Everything above has finished and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
