"""The first dckpt.async_save of a process vs later ones: how long each call blocks.

A user pays the first call once per job, but it decides whether async saving "feels"
free (issue 34, section 3: the first call blocked 12x a later one; target <= 2x).
Each run spawns ``--world`` fresh gloo ranks (a new process: no saver, no staging
buffers, no checkpoint group yet) holding the DTensor state of bench_save_load.py
(fp32 weights and two Adam moments of a small transformer, Shard(0) over a 1-D CPU
mesh; the defaults give 730 MiB), makes ``--calls`` async saves without a fence, each
waited for before the next (so no call includes a previous save), and reports per
call the blocking time (call to return; max over ranks). Two modes, alternating run
by run: "cold" (the first call allocates its staging buffers) and "prepared"
(``prepare_async_save(state)`` first, outside the timed calls, as a training script
does once after building or restoring its state; timed apart). The first call is also
split into phases (saver set-up, staging plan with its allocations, the copy) by
timing the engine's own functions. Medians over ``--runs`` runs per mode; the ratio
is per run (first / median of the later calls), then its median.

    python benchmarks/bench_async_first.py [--runs 5] [--calls 4] [--modes cold prepared]
        [--json OUT]
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save_load import add_state_args, make_state, model_specs, save_results  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("saver", "plan", "copy")


def _max(xs: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timing(cls: Any, name: str, into: dict, phase: str) -> None:
    """Wrap ``cls.name`` so that the seconds of its calls add up in ``into[phase]``."""
    fn = getattr(cls, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[phase] = into.get(phase, 0.0) + time.perf_counter() - t0

    setattr(cls, name, staticmethod(timed) if isinstance(cls.__dict__.get(name), staticmethod)
            else timed)


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dckpt
    from dckpt.protocol import async_save as engine
    from dckpt.engine.staging import StagingPool

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = make_state(model_specs(a["layers"], a["hidden"], a["vocab"], a["ffn_mult"]),
                       mesh, rank, world, zero=False)
    phases: dict[str, float] = {}
    _timing(engine._Saver, "__init__", phases, "saver")
    _timing(StagingPool, "plan", phases, "plan")
    _timing(StagingPool, "run", phases, "copy")
    prepared = float("nan")
    if a["mode"] == "prepared":
        from dckpt.protocol.async_save import prepare_async_save

        dist.barrier()
        t0 = time.perf_counter()
        prepare_async_save(state)
        prepared = time.perf_counter() - t0
        phases.clear()
    calls, first_phases = [], {}
    for i in range(a["calls"]):
        path = os.path.join(a["dir"], f"c{i}")
        dist.barrier()
        t0 = time.perf_counter()
        h = dckpt.async_save(state, path)
        blocked = time.perf_counter() - t0
        if i == 0:
            first_phases = dict(phases)
        h.result()
        calls.append(blocked)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    got = _max([*calls, *(first_phases.get(p, 0.0) for p in PHASES), prepared])
    if rank == 0:
        nbytes = sum(t.to_local().numel() * 4 for g in ("weights", "exp_avg", "exp_avg_sq")
                     for t in state[g].values())
        with open(out, "w") as fh:
            json.dump({"calls": got[:len(calls)],
                       "phases": dict(zip(PHASES, got[len(calls):len(calls) + 3])),
                       "prepare": got[-1], "rank0_bytes": nbytes}, fh)
    dist.destroy_process_group()


def _run(args: argparse.Namespace, mode: str) -> dict:
    """One run in fresh processes: the calls' blocking times, max over ranks."""
    import torch.multiprocessing as tmp

    scratch = tempfile.mkdtemp(prefix="dckpt-bench-first-", dir=args.dir)
    res_path = os.path.join(scratch, "result.json")
    try:
        tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"),
                                {**vars(args), "dir": scratch, "mode": mode}, res_path),
                  nprocs=args.world, join=True)
        with open(res_path) as fh:
            run = json.load(fh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    run["later"] = statistics.median(run["calls"][1:])
    run["ratio"] = run["calls"][0] / run["later"]
    run["load1"] = os.getloadavg()[0]
    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--runs", type=int, default=5, help="runs, each in fresh processes")
    p.add_argument("--calls", type=int, default=4, help="async saves per run (first + later)")
    p.add_argument("--modes", nargs="+", default=["cold", "prepared"],
                   choices=["cold", "prepared"], help="alternated run by run")
    add_state_args(p)
    p.set_defaults(layers=8)  # 730 MiB: the 768 MiB case, about
    p.add_argument("--dir", default=None, help="parent of the scratch dir (None: system temp)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    runs: dict[str, list] = {m: [] for m in args.modes}
    for r in range(args.runs):
        for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
            runs[mode].append(_run(args, mode))
            run = runs[mode][-1]
            c = run["calls"]
            print(f"  run {r} {mode:8}: first {c[0]:.3f} s (" + ", ".join(
                f"{k} {v:.3f}" for k, v in run["phases"].items()) + f"), later "
                f"{run['later']:.3f} s ({', '.join(f'{x:.3f}' for x in c[1:])}): "
                f"{run['ratio']:.2f}x" + (f"; prepare {run['prepare']:.3f} s"
                                          if mode == "prepared" else "")
                + f" [load {run['load1']:.1f}]", flush=True)
    med: dict[str, Any] = {}
    for mode, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("later", "ratio")}
        m["first"] = statistics.median(r["calls"][0] for r in rs)
        m["phases"] = {k: statistics.median(r["phases"][k] for r in rs) for k in PHASES}
        if mode == "prepared":
            m["prepare"] = statistics.median(r["prepare"] for r in rs)
        med[mode] = m
    one = next(iter(runs.values()))[0]
    print(f"\n~{one['rank0_bytes'] * args.world / 2**20:.0f} MiB of DTensors over "
          f"{args.world} gloo ranks, no fence; medians of {args.runs} runs per mode:")
    for mode, m in med.items():
        print(f"{mode:8}: first call blocks {m['first']:.3f} s (saver {m['phases']['saver']:.3f}, "
              f"plan {m['phases']['plan']:.3f}, copy {m['phases']['copy']:.3f}); later calls "
              f"{m['later']:.3f} s; first / later {m['ratio']:.2f}x (target <= 2x)"
              + (f"; prepare_async_save {m['prepare']:.3f} s" if mode == "prepared" else ""))
    res = {"runs": runs, "median": med, "args": vars(args)}
    save_results(res, args.json)
    return res


if __name__ == "__main__":
    main()
