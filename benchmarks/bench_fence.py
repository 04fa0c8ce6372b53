"""What a fenced save's module hooks cost: arming them, and one forward under them.

A model of ``--blocks`` residual blocks (Linear, LayerNorm, GELU, Linear: 5 modules a
block, ~4,500 modules for 900 blocks; tiny widths, so the hooks dominate) and Adam,
fenced as a TrainingState's automatic fence does (``fence=[opt, model]``), by the
:class:`dckpt.engine.fence.Fence` a save arms, with an event standing for the snapshot
(no save runs: its background thread would share the GIL with the timed forwards).
Reported, median of ``--reps`` saves, one process on the CPU, one thread:

* arm, first save: every module waits (nothing learned yet);
* arm, next saves: only the writers wait (LayerNorm has no buffers: none here), the
  others get the learning hooks;
* forward under the hooks, less the same forward with no hook at all;
* the forward after the snapshot (the hooks remove themselves in it), and the one
  after that (no hook left: the plain cost).

    python benchmarks/bench_fence.py [--blocks 900] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from dckpt.engine.fence import Fence


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.norm = torch.nn.Linear(width, width), torch.nn.LayerNorm(width)
        self.act, self.b = torch.nn.GELU(), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.act(self.norm(self.a(x))))


def _forward_s(m: torch.nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        m(x)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=900)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = torch.nn.Sequential(*(Block(args.width) for _ in range(args.blocks)))
    opt = torch.optim.Adam(m.parameters())
    x = torch.randn(2, args.width)
    n = sum(1 for _ in m.modules())
    plain = statistics.median(_forward_s(m, x) for _ in range(args.reps))

    rows: dict[str, list[float]] = {k: [] for k in ("arm_first", "arm_next", "forward_armed",
                                                    "forward_last", "forward_after")}
    for i in range(args.reps + 1):
        # a fence as async_save(fence=[opt, m]) arms it; its event stands for the
        # snapshot (no save runs: its background work would share the GIL with the
        # forwards timed here)
        done = threading.Event()
        fence = Fence(done)
        t0 = time.perf_counter()
        fence.arm([opt, m])
        rows["arm_first" if i == 0 else "arm_next"].append(time.perf_counter() - t0)
        if i > 0:  # the first save's forwards wait: none runs before the snapshot
            rows["forward_armed"].append(_forward_s(m, x) - plain)
        done.set()
        rows["forward_last"].append(_forward_s(m, x) - plain)
        rows["forward_after"].append(_forward_s(m, x) - plain)
        fence.disarm()
    print(f"{n} modules, plain forward {plain * 1e3:.1f} ms (CPU, 1 thread)")
    for k, v in rows.items():
        print(f"  {k:14s} {statistics.median(v) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
