"""Incremental and compressed saves: bytes written and time, against full saves and DCP.

One process (incremental saves are decided per rank; the coordination is the same as a
full save's). Three workloads, each saved as a chain of steps in four ways into
sibling directories on the same disk: ``full`` (dckpt, no base), ``incremental``
(``base=`` the previous step; the chain's first save with ``block_hashes=True``, as
an incremental CheckpointManager saves), ``incremental+zstd``, ``unhashed base`` (``base=``
the previous step of the ``full`` chain, plain saves that record no block hashes: each
compared chunk of the base is read back and hashed) and ``dcp``
(torch.distributed.checkpoint.save, single process):

- ``frozen``: a fine-tune with a frozen backbone (fp32, ~95% of the bytes) and LoRA-style
  adapters plus their two Adam moments, all of which change every step;
- ``embedding``: a recommendation-style fp32 table and its Adam moment table, 2% of
  random rows updated per step;
- ``dense``: LLM pre-training, weights and two Adam moments, everything changes.

Also, on the dense state: what recording block hashes costs a full save
(``block_hashes=True`` against a plain save), compression's cost and gain for full saves on the
disk and on /dev/shm (the fastest "disk" there is), and the compression ratio and
single-thread throughput of zstd and lz4 with and without byte grouping on trained-like
bf16/fp32 weights and Adam moments. Physical limits of the same bytes: raw
write+fsync on the disk and memcpy. Medians over steps and repetitions.

    python benchmarks/bench_incremental.py [--mib 192] [--steps 4] [--root DIR] [--json OUT]
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
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dckpt  # noqa: E402
from dckpt.format import codec  # noqa: E402
from bench_save_load import raw_write as _raw_write  # noqa: E402

MiB = 1 << 20


# ---------------------------------------------------------------- workloads
def frozen(mib: int, g: torch.Generator) -> tuple[dict, Callable[[dict, int], None]]:
    hidden = 1024
    rows = int(0.95 * mib * MiB) // (hidden * 4)
    layers = 8
    sd: dict[str, Any] = {f"backbone.{i}": torch.randn(rows // layers, hidden, generator=g) * 0.02
                          for i in range(layers)}
    rank = max(1, int(0.05 * mib * MiB) // (3 * 4 * 2 * hidden * layers))
    for i in range(layers):
        for n, shape in (("a", (rank, hidden)), ("b", (hidden, rank))):
            for part in ("w", "exp_avg", "exp_avg_sq"):
                sd[f"lora.{i}.{n}.{part}"] = torch.randn(*shape, generator=g) * 0.01

    def step(sd: dict, s: int) -> None:
        for k, v in sd.items():
            if k.startswith("lora."):
                v.add_(torch.randn(v.shape, generator=g) * 1e-3)
    return sd, step


def embedding(mib: int, g: torch.Generator) -> tuple[dict, Callable[[dict, int], None]]:
    dim = 64
    rows = mib * MiB // (2 * dim * 4)
    sd = {"table": torch.randn(rows, dim, generator=g) * 0.05,
          "table.exp_avg_sq": torch.rand(rows, dim, generator=g) * 1e-6}

    def step(sd: dict, s: int) -> None:
        idx = torch.randperm(rows, generator=g)[: rows // 50]  # 2% of the rows
        sd["table"][idx] += torch.randn(len(idx), dim, generator=g) * 1e-3
        sd["table.exp_avg_sq"][idx] = torch.rand(len(idx), dim, generator=g) * 1e-6
    return sd, step


def dense(mib: int, g: torch.Generator) -> tuple[dict, Callable[[dict, int], None]]:
    hidden, n = 1024, 12
    rows = mib * MiB // (3 * n * hidden * 4)
    sd = {}
    for i in range(n):
        sd[f"w.{i}"] = torch.randn(rows, hidden, generator=g) * 0.02
        sd[f"w.{i}.exp_avg"] = torch.randn(rows, hidden, generator=g) * 1e-4
        sd[f"w.{i}.exp_avg_sq"] = torch.rand(rows, hidden, generator=g) * 1e-7

    def step(sd: dict, s: int) -> None:
        for v in sd.values():
            v.add_(torch.randn(v.shape, generator=g) * 1e-5)
    return sd, step


WORKLOADS = {"frozen": frozen, "embedding": embedding, "dense": dense}
MODES = ("full", "incremental", "incremental+zstd", "unhashed base", "dcp")


def state_bytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def save_mode(mode: str, sd: dict, root: str, step: int) -> tuple[float, int]:
    """(seconds, bytes written) of one save of ``sd`` as ``step`` in ``mode``'s chain."""
    path = os.path.join(root, mode.replace("+", "_"), f"step-{step:04d}")
    if mode == "unhashed base":  # a sibling of the full chain's steps, its base
        if not step:
            return 0.0, 0
        path = os.path.join(root, "full", f"inc-{step:04d}")
        t, info = timed(lambda: dckpt.save(sd, path, base=os.path.join(
            root, "full", f"step-{step - 1:04d}")))
        return t, info.bytes_written
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp
        t, _ = timed(lambda: dcp.save(sd, checkpoint_id=path))
        return t, dir_bytes(path)
    base = os.path.join(os.path.dirname(path), f"step-{step - 1:04d}") if step else None
    kw: dict[str, Any] = {}
    if mode.startswith("incremental"):
        kw["base"] = base
        kw["block_hashes"] = True
    if mode.endswith("+zstd"):
        kw["compression"] = "zstd"
    t, info = timed(lambda: dckpt.save(sd, path, **kw))
    return t, info.bytes_written


def check_equal(sd: dict, path: str) -> None:
    back = dckpt.load({k: torch.empty_like(v) for k, v in sd.items()}, path)
    for k, v in sd.items():
        assert torch.equal(back[k], v), f"{path}: {k} does not round-trip"


def run_workload(name: str, mib: int, steps: int, root: str) -> dict:
    g = torch.Generator().manual_seed(0)
    sd, step = WORKLOADS[name](mib, g)
    total = state_bytes(sd)
    rows: dict[str, list[tuple[float, int]]] = {m: [] for m in MODES}
    for m in MODES:
        save_mode(m, sd, root, 0)
    for s in range(1, steps + 1):
        step(sd, s)
        order = MODES[s % len(MODES):] + MODES[: s % len(MODES)]  # spread the noise
        for m in order:
            rows[m].append(save_mode(m, sd, root, s))
    for m in ("incremental", "incremental+zstd"):
        check_equal(sd, os.path.join(root, m.replace("+", "_"), f"step-{steps:04d}"))
    check_equal(sd, os.path.join(root, "full", f"inc-{steps:04d}"))
    out = {"state_bytes": total}
    for m, r in rows.items():
        out[m] = {"seconds": statistics.median(t for t, _ in r),
                  "bytes": statistics.median(b for _, b in r)}
    shutil.rmtree(root)
    return out


# ---------------------------------------------------------------- limits, hashing
def raw_write(path: str, nbytes: int) -> float:
    """Seconds of a raw os.write + fsync of ``nbytes`` (bench_save_load's floor)."""
    block = memoryview(bytearray(os.urandom(16 * MiB)))
    t0 = time.perf_counter()
    _raw_write(path, nbytes, block)
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def memcpy(sd: dict) -> float:
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    for k, v in dst.items():
        v.copy_(sd[k])  # touch first
    t0 = time.perf_counter()
    for k, v in dst.items():
        v.copy_(sd[k])
    return time.perf_counter() - t0


def full_save_costs(mib: int, reps: int, disk: str, shm: str | None) -> dict:
    """Full saves of the dense state: raw, raw with block hashes, zstd, lz4; on ``disk``
    and (when given) on ``shm``. Medians over ``reps``."""
    g = torch.Generator().manual_seed(1)
    sd, _ = dense(mib, g)
    variants = {"raw": {}, "raw, block_hashes": {"block_hashes": True},
                "zstd": {"compression": "zstd"}, "lz4": {"compression": "lz4"}}
    out: dict[str, Any] = {"state_bytes": state_bytes(sd)}
    for where, root in (("disk", disk), ("shm", shm)):
        if root is None:
            continue
        res: dict[str, list[tuple[float, int]]] = {v: [] for v in variants}
        for i in range(reps):
            for v, kw in variants.items():
                path = os.path.join(root, f"cost-{v.replace(' ', '_').replace(',', '')}-{i}")
                t, info = timed(lambda: dckpt.save(sd, path, **kw))
                res[v].append((t, info.bytes_written))
                shutil.rmtree(path)
        out[where] = {v: {"seconds": statistics.median(t for t, _ in r),
                          "bytes": statistics.median(b for _, b in r)} for v, r in res.items()}
    out["raw_write_fsync_s"] = statistics.median(
        raw_write(os.path.join(disk, "raw"), out["state_bytes"]) for _ in range(reps))
    out["memcpy_s"] = statistics.median(memcpy(sd) for _ in range(reps))
    return out


# ---------------------------------------------------------------- codecs
def codec_table(mib: int) -> list[dict]:
    """Ratio and single-thread MB/s of each compressor, with and without byte grouping,
    on trained-like tensors (``mib`` MiB each)."""
    g = torch.Generator().manual_seed(2)
    n = mib * MiB // 4
    w = torch.randn(n, generator=g) * 0.02
    tensors = {
        "fp32 weights": w,
        "bf16 weights": w[: n // 2].to(torch.bfloat16),
        "fp32 Adam exp_avg": torch.randn(n, generator=g) * 1e-4,
        "fp32 Adam exp_avg_sq": (torch.randn(n, generator=g) * 1e-3) ** 2,
        "bf16 Adam exp_avg": (torch.randn(n // 2, generator=g) * 1e-4).to(torch.bfloat16),
    }
    out = []
    for name, t in tensors.items():
        raw = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
        dtype = "BF16" if t.dtype == torch.bfloat16 else "F32"
        for comp, flag in (("zstd", codec.ZSTD), ("lz4", codec.LZ4)):
            for grouped in (False, True):
                blocks = [raw[i:i + codec.HASH_BLOCK] for i in range(0, len(raw), codec.HASH_BLOCK)]
                t0 = time.perf_counter()
                enc = [codec.encode(b, dtype if grouped else "U8", t.element_size() if grouped else 1,
                                    flag) for b in blocks]
                tc = time.perf_counter() - t0
                stored = sum(len(e[1]) for e in enc)
                t0 = time.perf_counter()
                for (f, s), b in zip(enc, blocks):
                    codec.decode(f, s, len(b), t.element_size() if grouped else 1)
                td = time.perf_counter() - t0
                out.append({"tensor": name, "codec": comp, "grouped": grouped,
                            "ratio": len(raw) / stored, "compress_MBps": len(raw) / tc / 1e6,
                            "decompress_MBps": len(raw) / td / 1e6})
    return out


# ---------------------------------------------------------------- report
def report(res: dict) -> None:
    print(f"\n== incremental vs full vs DCP (medians over {res['steps']} steps) ==")
    print(f"{'workload':10}{'mode':18}{'MiB written':>12}{'x full':>8}{'save s':>8}{'x full':>8}")
    for name in WORKLOADS:
        w = res["workloads"][name]
        full = w["full"]
        for m in MODES:
            r = w[m]
            print(f"{name:10}{m:18}{r['bytes'] / MiB:12.1f}{r['bytes'] / full['bytes']:8.3f}"
                  f"{r['seconds']:8.3f}{r['seconds'] / full['seconds']:8.2f}")
    c = res["costs"]
    gb = c["state_bytes"] / 1e9
    print(f"\n== full saves of the dense state ({c['state_bytes'] / MiB:.0f} MiB) ==")
    print(f"raw write+fsync {c['raw_write_fsync_s']:.3f} s ({gb / c['raw_write_fsync_s']:.2f} GB/s), "
          f"memcpy {c['memcpy_s']:.3f} s ({gb / c['memcpy_s']:.2f} GB/s)")
    for where in ("disk", "shm"):
        if where not in c:
            continue
        raw = c[where]["raw"]
        for v, r in c[where].items():
            print(f"{where:5}{v:24}{r['seconds']:8.3f} s{r['seconds'] / raw['seconds']:7.2f}x"
                  f"{r['bytes'] / MiB:9.1f} MiB (ratio {c['state_bytes'] / r['bytes']:.2f})")
    print("\n== codecs, one thread, 1 MiB blocks ==")
    print(f"{'tensor':22}{'codec':6}{'grouped':>8}{'ratio':>7}{'comp MB/s':>10}{'dec MB/s':>10}")
    for r in res["codecs"]:
        print(f"{r['tensor']:22}{r['codec']:6}{str(r['grouped']):>8}{r['ratio']:7.3f}"
              f"{r['compress_MBps']:10.0f}{r['decompress_MBps']:10.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=192, help="state size per workload")
    ap.add_argument("--steps", type=int, default=4, help="incremental steps per workload")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the full-save costs")
    ap.add_argument("--root", default=None, help="a directory on the disk to measure")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base = tempfile.mkdtemp(prefix="bench-incr-", dir=a.root)
    shm = tempfile.mkdtemp(prefix="bench-incr-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    try:
        res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "mib": a.mib, "steps": a.steps,
                               "load1": os.getloadavg()[0], "workloads": {}}
        for name in WORKLOADS:
            res["workloads"][name] = run_workload(name, a.mib, a.steps, os.path.join(base, name))
            print(f"{name}: done (load {os.getloadavg()[0]:.1f})", flush=True)
        res["costs"] = full_save_costs(a.mib, a.reps, base, shm)
        res["codecs"] = codec_table(min(a.mib, 32))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
    report(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
