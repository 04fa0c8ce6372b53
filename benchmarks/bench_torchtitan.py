"""torchtitan's checkpoint manager on dckpt vs on DCP: time lost per save, and resume time.

Issue 36. The same torchtitan components, in the same processes, checkpointed by
``dckpt.integrations.torchtitan.DckptCheckpointManager`` and by torchtitan's own
``torchtitan.components.checkpointer.CheckpointManager`` (DCP), both built as torchtitan's
Trainer builds them: ``Config(enable=True, interval=..., last_save_model_only=False,
async_mode=...).build(dataloader=, model_parts=, optimizers=, lr_schedulers=, states=,
sd_adapter=None, base_folder=)``. The components are tests/titankit.py's (a llama-like
TinyLlama sharded with FSDP2 on a 1-D CPU mesh, torchtitan's OptimizersContainer with
AdamW, LRSchedulersContainer with warmup, ParallelAwareDataloader, a Stateful train
state), with a bigger model: ``--mib`` sets the number of layers so that the weights and
both AdamW moments come to about that many MiB (all ranks together). Each rank is driven
the way titankit's ``Parts.train`` (torchtitan's ``Trainer.train``) drives it: per step
draw a batch, forward and backward, ``maybe_wait_for_staging()``, optimizer and scheduler
steps, zero_grad, then ``save(step)``.

Every run spawns ``--world`` fresh gloo ranks (torch.multiprocessing, file://
rendezvous, OMP_NUM_THREADS=1) and measures, in one process group:

1. The physical limits on the rank's own checkpoint bytes (weights and both moments):
   raw ``os.write`` + ``os.fsync`` of them to a file per rank, both ranks at once, twice
   back to back (the second is the floor), a cold raw read of that file, and memcpy
   (``copy_`` into already-touched buffers).
2. Training loops of ``--interval * (--saves + 1)`` steps: without a checkpointer (the
   baseline; run before, between and after the two modes) and with each manager, sync
   (``async_mode="disabled"``) and async (``"async"``), saving every ``--interval``
   steps (``--saves`` saves, then ``--interval`` steps without one, then
   ``maybe_wait_for_saving()``; each loop saves into an empty folder). Modes and managers
   alternate from run to run. Per save: "call" is ``save()``; "blocking" is the call plus
   the next step's ``maybe_wait_for_staging()`` plus how much longer that step's
   ``optimizers.step()`` took than the median of the loop's other optimizer steps
   (dckpt's async save makes it wait for the copy); "lost" is the call plus the
   ``--interval`` steps after it minus as many baseline steps (the median step of the
   two baseline loops around the mode's loops), plus, for the last save, the final
   wait: whatever the save cost the training thread, background contention for the two
   cores included. "loop" is (loop wall - mean wall of those two baseline loops) /
   saves, the first save included. The first save of each loop is reported apart (it
   allocates buffers); the other figures are medians over the later saves of a run,
   then over runs.
3. Resume: ``load()`` of the newest step of the sync loop's folder into fresh components
   (a new model, optimizer, scheduler, dataloader, train state) with a new manager,
   ``--loads`` times per manager and run (order alternating), after dropping the page
   cache (when permitted) and touching ``--prefault-mib`` MiB (as bench_save_load does).
   The train state's step is checked.

Times are per-rank wall times, max over ranks; tables show medians over runs.

    python benchmarks/bench_torchtitan.py [--runs 5] [--mib 300] [--saves 3] [--json OUT]
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from bench_save_load import (PREFAULT_MIB, _max_over_ranks, drop_caches, memcpy_floor, raw_read,  # noqa: E402
                             raw_write, save_results, timed)

LIBS = ("dckpt", "dcp")
MODES = ("disabled", "async")
NAMES = {"dckpt": "dckpt (DckptCheckpointManager)", "dcp": "DCP (torchtitan CheckpointManager)"}


def layers_for(mib: float, dim: int, vocab: int) -> int:
    """TinyLlama layers whose fp32 weights + two AdamW moments come closest to ``mib``:
    a block holds 5 dim^2 + 2 dim values, embedding and output 2 vocab dim."""
    values = mib * 2**20 / 12
    per_layer = 5 * dim * dim + 2 * dim
    return max(1, round((values - 2 * vocab * dim - 2 * dim) / per_layer))


def make_parts(a: dict, seed: int) -> Any:
    """titankit's Parts with the benchmark's model dims (Parts builds a fixed tiny
    model): the same torchtitan components, built the same way."""
    from titankit import Parts, TinyLlama, Tokens, TrainState, shard
    import torch
    import torch.distributed as dist
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    class BenchParts(Parts):
        def __init__(self) -> None:  # Parts.__init__ with dims
            torch.manual_seed(seed)
            self.model = shard(TinyLlama(a["vocab"], a["dim"], a["layers"]))
            self.model_parts = [self.model]
            self.optimizers = default_adamw(lr=1e-4).build(model_parts=self.model_parts)
            self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
                optimizers=self.optimizers, training_steps=1_000_000)
            rank, world = dist.get_rank(), dist.get_world_size()
            self.dataloader = ParallelAwareDataloader(
                Tokens(rank, seq=a["seq"], vocab=a["vocab"]), dp_rank=rank,
                dp_world_size=world, batch_size=a["batch"])
            self.train_state = TrainState()
            self._it = None
            self.drawn = []

    return BenchParts()


def config(which: str, **kw: Any) -> Any:
    """The manager's Config: dckpt's or torchtitan's DCP one, same fields."""
    if which == "dckpt":
        from dckpt.integrations.torchtitan import DckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer import CheckpointManager as cls
    return cls.Config(enable=True, last_save_model_only=False, **kw)


def timed_step(parts: Any, ck: Any) -> dict[str, float]:
    """titankit's Parts.train_step (torchtitan's Trainer.train_step), split into timed
    phases; no batch is kept."""
    import torch.nn as nn
    t0 = time.perf_counter()
    batch = parts.batch()
    logits = parts.model(batch[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    t1 = time.perf_counter()
    if ck is not None:
        ck.maybe_wait_for_staging()
    t2 = time.perf_counter()
    parts.optimizers.step()
    t3 = time.perf_counter()
    parts.lr_schedulers.step()
    parts.optimizers.zero_grad()
    parts.train_state.ntokens_seen += batch.numel()
    t4 = time.perf_counter()
    return {"fb": t1 - t0, "stage": t2 - t1, "opt": t3 - t2, "step": t4 - t0}


def _max_list(xs: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def train_loop(parts: Any, a: dict, which: str | None, mode: str, base: str) -> dict:
    """One loop of interval * (saves + 1) steps, saving every interval steps with the
    manager ``which`` (None: no checkpointer); per-step phases, max over ranks."""
    import torch.distributed as dist
    n = a["interval"] * (a["saves"] + 1)
    last = a["interval"] * a["saves"]
    ck = None
    if which is not None:
        ck = config(which, interval=a["interval"], async_mode=mode).build(
            **parts.build_kwargs(base))
        ck.load()  # as the Trainer does before training: an empty folder, a fresh start
    parts.train_state.step = 0
    steps: list[dict[str, float]] = []
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        parts.train_state.step = i
        row = timed_step(parts, ck)
        ts = time.perf_counter()
        if ck is not None and i <= last:  # the tail's steps would save at n: not called
            ck.save(i, last_step=False)
        row["save"] = time.perf_counter() - ts
        steps.append(row)
    td = time.perf_counter()
    if ck is not None:
        ck.maybe_wait_for_saving()
    t1 = time.perf_counter()
    if ck is not None:
        ck.close()
    keys = ("fb", "stage", "opt", "step", "save")
    flat = _max_list([r[k] for r in steps for k in keys] + [t1 - td, t1 - t0])
    steps = [dict(zip(keys, flat[j * len(keys):(j + 1) * len(keys)])) for j in range(n)]
    dist.barrier()
    return {"lib": which or "none", "mode": mode, "steps": steps, "drain": flat[-2],
            "wall": flat[-1]}


def per_save(loop: dict, base_step: float, a: dict) -> list[dict]:
    """The figures of every save of a loop (see the module doc), in order. The optimizer
    step after a save is compared with the median of the loop's other optimizer steps."""
    k, out, st = a["interval"], [], loop["steps"]
    after_save = {j * k for j in range(1, a["saves"] + 1)}  # 0-based: the step after save j
    opt = statistics.median(r["opt"] for i, r in enumerate(st) if i not in after_save)
    for j in range(1, a["saves"] + 1):
        s = j * k - 1  # index of the step that ends with save j
        after = st[s + 1:s + 1 + k]
        lost = st[s]["save"] + sum(r["step"] + r["save"] for r in after) - k * base_step
        if j == a["saves"]:
            lost += loop["drain"]
        out.append({"call": st[s]["save"],
                    "blocking": st[s]["save"] + after[0]["stage"] + after[0]["opt"] - opt,
                    "lost": lost})
    return out


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import logging
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="torch.optim.lr_scheduler")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    from torchtitan.tools.logging import logger as titan_logger
    titan_logger.setLevel(logging.WARNING)

    parts = make_parts(a, seed=0)
    for _ in range(a["warmup_steps"]):  # optimizer state allocated, allocator warm
        timed_step(parts, None)
    locs = [p.to_local() for p in parts.model.parameters()]
    locs += [v.to_local() for st in parts.optimizers.optimizers[0].state.values()
             for v in st.values() if isinstance(v, DTensor)]
    my_bytes = sum(t.numel() * t.element_size() for t in locs)
    total = int(sum(_max_list([float(my_bytes) if r == rank else 0.0 for r in range(world)])))
    res: dict[str, Any] = {"rank_bytes": my_bytes, "total_bytes": total,
                           "load1": os.getloadavg()[0]}

    # 1. physical limits on the rank's checkpoint bytes
    bs = 64 << 20
    block = memoryview(np.random.default_rng(rank).integers(0, 256, bs, np.uint8)).cast("B")
    raw = os.path.join(a["dir"], f"raw-{rank}.bin")
    res["raw_write_first"] = timed(lambda: raw_write(raw, my_bytes, block))
    os.unlink(raw)
    res["raw_write"] = timed(lambda: raw_write(raw, my_bytes, block))
    dropped = drop_caches(rank, a["prefault_mib"]) if a["drop_caches"] else False
    rbuf = memoryview(np.empty(bs, np.uint8)).cast("B")
    res["raw_read"] = timed(lambda: raw_read(raw, rbuf))
    os.unlink(raw)
    rbuf = block = None  # freed
    _, memcpy = memcpy_floor(locs)
    res["memcpy"] = statistics.median(timed(memcpy) for _ in range(3))
    memcpy = None  # its buffers freed

    # 2. training loops: a baseline before, between and after the two modes
    r = a["run"]
    modes = MODES if r % 2 == 0 else MODES[::-1]
    loops: list[dict] = [train_loop(parts, a, None, "none", "")]
    keep: dict[str, str] = {}
    for mi, mode in enumerate(modes):
        libs = LIBS if (r + mi) % 2 == 0 else LIBS[::-1]
        for lib in libs:
            base = os.path.join(a["dir"], f"{lib}-{mode}")
            loops.append(train_loop(parts, a, lib, mode, base))
            if mode == "disabled":
                keep[lib] = base  # resumed from below
            elif rank == 0:
                shutil.rmtree(base, ignore_errors=True)
            dist.barrier()
        loops.append(train_loop(parts, a, None, "none", ""))
    res["loops"] = loops
    del parts

    # 3. resume: load() of the newest step into fresh components
    loads: dict[str, list[float]] = {lib: [] for lib in LIBS}
    newest = a["interval"] * a["saves"]
    for i in range(a["loads"]):
        for lib in LIBS if (r + i) % 2 == 0 else LIBS[::-1]:
            fresh = make_parts(a, seed=1)
            ck = config(lib, interval=a["interval"], async_mode="disabled").build(
                **fresh.build_kwargs(keep[lib]))
            if a["drop_caches"]:
                dropped = drop_caches(rank, a["prefault_mib"]) and dropped
            ok: list[bool] = []
            loads[lib].append(timed(lambda: ok.append(ck.load())))
            ck.close()
            good = ok == [True] and fresh.train_state.step == newest
            if _max_over_ranks(0.0 if good else 1.0) != 0.0:
                raise AssertionError(f"{lib}: load() gave {ok}, step {fresh.train_state.step}")
            fresh = ck = None  # freed before the next build
    res["loads"] = loads
    res["dropped"] = bool(dropped)
    dist.barrier()
    if rank == 0:
        for p in keep.values():
            shutil.rmtree(p, ignore_errors=True)
        with open(out, "w") as fh:
            json.dump(res, fh)
    dist.destroy_process_group()


def one_run(args: argparse.Namespace, r: int) -> dict:
    import torch.multiprocessing as tmp

    scratch = tempfile.mkdtemp(prefix="dckpt-bench-titan-", dir=args.dir)
    res_path = os.path.join(scratch, "result.json")
    a = {**vars(args), "dir": scratch, "run": r}
    try:
        tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"), a, res_path),
                  nprocs=args.world, join=True)
        with open(res_path) as fh:
            return json.load(fh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def summarise(run: dict, a: dict) -> dict:
    """Per run and (mode, lib): the first and later saves' figures (medians over the
    later saves), against the two baseline loops around the loop's mode."""
    loops = run["loops"]
    out: dict[str, Any] = {"base_step": statistics.median(
        s["step"] for lp in loops if lp["lib"] == "none" for s in lp["steps"])}
    for i, lp in enumerate(loops):
        if lp["lib"] == "none":
            continue
        before = max(j for j in range(i) if loops[j]["lib"] == "none")
        after = min(j for j in range(i, len(loops)) if loops[j]["lib"] == "none")
        base = (loops[before], loops[after])
        base_step = statistics.median(s["step"] for b in base for s in b["steps"])
        base_wall = statistics.mean(b["wall"] for b in base)
        saves = per_save(lp, base_step, a)
        fig = {"first_" + k: v for k, v in saves[0].items()}
        later = saves[1:] or saves
        fig.update({k: statistics.median(s[k] for s in later) for k in saves[0]})
        fig["later_all"] = later
        fig["loop"] = (lp["wall"] - base_wall) / a["saves"]
        fig["drain"] = lp["drain"]
        fig["base_step"] = base_step
        out[f"{lp['mode']}/{lp['lib']}"] = fig
    return out


def report(res: dict) -> None:
    a, runs = res["args"], res["runs"]
    sums = [summarise(r, a) for r in runs]
    res["per_run"] = sums
    med = lambda xs: statistics.median(xs)  # noqa: E731
    tot = runs[0]["total_bytes"]
    rank_b = max(r["rank_bytes"] for r in runs)
    print(f"\nTinyLlama vocab {a['vocab']} dim {a['dim']} layers {a['layers']}: weights + "
          f"2 AdamW moments {tot / 2**20:.0f} MiB (rank share {rank_b / 2**20:.0f} MiB), "
          f"FSDP2 over {a['world']} gloo ranks; batch {a['batch']}x{a['seq']}; a save every "
          f"{a['interval']} steps, {a['saves']} per loop; medians over {len(runs)} runs "
          "(load1 at start " + ", ".join(f"{r['load1']:.1f}" for r in runs) + ")")
    bs = med([s["base_step"] for s in sums])
    print(f"baseline step (no checkpointer): {bs * 1e3:.0f} ms")
    phys = {k: med([r[k] for r in runs]) for k in ("raw_write", "raw_write_first", "raw_read",
                                                   "memcpy")}
    gb = rank_b / 1e9 * a["world"]
    print("physical limits on the rank's bytes, both ranks at once: " + "; ".join(
        f"{n} {phys[k]:.3f} s ({gb / phys[k]:.2f} GB/s)" for k, n in (
            ("raw_write", "raw write+fsync"), ("raw_write_first", "first of two"),
            ("raw_read", "cold raw read" if all(r["dropped"] for r in runs) else "raw read"),
            ("memcpy", "memcpy"))))
    keys = ("call", "blocking", "lost", "first_call", "first_lost", "loop")
    table: dict[str, dict[str, float]] = {}

    def row(name: str, xs: list[float]) -> None:
        print(f"{name:44}" + "".join(f"{x:9.3f}" if abs(x) < 100 else f"{x:9.0f}" for x in xs))

    print(f"\n{'seconds per save (max over ranks)':44}" + "".join(
        f"{h:>9}" for h in ("call", "blocking", "lost", "1st call", "1st lost", "loop")))
    for mode in MODES:
        for lib in LIBS:
            key = f"{mode}/{lib}"
            table[key] = {k: med([s[key][k] for s in sums]) for k in keys}
            row(f"{'sync' if mode == 'disabled' else 'async'}: {NAMES[lib]}",
                [table[key][k] for k in keys])
        d, p = table[f"{mode}/dckpt"], table[f"{mode}/dcp"]
        nan = float("nan")
        row("  ratio dckpt/DCP", [d[k] / p[k] if p[k] > 0 and d[k] > 0 else nan for k in keys])
        row("  ratio DCP/dckpt", [p[k] / d[k] if p[k] > 0 and d[k] > 0 else nan for k in keys])
    loads = {lib: med([x for r in runs for x in r["loads"][lib]]) for lib in LIBS}
    print(f"\nresume: load() of step {a['interval'] * a['saves']} into fresh components, "
          f"{a['loads']} per manager and run, "
          + ("page cache dropped before each" if all(r["dropped"] for r in runs)
             else "page cache NOT dropped"))
    for lib in LIBS:
        xs = [x for r in runs for x in r["loads"][lib]]
        print(f"  {NAMES[lib]:40}{loads[lib]:8.3f} s  (min {min(xs):.3f}, max {max(xs):.3f})")
    print(f"  ratio dckpt/DCP {loads['dckpt'] / loads['dcp']:.2f}, DCP/dckpt "
          f"{loads['dcp'] / loads['dckpt']:.2f}; floor: cold raw read {phys['raw_read']:.3f} s")
    print("\n(call: save(); blocking: call + the next step's maybe_wait_for_staging() + its "
          "optimizer step beyond the loop's median one; lost: call + the interval's steps "
          "after it - as many baseline steps (+ the final wait for the last save); 1st: the "
          "loop's first save; call/blocking/lost: medians over a run's later saves, then over "
          "runs; loop: (loop wall - baseline loop wall) / saves, first save included)")
    res["median"] = {"table": table, "loads": loads, "physical": phys, "base_step": bs}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--runs", type=int, default=5, help="runs, each in fresh processes")
    p.add_argument("--mib", type=float, default=300,
                   help="weights + AdamW moments, all ranks (sets --layers unless given)")
    p.add_argument("--dim", type=int, default=1024, help="model width")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: from --mib)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--interval", type=int, default=3, help="steps between saves")
    p.add_argument("--saves", type=int, default=3, help="saves per training loop")
    p.add_argument("--loads", type=int, default=2, help="load() per manager and run")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps at start")
    p.add_argument("--dir", default=None, help="parent of the scratch dir (None: system temp)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not drop the page cache before the loads")
    p.add_argument("--prefault-mib", type=int, default=PREFAULT_MIB,
                   help="MiB touched and freed before each load (see bench_save_load)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = layers_for(args.mib, args.dim, args.vocab)
    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    runs = []
    for r in range(args.runs):
        runs.append(one_run(args, r))
        s = summarise(runs[-1], vars(args))
        print(f"  run {r}: base step {s['base_step'] * 1e3:.0f} ms; " + "; ".join(
            f"{k.replace('disabled', 'sync')} lost {v['lost']:.3f} (1st {v['first_lost']:.3f}) "
            f"call {v['call']:.3f}" for k, v in s.items() if isinstance(v, dict))
            + "; load " + ", ".join(f"{lib} " + "/".join(f"{x:.3f}" for x in runs[-1]["loads"][lib])
                                    for lib in LIBS)
            + f" [load1 {runs[-1]['load1']:.1f}, {time.perf_counter() - t0:.0f} s]", flush=True)
    res = {"runs": runs, "args": vars(args)}
    report(res)
    save_results(res, args.json)
    return res


if __name__ == "__main__":
    main()
