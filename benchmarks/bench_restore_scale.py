"""One rank's restore planning at scale, without processes (issue 47).

For each saved world size R and layout (the manifests ``bench_scale.py --path rule``
commits: FSDP Shard(0) over R ranks, 500 tensors of mixed, partly uneven shapes; FSDP2
over TP on an (R / 8, 8) mesh with 70B-class block shapes), rank 0's manifest is built
by the plan-by-rule coordinator (untimed), then:

* parse: ``manifest.parse`` of its JSON, its time and the memory the parsed manifest
  keeps (tracemalloc: allocated after the parse, JSON bytes aside);
* for each target world size (the same R, and 65,536 / 98,304 when they differ from R:
  a load into another world size, same layout) and sampled target ranks (first, middle,
  last): what one rank does before its first read: ``restore.match_target`` (keys,
  dtypes, shapes against the manifest) and ``engine.reader.plan_pieces`` (the chunks
  overlapping each of its boxes, the coverage check, and each read chunk's box, which
  the reader looks its stored tensor up by). Time: median of ``--reps``; peak: tracemalloc
  over one more pass (what the planning allocates beyond the parsed manifest).

The target rank's boxes come from ``dckpt.layout.chunks.local_box`` /
``dckpt.layout.strided.local_boxes`` (the arithmetic ``describe_all`` uses for a
DTensor), its local tensors are meta tensors (no memory): DTensors over 131,072 ranks
cannot be built in one process, so ``restore.describe_all`` is answered from them.

Targets (issue 47): match + plan < 0.2 s and < 150 MB peak, parsed manifest < 100 MB,
16,384 -> 131,072 at most 1.5x in time and memory.

    python benchmarks/bench_restore_scale.py [--ranks 16384 65536 131072]
        [--layouts fsdp fsdp_tp] [--reps 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_scale import PLACEMENTS_2D, TP, tensor_specs, tensor_specs_2d  # noqa: E402
from dckpt.engine import reader  # noqa: E402
from dckpt.format import manifest as mf  # noqa: E402
from dckpt.layout.chunks import Box, local_box  # noqa: E402
from dckpt.layout.strided import local_boxes  # noqa: E402
from dckpt.protocol import restore  # noqa: E402
from dckpt.state.tensors import LocalPiece  # noqa: E402

TARGET_S, TARGET_MB, TARGET_MANIFEST_MB, TARGET_GROWTH = 0.2, 150.0, 100.0, 1.5


def build_manifest(world: int, layout: str, tensors: int) -> tuple[bytes, list]:
    """The committed manifest's JSON of a first save at ``world`` ranks (untimed), and
    the tensor specs (key, dtype, shape, TP style or None)."""
    from scale_rule import rank_votes, rule_coordinator, rule_offers

    if layout == "fsdp":
        specs = [(k, d, s, None) for k, d, s in tensor_specs(world, tensors)]
        offers = rule_offers(world, [(k, d, s) for k, d, s, _ in specs], layout)
    else:
        specs = tensor_specs_2d(tensors)
        offers = rule_offers(world, specs, layout)
    _, _, data, _ = rule_coordinator(offers, world, rank_votes(world))
    return data, specs


def target_pieces(specs: list, world: int, rank: int, layout: str) -> dict[str, list]:
    """{key: [LocalPiece]}: what rank ``rank`` of a ``world``-rank job of ``layout``
    holds, its local tensors on the meta device (untimed)."""
    out = {}
    memo: dict = {}
    for key, dt, shape, style in specs:
        got = memo.get((shape, style))
        if got is None:
            if layout == "fsdp":
                b = local_box(shape, (world,), (rank,), [("S", 0)])
                boxes = [(tuple(b.offsets), tuple(b.sizes))]
            else:
                lb = local_boxes(shape, (world // TP, TP), (rank // TP, rank % TP),
                                 PLACEMENTS_2D[style])
                boxes = [(tuple(o), tuple(z)) for o, z in zip(lb.offsets.tolist(),
                                                              lb.sizes.tolist())]
            got = memo[(shape, style)] = boxes
        out[key] = [LocalPiece(key, dt, tuple(shape), Box(o, z),
                               torch.empty(z, device="meta") if np.prod(z) else None)
                    for o, z in got]
    return out


def plan_one(m: mf.Manifest, pieces: dict[str, list]) -> int:
    """One rank's match + read plan; returns the reads planned."""
    state = {k: ps[0].local if ps[0].local is not None else torch.empty(0, device="meta")
             for k, ps in pieces.items()}
    real = restore.describe_all
    restore.describe_all = lambda key, t: pieces[key]
    try:
        matched = restore.match_target(state, m)
    finally:
        restore.describe_all = real
    planned = reader.plan_pieces(matched.pieces)
    for _, e, item in planned:  # the box the reader looks the stored tensor up by
        e.chunks.box(item.chunk)
    return len(planned)


def measure(data: bytes, pieces: dict, reps: int) -> tuple[float, float, int, float]:
    """(median seconds, peak MB over one more pass, reads, median CPU seconds: less
    sensitive than the wall time to other work on a shared machine). Each pass plans on a fresh
    parse (untimed), as a rank plans once per parse: whatever a first plan builds and
    keeps (expanded cells) is counted, not served from the pass before."""
    times, cpu = [], []
    for _ in range(reps):
        m = mf.parse(data)
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        n = plan_one(m, pieces)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        del m
    m = mf.parse(data)
    gc.collect()
    tracemalloc.start()
    try:
        plan_one(m, pieces)
        peak = tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()
    return statistics.median(times), peak, n, statistics.median(cpu)


def parsed(data: bytes) -> tuple[mf.Manifest, float, float]:
    """(manifest, parse seconds, MB the parsed manifest keeps)."""
    gc.collect()
    t = time.perf_counter()
    m = mf.parse(data)
    s = time.perf_counter() - t
    del m
    gc.collect()
    tracemalloc.start()
    try:
        m = mf.parse(data)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] / 1e6
    finally:
        tracemalloc.stop()
    return m, s, kept


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16384, 65536, 131072])
    p.add_argument("--targets", type=int, nargs="*", default=[65536, 98304],
                   help="target world sizes besides the saved one")
    p.add_argument("--layouts", nargs="+", default=["fsdp", "fsdp_tp"],
                   choices=["fsdp", "fsdp_tp"])
    p.add_argument("--tensors", type=int, default=500)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    print(f"one rank's restore planning, median of {args.reps} (manifest built untimed)\n"
          f"{'layout':>8}{'saved':>8}{'JSON MB':>8}{'parse s':>8}{'parsed MB':>10}"
          f"{'target':>8}{'rank':>8}{'reads':>6}{'plan s':>8}{'cpu s':>7}{'peak MB':>8}")
    for layout in args.layouts:
        for world in args.ranks:
            data, specs = build_manifest(world, layout, args.tensors)
            m, parse_s, kept = parsed(data)
            del m
            for tw in [world] + [t for t in args.targets if t != world]:
                for rank in (0, tw // 2, tw - 1):
                    pieces = target_pieces(specs, tw, rank, layout)
                    s, peak, n, cpu = measure(data, pieces, args.reps)
                    row = {"layout": layout, "saved": world, "json_mb": len(data) / 1e6,
                           "parse_s": parse_s, "parsed_mb": kept, "target": tw, "rank": rank,
                           "reads": n, "plan_s": s, "cpu_s": cpu, "peak_mb": peak}
                    rows.append(row)
                    print(f"{layout:>8}{world:8d}{row['json_mb']:8.2f}{parse_s:8.3f}{kept:10.1f}"
                          f"{tw:8d}{rank:8d}{n:6d}{s:8.3f}{cpu:7.3f}{peak:8.1f}", flush=True)
            del data
    verdict = check(rows, args)
    out = {"rows": rows, "verdict": verdict, "args": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def check(rows: list[dict], args) -> dict:
    """The issue's targets at the largest saved world size, and the growth from the
    smallest to the largest (worst sampled rank, same world size)."""
    out = {}
    for layout in args.layouts:
        mine = [r for r in rows if r["layout"] == layout]
        big, small = max(args.ranks), min(args.ranks)
        at = [r for r in mine if r["saved"] == big]
        worst_s, worst_mb = max(r["plan_s"] for r in at), max(r["peak_mb"] for r in at)
        same = lambda w, k: max(r[k] for r in mine if r["saved"] == w and r["target"] == w)  # noqa: E731
        grow_s = same(big, "plan_s") / max(same(small, "plan_s"), 1e-9)
        grow_mb = same(big, "peak_mb") / max(same(small, "peak_mb"), 1e-9)
        grow_cpu = same(big, "cpu_s") / max(same(small, "cpu_s"), 1e-9)
        grow_parsed = at[0]["parsed_mb"] / max(next(r["parsed_mb"] for r in mine
                                                    if r["saved"] == small), 1e-9)
        ok = (worst_s < TARGET_S and worst_mb < TARGET_MB
              and at[0]["parsed_mb"] < TARGET_MANIFEST_MB
              and grow_s <= TARGET_GROWTH and grow_mb <= TARGET_GROWTH)
        out[layout] = {"worst_s": worst_s, "worst_peak_mb": worst_mb,
                       "parsed_mb": at[0]["parsed_mb"], "growth_s": grow_s, "growth_cpu": grow_cpu,
                       "growth_peak": grow_mb, "growth_parsed": grow_parsed, "met": ok}
        print(f"\n{layout} at {big}: worst plan {worst_s:.3f} s (< {TARGET_S}), peak "
              f"{worst_mb:.1f} MB (< {TARGET_MB}), parsed {at[0]['parsed_mb']:.1f} MB "
              f"(< {TARGET_MANIFEST_MB}); {small} -> {big}: time x{grow_s:.2f} (cpu "
              f"x{grow_cpu:.2f}), peak "
              f"x{grow_mb:.2f}, parsed x{grow_parsed:.2f} (<= {TARGET_GROWTH}) -> "
              f"{'MET' if ok else 'MISSED'}")
    return out


if __name__ == "__main__":
    main()
