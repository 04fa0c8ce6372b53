"""Writing a state into a /dev/shm shard file: the paths a fast-tier save takes, side by
side, one process, one rank (no collectives: the write itself).

On CPU (always):
* ``host``: from the live host tensors (the fenced CPU path: no copy);
* ``bounce``: through the 16 MiB bounce pair (the GPU path's block logic and
  fingerprints, run on CPU tensors: its host-side cost beside ``host``);
* ``memcpy``: the floor, one copy of the state into a fresh host buffer.

With CUDA (run where a GPU is lent), the state on the GPU:
* ``gpu bounce``: streamed through the pinned bounce pair (the fenced GPU path: the
  tier's file is the one host copy);
* ``gpu staged``: copied whole into pinned staging buffers, then written (the path
  before: two host copies);
* ``d2h``: the floor, one device-to-host copy into pinned memory.

Medians of ``--reps`` runs, in seconds, and ratios to the floor; host memory growth
(peak RSS) per mode is printed too.

    python benchmarks/bench_devstream.py [--mib 512] [--reps 5] [--dir /dev/shm]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dckpt.engine import devstream  # noqa: E402
from dckpt.engine.staging import StagingPool  # noqa: E402
from dckpt.format.dtypes import to_code  # noqa: E402
from dckpt.layout.chunks import Box  # noqa: E402
from dckpt.protocol.commit import write_file  # noqa: E402
from dckpt.state.tensors import LocalPiece  # noqa: E402
from dckpt.storage.fsspec_storage import make_storage  # noqa: E402


def _piece(key: str, t: torch.Tensor) -> LocalPiece:
    """What a rank's plan holds for a whole tensor ``t`` (what write_file reads)."""
    shape = tuple(t.shape)
    return LocalPiece(key, to_code(t.dtype, key), shape, Box((0,) * t.dim(), shape), t)


def _state(mib: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mib * 2**20 // 4 // 8  # eight tensors
    return [torch.randn(n, generator=g).to(device) for _ in range(8)]


def _write(storage, root: str, tensors, stream: bool) -> float:
    devstream.STREAM_CPU = stream
    pieces = [_piece(f"t{i}", t) for i, t in enumerate(tensors)]
    t0 = time.perf_counter()
    write_file(storage, root, "data.safetensors", 0, pieces)
    dt = time.perf_counter() - t0
    storage.remove(storage.join(root, "data.safetensors"))
    devstream.STREAM_CPU = False
    return dt


def _median(f, reps: int) -> float:
    f()  # warm: page faults, pinning, the bounce pair
    return statistics.median(f() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dckpt-bench-devstream-", dir=a.dir)
    storage, root = make_storage(root)
    rows = []
    try:
        host = _state(a.mib, "cpu")

        def memcpy() -> float:
            out = [torch.empty_like(t) for t in host]
            t0 = time.perf_counter()
            for o, t in zip(out, host):
                o.copy_(t)
            return time.perf_counter() - t0

        floor = _median(memcpy, a.reps)
        rows.append(("memcpy (floor)", floor, floor))
        rows.append(("host", _median(lambda: _write(storage, root, host, False), a.reps), floor))
        rows.append(("bounce", _median(lambda: _write(storage, root, host, True), a.reps), floor))
        host.clear()  # frees the host state before the GPU rows
        if torch.cuda.is_available():
            gpu = _state(a.mib, "cuda")
            pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in gpu]

            def d2h() -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for p, t in zip(pinned, gpu):
                    p.copy_(t, non_blocking=True)
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            gfloor = _median(d2h, a.reps)
            pinned.clear()
            pool = StagingPool()

            def staged() -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                snap, _ = pool.snapshot({f"t{i}": t for i, t in enumerate(gpu)})
                pieces = [_piece(k, v) for k, v in snap.items()]
                write_file(storage, root, "data.safetensors", 0, pieces)
                dt = time.perf_counter() - t0
                storage.remove(storage.join(root, "data.safetensors"))
                return dt

            rows.append(("d2h pinned (floor)", gfloor, gfloor))
            rows.append(("gpu bounce", _median(lambda: _write(storage, root, gpu, False), a.reps),
                         gfloor))
            rows.append(("gpu staged", _median(staged, a.reps), gfloor))
            print(f"pinned staging held: {pool.nbytes / 2**20:.0f} MiB; bounce pair: "
                  f"{2 * devstream.BOUNCE / 2**20:.0f} MiB per GPU")
    finally:
        storage.remove_tree(root)
    print(f"state {a.mib} MiB, {a.reps} reps, medians; dir {a.dir}")
    print(f"{'mode':<22}{'seconds':>10}{'x floor':>10}{'GB/s':>8}")
    for name, dt, fl in rows:
        print(f"{name:<22}{dt:>10.3f}{dt / fl:>10.2f}{a.mib * 2**20 / dt / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
