"""Asynchronous save: dckpt.async_save vs torch.distributed.checkpoint.async_save (DCP).

Spawns ``--world`` gloo ranks (torch.multiprocessing, file:// rendezvous, one thread
each) holding the state of bench_save_load.py: fp32 weights and two Adam moments of a
small transformer as DTensors Shard(0) over a 1-D CPU mesh. Measured in one run:

1. Blocking time of one async save (call to return; the caller may then mutate its
   tensors), the first call reported apart from the median of later ones, and 2. the
   total time to commit (call until the handle/future resolves). Each call saves into a
   fresh directory and is waited for before the next, so blocking never includes
   waiting for a previous save. DCP: ``FileSystemWriter(sync_files=True)`` (its default
   stager: fresh buffers every call) and, as its best CPU configuration, a reused
   ``DefaultStager`` (caches its buffers); its background collectives run on a gloo
   group of their own. Per call: max over ranks; tables: medians.
3. The floor: memcpy (``copy_``) of the same local bytes into already-touched buffers.
4. A training loop: an MLP with AdamW (gradients all-reduced) runs ``--steps`` steps
   with no checkpoint, dckpt async saves, or DCP async saves every ``--every`` steps of
   the full state (model + optimizer + the sharded state above); a new save first waits
   for the previous one. Mean step time (max over ranks) and overhead vs the
   no-checkpoint loops run just before and after (each rep; medians over reps).

    python benchmarks/bench_async.py [--reps 6] [--loop-reps 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save_load import (_max_over_ranks, add_state_args, locals_of, make_state,  # noqa: E402
                             model_specs, timed)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBS = ("dckpt", "dcp", "dcp_cached")
# Training-loop modes: LIBS and dckpt with a fence on the optimizer (the copy overlaps
# the next forward/backward; the next optimizer step waits for it).
# "dckpt_tier": a CheckpointManager saving into a /dev/shm fast tier (no durable copy in
# the loop), fenced on the optimizer: the tier's files are written from the live tensors.
LOOP_MODES = LIBS + ("dckpt_fence", "dckpt_tier")
NAMES = {"dckpt": "dckpt", "dcp": "DCP (FileSystemWriter)", "dcp_cached": "DCP (reused stager)",
         "dckpt_fence": "dckpt, fenced on the optimizer",
         "dckpt_tier": "dckpt manager, /dev/shm tier, fenced"}


def _clean(x: Any) -> Any:
    """NaN (no value: e.g. DCP's staging seconds) -> None, so the JSON is standard."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return [_clean(v) for v in x] if isinstance(x, list) else x


def _max3(xs: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    import dckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    specs = model_specs(a["layers"], a["hidden"], a["vocab"], a["ffn_mult"])
    src = make_state(specs, mesh, rank, world, zero=False)
    locs = locals_of(src)
    my_bytes = sum(t.numel() * t.element_size() for t in locs)
    total = int(sum(_max3([float(my_bytes) if r == rank else 0.0 for r in range(world)])))
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives (dckpt makes its own)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    opt_box: list = [None]  # the training loop's optimizer, for the fenced mode
    handles: list = []  # dckpt's handles: blocking_seconds = call + fence wait

    def start(lib: str, state: Any, path: str) -> tuple[Callable[[], Any], float]:
        """Start one async save; returns (wait-for-commit, dckpt's staging seconds)."""
        if lib in ("dckpt", "dckpt_fence"):
            h = dckpt.async_save(state, path, fence=opt_box[0] if lib == "dckpt_fence" else None)
            handles.append(h)
            return h.result, h.staging_seconds
        extra = {"async_stager": stager} if lib == "dcp_cached" else {}
        r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                           process_group=dcp_pg, **extra)
        return getattr(r, "upload_completion", r).result, float("nan")

    def one_save(lib: str, path: str) -> dict[str, float]:
        dist.barrier()
        t0 = time.perf_counter()
        wait, staged = start(lib, src, path)
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        b, tot, st = _max3([t1 - t0, t2 - t0, staged])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return {f"{lib}_block": b, f"{lib}_total": tot, **({"dckpt_staging": st} if lib == "dckpt" else {})}

    bufs = [torch.empty_like(x) for x in locs]
    for b, x in zip(bufs, locs):
        b.copy_(x)  # touched: no page faults in the timed copies

    def memcpy() -> None:
        for b, x in zip(bufs, locs):
            b.copy_(x)

    rows: list[dict[str, Any]] = []
    for i in range(a["reps"] + 1):
        row: dict[str, Any] = {"rep": i, "load1": os.getloadavg()[0], "memcpy": timed(memcpy)}
        order = LIBS[i % 3:] + LIBS[:i % 3] if i else LIBS
        row["order"] = list(order)
        for lib in order:
            row.update(one_save(lib, os.path.join(a["dir"], f"{lib}-{i}")))
        if i == 0:  # the first call's floor: copy into fresh, untouched buffers (taken last)
            row["memcpy_fresh"] = timed(lambda: [torch.empty_like(x).copy_(x) for x in locs])
        rows.append(row)
        if rank == 0:
            print(f"  call {i} ({'/'.join(order)}): " + "  ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and k != "load1")
                + f"  [load {row['load1']:.1f}]", flush=True)

    # Correctness: mutate the source right after the call returns; the checkpoint must
    # hold the values at the call.
    expected = [x.clone() for x in locs]
    checked = {}
    for lib in LIBS:
        path = os.path.join(a["dir"], f"check-{lib}")
        wait, _ = start(lib, src, path)
        for x in locs:
            x.mul_(-2.0)
        wait()
        dst = make_state(specs, mesh, rank, world, zero=True)
        dckpt.load(dst, path) if lib == "dckpt" else dcp.load(dst, checkpoint_id=path, process_group=dcp_pg)
        ok = dst["step"] == src["step"] and all(torch.equal(x, y) for x, y in zip(locals_of(dst), expected))
        checked[lib] = _max3([0.0 if ok else 1.0])[0] == 0.0
        for x, e in zip(locs, expected):
            x.copy_(e)
        del dst
        dist.barrier()
    del expected

    # Training loop.
    torch.manual_seed(0)
    h, f = a["mlp_hidden"], 4 * a["mlp_hidden"]
    model = torch.nn.Sequential(torch.nn.Linear(h, f), torch.nn.GELU(), torch.nn.Linear(f, h))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt_box[0] = opt
    x = torch.randn(a["batch"], h, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()

    step()
    names = dict(model.named_parameters())
    full = {"model": {n: p.detach() for n, p in names.items()},
            "optim": {n: dict(opt.state[p]) for n, p in names.items()}, "shards": src}
    for _ in range(2):
        step()
    train_bytes = sum(t.numel() * t.element_size() for d in (full["model"], *full["optim"].values())
                      for t in d.values() if isinstance(t, torch.Tensor))

    def tier_manager(rep: int, every: int):
        shm = os.path.join("/dev/shm", os.path.basename(a["dir"].rstrip("/")) + f"-{rep}-{every}")
        return dckpt.CheckpointManager(
            os.path.join(a["dir"], f"loop-tier-{rep}-{every}"), async_save=True,
            capture_rng=False, local_root=os.path.join(shm, f"r{rank}"),
            durable_every_steps=10**9), shm

    def loop(mode: str, every: int, rep: int) -> dict[str, float]:
        dist.barrier()
        times, ckpt_steps, waits, pending = [], set(), [], None
        handles.clear()
        mgr, shm = tier_manager(rep, every) if mode == "dckpt_tier" else (None, None)
        cpu0, main0 = time.process_time(), time.thread_time()
        t_start = time.perf_counter()
        for s in range(1, a["steps"] + 1):
            t0 = time.perf_counter()
            step()
            if mode != "none" and s % every == 0 and s < a["steps"]:
                tw = time.perf_counter()
                if pending is not None and not mode.startswith("dckpt"):
                    pending()  # one save in flight (dckpt.async_save waits by itself)
                if mgr is not None:
                    mgr.save(s, full, force=True, fence=opt)
                    handles.append(mgr.tier._local_job)
                    pending = mgr.wait
                else:
                    pending, _ = start(mode, full, os.path.join(a["dir"], f"loop-{mode}-{rep}-{s}"))
                waits.append(time.perf_counter() - tw)
                ckpt_steps.add(s - 1)
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        t0 = time.perf_counter()
        if pending is not None:
            pending()
        drain = time.perf_counter() - t0
        if mgr is not None:
            mgr.close()
        bg_cpu = (time.process_time() - cpu0) - (time.thread_time() - main0)  # other threads
        other = [t for i, t in enumerate(times) if i not in ckpt_steps]
        ck = [t for i, t in enumerate(times) if i in ckpt_steps] or [float("nan")]
        lost = statistics.mean(h.blocking_seconds for h in handles) if handles else float("nan")
        r = _max3([wall / len(times), statistics.mean(other), statistics.mean(ck),
                   statistics.mean(waits) if waits else float("nan"), drain, bg_cpu, lost])
        dist.barrier()
        if rank == 0:
            for d in os.listdir(a["dir"]):
                if d.startswith("loop-"):
                    shutil.rmtree(os.path.join(a["dir"], d), ignore_errors=True)
            if shm is not None:
                shutil.rmtree(shm, ignore_errors=True)
        return {**dict(zip(("step", "step_other", "step_ckpt", "save_call", "drain", "bg_cpu",
                            "lost"), r)),
                "saves": len(waits)}

    loops: list[dict[str, Any]] = []
    modes = [(lib, n) for n in a["every"] for lib in LOOP_MODES]
    for rep in range(a["loop_reps"]):  # the baseline brackets each rep; the order rotates
        k = rep % len(modes)
        for mode, every in [("none", 0), *modes[k:], *modes[:k], ("none", 0)]:
            res = {"mode": mode, "every": every, "rep": rep, "load1": os.getloadavg()[0],
                   **loop(mode, every, rep)}
            loops.append(res)
            if rank == 0:
                print(f"  loop {rep} {mode:10} /{every:<3}: " + "  ".join(
                    f"{k} {v * 1e3:.1f}ms" for k, v in res.items() if isinstance(v, float) and k != "load1")
                    + f"  saves {res['saves']}  [load {res['load1']:.1f}]", flush=True)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"rows": rows, "loops": loops, "total_bytes": total, "checked": checked,
                       "tensors": 3 * len(specs), "train_bytes": train_bytes}, fh)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--reps", type=int, default=6, help="timed calls after the first")
    add_state_args(p)
    p.add_argument("--mlp-hidden", type=int, default=768, help="training loop MLP width")
    p.add_argument("--batch", type=int, default=192, help="training loop batch rows")
    p.add_argument("--steps", type=int, default=60, help="training steps per loop")
    p.add_argument("--every", type=int, nargs="+", default=[10, 20], help="checkpoint every N steps")
    p.add_argument("--loop-reps", type=int, default=3, help="loops per mode (order rotates)")
    p.add_argument("--dir", default=None, help="parent of the scratch dir (None: system temp)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    import torch
    import torch.multiprocessing as tmp

    os.environ["OMP_NUM_THREADS"] = "1"
    scratch = tempfile.mkdtemp(prefix="dckpt-bench-async-", dir=args.dir)
    a = {**vars(args), "dir": scratch}
    res_path = os.path.join(scratch, "result.json")
    print(f"scratch dir {scratch}; {args.world} ranks; first call + {args.reps} calls; "
          f"{args.loop_reps} loops per mode")
    try:
        tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"), a, res_path),
                  nprocs=args.world, join=True)
        with open(res_path) as fh:
            res = json.load(fh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["args"] = vars(args)
    res["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                  "machine": platform.platform(), "cpus": os.cpu_count()}
    report(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(_clean(res), fh, indent=1)
    return res


def report(res: dict) -> None:
    rows, total = res["rows"], res["total_bytes"]
    first, later = rows[0], rows[1:]
    med = {k: statistics.median(r[k] for r in later) for k in later[0] if isinstance(later[0][k], float)}
    res["median"] = med
    load = [r["load1"] for r in rows]
    gb, mc = total / 1e9, med["memcpy"]
    print(f"\nstate: {total / 2**20:.1f} MiB in {res['tensors']} DTensors (+1 int), Shard(0) over "
          f"{res['args']['world']} ranks; first call, then medians of {len(later)} calls; 1-min "
          f"load average {min(load):.1f}..{max(load):.1f} ({res['env']['cpus']} cores)")
    print(f"correct (checkpoint == state at the call, source mutated right after it returned): "
          f"{res['checked']}\n")
    mf = first["memcpy_fresh"]
    print(f"{'':24}{'first call':>20}{'later calls (median)':>36}")
    print(f"{'':24}{'blocking s':>11}{'x fresh':>8}{'total s':>9}{'blocking s':>11}{'x memcpy':>9}"
          f"{'total s':>9}{'GB/s':>7}")
    for lib in LIBS:
        b, t, fb = med[f"{lib}_block"], med[f"{lib}_total"], first[f"{lib}_block"]
        print(f"{NAMES[lib]:24}{fb:11.3f}{fb / mf:8.2f}{first[f'{lib}_total']:9.3f}{b:11.3f}"
              f"{b / mc:9.2f}{t:9.3f}{gb / t:7.2f}")
    st = med["dckpt_staging"]
    print(f"{'  dckpt staging_seconds':24}{first['dckpt_staging']:11.3f}{first['dckpt_staging'] / mf:8.2f}"
          f"{'':9}{st:11.3f}{st / mc:9.2f}")
    print(f"{'memcpy floor (copy_)':24}{mf:11.3f}{1.0:8.2f}{'':9}{mc:11.3f}{1.0:9.2f}{'':9}{gb / mc:7.2f}")
    print("(first call's floor: copy into fresh buffers, page faults included; later: into "
          "touched buffers)")
    ratios = {f"block_vs_{lib}": med["dckpt_block"] / med[f"{lib}_block"] for lib in LIBS[1:]}
    ratios |= {f"total_vs_{lib}": med["dckpt_total"] / med[f"{lib}_total"] for lib in LIBS[1:]}
    ratios["block_vs_memcpy"] = med["dckpt_block"] / mc
    res["ratios"] = ratios
    print(f"\ndckpt blocking / DCP: {ratios['block_vs_dcp']:.2f} (reused stager: "
          f"{ratios['block_vs_dcp_cached']:.2f}; target <= 0.5); dckpt blocking / memcpy: "
          f"{ratios['block_vs_memcpy']:.2f} (target <= 2)")
    print(f"dckpt total / DCP: {ratios['total_vs_dcp']:.2f} (reused stager: "
          f"{ratios['total_vs_dcp_cached']:.2f}; target <= 1)")
    loops, a = res["loops"], res["args"]
    print(f"\ntraining loop: MLP {a['mlp_hidden']}x{4 * a['mlp_hidden']} + AdamW (grads all-reduced), "
          f"batch {a['batch']}, {a['steps']} steps; saves of model + optimizer "
          f"({res['train_bytes'] / 2**20:.0f} MiB, replicated) + the {total / 2**20:.0f} MiB state; "
          f"medians over {a['loop_reps']} reps; max over ranks")
    keys = ("step", "step_other", "step_ckpt", "save_call", "drain", "overhead_pct", "bg_cpu_per_save",
            "lost")
    for r in loops:  # vs the mean of the two no-checkpoint loops around it (its rep)
        base = [b for b in loops if b["rep"] == r["rep"] and b["mode"] == "none"]
        r["overhead_pct"] = 100 * (r["step"] / statistics.mean(b["step"] for b in base) - 1)
        extra = r["bg_cpu"] - statistics.mean(b["bg_cpu"] for b in base)
        r["bg_cpu_per_save"] = extra / r["saves"] if r["saves"] else 0.0
    agg: dict[str, dict[str, float]] = {}
    for m, n in [("none", 0)] + [(lib, n) for n in a["every"] for lib in LOOP_MODES]:
        rs = [r for r in loops if r["mode"] == m and r["every"] == n]
        agg[f"{m}/{n}"] = {k: statistics.median(r.get(k, float("nan")) for r in rs)
                           for k in (*keys, "saves")}
    res["loop_summary"] = agg
    print(f"{'':38}{'step ms':>8}{'overhead':>9}{'other ms':>9}{'ckpt ms':>8}{'call ms':>8}"
          f"{'drain s':>8}{'bg cpu/save':>12}{'lost ms':>8}")
    for key, r in agg.items():
        m, n = key.split("/")
        name = "no checkpoint" if m == "none" else f"{NAMES[m]} /{n}: {r['saves']:.0f} saves"
        print(f"{name:38}{r['step'] * 1e3:8.1f}{r['overhead_pct']:8.1f}%{r['step_other'] * 1e3:9.1f}"
              f"{r['step_ckpt'] * 1e3:8.1f}{r['save_call'] * 1e3:8.1f}{r['drain']:8.2f}"
              f"{r['bg_cpu_per_save']:11.2f}s{r['lost'] * 1e3:8.1f}")
    print("(/N: a save every N steps; step: loop wall / steps; overhead: vs the no-checkpoint loops "
          "run just before and after, per rep; other/ckpt: mean step without/with "
          "a save call; call: the save call incl. waiting for the previous save; drain: wait for "
          "the last save after the loop; bg cpu/save: CPU seconds of the process's other threads "
          "per save, beyond those of the loop without checkpoints; lost: dckpt's "
          "SaveHandle.blocking_seconds, the call plus a fence's wait)")

if __name__ == "__main__":
    main()
