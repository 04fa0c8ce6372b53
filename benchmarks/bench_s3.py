"""S3 throughput: dckpt save/load through s3fs against s3fs's own bulk put/get of the
same bytes, from the same ranks, against the same server, in one run.

Starts an S3-compatible server on loopback (moto's ThreadedMotoServer, the one the tests
use; pass ``--endpoint`` for a real one, with credentials in the AWS_* variables) and
spawns ``--world`` gloo ranks. Each holds ``--mib`` MiB of fp32 as DTensors Shard(0) (a
few large tensors and many small ones). Per rep, in rotating order:

* ``s3fs put``: each rank ``fs.pipe``s its bytes as one object (s3fs's multipart upload);
  ``s3fs get``: each rank ``fs.cat``s its object back;
* ``dckpt save`` / ``dckpt load`` of the same state to/from the same bucket.

Time per operation: the slowest rank, barrier to barrier. The ratio is s3fs time /
dckpt time (1.0 = as fast as s3fs's own bulk transfer; target >= 0.8). With moto the
server is the bottleneck (Python, one process), so the ratio is the figure to read, not
the absolute MB/s.

    python benchmarks/bench_s3.py [--mib 128] [--reps 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ.update(a["env"])
    import fsspec
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import dckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    opts = {"endpoint_url": a["endpoint"]}
    fs = fsspec.filesystem("s3", **opts)
    per_rank = a["mib"] * 2**20 // world
    big = per_rank * 3 // 4 // 4 // 4  # four large tensors: 3/4 of the bytes
    small_n = 200
    small = max(1, per_rank // 4 // 4 // small_n)
    g = torch.Generator().manual_seed(rank)

    def dt(n: int) -> DTensor:
        local = torch.rand(n, generator=g)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([n * world]), stride=(1,))
    state = {"big": {f"b{i}": dt(big) for i in range(4)},
             "small": {f"s{i}": dt(small) for i in range(small_n)}}
    locs = [t.to_local() for d in state.values() for t in d.values()]
    nbytes = sum(t.numel() * 4 for t in locs)
    blob = b"".join(t.numpy().tobytes() for t in locs)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rows = []
    for i in range(a["reps"]):
        prefix = f"{a['bucket']}/bench-{a['run']}-{i}"  # the same on every rank
        row: dict = {"rep": i}
        obj = f"{prefix}/raw-{rank}"
        url = f"s3://{prefix}/ckpt"
        dst = {k: {n: DTensor.from_local(torch.zeros_like(t.to_local()), mesh, [Shard(0)],
                                         run_check=False, shape=t.shape, stride=t.stride())
                   for n, t in d.items()} for k, d in state.items()}
        ops = [("s3fs_put", lambda: fs.pipe(obj, blob)),
               ("dckpt_save", lambda: dckpt.save(state, url, storage_options=opts))]
        for name, fn in (ops if i % 2 == 0 else ops[::-1]):
            row[name] = timed(fn)
        got = {}
        ops = [("s3fs_get", lambda: got.update(raw=fs.cat(obj))),
               ("dckpt_load", lambda: dckpt.load(dst, url, storage_options=opts))]
        for name, fn in (ops if i % 2 == 0 else ops[::-1]):
            row[name] = timed(fn)
        assert got["raw"] == blob
        assert all(torch.equal(dst[k][n].to_local(), state[k][n].to_local())
                   for k in state for n in state[k])
        rows.append(row)
        if rank == 0:
            print(f"  rep {i}: " + "  ".join(f"{k} {v:.2f}s" for k, v in row.items() if k != "rep"),
                  flush=True)
            fs.rm(prefix, recursive=True)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"rows": rows, "bytes": nbytes * world}, fh)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=128, help="state size, all ranks together")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--endpoint", default=None, help="an S3 endpoint (default: moto on loopback)")
    p.add_argument("--bucket", default="dckpt-bench")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.multiprocessing as tmp

    server = None
    env = {}
    if args.endpoint is None:
        from s3server import CREDENTIALS, S3Server

        server = S3Server().start()  # its bucket is the tests'; make ours too
        import boto3
        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=args.bucket)
        endpoint, env = server.endpoint, dict(CREDENTIALS)
    else:
        endpoint = args.endpoint
    scratch = tempfile.mkdtemp(prefix="dckpt-bench-s3-")
    res_path = os.path.join(scratch, "result.json")
    a = {**vars(args), "endpoint": endpoint, "env": env, "run": uuid.uuid4().hex[:8]}
    try:
        tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"), a, res_path),
                  nprocs=args.world, join=True)
        with open(res_path) as fh:
            res = json.load(fh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if server is not None:
            server.stop()
    rows = res["rows"]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "rep"}
    mib = res["bytes"] / 2**20
    res["summary"] = {**med, "save_ratio": med["s3fs_put"] / med["dckpt_save"],
                      "load_ratio": med["s3fs_get"] / med["dckpt_load"]}
    print(f"\n{mib:.0f} MiB over {args.world} ranks, {'moto on loopback' if server else endpoint}; "
          f"medians of {len(rows)} reps")
    print(f"  save: dckpt {mib / med['dckpt_save']:.0f} MiB/s, s3fs put {mib / med['s3fs_put']:.0f} "
          f"MiB/s: dckpt at {res['summary']['save_ratio']:.2f}x of s3fs (target >= 0.8)")
    print(f"  load: dckpt {mib / med['dckpt_load']:.0f} MiB/s, s3fs get {mib / med['s3fs_get']:.0f} "
          f"MiB/s: dckpt at {res['summary']['load_ratio']:.2f}x of s3fs (target >= 0.8)")
    res["env"] = {"python": platform.python_version(), "machine": platform.platform(),
                  "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
