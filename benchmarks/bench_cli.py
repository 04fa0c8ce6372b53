"""CLI start-up: wall and CPU time of ``dckpt ls / inspect / du / history`` (and verify)
on a local checkpoint, each a fresh ``python -m dckpt`` process, against the floor the
CLI used to pay before issue 27 (item 9): ``python -c "import torch"``.

Builds a small run in a temporary directory: a CheckpointManager root with 4 committed
steps and its save history, and a fast tier (``local_root``). Every command runs
``--reps`` times (in rotating order, so a burst of load on a shared machine does not
hit one command only); the table gives medians. CPU time (user + sys of the child) is
less sensitive to other load than wall time. ``--baseline-src DIR``: also time the
same commands with the dckpt package found in DIR (e.g. ``git archive <commit> dckpt |
tar -x -C DIR``), the "before" of a change. Each command is also checked for importing
torch (``-X importtime``): ls, inspect, du and history must not.

    python benchmarks/bench_cli.py [--reps 9] [--baseline-src DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def build_run(tmp: str) -> dict[str, list[str]]:
    """A run with 4 durable steps, its history and a fast tier; the commands to time."""
    import torch

    import dckpt

    root, shm = os.path.join(tmp, "run"), os.path.join(tmp, "shm")
    mgr = dckpt.CheckpointManager(root, local_root=shm, every_steps=10, durable_every_steps=10,
                                  keep_last_local=2, capture_rng=False)
    for s in (10, 20, 30, 40):
        state = {"model": {f"layer{i}.weight": torch.randn(256, 256) for i in range(8)},
                 "step": s}
        assert mgr.save(s, state)
    mgr.close()
    step = os.path.join(root, "step-00000040")
    return {"ls": ["ls", root], "inspect": ["inspect", step], "du": ["du", root],
            "history": ["history", root], "ls (fast tier)": ["ls", shm],
            "verify": ["verify", step]}


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(argv: list[str], env: dict, cwd: str) -> tuple[float, float]:
    """(wall s, CPU s) of one process run to completion; raises if it fails."""
    c0, t0 = _child_cpu(), time.perf_counter()
    r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _child_cpu() - c0
    if r.returncode != 0:
        raise RuntimeError(f"{argv} failed ({r.returncode}): {r.stderr.strip()}")
    return wall, cpu


def imports_torch(argv: list[str], env: dict, cwd: str) -> bool:
    r = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env, cwd=cwd,
                       capture_output=True, text=True)
    return any(re.search(r"\|\s*torch$", line.rstrip()) for line in r.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--baseline-src", help="a directory holding an older dckpt package")
    ap.add_argument("--json", help="write the medians here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        cmds = build_run(tmp)
        cwd = tmp  # not the source tree: ``-m`` puts the cwd first on sys.path
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        variants = {"now": dict(os.environ, PYTHONPATH=here)}
        if a.baseline_src:
            variants["baseline"] = dict(os.environ, PYTHONPATH=os.path.abspath(a.baseline_src))
        jobs = [("import torch (the old floor)", "now", [sys.executable, "-c", "import torch"]),
                ("python -c pass", "now", [sys.executable, "-c", "pass"])]
        for name, argv in cmds.items():
            for v in variants:
                jobs.append((name, v, [sys.executable, "-m", "dckpt", *argv]))
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for rep in range(a.reps):
            k = rep % len(jobs)
            for name, v, argv in jobs[k:] + jobs[:k]:
                samples.setdefault((name, v), []).append(timed(argv, variants[v], cwd))
        torch_of = {name: imports_torch(["-m", "dckpt", *argv], variants["now"], cwd)
                    for name, argv in cmds.items()}
    load = os.getloadavg()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} CPUs  "
          f"load {load:.1f}  python {platform.python_version()}  reps {a.reps}")
    print("| command | dckpt | wall median (s) | CPU median (s) | imports torch |")
    print("|---|---|---|---|---|")
    out = {}
    for (name, v), xs in samples.items():
        wall = statistics.median(x[0] for x in xs)
        cpu = statistics.median(x[1] for x in xs)
        out[f"{name} [{v}]"] = {"wall_s": wall, "cpu_s": cpu}
        tq = ("yes" if torch_of[name] else "no") if name in torch_of and v == "now" else ""
        print(f"| {name} | {v if name in cmds else '-'} | {wall:.3f} | {cpu:.3f} | {tq} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load": load, "reps": a.reps, "medians": out}, f, indent=1)


if __name__ == "__main__":
    main()
