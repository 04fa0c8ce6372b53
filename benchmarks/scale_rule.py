"""The plan-by-rule path of ``bench_scale.py`` (``--path rule``, its default): what
rank 0 does on a first save and on a cached save at R ranks, votes included. Run it
through ``python benchmarks/bench_scale.py``; its docstring says what is timed."""
from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import statistics
import time

import numpy as np

from bench_scale import (PLACEMENTS_2D, TP, rank0_peak_mb, tensor_specs,  # noqa: E402
                         tensor_specs_2d)
from dckpt.format import manifest as mf  # noqa: E402
from dckpt.layout import plan as gplan  # noqa: E402
from dckpt.protocol import plancache  # noqa: E402


def rule_offers(world: int, specs: list, layout: str) -> list[bytes]:
    """Every rank's plan-by-rule offer (untimed): rank 0's with the signature."""
    from dckpt.format import codec
    from dckpt.layout import rules
    from dckpt.layout.strided import local_boxes

    if layout == "fsdp":
        lay = rules.Layout(tuple(range(world)), (world,), (("S", 0),))
        sig = rules.Signature(tuple(range(world)), [lay], [(k, d, s, 0) for k, d, s in specs])
    else:
        mesh = (world // TP, TP)
        lays = [rules.Layout(tuple(range(world)), mesh, PLACEMENTS_2D[st]) for st in ("col", "row", "norm")]
        sig = rules.Signature(tuple(range(world)), lays,
                              [(k, d, s, ("col", "row", "norm").index(st)) for k, d, s, st in specs])
    data = rules.encode(sig)
    sh = codec._xxh().xxh3_128_digest(data)
    hashes = np.zeros((world, 2), np.uint64)
    r = np.arange(world, dtype=np.int64)
    memo: dict = {}
    for k, (_, _, shape, lid) in enumerate(sig.items):
        got = memo.get((shape, lid))
        if got is None:
            offs = np.zeros((world, len(shape)), np.int64)
            sizes = np.tile(np.asarray(shape, np.int64), (world, 1))
            if layout == "fsdp":  # torch.chunk, per rank
                step = -(-shape[0] // world)
                offs[:, 0] = np.minimum(r * step, shape[0])
                sizes[:, 0] = np.minimum(step, shape[0] - offs[:, 0])
            else:
                for q in range(world):
                    lb = local_boxes(shape, mesh, (q // TP, q % TP), sig.layouts[lid].placements)
                    assert len(lb) == 1
                    offs[q], sizes[q] = lb.offsets[0], lb.sizes[0]
            got = memo[(shape, lid)] = rules.box_lanes(offs, sizes)
        with np.errstate(over="ignore"):
            hashes += rules.key_lanes(got, k)
    hb = hashes.astype("<u8").tobytes()
    fp = (bytes(16), bytes(16))
    return [plancache.encode_rule(fp, (data, sh, hb[16 * q:16 * q + 16]),
                                  {"step": 1} if q == 0 else None) for q in range(world)]


SAVE_ID = "0123456789abcdef"


def rank_votes(world: int, seed: int = 1) -> list[bytes]:
    """Every rank's vote as it sends it (untimed): a file of random size (100 MB to
    4 GB), header length (4 to 68 KB) and header CRC32, named as a save names it."""
    from dckpt.format.filenames import data_name
    from dckpt.protocol import votes

    rng = np.random.default_rng(seed)
    size = rng.integers(100 << 20, 4 << 30, world).tolist()
    hlen = rng.integers(4 << 10, 68 << 10, world).tolist()
    crc = rng.integers(0, 1 << 32, world).tolist()
    return [votes.encode({"file": data_name(SAVE_ID, r), "size": size[r], "hlen": hlen[r],
                          "crc": crc[r]}, SAVE_ID, r) for r in range(world)]


def commit_manifest(gp, vote_blobs: list[bytes], world: int) -> bytes:
    """Rank 0's commit before its I/O: decode the votes, the manifest (file table from
    the votes), its JSON."""
    from dckpt.protocol import votes

    table = votes.decode(vote_blobs, SAVE_ID)
    assert not table.errors and len(table.docs) == 0
    return mf.to_json(gplan.to_manifest(gp, table.files(), SAVE_ID, world,
                                        {"dckpt_version": "bench"}))


def rule_coordinator(offers: list[bytes], world: int, vote_blobs: list[bytes]
                     ) -> tuple[float, float, bytes, plancache.CoordCache]:
    """One timed plan-by-rule coordinator pass: (plan s, votes + manifest s, manifest,
    cache)."""
    from dckpt.protocol.coordinator import _Coordinator

    t0 = time.perf_counter()
    cache = plancache.CoordCache()
    coord = _Coordinator(None, "bench", True, world, cache)
    decoded = [plancache.decode_offer(o) for o in offers]
    gp = coord._derive(decoded)
    assert gp is not None, "not derived"
    kind, gp = cache.adopt(decoded, gp)
    assert kind == "plan", kind
    gplan.encode_writes(gp)
    t1 = time.perf_counter()
    data = commit_manifest(gp, vote_blobs, world)
    return t1 - t0, time.perf_counter() - t1, data, cache



def cached_coordinator(cache: plancache.CoordCache, offers: list[bytes], world: int,
                       vote_blobs: list[bytes]) -> float:
    """One timed cached-save coordinator pass (seconds): the numpy offer check, then
    the votes decoded into the manifest's file table, the manifest and its JSON."""
    t0 = time.perf_counter()
    gp = cache.reuse_uniform(offers)  # as the coordinator: the numpy path first
    if gp is None:
        kind, gp = cache.reuse([plancache.decode_offer(o) for o in offers])
        assert kind == "plan", kind
    commit_manifest(gp, vote_blobs, world)
    return time.perf_counter() - t0


def main_rule(args) -> dict:
    """The plan-by-rule rows: first save, rank 0's peak memory, cached save, parse (each
    the median of ``--reps``); with ``--profile``, a cProfile of one first save and one
    cached save at each layout's largest R."""
    import dckpt.protocol.coordinator  # noqa: F401 - imported before timing (torch: seconds)
    results = []
    print(f"plans by rule, median of {args.reps} (offers and votes built untimed)\n"
          f"{'layout':>8}{'ranks':>7}{'tensors':>8}{'recv MB':>8}{'plan s':>8}{'manif s':>8}"
          f"{'first s':>8}{'rank0 MB':>9}{'manif MB':>9}{'parse s':>8}{'cached s':>9}"
          f"{'c.recv MB':>10}")
    profiles = {}
    for layout, world in [(lay, w) for lay in args.layouts for w in args.ranks]:
        specs = (tensor_specs(world, args.tensors) if layout == "fsdp"
                 else [(k, d, s, st) for k, d, s, st in tensor_specs_2d(args.tensors)])
        offers = rule_offers(world, specs, layout)
        vote_blobs = rank_votes(world)
        vote_mb = sum(map(len, vote_blobs)) / 1e6
        recv = sum(map(len, offers)) / 1e6 + vote_mb
        runs = []
        for _ in range(args.reps):
            gc.collect()
            runs.append(rule_coordinator(offers, world, vote_blobs))
        plan_s = statistics.median(r[0] for r in runs)
        man_s = statistics.median(r[1] for r in runs)
        del runs
        last: list = []  # the memory pass's plan: the one the cached saves reuse
        peak = rank0_peak_mb(lambda: last.append(rule_coordinator(offers, world, vote_blobs)))
        data, cache = last[0][2], last[0][3]
        del last
        parses = []
        for _ in range(args.reps):
            gc.collect()
            t = time.perf_counter()
            parsed = mf.parse(data)
            parses.append(time.perf_counter() - t)
            assert len(parsed.tensors) == args.tensors and len(parsed.files) == world
            del parsed
        parse_s = statistics.median(parses)
        later = [plancache.encode_offer(True, (bytes(16), plancache.values_hash({"step": 2})), b"",
                                        {"step": 2} if q == 0 else None, cache.plan_id)
                 for q in range(world)]
        cached_runs = []
        for _ in range(args.reps):
            gc.collect()
            cached_runs.append(cached_coordinator(cache, later, world, vote_blobs))
        cached_s = statistics.median(cached_runs)
        row = {"layout": layout, "ranks": world, "tensors": args.tensors, "recv_mb": recv,
               "plan_s": plan_s, "manifest_s": man_s, "first_s": plan_s + man_s,
               "rank0_peak_mb": peak, "manifest_mb": len(data) / 1e6, "parse_s": parse_s,
               "parse_runs": parses, "cached_s": cached_s, "cached_runs": cached_runs,
               "cached_recv_mb": sum(map(len, later)) / 1e6 + vote_mb, "votes_mb": vote_mb}
        results.append(row)
        print(f"{layout:>8}{world:7d}{args.tensors:8d}{recv:8.2f}{plan_s:8.3f}{man_s:8.3f}"
              f"{row['first_s']:8.3f}{peak:9.1f}{row['manifest_mb']:9.3f}{parse_s:8.3f}"
              f"{cached_s:9.3f}{row['cached_recv_mb']:10.2f}", flush=True)
        if args.profile and world == args.ranks[-1]:
            profiles[layout] = {
                "first": _profiled(lambda: rule_coordinator(offers, world, vote_blobs), args.top),
                "cached": _profiled(lambda: cached_coordinator(cache, later, world, vote_blobs),
                                    args.top),
                "parse": _profiled(lambda: mf.parse(data), args.top, "tottime")}
            for step, text in profiles[layout].items():
                print(f"\ncProfile of one {step} pass at R={world} ({layout}):\n{text}")
    out = {"results": results, "args": vars(args), "profiles": profiles}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _profiled(fn, top: int, sort: str = "cumulative") -> str:
    prof = cProfile.Profile()
    gc.collect()
    prof.enable()
    fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(top)
    return s.getvalue()
