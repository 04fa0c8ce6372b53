"""Incremental and compressed durable copies under a fast tier (issue 30), on a
frozen-backbone workload: ``--mib`` MiB of fp32, 90% frozen (the same at every step), 10%
changed at every step. One process; the fast tier on --shm; the durable tier a local
directory (--dir) and, with --s3, S3 on moto (loopback).

For each durable tier and each mode (``full``: raw byte copies, today's staging;
``inc``: ``incremental=True`` with ``--compression``), a manager saves ``--saves`` steps,
each durable, synchronously (the local commit), then waits for the staging:

- upload bytes per durable save: the step's own data bytes (its manifest's total_bytes,
  what was PUT), and the staging seconds (from the local commit to the durable commit);
- restore: the fast tier wiped, a new manager restores the newest step (a chain of
  ``--saves`` copies for ``inc``, a full step for ``full``), timed (restore() alone);
- the training loop: ``--loop`` steps of a CPU compute step (matmuls), a save every
  ``--every`` steps (each durable), mean step time, ``inc`` vs ``full`` (the staging runs
  in the background thread and competes for the cores).

Prints one JSON line per measurement and a summary table. Example:
  python benchmarks/bench_tier_incremental.py --mib 256 --s3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import dckpt
from dckpt.format import manifest as mf
from dckpt.storage.fsspec_storage import make_storage

MIB_F32 = 1 << 18


def make_state(mib: int, step: int) -> dict:
    frozen = int(mib * 0.9)
    g = torch.Generator().manual_seed(1)
    backbone = {f"b{i}": torch.randn(4 * MIB_F32, generator=g) for i in range(frozen // 4)}
    g2 = torch.Generator().manual_seed(1000 + step)
    head = torch.randn((mib - 4 * (frozen // 4)) * MIB_F32, generator=g2)
    return {"backbone": backbone, "head": head}


def owned(mgr, step: int) -> int:
    st, p = make_storage(mgr.path(step), mgr.storage_options)
    return mf.parse(st.read_file(st.join(p, mf.MANIFEST_NAME), 1 << 28), p).total_bytes


def run_mode(root: str, opts, shm: str, mode: str, args) -> dict:
    kw = dict(incremental=True, compression=args.compression) if mode == "inc" else {}
    shutil.rmtree(shm, ignore_errors=True)
    mgr = dckpt.CheckpointManager(root, local_root=shm, storage_options=opts, every_steps=1,
                                  capture_rng=False, **kw)
    ups = []
    for s in range(1, args.saves + 1):
        state = make_state(args.mib, s)
        mgr.save(s, state)
        t = time.perf_counter()
        mgr.wait()
        ups.append({"step": s, "bytes": owned(mgr, s), "stage_s": time.perf_counter() - t})
    mgr.close()
    times = []
    for _ in range(args.reps):
        shutil.rmtree(shm, ignore_errors=True)
        m2 = dckpt.CheckpointManager(root, local_root=shm, storage_options=opts,
                                     every_steps=1, capture_rng=False)
        st = make_state(args.mib, 0)
        t = time.perf_counter()
        step = m2.restore(st)
        times.append(time.perf_counter() - t)
        assert step == args.saves and m2.restored_from == "durable"
        assert torch.equal(st["head"], make_state(args.mib, args.saves)["head"])
        m2.close()
    return {"uploads": ups, "restore_s": times}


def loop(root: str, opts, shm: str, mode: str, args) -> list[float]:
    kw = dict(incremental=True, compression=args.compression) if mode == "inc" else {}
    shutil.rmtree(shm, ignore_errors=True)
    mgr = dckpt.CheckpointManager(root, local_root=shm, storage_options=opts,
                                  every_steps=args.every, capture_rng=False, **kw)
    a = torch.randn(384, 384)
    state = make_state(args.mib, 0)
    steps = []
    for s in range(1, args.loop + 1):
        t = time.perf_counter()
        for _ in range(20):
            a = torch.tanh(a @ a.T / 384)
        state["head"].add_(0.01)
        mgr.save(s, state)
        steps.append(time.perf_counter() - t)
    mgr.close()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loop", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--compression", default="zstd", help="zstd, lz4 or none")
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--s3", action="store_true")
    args = ap.parse_args()
    if args.compression == "none":
        args.compression = None
    if args.compression == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            print("zstandard not installed: using lz4", file=sys.stderr)
            args.compression = "lz4"
    work = tempfile.mkdtemp(prefix="bench-tierinc-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="bench-tierinc-", dir=args.shm)
    tiers = [("dir", lambda n: (os.path.join(work, n), None))]
    server = None
    if args.s3:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from s3server import S3Server

        server = S3Server().start()
        tiers.append(("s3", lambda n: (server.url(n), server.options)))
    rows = []
    try:
        for tier, where in tiers:
            for mode in ("full", "inc"):
                root, opts = where(f"{tier}-{mode}")
                r = run_mode(root, opts, os.path.join(shm, "fast"), mode, args)
                later = r["uploads"][1:]
                row = {"tier": tier, "mode": mode, "mib": args.mib,
                       "compression": args.compression if mode == "inc" else None,
                       "first_bytes": r["uploads"][0]["bytes"],
                       "later_bytes": statistics.mean(u["bytes"] for u in later),
                       "first_stage_s": r["uploads"][0]["stage_s"],
                       "later_stage_s": statistics.median(u["stage_s"] for u in later),
                       "restore_s": statistics.median(r["restore_s"])}
                print(json.dumps(row), flush=True)
                rows.append(row)
        for mode in ("full", "inc", "full", "inc"):  # interleaved: drift shows
            root, _ = tiers[0][1](f"loop-{mode}-{time.time_ns()}")
            st = loop(root, None, os.path.join(shm, "fast"), mode, args)
            row = {"loop": mode, "mean_step_s": statistics.mean(st),
                   "median_step_s": statistics.median(st)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if server is not None:
            server.stop()
    print(f"\n{'tier':5} {'mode':5} {'1st MiB':>8} {'later MiB':>9} {'1st s':>6} "
          f"{'later s':>7} {'restore s':>9}")
    for r in rows:
        if "tier" in r:
            print(f"{r['tier']:5} {r['mode']:5} {r['first_bytes'] / 2**20:8.1f} "
                  f"{r['later_bytes'] / 2**20:9.1f} {r['first_stage_s']:6.2f} "
                  f"{r['later_stage_s']:7.2f} {r['restore_s']:9.2f}")
    for r in rows:
        if "loop" in r:
            print(f"loop {r['loop']:5} mean step {r['mean_step_s'] * 1e3:.1f} ms, "
                  f"median {r['median_step_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
