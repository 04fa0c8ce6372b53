"""DeepSpeed ZeRO on dckpt vs DeepSpeed's own save_checkpoint/load_checkpoint (issue 53).

    python benchmarks/bench_deepspeed.py --runs 3 --json benchmarks/results/deepspeed-2026-12-06.json

One DeepSpeed engine per ZeRO stage (2 and 3, fp32, torch Adam) on CPU
(``DS_ACCELERATOR=cpu``, gloo), a stack of ``Linear(W, W)`` layers (W = 1001: no size
divides by 2) and a ``Linear(W, 7)`` head, ``--mb`` MiB of fp32 parameters (Adam's two
moments and the fp32 masters come on top: a checkpoint is ~3x that), built through
``dckpt.integrations.deepspeed.initialize`` and trained 2 steps. One torchrun launch of
``--ranks`` ranks (default 2) does every same-size measurement; a second launch of 1
rank does the resize. Per stage, each repetition (``--runs``; the order of the
implementations alternates run by run) measures:

- time lost per save (max over ranks of the call's wall time, after a barrier):
  ``engine.save_checkpoint`` of dckpt synchronous (committed, fsynced, ``latest``
  written when it returns), dckpt asynchronous (``engine.dckpt.committer.async_save =
  True``: until the call returns; then ``engine.dckpt.wait()``, timed apart as "commit
  tail"), and stock ``engine.dckpt.stock_save`` (DeepSpeed's torch.save pickles; no
  fsync: the data may still be in the page cache when it returns). Beside it, "stock +
  fsync": the same call plus each rank's fsync of the files it wrote (what a durable
  stock save would cost);
- each checkpoint's bytes on disk (the tag folder);
- resume: a fresh engine of the same size (built untimed), page cache dropped (root
  only), then ``load_checkpoint`` of the dckpt tag vs ``stock_load`` of the stock tag;
- (each kind's first save, before the repetitions, is printed and kept in the JSON but
  left out of the medians: a process's first save sets things up);
- the physical limit: the dckpt tag's bytes, each rank its share to its own file, in
  64 MiB blocks, fsynced, all ranks at once; twice back to back, the faster kept.

Resize (the second launch, 1 rank, the last repetition's tags): a fresh 1-rank engine
loads the dckpt tag saved at 2 ranks; against DeepSpeed's Universal Checkpointing:
``python -m deepspeed.checkpoint.ds_to_universal --input_folder <stock tag>
--output_folder <tag>_universal --inject_missing_state`` (timed, cache dropped first),
then a plain ``deepspeed.initialize`` engine with ``"checkpoint": {"load_universal":
true}`` (dckpt refuses that option: its tags reshard by themselves) loads it (cache
dropped first). Order alternating run by run.

Every load is checked: the loaded full fp32 masters
(``deepspeed.utils.safe_get_full_fp32_param``) equal the saved ones bitwise, else the
benchmark stops. Medians over runs; ratios dckpt / stock.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=3)
p.add_argument("--mb", type=float, default=100.0, help="MiB of fp32 parameters")
p.add_argument("--width", type=int, default=1001)
p.add_argument("--ranks", type=int, default=2)
p.add_argument("--stages", type=int, nargs="+", default=[2, 3])
p.add_argument("--no-ucp", action="store_true", help="skip Universal Checkpointing")
p.add_argument("--json", default=None)
p.add_argument("--job", choices=["same", "resize"], default=None)
p.add_argument("--root", default=None)
args = p.parse_args()

STOCK_KINDS = ("dckpt", "dckpt_async", "stock")


def layers() -> int:
    w = args.width
    return max(1, round(args.mb * 2**20 / 4 / (w * w + w)))  # Linear(W, W) layers


# -- the job (under torchrun) ---------------------------------------------------------
def setup():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    return torch, deepspeed


def config(stage: int, universal: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage},
           "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def build(stage: int, *, plain: bool = False, universal: bool = False):
    """A fresh engine (collective); ``plain``: stock deepspeed.initialize, not attached."""
    import torch
    import deepspeed
    from dckpt.integrations import deepspeed as dds

    w = args.width

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.ModuleList(torch.nn.Linear(w, w) for _ in range(layers()))
            self.head = torch.nn.Linear(w, 7)

        def forward(self, x):
            for lin in self.body:
                x = torch.tanh(lin(x))
            return self.head(x)

    cfg = config(stage, universal)
    torch.manual_seed(0)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            m = Net()
    else:
        m = Net()
    init = deepspeed.initialize if plain else dds.initialize
    kw = {} if plain else {"async_save": False}
    eng, *_ = init(model=m, model_parameters=[q for q in m.parameters()], config=cfg, **kw)
    return eng


def masters(eng) -> dict:
    """name -> full fp32 master (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(q).detach().clone()
            for n, q in eng.module.named_parameters()}


def check(eng, ref: dict, what: str) -> None:
    got = masters(eng)
    bad = [n for n in ref if n not in got or not got[n].equal(ref[n])]
    if bad or sorted(got) != sorted(ref):
        raise SystemExit(f"WRONG VALUES after {what}: {len(bad)} parameters differ, e.g. {bad[:3]}")


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def destroy(eng) -> None:
    try:
        eng.destroy()
    except Exception:  # noqa: BLE001 - best effort
        pass
    gc.collect()


def job_same() -> None:
    torch, deepspeed = setup()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    root = args.root

    def tmax(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        return tmax(time.perf_counter() - t0), out

    def cold() -> bool:
        dist.barrier()
        ok = drop_caches() if rank == 0 else True
        dist.barrier()
        return ok

    def fsync_stock(tag: str) -> None:
        """Each rank fsyncs the files it wrote (rank 0: also the model states)."""
        for name in sorted(os.listdir(tag)):
            mine = f"zero_pp_rank_{rank}_" in name or (rank == 0 and name.startswith("mp_rank_"))
            if mine:
                fd = os.open(os.path.join(tag, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if rank == 0:
            fd = os.open(tag, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def raw(where: str, nbytes: int) -> float:
        block = os.urandom(64 << 20)
        best = float("inf")
        path = os.path.join(where, f"raw-probe-{rank}")
        for _ in range(2):
            def one() -> None:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    left = nbytes // world
                    while left > 0:
                        left -= os.write(fd, memoryview(block)[:min(left, len(block))])
                    os.fsync(fd)
                finally:
                    os.close(fd)
            t, _ = timed(one)
            best = min(best, t)
            os.remove(path)
        return best

    out: dict = {"world": world, "stages": {}}
    for stage in args.stages:
        sdir = os.path.join(root, f"z{stage}")
        if rank == 0:
            os.makedirs(sdir, exist_ok=True)
        dist.barrier()
        eng = build(stage)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(2, args.width, generator=g)
            loss = eng(x).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
        ref = masters(eng)
        if rank == 0:
            torch.save(ref, os.path.join(sdir, "ref.pt"))
        nparams = sum(t.numel() for t in ref.values())
        res: dict = {"params": nparams, "runs": []}
        if rank == 0:
            print(f"ZeRO-{stage}: {nparams / 1e6:.2f} M parameters "
                  f"({nparams * 4 / 2**20:.1f} MiB fp32), {world} ranks", flush=True)
        # one untimed-for-the-medians save of each kind first (a process's first save
        # sets things up; the first big write after other work is often slower)
        first: dict = {}
        for k in STOCK_KINDS:
            d = os.path.join(sdir, "warm", k)
            if k == "stock":
                first[k], _ = timed(lambda: eng.dckpt.stock_save(d))
            else:
                eng.dckpt.committer.async_save = k == "dckpt_async"
                first[k], _ = timed(lambda: eng.save_checkpoint(d))
                eng.dckpt.wait()
                eng.dckpt.committer.async_save = False
        res["first_save"] = first
        if rank == 0:
            print("  first saves (left out): " + ", ".join(f"{k} {v:.3f}" for k, v in first.items()),
                  flush=True)
            shutil.rmtree(os.path.join(sdir, "warm"))
        dist.barrier()
        for r in range(args.runs):
            rd = os.path.join(sdir, f"run-{r}")
            kinds = list(STOCK_KINDS) if r % 2 == 0 else list(reversed(STOCK_KINDS))
            one: dict = {"order": kinds, "load_avg": os.getloadavg()[0]}
            for k in kinds:
                d = os.path.join(rd, k)
                if k == "stock":
                    one["save_stock"], _ = timed(lambda: eng.dckpt.stock_save(d))
                    tag = os.path.join(d, f"global_step{eng.global_steps}")
                    one["fsync_stock"], _ = timed(lambda: fsync_stock(tag))
                    one["bytes_stock"] = tree_bytes(tag)
                else:
                    eng.dckpt.committer.async_save = k == "dckpt_async"
                    one[f"save_{k}"], _ = timed(lambda: eng.save_checkpoint(d))
                    if k == "dckpt_async":
                        one["tail_dckpt_async"], _ = timed(eng.dckpt.wait)
                    eng.dckpt.committer.async_save = False
                    one[f"bytes_{k}"] = tree_bytes(os.path.join(d, f"global_step{eng.global_steps}"))
            one["raw_write_fsync"] = raw(rd, one["bytes_dckpt"])
            # resume at the same size: fresh engine, cache dropped, load, check
            for k in (("dckpt", "stock") if r % 2 == 0 else ("stock", "dckpt")):
                fresh = build(stage)
                if r == 0 and k == "dckpt":
                    before = masters(fresh)
                    assert any(not before[n].equal(ref[n]) for n in ref), "fresh == trained?"
                one["cold"] = cold()
                d = os.path.join(rd, k)
                if k == "stock":
                    one["load_stock"], _ = timed(lambda: fresh.dckpt.stock_load(d))
                else:
                    one["load_dckpt"], (path, _) = timed(lambda: fresh.load_checkpoint(d))
                    assert path is not None and path.endswith(f"global_step{eng.global_steps}"), path
                check(fresh, ref, f"ZeRO-{stage} {k} load (run {r})")
                destroy(fresh)
                fresh = None
            dist.barrier()
            if rank == 0:
                print(f"  run {r} ({'/'.join(kinds)}; load avg {one['load_avg']:.1f}): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in one.items()
                    if k.startswith(("save_", "tail_", "fsync_", "load_", "raw_"))), flush=True)
                keep = os.path.join(sdir, "keep")
                if r == args.runs - 1:
                    if os.path.exists(keep):
                        shutil.rmtree(keep)
                    os.makedirs(keep)
                    for k in ("dckpt", "stock"):
                        os.rename(os.path.join(rd, k), os.path.join(keep, k))
                shutil.rmtree(rd, ignore_errors=True)
            dist.barrier()
            res["runs"].append(one)
        res["global_step"] = eng.global_steps
        out["stages"][str(stage)] = res
        destroy(eng)
        eng = None
        dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "same.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown (gloo's threads racing it, as the tests)


def job_resize() -> None:
    torch, deepspeed = setup()
    import torch.distributed as dist

    assert dist.get_world_size() == 1
    root = args.root
    same = json.load(open(os.path.join(root, "same.json")))
    out: dict = {"stages": {}}
    for stage in args.stages:
        sdir = os.path.join(root, f"z{stage}")
        keep = os.path.join(sdir, "keep")
        step = same["stages"][str(stage)]["global_step"]
        tag = f"global_step{step}"
        ref = torch.load(os.path.join(sdir, "ref.pt"))
        res: dict = {"runs": [], "ucp_error": None}
        for r in range(args.runs):
            one: dict = {"load_avg": os.getloadavg()[0]}
            kinds = ("dckpt", "ucp") if r % 2 == 0 else ("ucp", "dckpt")
            for k in kinds:
                if k == "dckpt":
                    eng = build(stage)
                    one["cold"] = drop_caches()
                    t0 = time.perf_counter()
                    path, _ = eng.load_checkpoint(os.path.join(keep, "dckpt"))
                    one["load_dckpt"] = time.perf_counter() - t0
                    assert path is not None, "dckpt: nothing loaded"
                    check(eng, ref, f"ZeRO-{stage} dckpt 2->1 load (run {r})")
                    destroy(eng)
                    eng = None
                    continue
                if args.no_ucp or res["ucp_error"]:
                    continue
                src = os.path.join(keep, "stock", tag)
                dst = os.path.join(keep, "stock", f"{tag}_universal")
                shutil.rmtree(dst, ignore_errors=True)
                drop_caches()
                t0 = time.perf_counter()
                conv = subprocess.run(
                    [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                     "--input_folder", src, "--output_folder", dst, "--inject_missing_state"],
                    capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
                one["ucp_convert"] = time.perf_counter() - t0
                if conv.returncode != 0:
                    res["ucp_error"] = "ds_to_universal exit %d: %s" % (
                        conv.returncode, (conv.stdout + conv.stderr)[-3000:])
                    print(res["ucp_error"], flush=True)
                    continue
                one["bytes_ucp"] = tree_bytes(dst)
                try:
                    eng = build(stage, plain=True, universal=True)
                    drop_caches()
                    t0 = time.perf_counter()
                    path, _ = eng.load_checkpoint(os.path.join(keep, "stock"),
                                                  tag=f"{tag}_universal")
                    one["load_ucp"] = time.perf_counter() - t0
                    assert path is not None, "UCP: nothing loaded"
                    check(eng, ref, f"ZeRO-{stage} UCP 2->1 load (run {r})")
                    destroy(eng)
                    eng = None
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    import traceback

                    res["ucp_error"] = f"UCP load: {type(e).__name__}: {e}\n" + \
                        traceback.format_exc()[-3000:]
                    print(res["ucp_error"], flush=True)
                    one.pop("ucp_convert", None)
            print(f"  ZeRO-{stage} 2->1 run {r} ({'/'.join(kinds)}; load avg "
                  f"{one['load_avg']:.1f}): " + ", ".join(
                      f"{k} {v:.3f}" for k, v in one.items()
                      if k.startswith(("load_", "ucp_"))), flush=True)
            res["runs"].append(one)
        out["stages"][str(stage)] = res
    with open(os.path.join(root, "resize.json"), "w") as f:
        json.dump(out, f, indent=1)
    sys.stdout.flush()
    os._exit(0)


# -- the driver ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, job: str, root: str, log: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.abspath(__file__), "--job", job, "--root", root,
           "--runs", str(args.runs), "--mb", str(args.mb), "--width", str(args.width),
           "--stages", *map(str, args.stages)] + (["--no-ucp"] if args.no_ucp else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            f.write(line)
            if line.startswith(("ZeRO", "  run", "  ZeRO", "  first", "WRONG", "ds_to_universal", "UCP")) \
                    or "Error" in line:
                print(line, end="", flush=True)
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"{job} launch failed (exit {rc}); log: {log}")


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def driver() -> None:
    base = tempfile.mkdtemp(prefix="bench-deepspeed-", dir=os.environ.get("BENCH_DIR"))
    print(f"load average at start: {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; "
          f"dir {base}", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    rev = {"commit": git("rev-parse", "HEAD"),
           "dirty": git("status", "--short", "--", "../dckpt").splitlines()}
    print(f"dckpt at {rev['commit'][:10]}" + (f" + uncommitted {rev['dirty']}" if rev["dirty"]
                                             else ""), flush=True)
    t0 = time.perf_counter()
    launch(args.ranks, "same", base, os.path.join(base, "same.log"))
    t1 = time.perf_counter()
    launch(1, "resize", base, os.path.join(base, "resize.log"))
    t2 = time.perf_counter()
    same = json.load(open(os.path.join(base, "same.json")))
    resize = json.load(open(os.path.join(base, "resize.json")))
    summary: dict = {}
    for st in map(str, args.stages):
        runs = same["stages"][st]["runs"]
        m = {k: med([r.get(k) for r in runs]) for k in runs[0]
             if isinstance(runs[0][k], (int, float)) and not isinstance(runs[0][k], bool)}
        m["stock_durable"] = med([r["save_stock"] + r["fsync_stock"] for r in runs])
        m["async_lost_plus_tail"] = med([r["save_dckpt_async"] + r["tail_dckpt_async"]
                                         for r in runs])
        rz = resize["stages"][st]["runs"]
        for k in ("load_dckpt", "ucp_convert", "load_ucp", "bytes_ucp"):
            m[f"resize_{k}"] = med([r.get(k) for r in rz])
        if m["resize_ucp_convert"] is not None and m["resize_load_ucp"] is not None:
            m["resize_ucp_total"] = med([r["ucp_convert"] + r["load_ucp"] for r in rz
                                         if "load_ucp" in r])
        # ratios from each run's own pair (same run), then their median
        def rmed(a: str, b: str, rr=runs) -> float | None:
            return med([x[a] / x[b] for x in rr if x.get(a) and x.get(b)])
        ratio = {"save dckpt/stock": rmed("save_dckpt", "save_stock"),
                 "save dckpt/(stock+fsync)": med([x["save_dckpt"] / (x["save_stock"] + x["fsync_stock"])
                                                  for x in runs]),
                 "save dckpt_async/stock": rmed("save_dckpt_async", "save_stock"),
                 "save dckpt/raw": rmed("save_dckpt", "raw_write_fsync"),
                 "load dckpt/stock": rmed("load_dckpt", "load_stock"),
                 "bytes dckpt/stock": m["bytes_dckpt"] / m["bytes_stock"]}
        if m.get("resize_ucp_total"):
            ratio["resize dckpt/UCP load"] = rmed("load_dckpt", "load_ucp", rz)
            ratio["resize dckpt/(UCP convert+load)"] = med(
                [x["load_dckpt"] / (x["ucp_convert"] + x["load_ucp"]) for x in rz if "load_ucp" in x])
        summary[st] = {"median": m, "ratio": ratio,
                       "ucp_error": resize["stages"][st]["ucp_error"]}
        mib = 2**20
        print(f"\nZeRO-{st}, {same['world']} ranks, {same['stages'][st]['params'] / 1e6:.2f} M "
              f"fp32 parameters; medians of {args.runs} runs:")
        rows = [("save dckpt sync", "save_dckpt"), ("save dckpt async (blocking)", "save_dckpt_async"),
                ("  async commit tail (wait)", "tail_dckpt_async"),
                ("save stock (torch.save)", "save_stock"), ("  stock + fsync", "stock_durable"),
                ("raw write+fsync (same bytes)", "raw_write_fsync"),
                ("resume dckpt (cold)", "load_dckpt"), ("resume stock (cold)", "load_stock"),
                ("resize 2->1 dckpt (cold)", "resize_load_dckpt"),
                ("resize 2->1 UCP convert", "resize_ucp_convert"),
                ("resize 2->1 UCP load", "resize_load_ucp"),
                ("resize 2->1 UCP total", "resize_ucp_total")]
        for label, k in rows:
            if m.get(k) is not None:
                print(f"  {label:32s} {m[k]:8.3f} s")
        print(f"  bytes: dckpt {m['bytes_dckpt'] / mib:.1f} MiB, stock {m['bytes_stock'] / mib:.1f} MiB"
              + (f", UCP {m['resize_bytes_ucp'] / mib:.1f} MiB" if m.get("resize_bytes_ucp") else ""))
        for k, v in ratio.items():
            if v is not None:
                print(f"  {k:34s} {v:.2f}x")
        if summary[st]["ucp_error"]:
            print(f"  UCP did not run: {summary[st]['ucp_error'][-600:]}")
    print(f"\nwall: same-size launch {t1 - t0:.0f} s, resize launch {t2 - t1:.0f} s; "
          f"load average at end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "date": time.strftime("%Y-%m-%d"),
                       "layers": layers(), "git": rev,
                       "load_avg_end": os.getloadavg()[0], "same": same, "resize": resize, "summary": summary,
                       "wall_s": {"same": t1 - t0, "resize": t2 - t1}}, f, indent=1)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if args.job == "same":
        job_same()
    elif args.job == "resize":
        job_resize()
    else:
        driver()
