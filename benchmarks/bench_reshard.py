"""Resharding restore N=2 -> M ranks: dckpt vs torch.distributed.checkpoint (DCP), time and memory.

2 gloo ranks save the bench_save_load.py state (fp32 weights + 2 Adam moments, DTensors
Shard(0), 568 MiB) once with dckpt.save, once with dcp.save(FileSystemWriter(sync_files=
True)); values hash the global index, so any world can check its slices. For each M in
--worlds, M fresh gloo ranks build the zeroed target (Shard(0), M-rank mesh) and each rep
(order alternating, after --warmup checked ones) restore it with dckpt.load and
dcp.load(FileSystemReader), page cache dropped first when permitted. Per load: wall time
between barriers (max over ranks); peak extra memory: max RSS sampled from /proc/self/statm
every --sample-ms by a thread minus RSS just before (target touched, gc + malloc_trim done),
max over ranks; bytes read and CPU time (/proc/self/io, os.times; all ranks). Floor: every
rank reads exactly the bytes it needs from the dckpt shard files (cold, raw os.preadv,
--raw-threads threads), all ranks at once. Tables show medians.

    python benchmarks/bench_reshard.py [--worlds 1,3,4] [--reps 3] [--dir D] [--json OUT]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save_load import PREFAULT_MIB, _max_over_ranks, drop_caches, model_specs, timed  # noqa: E402

GROUPS = ("weights", "exp_avg", "exp_avg_sq")
PAGE = os.sysconf("SC_PAGE_SIZE")


def values(k: int, shape: tuple[int, ...], row0: int, rows: int):
    """Rows [row0, row0+rows) of tensor number ``k``: exact fp32 in [0, 1) from a hash of
    the global flat index, so any world's slices can be checked without the source."""
    import torch
    inner = int(torch.Size(shape[1:]).numel())
    i = torch.arange(row0 * inner, (row0 + rows) * inner, dtype=torch.int64)
    return ((i * 2654435761 + k * 40503) % (1 << 24)).to(torch.float32).div_(1 << 24).reshape(
        rows, *shape[1:])


def _pieces(specs, rank: int, world: int):
    """(group, name, global shape, tensor number, first row, rows) of this rank's shards."""
    from dckpt.layout.chunks import chunk_range
    for g, group in enumerate(GROUPS):
        for j, (name, shape) in enumerate(specs):
            yield (group, name, shape, g * len(specs) + j, *chunk_range(shape[0], world, rank))


def make_state(specs, mesh, rank: int, world: int, zero: bool) -> dict[str, Any]:
    """{group: {name: DTensor Shard(0)}, "step": int}: zeros (touched) or the known values."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    state: dict[str, Any] = {"step": 0 if zero else 1000, **{g: {} for g in GROUPS}}
    for group, name, shape, k, r0, n in _pieces(specs, rank, world):
        local = torch.zeros(n, *shape[1:]) if zero else values(k, shape, r0, n)
        stride = tuple(int(torch.Size(shape[i + 1:]).numel()) for i in range(len(shape)))
        state[group][name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                shape=torch.Size(shape), stride=stride)
    return state


def check(state: dict, specs, rank: int, world: int) -> bool:
    """Every local shard equals its expected slice and the int came back, on all ranks."""
    import torch
    ok = state["step"] == 1000 and all(torch.equal(state[g][name].to_local(), values(k, shape, r0, n))
                                       for g, name, shape, k, r0, n in _pieces(specs, rank, world))
    return _max_over_ranks(0.0 if ok else 1.0) == 0.0


def _rss() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def _io() -> list[float]:
    """[rchar, read_bytes, CPU s] of this process: bytes read by syscalls, bytes fetched
    from disk, user + system time of all its threads."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return [int(d["rchar"]), int(d["read_bytes"]), sum(os.times()[:2])]


def measured(fn: Callable[[], Any], period: float) -> dict[str, float]:
    """Barrier, ``fn`` on every rank, barrier. Returns the slowest rank's seconds ("s"), the
    max over ranks of the peak extra RSS in MiB ("mib", sampled by a thread every
    ``period`` s), and, summed over ranks, bytes read by syscalls / from disk ("rchar",
    "disk") and CPU seconds ("cpu")."""
    import torch
    import torch.distributed as dist
    gc.collect()
    getattr(ctypes.CDLL(None), "malloc_trim", lambda _: 0)(0)  # same starting RSS every load
    base, stop = _rss(), threading.Event()
    peak = [base]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _rss())
            if stop.wait(period):
                return
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    io0 = _io()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], _rss())
    io = torch.tensor([b - a for a, b in zip(io0, _io())], dtype=torch.float64)
    dist.barrier()
    dist.all_reduce(io)
    return {"s": _max_over_ranks(dt), "mib": _max_over_ranks((peak[0] - base) / 2**20), "rchar": float(io[0]), "disk": float(io[1]), "cpu": float(io[2])}


def needed_ranges(ck: str, specs, rank: int, world: int) -> list[tuple[str, int, int]]:
    """(path, start, end) of exactly the bytes this rank's shards need, from the manifest's
    Shard(0) row grid and the standard safetensors headers; adjacent ranges merged."""
    with open(os.path.join(ck, "manifest.json")) as f:
        man = json.load(f)
    paths, heads = [os.path.join(ck, f[0]) for f in man["files"]], []
    for p in paths:
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            heads.append((8 + n, json.loads(f.read(n))))
    out: list[tuple[str, int, int]] = []
    for group, name, shape, _, r0, n in _pieces(specs, rank, world):
        key, row = f"{group}.{name}", 4 * math.prod(shape[1:])
        grid, fids = man["tensors"][key]["chunks"]["grid"][0], man["tensors"][key]["chunks"]["file"]
        for c, fi in enumerate(fids):  # one chunk per dim-0 cell (dims > 0 are not split)
            lo, hi = max(r0, grid[c]), min(r0 + n, grid[c + 1])
            base = heads[fi][0] + heads[fi][1][key]["data_offsets"][0] - grid[c] * row
            out += [(paths[fi], base + lo * row, base + hi * row)] if lo < hi else []
    merged: list[tuple[str, int, int]] = []
    for f, lo, hi in sorted(out):
        if merged and merged[-1][0] == f and merged[-1][2] == lo:
            lo = merged.pop()[1]
        merged.append((f, lo, hi))
    return merged


def raw_read(ranges: list[tuple[str, int, int]], threads: int, block: int = 16 << 20) -> None:
    """os.preadv the ranges in order, cut into ``threads`` runs of equal bytes read at once."""
    import numpy as np
    per, runs, acc = -(-sum(h - lo for _, lo, h in ranges) // threads), [[]], 0
    for f, lo, hi in ranges:
        while lo < hi:
            n = min(hi - lo, per - acc)
            runs[-1].append((f, lo, lo + n))
            lo, acc = lo + n, acc + n
            if acc == per:
                runs.append([])
                acc = 0

    def run(rs: list[tuple[str, int, int]]) -> None:
        buf = memoryview(np.empty(block, np.uint8)).cast("B")
        for f, lo, hi in rs:
            fd = os.open(f, os.O_RDONLY)
            while lo < hi:
                lo += os.preadv(fd, [buf[:min(block, hi - lo)]], lo)
            os.close(fd)
    ts = [threading.Thread(target=run, args=(r,)) for r in runs if r]
    [t.start() for t in ts]
    [t.join() for t in ts]


def _init(rank: int, world: int, init: str, a: dict):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,)), model_specs(a["layers"], a["hidden"], a["vocab"], a["ffn_mult"])


def save_worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import dckpt
    mesh, specs = _init(rank, world, init, a)
    src = make_state(specs, mesh, rank, world, zero=False)
    res = {"dckpt": timed(lambda: dckpt.save(src, os.path.join(a["dir"], "dckpt"))),
           "dcp": timed(lambda: dcp.save(src, storage_writer=dcp.FileSystemWriter(
               os.path.join(a["dir"], "dcp"), sync_files=True)))}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def load_worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import dckpt
    mesh, specs = _init(rank, world, init, a)
    dst = make_state(specs, mesh, rank, world, zero=True)
    locs = [t.to_local() for g in GROUPS for t in dst[g].values()]
    mine = sum(x.numel() * x.element_size() for x in locs)
    per_rank = _max_over_ranks(mine)
    paths = {lib: os.path.join(a["dir"], lib) for lib in ("dckpt", "dcp")}
    need = needed_ranges(paths["dckpt"], specs, rank, world)
    assert sum(h - lo for _, lo, h in need) == mine
    loaders = {"dckpt": lambda: dckpt.load(dst, paths["dckpt"]),
               "dcp": lambda: dcp.load(dst, storage_reader=dcp.FileSystemReader(paths["dcp"]))}
    period, drop = a["sample_ms"] / 1000, a["drop_caches"]
    rows, checked, dropped = [], {}, drop

    def cold() -> None:
        nonlocal dropped
        if drop:
            dropped = drop_caches(rank, a["prefault_mib"]) and dropped
        torch._foreach_zero_(locs)
        dst["step"] = 0
    for i in range(a["warmup"] + a["reps"]):
        row: dict[str, Any] = {"rep": i - a["warmup"], "load1": os.getloadavg()[0]}
        row["order"] = libs = ["dckpt", "dcp"] if i % 2 == 0 else ["dcp", "dckpt"]
        for lib in libs:
            cold()
            row.update({f"{lib}_{k}": v for k, v in measured(loaders[lib], period).items()})
            if lib not in checked:
                checked[lib] = check(dst, specs, rank, world)
        if i >= a["warmup"]:
            rows.append(row)
        if rank == 0:
            print(f"  M={world} rep {row['rep']:>2} ({'/'.join(libs)}): " + "  ".join(
                f"{k} {v:.3f}" for k, v in row.items() if k[-2:] in ("_s", "ib"))
                + f"  [loadavg {row['load1']:.1f}]", flush=True)
    # The floor in a loop of its own. Read inside the loop above, just before one of the
    # libraries, it warmed the VM host's cache (which holds the virtual disk) for dckpt's
    # files only, and dckpt ran faster in the repetitions where it came first.
    for row in rows:
        cold()
        row["raw_read"] = measured(lambda: raw_read(need, a["raw_threads"]), period)["s"]
    if rank == 0:
        print(f"  M={world} floor (raw reads): " + " ".join(f"{r['raw_read']:.3f}" for r in rows),
              flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "checked": checked, "per_rank_bytes": per_rank, "dropped": dropped}, f)
    dist.destroy_process_group()


def spawn(fn, world: int, scratch: str, a: dict, tag: str) -> dict:
    import torch.multiprocessing as tmp
    out = os.path.join(scratch, f"{tag}.json")
    tmp.spawn(fn, args=(world, os.path.join(scratch, f"rdv-{tag}"), a, out), nprocs=world, join=True)
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worlds", default="1,3,4", help="target world sizes M, comma separated")
    for name, v, h in (("save-world", 2, "ranks that save (N)"), ("reps", 3, "timed repetitions per M"),
                       ("warmup", 1, "untimed repetitions first (checked)"),
                       ("raw-threads", 4, "reader threads per rank, raw read"), ("layers", 6, "model shape"),
                       ("hidden", 768, "model shape"), ("vocab", 8193, "model shape"), ("ffn-mult", 4, "model shape")):
        p.add_argument(f"--{name}", type=int, default=v, help=h)
    p.add_argument("--sample-ms", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--dir", default=None, help="parent of the scratch dir (None: the system temp dir)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not try to drop the page cache before loads")
    p.add_argument("--prefault-mib", type=int, default=PREFAULT_MIB,
                   help="MiB touched and freed right before each load (0: none); see drop_caches")
    p.add_argument("--json", default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    if args.reps % 2:  # the order of the loads matters on this VM: each library goes first equally
        args.reps += 1
        print(f"--reps rounded up to {args.reps}: both libraries go first equally often")
    worlds = [int(w) for w in args.worlds.split(",") if w]
    os.environ["OMP_NUM_THREADS"] = "1"
    scratch = tempfile.mkdtemp(prefix="dckpt-reshard-", dir=args.dir)
    a = {**vars(args), "dir": scratch}
    print(f"scratch dir {scratch}; saved by {args.save_world} ranks, restored into M = {worlds}; "
          f"{args.reps} reps (+{args.warmup} warmup)", flush=True)
    res: dict[str, Any] = {"args": vars(args), "worlds": {}}
    try:
        res["save"] = spawn(save_worker, args.save_world, scratch, a, "save")
        ck = os.path.join(scratch, "dckpt")
        res["total_bytes"] = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck)
                                 if f != "manifest.json")
        print(f"save: dckpt {res['save']['dckpt']:.3f}s, DCP {res['save']['dcp']:.3f}s", flush=True)
        for m in worlds:
            res["worlds"][str(m)] = spawn(load_worker, m, scratch, a, f"load-{m}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import platform, torch  # noqa: E401
    res["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                  "machine": platform.platform(), "cpus": os.cpu_count()}
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def report(res: dict) -> None:
    total = res["total_bytes"]
    print(f"\nstate: {total / 2**20:.1f} MiB saved by {res['args']['save_world']} ranks; medians of "
          f"{res['args']['reps']} reps\n{'M':>2}{'MiB/rank':>9}{'dckpt s':>8}{'DCP s':>7}{'ratio':>6}"
          f"{'floor s':>8}{'GB/s':>6}{'dckpt MiB':>10}{'DCP MiB':>8}  correct  cold  loadavg")
    for m, w in res["worlds"].items():
        rows = w["rows"]
        md = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
        w["median"], w["ratio"] = md, md["dckpt_s"] / md["dcp_s"]
        w["targets_met"] = {"time<=0.8xDCP": w["ratio"] <= 0.8, "mem<=DCP": md["dckpt_mib"] <= md["dcp_mib"]}
        ok = "ok" if all(w["checked"].values()) and len(w["checked"]) == 2 else "BAD"
        load = [r["load1"] for r in rows]
        print(f"{m:>2}{w['per_rank_bytes'] / 2**20:9.1f}{md['dckpt_s']:8.3f}{md['dcp_s']:7.3f}"
              f"{w['ratio']:6.2f}{md['raw_read']:8.3f}{total / 1e9 / md['raw_read']:6.2f}"
              f"{md['dckpt_mib']:10.1f}{md['dcp_mib']:8.1f}  {ok:9}{'yes' if w['dropped'] else 'NO':6}"
              f"{min(load):.1f}..{max(load):.1f}")
    print("s: load wall time, max over ranks (target ratio <= 0.80). floor: every rank reads exactly"
          "\nthe bytes it needs from the dckpt shard files, cold, raw os.preadv (GB/s: all ranks)."
          "\nMiB: peak extra RSS during the load, max over ranks (target dckpt <= DCP). Below: floor"
          "\nas % of load time; read x: bytes read by syscalls (from disk), all ranks, / state size;"
          "\nCPU s: user + system, all ranks")
    for m, w in res["worlds"].items():
        md = w["median"]
        print(f"M={m}: {w['targets_met']}; floor/time dckpt {100 * md['raw_read'] / md['dckpt_s']:.0f}%"
              f" DCP {100 * md['raw_read'] / md['dcp_s']:.0f}%; read x dckpt "
              f"{md['dckpt_rchar'] / total:.2f} ({md['dckpt_disk'] / total:.2f}) DCP {md['dcp_rchar'] / total:.2f}"
              f" ({md['dcp_disk'] / total:.2f}); CPU s dckpt {md['dckpt_cpu']:.2f} DCP {md['dcp_cpu']:.2f}")


if __name__ == "__main__":
    main()
