"""Stock Accelerate and the stock transformers Trainer vs dckpt's adapters (issues 45, 52).

    python benchmarks/bench_hf.py --runs 3 --json benchmarks/results/hf-2026-11-28.json

The same FSDP2 Llama (``LlamaForCausalLM`` from a ``LlamaConfig``: ``--hidden``,
``--layers``, ``--inter``, ``--vocab``; each decoder layer its own FSDP unit) and AdamW, at
``--ranks`` CPU ranks under torchrun (gloo), FSDP2 through the CPU shim of
tests/multirank/jobs/accelerate_job.py and trainer_job.py (Accelerate runs FSDP only on
accelerators: ``DistributedType.FSDP`` is forced after the Accelerator is built). Kinds:

- ``acc-stock``: a custom loop with ``accelerate.Accelerator.save_state`` (FSDP2
  SHARDED_STATE_DICT: DCP folders + pickles), automatic naming, ``total_limit=2``;
- ``acc-dckpt`` / ``acc-dckpt-async``: the same loop with
  ``dckpt.integrations.accelerate.DckptAccelerator`` (``async_save=True``);
- ``tr-stock-sharded`` / ``tr-stock-full``: ``transformers.Trainer`` (``save_steps``,
  ``save_total_limit=2``) with FSDP2 SHARDED_STATE_DICT / FULL_STATE_DICT;
- ``tr-dckpt`` / ``tr-dckpt-async``: ``dckpt.integrations.transformers.DckptTrainer``
  (its model folder on: the ranks' background export after each commit, issue 52);
  ``tr-dckpt-nofolder`` / ``tr-dckpt-async-nofolder``: ``model_folder=False``;
- ``tr-ddp-*``: the same Trainer kinds under DDP (no FSDP shim): stock
  (``model.safetensors`` + pickles), dckpt with the model folder (side files: the
  weights written once), async, and ``model_folder=False``.

``tail``: from the last save's return to ``train()``'s (dckpt: the wait for the last
asynchronous commit and the background export, what a run pays at its end).

Each run of a kind is a fresh torchrun that trains ``--steps`` steps saving every
``--every``, then (page cache dropped when run as root: the restart case) a second
torchrun that resumes from the newest checkpoint and trains one step. Measured on rank 0:

- time lost per save: the wall time of ``save_state`` / ``Trainer._save_checkpoint``,
  plus for ``async_save`` the next optimizer step's wait for the snapshot copy (the
  fence: ``SaveHandle.blocking_seconds`` grows by it); median of a run's saves, the
  first left out (one-off set-up);
- resume: ``load_state()`` (newest under automatic naming); for the Trainer, from the
  ``train(resume_from_checkpoint=True)`` call to ``_inner_training_loop`` (the lookup:
  stock's ``get_last_checkpoint``, dckpt's committed-checkpoint pick and verification)
  plus ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler`` and
  ``_load_rng_state`` (model preparation, common to both, is left out);
- the newest checkpoint's bytes on disk.

Kinds alternate run by run (listed order, then reversed); medians over runs; ratios
dckpt / stock (Accelerate against ``acc-stock``, the Trainer against both stock Trainers).
Physical reference, every run: the dckpt checkpoint's bytes written in 64 MiB blocks and
fsynced, split over ``--ranks`` files written at once (each rank's share; the faster of two
back-to-back writes): the disk's floor for that save, and its MiB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

KINDS = ["acc-stock", "acc-dckpt", "acc-dckpt-async",
         "tr-stock-sharded", "tr-stock-full", "tr-dckpt", "tr-dckpt-async",
         "tr-dckpt-nofolder", "tr-dckpt-async-nofolder",
         "tr-ddp-stock", "tr-ddp-dckpt", "tr-ddp-dckpt-async", "tr-ddp-dckpt-nofolder"]
p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=3)
p.add_argument("--ranks", type=int, default=2)
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--inter", type=int, default=1024)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--vocab", type=int, default=8000)
p.add_argument("--seq", type=int, default=32)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--every", type=int, default=2)
p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
p.add_argument("--json", default=None)
p.add_argument("--job", choices=KINDS, default=None)
p.add_argument("--root", default=None)
p.add_argument("--resume", action="store_true")
args = p.parse_args()


def job() -> None:
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    rank = int(os.environ.get("RANK", "0"))
    sdt = "FULL_STATE_DICT" if args.job == "tr-stock-full" else "SHARDED_STATE_DICT"
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type=sdt, reshard_after_forward=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])

    def shim() -> None:  # as tests/multirank/jobs/accelerate_job.py
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.inter, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (64 * args.ranks, args.seq), generator=g)
    times: dict = {"save": [], "fence": [], "load": []}
    handles: list = []  # async: (handle, its blocking seconds right after the call)
    model_ref = [model]  # the model as trained (FSDP2 modules hold DTensor parameters)
    if args.job.startswith("acc-"):
        run_accelerate(model_ref, ids, plugin, shim, times, handles)
    else:
        run_trainer(model_ref, ids, shim, times, handles)
    times["fence"] = [h.blocking_seconds - b for h, b in handles]
    times["sharded"] = all(type(q).__name__ == "DTensor" for q in model_ref[0].parameters())
    if rank == 0:
        with open(os.path.join(args.root, "resume.json" if args.resume else "fit.json"),
                  "w") as f:
            json.dump(times, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip the teardown: gloo's threads racing it abort now and then


def run_accelerate(model_ref, ids, plugin, shim, times, handles) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    pc = ProjectConfiguration(project_dir=os.path.join(args.root, "p"),
                              automatic_checkpoint_naming=True, total_limit=2)
    if args.job == "acc-stock":
        acc = Accelerator(cpu=True, fsdp_plugin=plugin, project_config=pc)
    else:
        from dckpt.integrations.accelerate import DckptAccelerator

        acc = DckptAccelerator(cpu=True, fsdp_plugin=plugin, project_config=pc,
                               async_save=args.job == "acc-dckpt-async")
    shim()
    model = model_ref[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2,
                                     shuffle=True)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    model_ref[0] = model
    steps = args.steps
    if args.resume:
        t0 = time.perf_counter()
        acc.load_state()
        times["load"].append(time.perf_counter() - t0)
        steps = 1
    it = iter(dl)
    for s in range(1, steps + 1):
        (x,) = next(it)
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if not args.resume and s % args.every == 0:
            t0 = time.perf_counter()
            acc.save_state()
            times["save"].append(time.perf_counter() - t0)
            h = getattr(getattr(acc, "_dckpt", None), "_handle", None)
            if h is not None:
                handles.append((h, h.blocking_seconds))
    acc.end_training()


def run_trainer(model_ref, ids, shim, times, handles) -> None:
    from transformers import Trainer, TrainingArguments

    ddp = args.job.startswith("tr-ddp-")
    if "dckpt" in args.job:
        from dckpt.integrations.transformers import DckptTrainer as Base
        kw = {"async_save": "-async" in args.job, "model_folder": "nofolder" not in args.job}
    else:
        Base, kw = Trainer, {}
    marks: dict = {"train": None, "inner": None, "loads": []}

    def timed(name):
        def call(self, *a, **k):
            t0 = time.perf_counter()
            out = getattr(Base, name)(self, *a, **k)
            marks["loads"].append((t0, time.perf_counter() - t0))
            return out
        return call

    class Job(Base):
        def train(self, *a, **k):
            marks["train"] = time.perf_counter()
            return super().train(*a, **k)

        def _inner_training_loop(self, *a, **k):
            if marks["inner"] is None:
                marks["inner"] = time.perf_counter()
            return super()._inner_training_loop(*a, **k)

        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            marks["saved"] = time.perf_counter()
            times["save"].append(marks["saved"] - t0)
            h = getattr(getattr(self, "_dckpt", None), "_handle", None)
            if h is not None:
                handles.append((h, h.blocking_seconds))

        _load_from_checkpoint = timed("_load_from_checkpoint")
        _load_optimizer_and_scheduler = timed("_load_optimizer_and_scheduler")
        _load_scaler = timed("_load_scaler")
        _load_rng_state = timed("_load_rng_state")

    data = [{"input_ids": x, "labels": x} for x in ids]
    targs = TrainingArguments(
        output_dir=os.path.join(args.root, "out"),
        max_steps=args.steps + 1 if args.resume else args.steps, save_strategy="steps",
        save_steps=args.every, save_total_limit=2, logging_steps=1000,
        per_device_train_batch_size=2, learning_rate=1e-4, use_cpu=True, report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, seed=7)
    trainer = Job(model=model_ref[0], args=targs, train_dataset=data, **kw)
    if not ddp:
        shim()
        trainer.is_fsdp_enabled = True
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    # from the last save's return to train()'s: dckpt's wait for the last async commit
    # and for the background export of the model folder (what the run pays at its end)
    times["tail"] = time.perf_counter() - marks.get("saved", time.perf_counter())
    model_ref[0] = trainer.model
    if args.resume:
        inner = marks["inner"]
        times["load"].append(inner - marks["train"]
                             + sum(d for t, d in marks["loads"] if t >= inner))


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def newest(root: str, kind: str) -> str:
    parent = os.path.join(root, "p", "checkpoints") if kind.startswith("acc-") \
        else os.path.join(root, "out")
    names = [n for n in os.listdir(parent) if n.startswith("checkpoint") and
             n.replace("-", "_").split("_")[-1].isdigit()]
    return os.path.join(parent, max(names, key=lambda n: int(n.replace("-", "_")
                                                              .split("_")[-1])))


def drop_caches() -> bool:
    """sync, then drop the page cache (root only): the resume reads from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_write(where: str, nbytes: int, writers: int) -> float:
    """Seconds to write ``nbytes`` split over ``writers`` files at once (one thread each,
    as each rank writes its share; 64 MiB blocks) and fsync them; twice back to back,
    the faster kept (the first big write after other work is often slower)."""
    from concurrent.futures import ThreadPoolExecutor

    block = os.urandom(64 << 20)

    def one(i: int) -> None:
        path = os.path.join(where, f"raw-probe-{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes // writers
            while left > 0:
                left -= os.write(fd, memoryview(block)[:min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)

    best = float("inf")
    with ThreadPoolExecutor(writers) as pool:
        for _ in range(2):
            t0 = time.perf_counter()
            list(pool.map(one, range(writers)))
            best = min(best, time.perf_counter() - t0)
            for i in range(writers):
                os.remove(os.path.join(where, f"raw-probe-{i}"))
    return best


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def against(kind: str) -> list[str]:
    if kind.startswith("acc-dckpt"):
        return ["acc-stock"]
    if kind.startswith("tr-dckpt"):
        return ["tr-stock-sharded", "tr-stock-full"]
    if kind.startswith("tr-ddp-dckpt"):
        return ["tr-ddp-stock"]
    return []


def driver() -> None:
    kinds = args.kinds
    res: dict = {k: {"save": [], "load": [], "bytes": []} for k in kinds}
    raw: list = []
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    base = tempfile.mkdtemp(prefix="bench-hf-", dir=os.environ.get("BENCH_DIR"))
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    for r in range(args.runs):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            root = os.path.join(base, f"{kind}-{r}")
            os.makedirs(root)
            common = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                      str(args.ranks), "--master-addr", "127.0.0.1", "--master-port", None,
                      os.path.abspath(__file__), "--job", kind, "--root", root]
            for k in ("ranks", "hidden", "inter", "layers", "vocab", "seq", "steps", "every"):
                common += [f"--{k}", str(getattr(args, k))]
            cold = False
            for extra in ([], ["--resume"]):
                if extra:
                    cold = drop_caches()
                common[8] = str(free_port())
                with open(os.path.join(base, f"{kind}-{r}{'-resume' if extra else ''}.log"),
                          "w") as log:
                    subprocess.run(common + extra, check=True, env=env, timeout=900,
                                   stdout=log, stderr=subprocess.STDOUT)
            fit = json.load(open(os.path.join(root, "fit.json")))
            resume = json.load(open(os.path.join(root, "resume.json")))
            waits = fit["fence"] or [0.0] * len(fit["save"])
            lost = [s + w for s, w in zip(fit["save"], waits)]
            saves = lost[1:] or lost
            res[kind].setdefault("tail", []).append(fit.get("tail", 0.0))
            if not kind.startswith("tr-ddp-") and not (fit["sharded"] and resume["sharded"]):
                print(f"WARNING: {kind} did not train FSDP2 (DTensor) parameters", flush=True)
            res[kind]["save"].append(statistics.median(saves))
            res[kind]["load"].append(resume["load"][0])
            res[kind]["bytes"].append(du(newest(root, kind)))
            print(f"run {r} {kind:16s}: save {res[kind]['save'][-1]:.3f} s (saves "
                  f"{', '.join(f'{s:.3f}' for s in lost)}; fence waits "
                  f"{', '.join(f'{w:.3f}' for w in waits)}), resume "
                  f"{resume['load'][0]:.3f} s ({'cold' if cold else 'WARM'}), checkpoint "
                  f"{res[kind]['bytes'][-1] / 2**20:.1f} MiB, tail "
                  f"{res[kind]['tail'][-1]:.3f} s, load avg "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
        ref = next((res[k]["bytes"][-1] for k in kinds if "dckpt" in k), None) \
            or res[kinds[0]]["bytes"][-1]
        raw.append((ref, raw_write(base, ref, args.ranks)))
        print(f"run {r} raw write+fsync ({args.ranks} files) of {ref / 2**20:.1f} MiB: {raw[-1][1]:.3f} s "
              f"({ref / 2**20 / raw[-1][1]:.0f} MiB/s)", flush=True)
    med = {k: {m: statistics.median(v[m]) for m in ("save", "load", "bytes", "tail")
               if v.get(m)} for k, v in res.items()}
    raw_s = statistics.median(t for _, t in raw)
    out = {"args": vars(args), "runs": res, "median": med,
           "raw_write_fsync": {"bytes": raw[0][0], "runs_s": [t for _, t in raw],
                               "median_s": raw_s}, "ratio": {}}
    print(f"\n{'kind':24s} {'lost/save s':>11s} {'resume s':>9s} {'MiB':>7s} {'tail s':>7s}")
    for k in kinds:
        print(f"{k:24s} {med[k]['save']:11.3f} {med[k]['load']:9.3f} "
              f"{med[k]['bytes'] / 2**20:7.1f} {med[k].get('tail', 0.0):7.3f}")
    print(f"{'raw write+fsync':18s} {raw_s:11.3f} {'':9s} {raw[0][0] / 2**20:7.1f}")
    for k in kinds:
        for s in against(k):
            if s not in med:
                continue
            q = {m: med[k][m] / med[s][m] for m in ("save", "load")}
            out["ratio"][f"{k}/{s}"] = q
            print(f"{k} / {s}: time lost per save {q['save']:.2f}x, resume {q['load']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    job() if args.job else driver()
