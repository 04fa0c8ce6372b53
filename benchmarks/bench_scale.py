"""The save coordinator's cost at scale, without processes.

For each world size R, T tensors are sharded Shard(0) over all R ranks, FSDP style
(dim0 >= R, a third of them not divisible by R, so some ranks hold short or empty
shards; dim1 mixed 64..4096; every 5th tensor 1-D). Each rank's
:class:`dckpt.layout.localplan.LocalPlan` is built with ``chunks.local_box`` and encoded
to bytes, as ranks send it (not timed). Then what rank 0 does is timed:

* plan+validate: ``localplan.decode`` of every blob (one shared cache), ``plan_global``,
  ``encode_writes`` (the write masks it broadcasts);
* manifest: ``to_manifest`` (one fake FileEntry per rank) + ``manifest.to_json``;
* parse: ``manifest.parse`` of the JSON (what every rank does at load);
* cached: a later save whose plans did not change (dckpt.protocol.plancache): decode
  every rank's 41-byte offer, reuse the plan with the new values, then the manifest as
  above. The offers are built untimed (each rank fingerprints its own plan).

``--layouts fsdp_tp`` (run by default after ``fsdp``) is FSDP2 over TP on a (R / 8, 8)
mesh with a 70B-class block's shapes (:data:`BLOCK_2D`): colwise weights carry
``[_StridedShard(0, sf=8), Shard(0)]``, so their boxes do not ascend with the rank;
rowwise weights split two dims; norms are replicated over tp. Its plans are built with
``dckpt.layout.strided.local_boxes`` (untimed); "items" counts the boxes sent.

``--path rule`` (the default since issue 38) simulates plans by rule: every rank sends a
65-byte offer (hashes: its structure, values, signature, and the boxes it holds), rank 0
its signature too; rank 0 derives every rank's boxes (dckpt.layout.derive), checks the
hashes, builds the write masks and the manifest. Each rank's plan hash is computed
untimed from its own boxes (``chunks.local_box`` arithmetic / ``strided.local_boxes``,
not the derivation). ``--path gathered`` is the path before (every rank's boxes).
"rank0 MB" is tracemalloc's peak over the timed coordinator step in a separate pass
(what rank 0 receives as Python bytes plus everything it builds; not the simulation).

In the rule path (benchmarks/scale_rule.py), the "manif s" part of the first save and
the cached save also time what rank 0 does with the votes every save: every rank's vote
(its file's size, header length and header CRC32, random per rank; built untimed with
``dckpt.protocol.votes.encode``, as each rank sends it: a 20-byte record) is decoded
(``votes.decode``) into the manifest's file table, and the manifest is built and
serialised (``to_manifest`` + ``to_json``), as ``_Coordinator.commit`` does before its
I/O. Not timed: the gathers themselves, the listing that checks the files exist, the
manifest's write. "recv MB" / "c.recv MB" are the bytes rank 0 receives per first /
cached save: offers plus votes. First save, parse and cached save are each the median
of ``--reps`` passes; the cached saves reuse the plan of the last first-save pass (the
memory pass), and with it its manifest entries and their JSON, as a real later save
reuses those of the save before.

Reports the median of ``--reps`` runs. Target (gathered path): R=4096 x T=500 total
< 5 s, manifest < 64 MB. ``--profile`` prints a cProfile of one coordinator pass at the
largest R (rule path: of the first save, the cached save and the parse, per layout).

    python benchmarks/bench_scale.py [--ranks 64 256 1024 4096] [--tensors 500]
        [--layouts fsdp fsdp_tp] [--json OUT]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dckpt.format import manifest as mf  # noqa: E402
from dckpt.layout import localplan  # noqa: E402
from dckpt.layout import plan as gplan  # noqa: E402
from dckpt.layout.chunks import local_box  # noqa: E402
from dckpt.protocol import plancache  # noqa: E402

TARGET_S, TARGET_MB = 5.0, 64.0


def tensor_specs(world: int, count: int, seed: int = 0) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype, global shape) of ``count`` tensors, dim0 >= ``world``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        dim0 = world * int(rng.integers(1, 9))
        if i % 3 == 0:  # not divisible by world: torch.chunk leaves short/empty shards
            dim0 += int(rng.integers(1, world))
        dim1 = int(rng.choice([64, 128, 256, 512, 1024, 2048, 4096]))
        shape = (dim0,) if i % 5 == 4 else (dim0, dim1)
        out.append((f"model.layers.{i // 10}.block.param_{i % 10}.weight", "BF16", shape))
    return out


TP = 8  # the 2-D layout's tensor-parallel degree (a 70B-class job: TP 8 within a node)
# One transformer block of a 70B-class model (Llama-2-70B shapes, GQA): (name, shape,
# TP style). Colwise weights are Shard(0) under TP; FSDP2 over TP then shards dim 0
# again: [_StridedShard(0, sf=TP), Shard(0)] on the (dp, tp) mesh. Rowwise weights are
# Shard(1) under TP, then Shard(0) over dp; norms are replicated over tp.
BLOCK_2D = [("attention.wq", (8192, 8192), "col"), ("attention.wk", (1024, 8192), "col"),
            ("attention.wv", (1024, 8192), "col"), ("attention.wo", (8192, 8192), "row"),
            ("feed_forward.w1", (28672, 8192), "col"), ("feed_forward.w3", (28672, 8192), "col"),
            ("feed_forward.w2", (8192, 28672), "row"), ("attention_norm", (8192,), "norm"),
            ("ffn_norm", (8192,), "norm")]
PLACEMENTS_2D = {"col": (("SS", 0, TP), ("S", 0)), "row": (("S", 0), ("S", 1)),
                 "norm": (("S", 0), ("R",))}


def tensor_specs_2d(count: int) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(key, dtype, global shape, TP style) of ``count`` tensors: whole blocks of
    :data:`BLOCK_2D`, layer after layer."""
    out = []
    for i in range(count):
        name, shape, style = BLOCK_2D[i % len(BLOCK_2D)]
        out.append((f"model.layers.{i // len(BLOCK_2D)}.{name}.weight", "BF16", shape, style))
    return out


def build_blobs_2d(world: int, specs: list) -> list[bytes]:
    """Every rank's encoded LocalPlan under FSDP2 over TP on a (world / TP, TP) mesh,
    its boxes from ``dckpt.layout.strided.local_boxes`` (what dckpt.state.tensors asks
    for each DTensor), one item per box. Layers repeat shapes: boxes are computed once
    per (shape, style, rank)."""
    from dckpt.layout.strided import local_boxes

    mesh = (world // TP, TP)
    items = [(k, d, s) for k, d, s, _ in specs]
    memo: dict = {}
    blobs = []
    for r in range(world):
        coord = (r // TP, r % TP)
        flat: list[int] = []
        its: list = []
        for (key, dt, shape), (_, _, _, style) in zip(items, specs):
            got = memo.get((shape, style, r))
            if got is None:
                lb = local_boxes(shape, mesh, coord, PLACEMENTS_2D[style])
                got = memo[(shape, style, r)] = [o + z for o, z in zip(lb.offsets.tolist(),
                                                                      lb.sizes.tolist())]
            for box in got:
                its.append((key, dt, shape))
                flat += box
        blobs.append(localplan.encode(localplan.LocalPlan(its, np.asarray(flat, np.int64))))
    return blobs


def build_blobs(world: int, specs: list) -> list[bytes]:
    """Every rank's encoded LocalPlan (what it sends to rank 0)."""
    blobs = []
    for r in range(world):
        flat: list[int] = []
        for _, _, shape in specs:
            b = local_box(shape, (world,), (r,), [("S", 0)])
            flat += b.offsets
            flat += b.sizes
        blobs.append(localplan.encode(localplan.LocalPlan(specs, np.asarray(flat, np.int64))))
    return blobs


def coordinator(blobs: list[bytes], world: int) -> tuple[float, float, float, bytes]:
    """One timed coordinator pass: (plan s, manifest s, parse s, manifest bytes)."""
    t0 = time.perf_counter()
    cache: dict = {}
    plans = [localplan.decode(b, cache) for b in blobs]
    gp = gplan.plan_global(plans)
    gplan.encode_writes(gp)
    t1 = time.perf_counter()
    files = [mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors",
                          int(gp.bytes_per_rank[r]) + 4096, 4088, 12345, r) for r in range(world)]
    m = gplan.to_manifest(gp, files, "0123456789abcdef", world, {"dckpt_version": "bench"})
    data = mf.to_json(m)
    t2 = time.perf_counter()
    parsed = mf.parse(data)
    t3 = time.perf_counter()
    assert len(parsed.tensors) == len(gp.tensors)
    return t1 - t0, t2 - t1, t3 - t2, data


def rank0_peak_mb(fn) -> float:
    """tracemalloc's peak (MB) while ``fn()`` runs (numpy reports its buffers to it)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def cached_offers(blobs: list[bytes], step: int) -> tuple[plancache.CoordCache, list[bytes]]:
    """A coordinator cache primed by a first (full) save of ``blobs``, and every rank's
    cached offer for a later save whose only change is a value ("step"). Untimed."""
    cache = plancache.CoordCache()
    dec: dict = {}
    plans = [localplan.decode(b, dec) for b in blobs]
    offers = []
    for p, b in zip(plans, blobs):
        offers.append(plancache.decode_offer(
            plancache.encode_offer(False, plancache.fingerprints(p, b), b)))
    gp = gplan.plan_global(plans)
    pid = cache.store(offers, plans, gp)
    world = len(blobs)
    files = [mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors",
                          int(gp.bytes_per_rank[r]) + 4096, 4088, 12345, r) for r in range(world)]
    mf.to_json(gplan.to_manifest(gp, files, "0123456789abcdef", world, {}))  # the first save's
    later = []
    for r, (p, b) in enumerate(zip(plans, blobs)):
        p.values = {"step": step}
        fp = plancache.fingerprints(p, b)
        later.append(plancache.encode_offer(True, fp, b"", p.values if r == 0 else None, pid))
    return cache, later


def cached_coordinator(cache: plancache.CoordCache, offers: list[bytes], world: int) -> tuple[float, int]:
    """One timed cached-save coordinator pass of the gathered path's table: (seconds,
    offer bytes received); the files are one FileEntry per rank (the rule path's
    ``scale_rule.cached_coordinator`` decodes the votes instead)."""
    t0 = time.perf_counter()
    gp = cache.reuse_uniform(offers)  # as the coordinator: the numpy path first
    if gp is None:
        kind, gp = cache.reuse([plancache.decode_offer(o) for o in offers])
        assert kind == "plan", kind
    files = [mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors",
                          int(gp.bytes_per_rank[r]) + 4096, 4088, 12345, r) for r in range(world)]
    mf.to_json(gplan.to_manifest(gp, files, "0123456789abcdef", world, {"dckpt_version": "bench"}))
    return time.perf_counter() - t0, sum(map(len, offers))


def profile(blobs: list[bytes], world: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    coordinator(blobs, world)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096],
                   help="world sizes R")
    p.add_argument("--tensors", type=int, default=500, help="tensors T per rank")
    p.add_argument("--reps", type=int, default=3, help="timed coordinator passes per R")
    p.add_argument("--profile", action="store_true",
                   help="cProfile one pass at the largest R (also done when the target is missed)")
    p.add_argument("--top", type=int, default=25, help="profile lines to print")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--layouts", nargs="+", default=["fsdp", "fsdp_tp"],
                   choices=["fsdp", "fsdp_tp"],
                   help="fsdp: Shard(0) over all ranks; fsdp_tp: FSDP2 over TP "
                        f"(dp = R / {TP}, tp = {TP}), 70B-class block shapes")
    p.add_argument("--path", choices=["rule", "gathered"], default="rule",
                   help="rule: plans by rule (signatures + hashes); gathered: every rank's boxes")
    args = p.parse_args(argv)
    if args.path == "rule":
        from scale_rule import main_rule  # noqa: PLC0415 - beside this script

        return main_rule(args)

    results = []
    hdr = (f"{'layout':>8}{'ranks':>6}{'tensors':>8}{'items':>10}{'plans MB':>9}{'plan+val s':>11}"
           f"{'manifest s':>11}{'total s':>9}{'manif. MB':>10}{'parse s':>9}"
           f"{'cached s':>9}{'offers KB':>10}")
    print(f"coordinator cost, median of {args.reps} (plans built+encoded untimed)\n{hdr}")
    blobs: list[bytes] = []
    for layout, world in [(lay, w) for lay in args.layouts for w in args.ranks]:
        t = time.perf_counter()
        if layout == "fsdp":
            blobs = build_blobs(world, tensor_specs(world, args.tensors))
        else:
            blobs = build_blobs_2d(world, tensor_specs_2d(args.tensors))
        build_s = time.perf_counter() - t
        runs = []
        for _ in range(args.reps):
            gc.collect()
            runs.append(coordinator(blobs, world))
        med = [statistics.median(r[i] for r in runs) for i in range(3)]
        cache, offers = cached_offers(blobs, 1)
        cruns = [cached_coordinator(cache, offers, world) for _ in range(args.reps)]
        cached_s = statistics.median(c[0] for c in cruns)
        size_mb = len(runs[-1][3]) / 1e6
        items = sum(len(localplan.decode(b).items) for b in blobs) if layout != "fsdp" \
            else world * args.tensors
        row = {"layout": layout, "ranks": world, "tensors": args.tensors, "items": items,
               "plans_mb": sum(map(len, blobs)) / 1e6, "plan_s": med[0], "manifest_s": med[1],
               "total_s": med[0] + med[1], "manifest_mb": size_mb, "parse_s": med[2],
               "build_untimed_s": build_s, "runs": [r[:3] for r in runs],
               "cached_s": cached_s, "offers_kb": cruns[0][1] / 1e3}
        results.append(row)
        print(f"{layout:>8}{world:6d}{args.tensors:8d}{row['items']:10d}{row['plans_mb']:9.1f}"
              f"{med[0]:11.3f}{med[1]:11.3f}{row['total_s']:9.3f}{size_mb:10.3f}{med[2]:9.3f}"
              f"{cached_s:9.3f}{row['offers_kb']:10.1f}",
              flush=True)
    met = True
    for layout in args.layouts:  # the target holds for every layout at the largest R
        last = [r for r in results if r["layout"] == layout][-1]
        ok = last["total_s"] < TARGET_S and last["manifest_mb"] < TARGET_MB
        met &= ok
        print(f"\ntarget ({layout}) at {last['ranks']}x{last['tensors']}: total < {TARGET_S} s "
              f"and manifest < {TARGET_MB} MB -> {'MET' if ok else 'MISSED'} "
              f"({last['total_s']:.3f} s, {last['manifest_mb']:.3f} MB)")
    out = {"results": results, "target_met": met, "args": vars(args)}
    if args.profile or not met:  # of the last layout's plans, still in ``blobs``
        prof = profile(blobs, args.ranks[-1], args.top)
        print(f"\ncProfile of one coordinator pass at R={args.ranks[-1]} ({args.layouts[-1]}):\n{prof}")
        out["profile"] = prof
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
