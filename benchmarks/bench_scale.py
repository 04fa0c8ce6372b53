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

Reports the median of ``--reps`` runs. Target: R=4096 x T=500 total < 5 s, manifest
< 64 MB. ``--profile`` prints a cProfile of one coordinator pass at the largest R.

    python benchmarks/bench_scale.py [--ranks 64 256 1024 4096] [--tensors 500] [--json OUT]
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
    """One timed cached-save coordinator pass: (seconds, offer bytes received)."""
    t0 = time.perf_counter()
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
    args = p.parse_args(argv)

    results = []
    hdr = (f"{'ranks':>6}{'tensors':>8}{'items':>10}{'plans MB':>9}{'plan+val s':>11}"
           f"{'manifest s':>11}{'total s':>9}{'manif. MB':>10}{'parse s':>9}"
           f"{'cached s':>9}{'offers KB':>10}")
    print(f"coordinator cost, median of {args.reps} (plans built+encoded untimed)\n{hdr}")
    blobs: list[bytes] = []
    for world in args.ranks:
        specs = tensor_specs(world, args.tensors)
        t = time.perf_counter()
        blobs = build_blobs(world, specs)
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
        row = {"ranks": world, "tensors": args.tensors, "items": world * args.tensors,
               "plans_mb": sum(map(len, blobs)) / 1e6, "plan_s": med[0], "manifest_s": med[1],
               "total_s": med[0] + med[1], "manifest_mb": size_mb, "parse_s": med[2],
               "build_untimed_s": build_s, "runs": [r[:3] for r in runs],
               "cached_s": cached_s, "offers_kb": cruns[0][1] / 1e3}
        results.append(row)
        print(f"{world:6d}{args.tensors:8d}{row['items']:10d}{row['plans_mb']:9.1f}"
              f"{med[0]:11.3f}{med[1]:11.3f}{row['total_s']:9.3f}{size_mb:10.3f}{med[2]:9.3f}"
              f"{cached_s:9.3f}{row['offers_kb']:10.1f}",
              flush=True)
    last = results[-1]
    met = last["total_s"] < TARGET_S and last["manifest_mb"] < TARGET_MB
    print(f"\ntarget at {last['ranks']}x{last['tensors']}: total < {TARGET_S} s and manifest < "
          f"{TARGET_MB} MB -> {'MET' if met else 'MISSED'} ({last['total_s']:.3f} s, "
          f"{last['manifest_mb']:.3f} MB)")
    out = {"results": results, "target_met": met, "args": vars(args)}
    if args.profile or not met:
        prof = profile(blobs, args.ranks[-1], args.top)
        print(f"\ncProfile of one coordinator pass at R={args.ranks[-1]}:\n{prof}")
        out["profile"] = prof
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
