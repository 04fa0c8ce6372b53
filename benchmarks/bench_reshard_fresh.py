"""Resharding restore from checkpoints no cache has seen: dckpt vs DCP, N=2 -> M ranks.

bench_reshard.py reloads one checkpoint many times, dropping the VM's page cache before
each load; but the VM's host also caches the virtual disk, so those reads come from the
host's memory, and which library's files it holds depends on the order of the loads. A
job restarting after a failure reads a checkpoint written minutes or hours before, from
the disk. Here every repetition saves both checkpoints afresh (2 gloo ranks, same state
and writers as bench_reshard.py), then M fresh ranks load each once (order alternating,
page cache dropped before each, after --settle seconds for the host to finish writing
the save): every load is the first read of its files.

    python benchmarks/bench_reshard_fresh.py [--worlds 1,3,4] [--reps 6] [--json OUT]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reshard import GROUPS, _init, check, make_state, measured, save_worker, spawn  # noqa: E402
from bench_save_load import PREFAULT_MIB, drop_caches  # noqa: E402


def load_once(rank: int, world: int, init: str, a: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import dckpt
    mesh, specs = _init(rank, world, init, a)
    dst = make_state(specs, mesh, rank, world, zero=True)
    locs = [t.to_local() for g in GROUPS for t in dst[g].values()]
    paths = {lib: os.path.join(a["dir"], lib) for lib in ("dckpt", "dcp")}
    loaders = {"dckpt": lambda: dckpt.load(dst, paths["dckpt"]),
               "dcp": lambda: dcp.load(dst, storage_reader=dcp.FileSystemReader(paths["dcp"]))}
    row: dict = {"order": a["order"], "load1": os.getloadavg()[0]}
    for lib in a["order"]:
        drop_caches(rank, a["prefault_mib"])
        row.update({f"{lib}_{k}": v for k, v in measured(loaders[lib], a["sample_ms"] / 1000).items()})
        row[f"{lib}_ok"] = check(dst, specs, rank, world)
        torch._foreach_zero_(locs)  # the next library starts from zeros too
        dst["step"] = 0
    if rank == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worlds", default="1,3,4", help="target world sizes M, comma separated")
    p.add_argument("--reps", type=int, default=6, help="fresh checkpoints per M (rounded up to even)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds to wait after each save before the loads")
    p.add_argument("--dir", default=None, help="parent of the scratch dir")
    p.add_argument("--prefault-mib", type=int, default=PREFAULT_MIB,
                   help="MiB touched and freed right before each load (0: none); see drop_caches")
    p.add_argument("--json", default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    args.reps += args.reps % 2  # each library goes first equally often
    os.environ["OMP_NUM_THREADS"] = "1"
    a = {"save_world": 2, "layers": 6, "hidden": 768, "vocab": 8193, "ffn_mult": 4,
         "sample_ms": 5.0, "prefault_mib": args.prefault_mib}
    res: dict = {"args": vars(args), "worlds": {}}
    print(f"fresh checkpoints, saved by 2 ranks, restored into M = {args.worlds}; "
          f"{args.reps} reps per M", flush=True)
    for m in [int(w) for w in args.worlds.split(",") if w]:
        rows = []
        for i in range(args.reps):
            scratch = tempfile.mkdtemp(prefix="dckpt-fresh-", dir=args.dir)
            try:
                run = {**a, "dir": scratch, "order": ["dckpt", "dcp"] if i % 2 == 0 else ["dcp", "dckpt"]}
                spawn(save_worker, 2, scratch, run, "save")
                # Lets the host finish writing the save. (The "first load after a save
                # is 0.4-0.6 s slower, whichever library" effect seen in session 3 was
                # free page reporting, which the prefault in drop_caches now removes.)
                time.sleep(args.settle)
                row = spawn(load_once, m, scratch, run, f"load-{m}")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            assert row["dckpt_ok"] and row["dcp_ok"], row
            rows.append(row)
            print(f"  M={m} rep {i} ({'/'.join(row['order'])}): dckpt {row['dckpt_s']:.3f} s "
                  f"{row['dckpt_mib']:.1f} MiB, DCP {row['dcp_s']:.3f} s {row['dcp_mib']:.1f} MiB, "
                  f"ratio {row['dckpt_s'] / row['dcp_s']:.2f}  [loadavg {row['load1']:.1f}]", flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in ("dckpt_s", "dcp_s", "dckpt_mib", "dcp_mib")}
        med["ratio"] = med["dckpt_s"] / med["dcp_s"]
        med["ratio_per_rep"] = statistics.median(r["dckpt_s"] / r["dcp_s"] for r in rows)
        res["worlds"][str(m)] = {"rows": rows, "median": med}
    print("\n M  dckpt s  DCP s  ratio  (median of per-rep ratios)  dckpt MiB  DCP MiB")
    for m, w in res["worlds"].items():
        d = w["median"]
        print(f"{m:>2}  {d['dckpt_s']:7.3f} {d['dcp_s']:6.3f}  {d['ratio']:5.2f}  ({d['ratio_per_rep']:.2f})"
              f"                 {d['dckpt_mib']:9.1f} {d['dcp_mib']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
