"""GPU check part "titan": torchtitan's real Trainer on the GPU, killed mid-run and
resumed, checkpointed by dckpt (``llama3_debugmodel_dckpt``) and by torchtitan's DCP
manager, side by side.

Runs (``torchrun --nproc-per-node=1 -m torchtitan.train``, configs in
titan_configs.py, ``--steps`` steps, a checkpoint every 5, deterministic):
1. a reference run of the dckpt config, to the end: the losses every step;
2. per manager: a run SIGKILLed (with its process group) once step ``--kill-after``
   is logged, then the same command again: it must resume from the newest committed
   step and log, for every step after it, the reference's loss exactly (the dataset,
   RNG and optimizer state are all in the checkpoint).
Figures: each manager's logged save times ("Finished saving ... in X seconds") and
load time, and the resumed run's wall time. Needs torchtitan (carried as wheels,
see benchmarks/README.md) and CUDA (torchtitan's llama3 uses triton kernels).

    python benchmarks/gpu_check/titan.py [--steps 15] [--kill-after 8]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, Report, device_or_skip, scratch  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"step:\s*(\d+)\s.*?loss:\s*([-0-9.naif]+)")
SAVED = re.compile(r"Finished (?:saving|staging).*? in ([0-9.]+) seconds")
LOADED = re.compile(r"(?:Finished loading|Loaded the checkpoint).*? in ([0-9.]+) seconds")
CONFIGS = {"dckpt": "dckpt_check", "dcp": "dcp_check"}


def make_assets(d: str) -> None:
    """A byte-level BPE tokenizer (vocab 512 < the debug model's 2048) trained on
    generated text, its config naming BOS/EOS, and a JSON-lines dataset of that text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(200, 600)))
             for _ in range(400)]
    os.makedirs(f"{d}/tokenizer", exist_ok=True)
    os.makedirs(f"{d}/data", exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=special))
    tok.save(f"{d}/tokenizer/tokenizer.json")
    with open(f"{d}/tokenizer/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": special[0], "eos_token": special[1],
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    with open(f"{d}/data/train.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def launch(manager: str, dump: str, log: str, env: dict, kill_after: int | None,
           limit: float) -> dict:
    """One torchrun job; with ``kill_after`` its process group is SIGKILLed once that
    step's loss is logged. Returns the losses by step, save/load times, wall time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           "--master-port", str(29500 + (os.getpid() % 500)), "-m", "torchtitan.train",
           "--module", "benchmarks.gpu_check.titan_configs", "--config", CONFIGS[manager],
           "--dump_folder", dump]
    out: dict = {"losses": {}, "saves_s": [], "load_s": None, "killed": False}
    t0 = time.perf_counter()
    with open(log, "a") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n")
        lf.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert p.stdout is not None
        for line in p.stdout:  # torchtitan logs to stderr: merged into stdout above
            lf.write(line)
            line = ANSI.sub("", line)
            if (m := STEP.search(line)):
                out["losses"][int(m.group(1))] = m.group(2)  # as logged: exact text
                if kill_after is not None and int(m.group(1)) >= kill_after:
                    os.killpg(p.pid, signal.SIGKILL)  # the whole job, no clean exit
                    out["killed"] = True
            elif (m := SAVED.search(line)):
                out["saves_s"].append(float(m.group(1)))
            elif (m := LOADED.search(line)):
                out["load_s"] = float(m.group(1))
            if time.perf_counter() - t0 > limit:
                os.killpg(p.pid, signal.SIGKILL)
                out["timed_out"] = True
        out["rc"] = p.wait()
    out["wall_s"] = time.perf_counter() - t0
    return out


def main(rep: Report) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--kill-after", type=int, default=8)
    ap.add_argument("--run-limit", type=float, default=120, help="seconds per launch")
    a = ap.parse_args()
    if device_or_skip("titan") != "cuda":
        print("skipped: no CUDA (titan: torchtitan's llama3 needs CUDA even in GPU_CHECK_CPU=1)")
        sys.exit(77)
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        rep.check("torchtitan importable", False, f"{e}: carry its wheels (benchmarks/README.md)")
        return
    work = scratch("gpucheck-titan-")
    log = os.path.join(os.environ.get("GPU_CHECK_PARTS", work), "titan.train.log")
    make_assets(f"{work}/assets")
    env = dict(os.environ, GPU_CHECK_TITAN_ASSETS=f"{work}/assets",
               GPU_CHECK_TITAN_STEPS=str(a.steps), PYTHONUNBUFFERED="1",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",  # no network there
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    ref = launch("dckpt", f"{work}/ref", log, env, None, a.run_limit)
    rep.figures["reference"] = ref
    if not rep.check("reference run finished", ref["rc"] == 0 and len(ref["losses"]) == a.steps,
                     f"rc {ref['rc']}, {len(ref['losses'])} steps logged; see titan.train.log"):
        return
    for mgr in ("dckpt", "dcp"):
        dump = f"{work}/{mgr}"
        killed = launch(mgr, dump, log, env, a.kill_after, a.run_limit)
        resumed = launch(mgr, dump, log, env, None, a.run_limit)
        rep.figures[mgr] = {"killed": killed, "resumed": resumed}
        rep.check(f"{mgr}: killed after step {a.kill_after}", killed["killed"],
                  f"rc {killed['rc']}, last step {max(killed['losses'] or [0])}")
        after = sorted(resumed["losses"])
        first = after[0] if after else None
        rep.check(f"{mgr}: resumed from a committed step (first logged step {first})",
                  resumed["rc"] == 0 and first is not None and 1 < first <= a.kill_after + 1)
        bad = [s for s in after if resumed["losses"][s] != ref["losses"].get(s)]
        rep.check(f"{mgr}: resumed losses equal the reference's at steps {after}", not bad and
                  bool(after), "; ".join(f"step {s}: {resumed['losses'][s]} vs "
                                         f"{ref['losses'].get(s)}" for s in bad[:5]))
        print(f"{mgr}: saves {killed['saves_s'] + resumed['saves_s']} s, load "
              f"{resumed['load_s']} s, resumed run {resumed['wall_s']:.1f} s", flush=True)
        rep.write()
        shutil.rmtree(dump, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    Report("titan").run(main)
