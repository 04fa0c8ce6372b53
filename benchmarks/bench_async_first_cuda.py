"""The first dckpt.async_save of CUDA tensors vs later ones (pinned staging): how long
each call blocks, cold and after ``dckpt.prepare_async_save``.

The CUDA counterpart of bench_async_first.py (issue 34, section 3): one process, no
process group, a state of ``--mib`` MiB of fp32 CUDA tensors (``--tensors`` of them),
``--calls`` async saves without a fence, each waited for before the next. "cold": the
first call allocates and pins its staging buffers; "prepared": prepare_async_save(state)
first (timed apart). Each mode runs ``--runs`` times, each in a fresh process (so a
run's first call is a process's first). Prints per mode the medians of the first call,
the later calls and their ratio, and, for scale, the device-to-host copy of the state
into already pinned memory (the physical floor of a later call).

    python benchmarks/bench_async_first_cuda.py [--mib 1024] [--tensors 64] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _one(mode: str, mib: int, tensors: int, calls: int, out: str) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import dckpt

    n = mib * 2**20 // 4 // tensors
    state = {f"t{i}": torch.randn(n, device="cuda") for i in range(tensors)}
    torch.cuda.synchronize()
    prep = None
    if mode == "prepared":
        t0 = time.perf_counter()
        dckpt.prepare_async_save(state)
        prep = time.perf_counter() - t0
    blocked = []
    for c in range(calls):
        t0 = time.perf_counter()
        h = dckpt.async_save(state, os.path.join(out, f"c{c}"), overwrite=True)
        blocked.append(time.perf_counter() - t0)
        h.result()
    pinned = torch.empty(n * tensors, dtype=torch.float32, pin_memory=True)
    t0 = time.perf_counter()
    off = 0
    for t in state.values():
        pinned[off:off + n].copy_(t, non_blocking=True)
        off += n
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    return {"mode": mode, "first": blocked[0], "later": statistics.median(blocked[1:]),
            "prepare": prep, "d2h_pinned": d2h}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_one(a.child[0], a.mib, a.tensors, a.calls, a.child[1])))
        return
    rows = []
    for r in range(a.runs):
        for mode in ("cold", "prepared"):
            with tempfile.TemporaryDirectory() as d:
                out = subprocess.run([sys.executable, __file__, "--mib", str(a.mib), "--tensors",
                                      str(a.tensors), "--calls", str(a.calls), "--child", mode,
                                      d], capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print(f"\n{a.mib} MiB of CUDA fp32 tensors ({a.tensors}), {a.runs} runs per mode, medians:")
    print("| mode | first call | later calls | first / later | prepare | D2H into pinned |")
    print("|---|---|---|---|---|---|")
    for mode in ("cold", "prepared"):
        rs = [x for x in rows if x["mode"] == mode]
        med = {k: statistics.median(x[k] for x in rs) for k in ("first", "later", "d2h_pinned")}
        ratio = statistics.median(x["first"] / x["later"] for x in rs)
        prep = statistics.median(x["prepare"] for x in rs) if mode == "prepared" else None
        print(f"| {mode} | {med['first']:.3f} s | {med['later']:.3f} s | {ratio:.2f}x | "
              f"{'-' if prep is None else f'{prep:.3f} s'} | {med['d2h_pinned']:.3f} s |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
