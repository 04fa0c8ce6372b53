"""CheckpointManager overhead on a real training loop: launch/train.py under torchrun.

Runs launch/train.py (FSDP2 TinyLM, AdamW, gloo on CPU) for ``--steps`` steps with
saves every N steps, synchronous and asynchronous, and with no checkpointing, in one
run and in rotating order (the machine is noisy: each rep runs every mode once; the
no-checkpoint loop is run first and last). Reported per mode: the training loop's mean
step time as the job itself logs it at its last step (restore at start-up and the
final wait for an in-flight save excluded), medians over reps, and the overhead against
the no-checkpoint loops of the same reps. Each run starts from an empty checkpoint root.

    python benchmarks/bench_manager.py [--nproc 2] [--steps 60] [--every 10 20] [--reps 3]
    python benchmarks/bench_manager.py --kinds async tier --every 10 --steps 100 --durable-every 50
    python benchmarks/bench_manager.py --kinds async dcp --every 10 25 50 --steps 100

``tier``: async saves to a fast tier on /dev/shm (``--local-root``), every
``--durable-every`` steps staged to the durable root in the background.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "..", "launch", "train.py")
STEP_RE = re.compile(r"step (\d+) loss \S+ lr \S+ \(([0-9.]+) s/step\)")


def run_job(a, root: str, every: int | None, kind: str) -> dict:
    """One torchrun job; returns its mean step time and checkpoint figures."""
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.nproc}", TRAIN, "--steps", str(a.steps), "--ckpt-root", root,
           "--every", str(every or 10 ** 9), "--keep-last", "2", "--log-every", str(a.steps),
           "--width", str(a.width), "--depth", str(a.depth), "--batch", str(a.batch),
           "--seq", str(a.seq), "--vocab", str(a.vocab)]
    if kind in ("async", "tier"):
        cmd.append("--async-save")
    if kind == "dcp":  # the same loop saving with DCP's async_save (reused stager)
        cmd.append("--dcp")
    local = None
    if kind == "tier":  # async saves to a /dev/shm fast tier, some staged to ``root``
        local = tempfile.mkdtemp(prefix="dckpt-manager-shm-", dir=a.shm)
        cmd += ["--local-root", local, "--durable-every", str(a.durable_every)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // a.nproc)))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if local:
        shutil.rmtree(local, ignore_errors=True)
    if p.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(cmd)}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    steps = [(int(s), float(t)) for s, t in STEP_RE.findall(p.stdout + p.stderr)]
    if not steps or steps[-1][0] != a.steps:
        raise SystemExit(f"no final step line in the job's log:\n{(p.stdout + p.stderr)[-3000:]}")
    saved = sorted(d for d in os.listdir(root) if d.startswith("step-")) if os.path.isdir(root) else []
    size = sum(os.path.getsize(os.path.join(root, saved[-1], f))
               for f in os.listdir(os.path.join(root, saved[-1]))) if saved else 0
    return {"step_s": steps[-1][1], "wall_s": wall, "ckpt_mib": size / 2 ** 20, "kept": len(saved)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, nargs="+", default=[10, 20], help="save every N steps")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dir", default=None, help="parent of the scratch dir (None: system temp)")
    p.add_argument("--kinds", nargs="+", default=["sync", "async"],
                   choices=["sync", "async", "tier", "dcp"], help="checkpointing modes to run")
    p.add_argument("--durable-every", type=int, default=50, help="tier: durable every N steps")
    p.add_argument("--shm", default="/dev/shm", help="tier: parent of the fast tier")
    p.add_argument("--json", default=None, help="write results as JSON here")
    a = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="dckpt-manager-", dir=a.dir)
    modes = [(kind, n) for n in a.every for kind in a.kinds]
    runs: list[dict] = []
    try:
        for rep in range(a.reps):
            k = rep % len(modes)
            for kind, n in [("none", 0), *modes[k:], *modes[:k], ("none", 0)]:
                r = run_job(a, os.path.join(scratch, "ck"), n or None, kind)
                r.update(mode=kind, every=n, rep=rep, load1=os.getloadavg()[0])
                runs.append(r)
                print(f"  rep {rep} {kind:5} /{n:<3} step {r['step_s'] * 1e3:7.1f} ms  "
                      f"ckpt {r['ckpt_mib']:.1f} MiB  [load {r['load1']:.1f}]", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {"args": vars(a), "runs": runs, "summary": summarise(runs, modes)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def summarise(runs: list[dict], modes) -> list[dict]:
    """Median step time per mode, and the median over reps of each rep's overhead
    against that rep's own no-checkpoint loops (the mean of its first and last)."""
    rows = []
    base = {rep: statistics.mean(r["step_s"] for r in runs if r["mode"] == "none" and r["rep"] == rep)
            for rep in {r["rep"] for r in runs}}
    print(f"\n{'mode':>6} {'every':>5} {'step ms':>8} {'overhead':>9} {'ckpt MiB':>9}")
    for kind, n in [("none", 0), *modes]:
        rs = [r for r in runs if r["mode"] == kind and r["every"] == n]
        step = statistics.median(r["step_s"] for r in rs)
        over = statistics.median(r["step_s"] / base[r["rep"]] - 1 for r in rs)
        mib = max(r["ckpt_mib"] for r in rs)
        rows.append({"mode": kind, "every": n, "step_s": step, "overhead": over, "ckpt_mib": mib})
        print(f"{kind:>6} {n or '-':>5} {step * 1e3:8.1f} {over * 100:8.1f}% {mib:9.1f}")
    print("step: the job's mean loop step time at its last step, medians over reps; overhead: "
          "vs the same rep's no-checkpoint runs (target <= 3% for async)")
    return rows


if __name__ == "__main__":
    main()
