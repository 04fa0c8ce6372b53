"""GPU check part "fenced": a fenced fast-tier save of a GPU model while it trains.

A CheckpointManager with ``async_save=True`` and ``local_root`` in /dev/shm saves a
``TrainingState`` of a CUDA MLP + Adam (``--layers`` x ``--width``^2 fp32, ~1.5 GiB
with the moments by default) at three steps of a training loop; the loop goes on at
once, so the next optimizer steps (fenced: they wait for the bounce-pair writer) and
forwards change every tensor on the device while the tier's files are written. Checks:
each saved step restores, from the durable copy and (the newest) from the fast tier,
to exactly the values captured at the call (device clones taken just before it), and
the live model has moved on. Figures: per save, what the training thread lost (the
manager's ``save_seconds``: call + fence wait), and the loop's step time with saves vs
the same loop without (run first).

    python benchmarks/gpu_check/fenced.py [--width 4096] [--layers 8] [--steps 30]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, cpu_mode, device_or_skip, scratch, sync  # noqa: E402

import torch  # noqa: E402

SAVE_AT = (5, 15, 25)


def _model(width: int, layers: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    return m, torch.optim.Adam(m.parameters(), lr=1e-4)


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=False)
    m(x).square().mean().backward()
    opt.step()


def _capture(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Device clones of every tensor the TrainingState holds (taken before the save:
    queued on the same stream, so they hold the values the save must hold)."""
    import dckpt

    out = {}
    for part, sd in dckpt.TrainingState(m, opt).state_dict().items():
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                out[f"{part}/{k}"] = v.detach().clone()
    return out


def _differs(m: torch.nn.Module, opt: torch.optim.Optimizer, want: dict) -> list[str]:
    got = _capture(m, opt)
    return [k for k in want if k not in got or not torch.equal(got[k].cpu(), want[k].cpu())]


def main(rep: Report) -> None:
    import dckpt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    device = device_or_skip("fenced")
    if cpu_mode():
        a.width, a.layers = 256, 4
    nbytes = a.layers * (a.width * a.width + a.width) * 4 * 3  # weights + 2 Adam moments
    rep.data.update(device=device, width=a.width, layers=a.layers, state_bytes=nbytes)
    root, node = scratch("gpucheck-fenced-root-"), scratch("gpucheck-fenced-node-", shm=True)
    try:
        x = torch.randn(64, a.width, device=device)
        m, opt = _model(a.width, a.layers, device)
        for _ in range(3):  # warm-up: kernels, allocator, Adam's state created
            _step(m, opt, x)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            _step(m, opt, x)
        sync(device)
        base = (time.perf_counter() - t0) / a.steps
        wants, lost = {}, []
        mgr = dckpt.CheckpointManager(root, async_save=True, capture_rng=False, local_root=node,
                                      keep_last=len(SAVE_AT) + 1)
        with mgr:
            # as a training job starts: restore() finds nothing and prepares the saver
            # (its pinned bounce pair) off the first save's critical path
            mgr.restore({"train": dckpt.TrainingState(m, opt)})
            sync(device)
            t0 = time.perf_counter()
            for i in range(1, a.steps + 1):
                _step(m, opt, x)
                if i in SAVE_AT:
                    wants[i] = _capture(m, opt)
                    mgr.save(i, {"train": dckpt.TrainingState(m, opt)}, force=True)
                if i - 1 in SAVE_AT:
                    sync(device)  # the fenced step above has run: the save's cost is known
                    # private: the handle's call + fence wait, what save_seconds reports
                    # only at the next save
                    lost.append(mgr._lost.blocking_seconds if mgr._lost is not None else None)
            sync(device)
            loop = (time.perf_counter() - t0) / a.steps
            mgr.wait()
        rep.figures.update(step_s_no_ckpt=base, step_s_with_saves=loop,
                           lost_per_save_s=lost, saves=list(SAVE_AT))
        print(f"step {base * 1e3:.2f} ms without saves, {loop * 1e3:.2f} ms with "
              f"{len(SAVE_AT)} saves; lost per save: {lost}")
        rep.check("the live model moved on after the last save",
                  bool(_differs(m, opt, wants[SAVE_AT[-1]])))
        for step, want in wants.items():
            m2, o2 = _model(a.width, a.layers, device)
            _step(m2, o2, x)  # Adam's state exists to load into
            # the manager keeps the state under "state" in its checkpoints
            dckpt.load({"state": {"train": dckpt.TrainingState(m2, o2)}}, mgr.path(step))
            bad = _differs(m2, o2, want)
            rep.check(f"step {step}: durable copy holds the values at the call", not bad,
                      ", ".join(bad[:5]))
        m2, o2 = _model(a.width, a.layers, device)
        _step(m2, o2, x)
        with dckpt.CheckpointManager(root, async_save=True, capture_rng=False,
                                     local_root=node) as mgr2:
            got = mgr2.restore({"train": dckpt.TrainingState(m2, o2)})
            where = mgr2.restored_from
        bad = _differs(m2, o2, wants[SAVE_AT[-1]])
        rep.check(f"restore() from the fast tier (step {got}, from {where!r}) holds the values "
                  "at the call", got == SAVE_AT[-1] and where == "local" and not bad,
                  ", ".join(bad[:5]))
        rep.check("restored tensors are on the GPU" if device == "cuda" else "restored on CPU",
                  next(m2.parameters()).device.type == device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(node, ignore_errors=True)


if __name__ == "__main__":
    Report("fenced").run(main)
