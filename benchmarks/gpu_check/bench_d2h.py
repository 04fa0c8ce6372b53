"""GPU check part "bench_d2h": the fenced fast-tier save of 1-4 GiB of CUDA tensors
against its physical limits, measured in the same process.

Per size (``--gib``, default 1 2 4; eight fp32 tensors):
* ``d2h``: the pinned device-to-host copy of the same bytes (one pinned buffer of the
  largest size, allocated once; its pinning time is reported apart);
* ``shm``: writing those bytes from the pinned buffer into a fresh /dev/shm file
  (64 MiB ``os.write`` calls; tmpfs pages allocated as the tier's are);
* ``tier``: ``CheckpointManager(async_save=True, local_root=/dev/shm/...)`` saving
  the tensors fenced on an optimizer over them (the bounce-pair path of
  engine/devstream.py), from the call until ``wait()`` returns (durable copies off).
Medians of ``--reps`` after one warm-up; target: tier >= 80% of the D2H bandwidth.

    python benchmarks/gpu_check/bench_d2h.py [--gib 1 2 4] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, cpu_mode, device_or_skip, gbps, median, scratch, sync  # noqa: E402

import torch  # noqa: E402

BLOCK = 64 << 20


def _shm_write(buf: torch.Tensor, nbytes: int) -> float:
    """Seconds to write ``nbytes`` of ``buf`` into a new /dev/shm file."""
    view = memoryview(buf.view(torch.uint8).numpy())[:nbytes]
    path = os.path.join("/dev/shm", f"gpucheck-shm-{os.getpid()}")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, nbytes, BLOCK):
            os.write(fd, view[off:off + BLOCK])
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def main(rep: Report) -> None:
    import dckpt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    device = device_or_skip("bench_d2h")
    if cpu_mode():
        a.gib = [1 / 32]
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    # the tier file and the shm-write file never coexist, but keep 2x as margin
    fits = [g for g in a.gib if 2 * g * 2**30 < free]
    rep.data.update(device=device, shm_free=free, sizes_gib=fits, skipped_sizes=
                    [g for g in a.gib if g not in fits])
    rep.check("/dev/shm holds the sizes asked for", fits == a.gib,
              f"free {free / 2**30:.1f} GiB; running {fits}")
    if not fits:
        return
    top = int(max(fits) * 2**30)
    t0 = time.perf_counter()
    pinned = torch.empty(top // 4, dtype=torch.float32, pin_memory=device == "cuda")
    rep.figures["pin_alloc_s"] = time.perf_counter() - t0
    rows = rep.figures.setdefault("sizes", [])
    for g in fits:
        nbytes = int(g * 2**30) // 32 * 32
        n = nbytes // 4 // 8
        params = [torch.nn.Parameter(torch.randn(n, device=device)) for _ in range(8)]
        opt = torch.optim.SGD(params, lr=0.0)  # the fence: nothing changes the tensors
        state = {f"t{i}": p for i, p in enumerate(params)}

        def d2h() -> float:
            sync(device)
            t = time.perf_counter()
            for i, p in enumerate(params):
                pinned[i * n:(i + 1) * n].copy_(p.detach(), non_blocking=True)
            sync(device)
            return time.perf_counter() - t

        root, node = scratch("gpucheck-d2h-root-", shm=True), scratch("gpucheck-d2h-node-",
                                                                        shm=True)
        tier: list[float] = []
        try:
            with dckpt.CheckpointManager(root, async_save=True, capture_rng=False,
                                         local_root=node, durable_every_steps=10**9) as mgr:
                mgr.restore(state)  # prepares the saver, as a job's start does
                for step in range(1, a.reps + 2):
                    sync(device)
                    t = time.perf_counter()
                    mgr.save(step, state, force=True, force_durable=False, fence=opt)
                    mgr.wait()
                    if step > 1:  # the first is the warm-up
                        tier.append(time.perf_counter() - t)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(node, ignore_errors=True)
        d2h()
        dd = median([d2h() for _ in range(a.reps)])
        _shm_write(pinned, n * 4 * 8)
        sh = median([_shm_write(pinned, n * 4 * 8) for _ in range(a.reps)])
        tm = median(tier)
        row = {"gib": g, "bytes": n * 32, "d2h_s": dd, "shm_write_s": sh, "tier_save_s": tm,
               "d2h_GBps": gbps(n * 32, dd), "shm_GBps": gbps(n * 32, sh),
               "tier_GBps": gbps(n * 32, tm), "tier_runs_s": tier}
        row["tier_vs_d2h"] = dd / tm if tm else None
        rows.append(row)
        print(f"{g:g} GiB: D2H {row['d2h_GBps']:.2f} GB/s, /dev/shm write {row['shm_GBps']:.2f} "
              f"GB/s, fenced tier save {row['tier_GBps']:.2f} GB/s "
              f"({100 * row['tier_vs_d2h']:.0f}% of D2H)", flush=True)
        rep.write()
        del params, opt, state
        if device == "cuda":
            torch.cuda.empty_cache()
    rep.check("measured every size", len(rows) == len(fits))


if __name__ == "__main__":
    Report("bench_d2h").run(main)
