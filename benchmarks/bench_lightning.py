"""Lightning's stock ModelParallelStrategy vs dckpt's, on the same model and Trainer.

    python benchmarks/bench_lightning.py --runs 3 --devices 2 --width 1024 --layers 6 \
        --json benchmarks/results/lightning-2026-11-26.json

Each run is a fresh Lightning fit (its launcher starts the processes) of an FSDP2 MLP
(``--layers`` Linear(width, width), AdamW) at ``--devices`` CPU devices, saving a
sharded checkpoint every ``--every`` steps (ModelCheckpoint, save_top_k=1, so each save
also removes the previous one), then a second fit that resumes from it
(``ckpt_path="last"``) for one step. Measured on rank 0:

- time lost per save: the wall time of ``Trainer.save_checkpoint`` (dump_checkpoint,
  the strategy's save, the barrier), plus for ``async_save`` the next optimizer step's
  wait for the snapshot copy (the fence: ``SaveHandle.blocking_seconds`` grows by it);
  median over the run's saves (the first save of a run is left out: one-off set-up of
  both libraries);
- resume time: the wall time of the strategy's ``load_checkpoint`` (it loads the model
  and the optimizer and returns the metadata), from a cold page cache (dropped between
  the two fits when run as root: the restart case).

``dckpt-local``: dckpt's with ``local_root`` in ``$BENCH_LOCAL`` (default /dev/shm, a
node-local tier): the save's time is the node-local commit (the copy to the checkpoint's
name runs in the background, and the fit's end waits for it); the resume reads the
node-local copy (not dropped with the page cache: /dev/shm is memory), as a restart on
the same nodes does.

Strategies alternate run by run; the medians over runs and their ratios (dckpt / stock)
are printed and written as JSON. The checkpoint bytes (DCP's files vs dckpt's) and the
disk's write speed (one fsynced 256 MiB file) are printed as the physical reference.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=3)
p.add_argument("--devices", type=int, default=2)
p.add_argument("--width", type=int, default=1024)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--every", type=int, default=2)
p.add_argument("--json", default=None)
p.add_argument("--job", choices=["stock", "dckpt", "dckpt-async", "dckpt-local"], default=None)
p.add_argument("--local-root", default=None)
p.add_argument("--kinds", nargs="+", default=["stock", "dckpt", "dckpt-async", "dckpt-local"])
p.add_argument("--root", default=None)
p.add_argument("--resume", action="store_true")
args = p.parse_args()


def job() -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(args.width, args.width)
                                       for _ in range(args.layers)])

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    if args.job == "stock":
        base = ModelParallelStrategy
        kw: dict = {}
    else:
        from dckpt.integrations.lightning import DckptModelParallelStrategy as base
        kw = {"async_save": args.job == "dckpt-async"}
        if args.job == "dckpt-local":
            kw["local_root"] = args.local_root
    times = {"save": [], "load": []}

    handles: list = []  # dckpt-async: (handle, its blocking seconds at the call)

    class Timed(base):
        def save_checkpoint(self, *a, **k):
            super().save_checkpoint(*a, **k)
            h = getattr(getattr(self, "_dckpt", None), "_handle", None)
            if h is not None:
                handles.append((h, h.blocking_seconds))

        def load_checkpoint(self, *a, **k):
            t0 = time.perf_counter()
            out = super().load_checkpoint(*a, **k)
            times["load"].append(time.perf_counter() - t0)
            return out

    saving = pl.Trainer.save_checkpoint

    def timed_save(self, *a, **k):
        t0 = time.perf_counter()
        saving(self, *a, **k)
        times["save"].append(time.perf_counter() - t0)

    pl.Trainer.save_checkpoint = timed_save
    strategy = Timed(data_parallel_size=args.devices, tensor_parallel_size=1, **kw)
    ckpt = ModelCheckpoint(dirpath=os.path.join(args.root, "ckpts"), filename="{step}",
                           every_n_train_steps=args.every, save_top_k=1, monitor="step",
                           mode="max", save_last=False)
    steps = args.steps + 1 if args.resume else args.steps
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_steps=steps, callbacks=[ckpt], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=args.root)
    data = TensorDataset(torch.randn(64 * args.devices, args.width))
    path = None
    if args.resume:
        path = os.path.join(args.root, "ckpts", f"step={args.steps}.ckpt")
    trainer.fit(Net(), DataLoader(data, batch_size=4), ckpt_path=path)
    # an async save's cost to training: the call plus the fenced step's wait for the copy
    times["fence"] = [h.blocking_seconds - b for h, b in handles]
    if trainer.is_global_zero:
        name = "resume" if args.resume else "fit"
        with open(os.path.join(args.root, f"{name}.json"), "w") as f:
            json.dump(times, f)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def drop_caches() -> bool:
    """sync, then drop the page cache (root only): the resume reads the checkpoint from
    the disk, as a restart on another node or after a reboot does. The fit's saves
    would otherwise leave DCP's buffered files in the cache but not dckpt's (written
    with O_DIRECT). True if the drop worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_write_mbps(where: str, mib: int = 256) -> float:
    buf = os.urandom(1 << 20)
    path = os.path.join(where, "disk-probe")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return mib / dt


def driver() -> None:
    kinds = args.kinds
    assert kinds[0] == "stock", "the ratios are against the stock strategy: list it first"
    res: dict = {k: {"save": [], "load": [], "bytes": []} for k in kinds}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = tempfile.mkdtemp(prefix="bench-lightning-", dir=os.environ.get("BENCH_DIR"))
    print(f"load average at start: {os.getloadavg()[0]:.1f}; disk write (fsync): "
          f"{disk_write_mbps(base):.0f} MiB/s", flush=True)
    for r in range(args.runs):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            root = os.path.join(base, f"{kind}-{r}")
            local = os.path.join(os.environ.get("BENCH_LOCAL", "/dev/shm"), f"bench-pl-{os.getpid()}-{r}")
            common = [sys.executable, os.path.abspath(__file__), "--job", kind, "--root", root,
                      "--local-root", local,
                      "--devices", str(args.devices), "--width", str(args.width),
                      "--layers", str(args.layers), "--steps", str(args.steps),
                      "--every", str(args.every)]
            for extra in ([], ["--resume"]):
                if extra:
                    cold = drop_caches()
                subprocess.run(common + extra, check=True, env=env, timeout=900,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            fit = json.load(open(os.path.join(root, "fit.json")))
            resume = json.load(open(os.path.join(root, "resume.json")))
            waits = fit.get("fence") or [0.0] * len(fit["save"])
            lost = [s + w for s, w in zip(fit["save"], waits)]
            saves = lost[1:] or lost
            res[kind]["save"].append(statistics.median(saves))
            res[kind]["load"].append(resume["load"][0])
            res[kind]["bytes"].append(du(os.path.join(root, "ckpts", f"step={args.steps}.ckpt")))
            print(f"run {r} {kind:11s}: save {statistics.median(saves):.3f} s "
                  f"(saves {', '.join(f'{s:.3f}' for s in lost)}; fence waits "
                  f"{', '.join(f'{w:.3f}' for w in waits)}), "
                  f"resume load {resume['load'][0]:.3f} s ({'cold' if cold else 'WARM'}), "
                  f"checkpoint {res[kind]['bytes'][-1] / 2**20:.1f} MiB", flush=True)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
    med = {k: {m: statistics.median(v[m]) for m in ("save", "load", "bytes")} for k, v in res.items()}
    out = {"args": vars(args), "runs": res, "median": med, "ratio": {
        k: {m: med[k][m] / med["stock"][m] for m in ("save", "load")} for k in kinds[1:]}}
    for k in kinds[1:]:
        print(f"{k} / stock: time lost per save {out['ratio'][k]['save']:.2f}x "
              f"({med[k]['save']:.3f} s vs {med['stock']['save']:.3f} s), resume "
              f"{out['ratio'][k]['load']:.2f}x ({med[k]['load']:.3f} s vs "
              f"{med['stock']['load']:.3f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    job() if args.job else driver()
