"""Save/load wall time of dckpt vs torch.distributed.checkpoint (DCP) on the same state.

Spawns ``--world`` gloo ranks (torch.multiprocessing, file:// rendezvous,
OMP_NUM_THREADS=1). Each rank holds fp32 "weights" plus Adam "exp_avg"/"exp_avg_sq" of a
small transformer as DTensors sharded Shard(0) over a 1-D CPU mesh of all ranks. Every
repetition saves and loads with both libraries (order alternates), each save into a
fresh directory, and also measures the physical limits on the same bytes: raw
os.write + os.fsync (each rank its own file, concurrently; twice back to back, the second
is the floor), raw cold read, and memcpy (torch ``copy_`` into a preallocated buffer).
Times are per-rank wall times between barriers, max over ranks; the table reports
medians over repetitions.

    python benchmarks/bench_save_load.py [--reps 5] [--layers 6 --hidden 768] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_specs(layers: int, hidden: int, vocab: int, ffn_mult: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of every parameter of a GPT-like model."""
    h, f = hidden, ffn_mult * hidden
    specs: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, h)), ("pos.weight", (1024, h))]
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            specs += [(p + f"attn.{n}.weight", (h, h)), (p + f"attn.{n}.bias", (h,))]
        specs += [(p + "mlp.up.weight", (f, h)), (p + "mlp.up.bias", (f,)),
                  (p + "mlp.down.weight", (h, f)), (p + "mlp.down.bias", (h,))]
        for n in ("ln1", "ln2"):
            specs += [(p + f"{n}.weight", (h,)), (p + f"{n}.bias", (h,))]
    specs += [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]
    return specs


def make_state(specs, mesh, rank: int, world: int, zero: bool) -> dict[str, Any]:
    """{"weights"|"exp_avg"|"exp_avg_sq": {name: DTensor Shard(0)}, "step": int}."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from dckpt.layout.chunks import chunk_range

    state: dict[str, Any] = {"step": 0 if zero else 1000}
    gen = torch.Generator().manual_seed(1234 + rank)
    for group in ("weights", "exp_avg", "exp_avg_sq"):
        d = {}
        for name, shape in specs:
            _, n = chunk_range(shape[0], world, rank)
            local_shape = (n, *shape[1:])
            local = torch.zeros(local_shape) if zero else torch.rand(local_shape, generator=gen)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            d[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                         shape=torch.Size(shape), stride=stride)
        state[group] = d
    return state


def locals_of(state: dict[str, Any]) -> list:
    return [t.to_local() for g in ("weights", "exp_avg", "exp_avg_sq") for t in state[g].values()]


def memcpy_floor(locs: list) -> tuple[list, Callable[[], None]]:
    """Buffers like ``locs`` (written once, so their pages exist) and a function that
    copies ``locs`` into them: the memcpy floor of a restore. The function holds the
    buffers: drop both to free them."""
    import torch

    bufs = [torch.empty_like(x) for x in locs]

    def memcpy() -> None:
        for b, x in zip(bufs, locs):
            b.copy_(x)

    memcpy()
    return bufs, memcpy


def _max_over_ranks(x: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[], Any]) -> float:
    """Barrier, run ``fn`` on every rank, barrier; the slowest rank's seconds."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    dist.barrier()
    return _max_over_ranks(dt)


# The VM returns free memory to its host (virtio-balloon free page reporting, 8 MiB
# blocks, about 2 s after they are freed) and puts reported blocks at the back of the
# free lists. The first touch of a reported page is a host fault: measured, a cold 568 MiB
# load that took its page cache from such memory spent 0.75-0.82 s in the kernel instead
# of 0.15-0.24 s. Which load that hits depended on what ran before it (a long wait, or a
# library that had just freed big buffers), not on the library. Touching and freeing
# PREFAULT_MIB right before each load gives every load recently freed, resident pages.
PREFAULT_MIB = 2048


def drop_caches(rank: int, prefault_mib: int = PREFAULT_MIB) -> bool:
    """sync + echo 3 > /proc/sys/vm/drop_caches on rank 0 (one host), then (rank 0)
    touch and free ``prefault_mib`` MiB of memory; True if the drop worked. Collective
    (a barrier)."""
    import numpy as np
    import torch.distributed as dist
    ok = 1.0
    if rank == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            ok = 0.0
        if prefault_mib > 0:
            np.ones(prefault_mib << 20, np.uint8)  # every page written, then freed at once
    dist.barrier()
    return _max_over_ranks(ok) > 0


def raw_write(path: str, nbytes: int, block: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, buf: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    import dckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    specs = model_specs(a["layers"], a["hidden"], a["vocab"], a["ffn_mult"])
    src = make_state(specs, mesh, rank, world, zero=False)
    my_bytes = sum(t.numel() * t.element_size() for t in locals_of(src))
    t = torch.tensor([my_bytes], dtype=torch.int64)
    dist.all_reduce(t)
    total = int(t.item())
    bs = a["raw_block_mib"] << 20
    block = memoryview(np.random.default_rng(rank).integers(0, 256, bs, np.uint8)).cast("B")
    rbuf = memoryview(np.empty(bs, np.uint8)).cast("B")
    cbuf = torch.empty(my_bytes, dtype=torch.uint8)

    def do_save(lib: str, path: str) -> None:
        if lib == "dckpt":
            dckpt.save(src, path)
        else:
            dcp.save(src, storage_writer=dcp.FileSystemWriter(path, sync_files=True,
                                                              thread_count=a["dcp_threads"]))

    def do_load(lib: str, dst: dict, path: str) -> None:
        if lib == "dckpt":
            dckpt.load(dst, path)
        else:
            dcp.load(dst, storage_reader=dcp.FileSystemReader(path))

    def memcpy() -> None:
        pos = 0
        for x in locals_of(src):
            n = x.numel() * x.element_size()
            cbuf[pos:pos + n].copy_(x.reshape(-1).view(torch.uint8))
            pos += n

    rows, dropped, checked = [], True, {}
    for i in range(a["warmup"] + a["reps"]):
        row: dict[str, Any] = {"rep": i - a["warmup"], "order": [], "load1": os.getloadavg()[0]}
        libs = ["dckpt", "dcp"] if i % 2 == 0 else ["dcp", "dckpt"]
        # Physical limits. The first big write after other work is often much slower
        # on this VM (see RESULTS.md), so raw write+fsync is timed twice back to back:
        # "raw_write_first" and "raw_write" (the floor).
        raw = os.path.join(a["dir"], f"raw-{i}-{rank}.bin")
        row["raw_write_first"] = timed(lambda: raw_write(raw, my_bytes, block))
        os.unlink(raw)
        row["raw_write"] = timed(lambda: raw_write(raw, my_bytes, block))
        if a["drop_caches"]:
            dropped = drop_caches(rank, a["prefault_mib"]) and dropped
        row["raw_read"] = timed(lambda: raw_read(raw, rbuf))
        os.unlink(raw)
        row["memcpy"] = timed(memcpy)
        for lib in libs:
            path = os.path.join(a["dir"], f"{lib}-{i}")
            row["order"].append(lib)
            row[f"{lib}_save"] = timed(lambda: do_save(lib, path))
            dst = make_state(specs, mesh, rank, world, zero=True)  # fresh zeroed, same layout
            if a["drop_caches"]:
                dropped = drop_caches(rank, a["prefault_mib"]) and dropped
            row[f"{lib}_load"] = timed(lambda: do_load(lib, dst, path))
            if lib not in checked:
                ok = dst["step"] == src["step"] and all(
                    torch.equal(x, y) for x, y in zip(locals_of(dst), locals_of(src)))
                checked[lib] = _max_over_ranks(0.0 if ok else 1.0) == 0.0
            del dst
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        if i >= a["warmup"]:
            rows.append(row)
        if rank == 0:
            print(f"  rep {row['rep']:>2} ({'/'.join(row['order'])}): " + "  ".join(
                f"{k} {v:.3f}s" for k, v in row.items() if isinstance(v, float) and k != "load1")
                + f"  [loadavg {row['load1']:.1f}]", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "total_bytes": total, "checked": checked,
                       "tensors": 3 * len(specs), "dropped": dropped and a["drop_caches"]}, f)
    dist.destroy_process_group()


def save_results(res: dict, path: str | None) -> None:
    """Record this run's environment (Python, torch, machine, cores, date) in ``res`` and
    write ``res`` as JSON to ``path`` (None: not written)."""
    import platform

    import torch

    res["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                  "machine": platform.platform(), "cpus": os.cpu_count(),
                  "date": time.strftime("%Y-%m-%d")}
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)


def add_state_args(p: argparse.ArgumentParser) -> None:
    """The model-shape options every benchmark of this folder shares."""
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=768, help="model width")
    p.add_argument("--vocab", type=int, default=8193, help="odd: uneven Shard(0)")
    p.add_argument("--ffn-mult", type=int, default=4, help="MLP width / hidden")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    add_state_args(p)
    p.add_argument("--dcp-threads", type=int, default=1, help="FileSystemWriter thread_count")
    p.add_argument("--raw-block-mib", type=int, default=64, help="raw write/read block size")
    p.add_argument("--dir", default=None, help="parent of the scratch dir (None: the system temp dir)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not try to drop the page cache before loads")
    p.add_argument("--prefault-mib", type=int, default=PREFAULT_MIB,
                   help="MiB touched and freed right before each load (0: none); see drop_caches")
    p.add_argument("--json", default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    import torch.multiprocessing as tmp

    os.environ["OMP_NUM_THREADS"] = "1"
    scratch = tempfile.mkdtemp(prefix="dckpt-bench-", dir=args.dir)
    a = {**vars(args), "dir": scratch}
    res_path = os.path.join(scratch, "result.json")
    print(f"scratch dir {scratch}; {args.world} ranks; {args.reps} reps (+{args.warmup} warmup)")
    try:
        tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"), a, res_path),
                  nprocs=args.world, join=True)
        with open(res_path) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["args"] = vars(args)
    import platform
    import torch
    res["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                  "machine": platform.platform(), "cpus": os.cpu_count()}
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def report(res: dict) -> None:
    rows, total = res["rows"], res["total_bytes"]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
    load = [r["load1"] for r in rows]
    res["median"] = med
    gb = total / 1e9
    print(f"\nstate: {total / 2**20:.1f} MiB in {res['tensors']} DTensors (+1 int), "
          f"Shard(0) over {res['args']['world']} ranks; medians of {len(rows)} reps; 1-min "
          f"load average at rep start {min(load):.1f}..{max(load):.1f} (2 cores)")
    print("loads: " + ("page cache dropped before each load (cold reads from disk)" if res["dropped"]
                       else "page cache NOT dropped: loads read from the page cache for both"))
    print(f"correct (loaded == saved): {res['checked']}\n")
    print(f"{'':22}{'save s':>9}{'GB/s':>7}{'load s':>9}{'GB/s':>7}")
    for lib, name in (("dckpt", "dckpt"), ("dcp", "DCP")):
        s, lo = med[f"{lib}_save"], med[f"{lib}_load"]
        print(f"{name:22}{s:9.3f}{gb / s:7.2f}{lo:9.3f}{gb / lo:7.2f}")
    rs, rl = med["dckpt_save"] / med["dcp_save"], med["dckpt_load"] / med["dcp_load"]
    print(f"{'ratio dckpt/DCP':22}{rs:9.2f}{'':7}{rl:9.2f}   (target <= 0.80)")
    print(f"\n{'physical limits':22}{'s':>9}{'GB/s':>7}")
    for k, name in (("raw_write", "raw write+fsync"), ("raw_write_first", "  first of the two"),
                    ("raw_read", "raw read (cold)" if res["dropped"] else "raw read (cached)"),
                    ("memcpy", "memcpy (copy_)")):
        print(f"{name:22}{med[k]:9.3f}{gb / med[k]:7.2f}")
    pct = {f"{lib}_pct_of_{w}": 100 * med[w] / med[f"{lib}_save"]
           for lib in ("dckpt", "dcp") for w in ("raw_write", "raw_write_first")}
    res["ratios"] = {"save": rs, "load": rl, **pct}
    print(f"\nsave throughput as % of raw write+fsync (target >= 80%): dckpt "
          f"{pct['dckpt_pct_of_raw_write']:.0f}% (of the first raw write: "
          f"{pct['dckpt_pct_of_raw_write_first']:.0f}%); DCP {pct['dcp_pct_of_raw_write']:.0f}% "
          f"({pct['dcp_pct_of_raw_write_first']:.0f}%)")


if __name__ == "__main__":
    main()
