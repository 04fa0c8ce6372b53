"""A torchrun job that saves generations of a sharded state to S3, for the S3 crash tests.

    torchrun --nproc-per-node=2 s3_job.py URL RUNDIR --gens N [--fault-gen G --fault SPEC]
                                          [--storage-options JSON] [--rows R]

The endpoint and credentials come from the environment only (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID...). Generation g's state is a pure function of g (every element
encodes g), so a loaded checkpoint shows whether it is one whole generation or a mix;
each rank's shard of ``w`` is over S3's 5 MiB smallest part, so with a 5 MiB block size
its upload is a multipart one. Each rank writes its pid to RUNDIR/pid.RANK; rank 0
prints "saved g" after each committed save.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import dckpt

ROWS, COLS = 1536, 1024  # per rank: 6 MiB of int32


def full(gen: int, world: int, rows: int = ROWS) -> dict:
    """The whole state of generation ``gen`` as plain tensors (what a load must give);
    ``rows`` per rank."""
    w = torch.arange(world * rows * COLS, dtype=torch.int32).reshape(world * rows, COLS)
    return {"w": w + gen * 10_000_000, "r": torch.full((64, 64), float(gen)), "gen": gen}


def state(gen: int, mesh, rows: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    f = full(gen, mesh.size(), rows)
    return {"w": distribute_tensor(f["w"], mesh, [Shard(0)], src_data_rank=None),
            "r": distribute_tensor(f["r"], mesh, [Replicate()], src_data_rank=None),
            "gen": gen}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("rundir")
    ap.add_argument("--gens", type=int, default=2)
    ap.add_argument("--fault-gen", type=int, default=-1)
    ap.add_argument("--fault", default="")
    ap.add_argument("--storage-options", default="{}")
    ap.add_argument("--rows", type=int, default=ROWS, help="rows of w per rank")
    a = ap.parse_args()
    opts = json.loads(a.storage_options)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    with open(os.path.join(a.rundir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    for gen in range(1, a.gens + 1):
        if gen == a.fault_gen:
            os.environ["DCKPT_FAULT"] = a.fault
        dckpt.save(state(gen, mesh, a.rows), a.url, overwrite=True, storage_options=opts)
        if rank == 0:
            print(f"saved {gen}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
