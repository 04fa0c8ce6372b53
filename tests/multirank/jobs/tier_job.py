"""A torchrun job saving through a CheckpointManager with a fast tier, for crash tests.

    torchrun --nproc-per-node=2 tier_job.py ROOT RUNDIR --steps N [--fault-step S --fault SPEC]
        [--incremental]

Each rank's local_root is RUNDIR/node<rank> (node-local, never shared). The state of
step s is a pure function of s. Rank 0 prints "local s" when step s is committed in the
fast tier, and "durable s" once it is committed in the durable tier too.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import dckpt


def state(step: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024) + step * 1e7
    return {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((1 << 16,), float(step)), "step": step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("rundir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fault-step", type=int, default=-1)
    ap.add_argument("--fault", default="")
    ap.add_argument("--incremental", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    with open(os.path.join(a.rundir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    mgr = dckpt.CheckpointManager(a.root, every_steps=1, capture_rng=False,
                                  local_root=os.path.join(a.rundir, f"node{rank}"),
                                  incremental=a.incremental)
    for step in range(1, a.steps + 1):
        if step == a.fault_step:
            os.environ["DCKPT_FAULT"] = a.fault
        mgr.save(step, state(step, mesh))
        if rank == 0:
            print(f"local {step}", flush=True)
        if step != a.fault_step:
            mgr.wait()
            if rank == 0:
                print(f"durable {step}", flush=True)
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
