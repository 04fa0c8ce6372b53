"""A torchrun job that saves generations of a sharded state, for crash tests.

    torchrun --nproc-per-node=2 save_job.py PATH RUNDIR --gens N [--fault-gen G --fault SPEC]
        [--async-save | --incremental | --manager]

Generation g's state is a pure function of g (every element encodes g), so a loaded
checkpoint shows whether it is one whole generation or a mix. Each rank writes its pid
to RUNDIR/pid.RANK; rank 0 prints "saved g" after each committed save.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import dckpt


def state(gen: int, mesh, frozen: bool = False) -> dict:
    """With ``frozen``, "w" (most of the bytes) is generation 0's in every generation,
    as a frozen backbone is: incremental saves then write only the rest."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rows = 1 << 12
    base = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024)
    full = base + gen * 1e7
    w = base if frozen else full
    return {
        "w": distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None),
        "m": distribute_tensor(full[:, :512] * 2, mesh, [Shard(1)], src_data_rank=None),
        "r": distribute_tensor(torch.full((256, 256), float(gen)), mesh, [Replicate()], src_data_rank=None),
        "b": torch.full((1 << 16,), float(gen)),
        "gen": gen,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("rundir")
    ap.add_argument("--gens", type=int, default=1000)
    ap.add_argument("--fault-gen", type=int, default=-1)
    ap.add_argument("--fault", default="")
    ap.add_argument("--async-save", action="store_true", help="dckpt.async_save, then wait")
    ap.add_argument("--incremental", action="store_true",
                    help="CheckpointManager(PATH, incremental=True, full_every=3, keep_last=2) "
                         "saving generation g as step g, with a frozen 'w'")
    ap.add_argument("--manager", action="store_true",
                    help="CheckpointManager(PATH, keep_last=2, every_epochs=1), synchronous, "
                         "saving generation g as step g at the end of epoch g - 1 (its save "
                         "history is under PATH)")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    with open(os.path.join(a.rundir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    mgr = (dckpt.CheckpointManager(a.path, incremental=True, full_every=3, keep_last=2,
                                   capture_rng=False) if a.incremental else None)
    if a.manager:
        mgr = dckpt.CheckpointManager(a.path, keep_last=2, every_epochs=1, capture_rng=False)
    for gen in range(1, a.gens + 1):
        if gen == a.fault_gen:
            os.environ["DCKPT_FAULT"] = a.fault
        if a.manager:
            assert mgr.save(gen, state(gen, mesh), epoch=gen - 1)
        elif mgr is not None:
            mgr.save(gen, state(gen, mesh, frozen=True), force=True)
        elif a.async_save:
            h = dckpt.async_save(state(gen, mesh), a.path, overwrite=True)
            if rank == 0:
                print(f"staged {gen}", flush=True)
            h.result()
        else:
            dckpt.save(state(gen, mesh), a.path, overwrite=True)
        if rank == 0:
            print(f"saved {gen}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
