"""GPU check part "bench_async": what one async save of a CUDA training state costs
the training thread, dckpt vs DCP's ``async_save``, on the same state and loop.

One rank (NCCL; DCP's background collectives on a gloo group of their own, as its docs
ask). A CUDA MLP + Adam (``--layers`` x ``--width``^2 fp32: ~1.5 GiB with the moments)
trains ``--steps`` steps, saving every ``--every``, in four loops run in turn: no
checkpoint, ``dckpt.async_save`` fenced on the optimizer (after
``prepare_async_save``), ``dckpt.async_save`` unfenced (pinned staging), and
``dcp.async_save`` of ``get_state_dict`` (a new save first waits for the previous
one, in every mode). Per mode: the blocking time of each call, and the loop's time
lost per save against the no-checkpoint loop (its excess / saves). Target: dckpt's
lost time <= 0.25x DCP's.

    python benchmarks/gpu_check/bench_async.py [--width 4096] [--layers 8] [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, cpu_mode, device_or_skip, median, scratch, sync  # noqa: E402

import torch  # noqa: E402


def _loop(mode: str, a: Any, device: str, root: str, gloo: Any) -> dict:
    """One training loop in ``mode``; returns its wall time and per-call blocking."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dckpt

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width)
                              for _ in range(a.layers)]).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    x = torch.randn(64, a.width, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        m(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    if mode.startswith("dckpt"):
        dckpt.prepare_async_save(dckpt.TrainingState(m, opt))
    pending: Any = None
    blocked: list[float] = []
    sync(device)
    t0 = time.perf_counter()
    for i in range(1, a.steps + 1):
        step()
        if i % a.every:
            continue
        path = os.path.join(root, f"{mode}-{i}")
        t = time.perf_counter()
        if pending is not None:  # at most one in flight, in every mode
            pending.result()
        if mode == "dckpt fenced":
            pending = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, path, fence=opt)
        elif mode == "dckpt":
            pending = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, path)
        elif mode == "dcp":
            msd, osd = get_state_dict(m, opt)
            pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path,
                                     process_group=gloo)
        blocked.append(time.perf_counter() - t)
    sync(device)
    wall = time.perf_counter() - t0
    if pending is not None:
        pending.result()
    return {"mode": mode, "wall_s": wall, "blocked_s": blocked}


def main(rep: Report) -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    a = ap.parse_args()
    device = device_or_skip("bench_async")
    if cpu_mode():
        a.width, a.layers, a.steps, a.every = 256, 4, 12, 4
    root = scratch("gpucheck-async-")
    rdzv = os.path.join(root, "rdzv")
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{rdzv}", rank=0, world_size=1)
    gloo = dist.new_group(backend="gloo")
    saves = a.steps // a.every
    rep.data.update(device=device, width=a.width, layers=a.layers, steps=a.steps,
                    every=a.every, state_bytes=a.layers * (a.width ** 2 + a.width) * 12)
    runs = []
    try:
        _loop("none", a, device, root, gloo)  # warm-up: CUDA context, kernels, allocator
        for mode in ("none", "dckpt fenced", "dckpt", "dcp", "none"):
            r = _loop(mode, a, device, root, gloo)
            runs.append(r)
            print(f"{mode}: loop {r['wall_s']:.3f} s, blocked per call "
                  f"{[round(b, 4) for b in r['blocked_s']]}", flush=True)
            for d in os.listdir(root):  # keep the disk free: each save ~1.5 GiB
                if d != "rdzv":
                    shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        base = median([r["wall_s"] for r in runs if r["mode"] == "none"])
        for mode in ("dckpt fenced", "dckpt", "dcp"):
            r = next(x for x in runs if x["mode"] == mode)
            rep.figures[mode] = {"lost_per_save_s": (r["wall_s"] - base) / saves,
                                 "first_call_s": r["blocked_s"][0],
                                 "later_calls_s": median(r["blocked_s"][1:])}
        rep.figures["runs"] = runs
        dcp_lost = rep.figures["dcp"]["lost_per_save_s"]
        for mode in ("dckpt fenced", "dckpt"):
            lost = rep.figures[mode]["lost_per_save_s"]
            ratio = lost / dcp_lost if dcp_lost > 0 else None
            rep.figures[mode]["vs_dcp"] = ratio
            print(f"{mode}: lost {lost:.4f} s per save vs DCP {dcp_lost:.4f} s "
                  f"(ratio {ratio if ratio is None else round(ratio, 3)}; target <= 0.25)")
        rep.check("every mode ran", len(runs) == 5)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    Report("bench_async").run(main)
