"""DckptTrainer with the real transformers Trainer on gloo CPU ranks (torchrun: DDP), a
tiny Llama, next to the stock Trainer in the same scenario (issue 45, part 2).
Job script: tests/multirank/jobs/trainer_job.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .lightning_run import run_cmd, torchrun  # noqa: E402
from .staterefs import ref, same_state  # noqa: E402
from ..integrations.hf_helpers import tiny_llama, training_args, weights_in  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "trainer_job.py")


def run(out, impl: str, n: int | None, *args: str, ok: bool = True,
        timeout: float = 150) -> str:
    """torchrun ``n`` ranks of the job (``n`` None: one plain process) under a
    deadline, the whole session reaped; must exit 0 when ``ok``."""
    cmd = torchrun(JOB, n) + ["--impl", impl, "--out", str(out)] + list(args)
    rc, text = run_cmd(cmd, timeout)
    if ok:
        assert rc == 0, text[-4000:]
    else:
        assert rc != 0, text[-4000:]
    return text


def same(a: dict, b: dict) -> bool:
    """Model, optimizer, scheduler and global step equal (bitwise)."""
    return same_state(a, b, ("sched", "step"))


def _seen_at_start(seen: dict) -> type:
    """A Trainer callback that records, in ``seen``, the global step and a copy of the
    model's state when training begins (after a resume)."""
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            seen["step"] = state.global_step
            seen["model"] = {k: v.clone() for k, v in model.state_dict().items()}

    return Seen


def ckpts(out) -> list[str]:
    """What the Trainer's lookup and a user see (dckpt's staging is hidden)."""
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


def test_options_are_checked():
    from transformers import TrainingArguments

    from dckpt import CheckpointError
    from dckpt.integrations.transformers import DckptTrainer

    for kw in ({"async_save": 1}, {"local_root": "s3://b/x"}, {"compression": "gzip"},
               {"storage_options": {"anon": True}}, {"local_root": "/tmp/x",
                                                     "keep_last_local": 0}):
        with pytest.raises(CheckpointError):
            DckptTrainer(model=torch.nn.Linear(2, 2),
                         args=TrainingArguments(output_dir="unused", use_cpu=True,
                                                report_to=[]), **kw)


def _from_pretrained_equals(folder, want: dict) -> None:
    """``folder`` is what from_pretrained loads, holding exactly ``want``'s weights."""
    from transformers import LlamaForCausalLM

    files = sorted(os.listdir(folder))
    assert "config.json" in files and weights_in(files), files
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files), files
    got = LlamaForCausalLM.from_pretrained(str(folder)).state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_fsdp2_rotation_resume_at_3_ranks_and_a_damaged_newest_at_1(tmp_path):
    """FSDP2 (the CPU shim) at 2 ranks -> FSDP2 at 3 ranks -> one plain process."""
    out = tmp_path / "out"
    text = run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--limit", "2", "--fsdp",
               "--save-model", str(tmp_path / "final"))
    assert text.count("fsdp=True model=FSDPLlamaForCausalLM") == 2, text[-3000:]
    # save_model under SHARDED_STATE_DICT: HF safetensors + config, never gathered
    _from_pretrained_equals(tmp_path / "final", ref(tmp_path, "final-r0"))
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))  # its temp removed
    assert ckpts(out) == ["checkpoint-4", "checkpoint-6"]  # save_total_limit, commit order
    for c in ckpts(out):
        files = os.listdir(out / c)
        assert all(f.endswith((".safetensors", ".json")) for f in files), files  # no pickle
        assert "trainer_state.json" in files and "training_args.bin" not in files
    r = subprocess.run([sys.executable, "-m", "dckpt", "verify", str(out / "checkpoint-6")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    saved = [ref(tmp_path, f"save-6-r{r}") for r in range(2)]
    # 3 ranks: the newest committed checkpoint; everything as saved
    r = subprocess.run([sys.executable, "-m", "dckpt", "inspect", str(out / "checkpoint-6")],
                       capture_output=True, text=True, timeout=60)
    assert "2 x dim0" in r.stdout, r.stdout  # sharded as trained, no gather
    text = run(out, "dckpt", 3, "--steps", "8", "--every", "2", "--limit", "2", "--resume",
               "--fsdp")
    assert text.count(f"RESUMED step=6 from={out}/checkpoint-6") == 3, text[-3000:]
    got = [ref(tmp_path, f"resumed-3-r{r}") for r in range(3)]
    for r in range(3):
        assert same(got[r], saved[0]), r
    assert torch.equal(got[0]["rng"], saved[0]["rng"])
    assert torch.equal(got[1]["rng"], saved[1]["rng"])
    assert not torch.equal(got[2]["rng"], saved[0]["rng"])  # rank 2: a derived stream
    assert ckpts(out) == ["checkpoint-6", "checkpoint-8"]
    # a flipped byte in the newest: skipped with a warning, the one before it resumes
    d = out / "checkpoint-8"
    f = next(d / n for n in sorted(os.listdir(d)) if n.endswith(".safetensors"))
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) - 8)
        b = fh.read(1)
        fh.seek(os.path.getsize(f) - 8)
        fh.write(bytes([b[0] ^ 0xFF]))
    text = run(out, "dckpt", None, "--steps", "8", "--every", "2", "--limit", "2", "--resume")
    assert "checkpoint-8 could not be loaded" in text, text[-3000:]
    assert f"RESUMED step=6 from={out}/checkpoint-6" in text
    assert same(ref(tmp_path, "resumed-1-r0"), saved[0])
    assert ckpts(out) == ["checkpoint-6", "checkpoint-8"]  # checkpoint-8 saved again, whole


def test_stock_save_model_under_fsdp_sharded_state_writes_no_weights(tmp_path):
    """The stock side of save_model under FSDP SHARDED_STATE_DICT (transformers
    #30491): no weights at all (dckpt's: the FSDP2 test above)."""
    run(tmp_path / "out", "stock", 2, "--steps", "2", "--every", "100", "--fsdp",
        "--save-model", str(tmp_path / "final"))
    files = os.listdir(tmp_path / "final") if os.path.isdir(tmp_path / "final") else []
    assert not any(f.endswith(".safetensors") for f in files), files


def test_sigkill_before_the_commit_resumes_the_previous_one_stock_picks_the_partial(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    # dckpt: every rank killed in the save of step 4, before its commit
    out = tmp_path / "dckpt" / "out"
    run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--kill-at", "4", ok=False)
    assert ckpts(out) == ["checkpoint-2"]  # the partial one is hidden, never checkpoint-4
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")  # HF's scripts' lookup
    text = run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--resume", "--async-save")
    assert text.count(f"RESUMED step=2 from={out}/checkpoint-2") == 2, text[-3000:]
    for r in range(2):
        got, saved = ref(tmp_path / "dckpt", f"resumed-2-r{r}"), ref(tmp_path / "dckpt",
                                                                      f"save-2-r{r}")
        assert same(got, saved) and torch.equal(got["rng"], saved["rng"]), r
    # asynchronous saves after the resume: placed by the end of train(), as saved
    assert ckpts(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    import dckpt

    with dckpt.open(str(out / "checkpoint-6")) as ck:
        six = ref(tmp_path / "dckpt", "save-6-r0")["model"]
        assert all(torch.equal(ck[f"models.0.{k}"], v) for k, v in six.items())
    # stock, the same scenario: killed after the model was written
    out = tmp_path / "stock" / "out"
    run(out, "stock", 2, "--steps", "6", "--every", "2", "--kill-at", "4", ok=False)
    assert ckpts(out) == ["checkpoint-2", "checkpoint-4"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-4")  # the partial one
    assert "trainer_state.json" not in os.listdir(out / "checkpoint-4")
    text = run(out, "stock", 2, "--steps", "6", "--every", "2", "--resume", ok=False)
    assert "checkpoint-4/trainer_state.json" in text and "FileNotFoundError" in text
    # migration: DckptTrainer resumes the stock checkpoint-2 (stock path), saves dckpt
    # ones; a save never replaces a folder dckpt did not write, so the stock partial
    # checkpoint-4 is removed by hand first (as stock users must, to resume at all)
    import shutil

    shutil.rmtree(out / "checkpoint-4")
    text = run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--resume",
               str(out / "checkpoint-2"))
    assert text.count(f"RESUMED step=2 from={out}/checkpoint-2") == 2, text[-3000:]
    assert "manifest.json" in os.listdir(out / "checkpoint-4")
    assert not any(f.endswith((".pt", ".bin")) for f in os.listdir(out / "checkpoint-4"))


def _tiny():
    return tiny_llama()


def _args(out, **kw):
    return training_args(out, **kw)


def test_one_process_best_checkpoint_kept_and_loaded_and_model_only(tmp_path):
    import dckpt
    from dckpt.integrations.transformers import DckptTrainer

    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, eval_dataset=data[:4], args=_args(
        tmp_path / "a", max_steps=6, eval_strategy="steps", eval_steps=2, save_total_limit=2,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True))
    t.train()
    best = os.path.basename(t.state.best_model_checkpoint)
    assert best == "checkpoint-2"  # the eval loss falls: the first is the "greatest"
    # stock's rule: the best is kept beside the newest (checkpoint-4 went, in commit order)
    assert ckpts(tmp_path / "a") == ["checkpoint-2", "checkpoint-6"]
    with dckpt.open(str(tmp_path / "a" / best)) as ck:  # the best model was loaded at the end
        for k, v in t.model.state_dict().items():
            assert torch.equal(v, ck[f"models.0.{k}"]), k
    # save_only_model: no optimizer in the checkpoint; a resume restores the model and step
    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data,
                     args=_args(tmp_path / "b", max_steps=2, save_only_model=True))
    t.train()
    with dckpt.open(str(tmp_path / "b" / "checkpoint-2")) as ck:
        assert not any(k.startswith("optimizers.") for k in ck.keys())
        saved = {k[len("models.0."):]: ck[k] for k in ck.keys() if k.startswith("models.0.")}
    seen: dict = {}
    Seen = _seen_at_start(seen)

    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, callbacks=[Seen()],
                     args=_args(tmp_path / "b", max_steps=4, save_only_model=True))
    t.train(resume_from_checkpoint=True)
    assert seen["step"] == 2 and t.state.global_step == 4
    assert all(torch.equal(seen["model"][k], v) for k, v in saved.items())


def test_one_process_refuses_another_frameworks_checkpoint_and_skips_a_stateless_one(
        tmp_path, caplog):
    import dckpt
    from transformers import TrainerCallback

    from dckpt.errors import StateMismatchError
    from dckpt.integrations.transformers import DckptTrainer

    dckpt.save({"x": torch.zeros(2)}, str(tmp_path / "other"))
    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, args=_args(tmp_path / "a", max_steps=4))
    with pytest.raises(StateMismatchError, match="not of the transformers Trainer"):
        t.train(resume_from_checkpoint=str(tmp_path / "other"))
    t.train()
    os.remove(tmp_path / "a" / "checkpoint-4" / "trainer_state.json")  # by hand
    seen = {}

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen["step"] = state.global_step

    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, callbacks=[Seen()],
                     args=_args(tmp_path / "a", max_steps=4))
    with caplog.at_level("WARNING"):
        t.train(resume_from_checkpoint=True)
    assert seen["step"] == 2
    assert "checkpoint-4 could not be loaded" in caplog.text and "trainer_state.json" in caplog.text


def test_one_process_async_saves_are_placed_by_the_end_of_train_and_resume(tmp_path):
    import dckpt
    from dckpt.integrations.transformers import DckptTrainer

    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, async_save=True,
                     args=_args(tmp_path / "a", max_steps=4, save_total_limit=1))
    t.train()
    assert ckpts(tmp_path / "a") == ["checkpoint-4"]  # placed and rotated by then
    assert not t._dckpt.pending
    with dckpt.open(str(tmp_path / "a" / "checkpoint-4")) as ck:
        saved = {k[len("models.0."):]: ck[k] for k in ck.keys() if k.startswith("models.0.")}
    for k, v in t.model.state_dict().items():  # the step after the save waited for its copy
        assert torch.equal(v, saved[k]), k
    seen: dict = {}
    Seen = _seen_at_start(seen)

    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, async_save=True, callbacks=[Seen()],
                     args=_args(tmp_path / "a", max_steps=6, save_total_limit=1))
    t.train(resume_from_checkpoint=True)
    assert seen["step"] == 4 and all(torch.equal(seen["model"][k], v) for k, v in saved.items())
    assert ckpts(tmp_path / "a") == ["checkpoint-6"]


def test_one_process_jit_checkpoint_on_sigterm_is_a_commit_and_a_killed_one_is_passed_over(
        tmp_path, caplog):
    """enable_jit_checkpoint: on SIGTERM transformers creates checkpoint-N holding its
    sentinel, then calls _save_checkpoint; the dckpt save replaces that folder whole.
    A JIT save killed after the sentinel leaves checkpoint-N with the sentinel only:
    get_last_checkpoint returns it; stock then fails (ValueError); dckpt resumes
    the newest committed checkpoint beside it, with a warning."""
    import signal
    import time

    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint

    from dckpt.catalog.verify import verify_checkpoint
    from dckpt.integrations.transformers import DckptTrainer

    class Term(TrainerCallback):  # the scheduler's SIGTERM at step 3, then slow steps
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            if state.global_step >= 3:
                time.sleep(1.0)  # transformers waits 3 s before it saves

    model, data = _tiny()
    out = tmp_path / "a"
    t = DckptTrainer(model=model, train_dataset=data, callbacks=[Term()],
                     args=_args(out, max_steps=40, save_steps=100,
                                enable_jit_checkpoint=True))
    t.train()
    [jit] = ckpts(out)  # the JIT save only (no step save before step 100)
    # transformers saves at its next hook (before an optimizer step: global_step + 1 ends)
    assert 3 < int(jit.split("-")[1]) <= t.state.global_step < 40
    assert sorted(os.listdir(out / jit)) == sorted(
        n for n in os.listdir(out / jit) if n.endswith((".safetensors", ".json")))
    assert verify_checkpoint(str(out / jit)).ok
    # a JIT save killed after the sentinel: what transformers leaves on disk
    step = int(jit.split("-")[1]) + 1
    os.makedirs(out / f"checkpoint-{step}")
    (out / f"checkpoint-{step}" / "checkpoint-is-incomplete.txt").write_text("in progress")
    last = get_last_checkpoint(str(out))
    assert last == str(out / f"checkpoint-{step}")
    model, data = _tiny()
    with pytest.raises(ValueError, match="valid checkpoint"):  # stock, as HF's scripts call it
        Trainer(model=model, train_dataset=data,
                args=_args(tmp_path / "stock", max_steps=40)).train(resume_from_checkpoint=last)
    seen: dict = {}
    Seen = _seen_at_start(seen)
    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, callbacks=[Seen()],
                     args=_args(out, max_steps=step + 1))
    with caplog.at_level("WARNING"):
        t.train(resume_from_checkpoint=last)
    assert seen["step"] == step - 1 and "is an incomplete save" in caplog.text
    # the next JIT save of that step (as transformers runs it) replaces the leftover
    from transformers.trainer_jit_checkpoint import CheckpointManager

    t.state.global_step = step
    CheckpointManager(t).execute_jit_checkpoint()
    assert "checkpoint-is-incomplete.txt" not in os.listdir(out / f"checkpoint-{step}")
    assert verify_checkpoint(str(out / f"checkpoint-{step}")).ok  # replaced the sentinel folder


def test_local_root_kill_after_the_local_commit_resumes_it_from_the_fast_tier(tmp_path):
    """2 ranks (DDP) with local_root: every rank SIGKILLed once the save of step 4 is
    committed in the fast tier, before its copy to checkpoint-4 began. The restart
    resumes step 4 from the fast tier (not checkpoint-2), and its saves are copied."""
    out, local = tmp_path / "out", str(tmp_path / "local")
    run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--kill-at", "4",
        "--local-root", local, ok=False)
    assert "checkpoint-4" not in ckpts(out) if os.path.isdir(out) else True
    text = run(out, "dckpt", 2, "--steps", "6", "--every", "2", "--resume",
               "--local-root", local)
    assert text.count("RESUMED step=4 from=") == 2, text[-3000:]
    for r in range(2):
        got = ref(tmp_path, f"resumed-2-r{r}")
        assert got["step"] == 4 and not same(got, ref(tmp_path, f"save-2-r{r}"))
    assert "checkpoint-6" in ckpts(out)
    assert not [n for n in os.listdir(local) if n.startswith(".trainer-resume")]


def _losses(text: str) -> dict[int, str]:
    return {int(ln.split()[1]): ln.split()[2] for ln in text.splitlines()
            if ln.startswith("LOSS ")}


@pytest.mark.parametrize("impl", ["dckpt", "stock"])
def test_a_resume_repeats_the_uninterrupted_losses_bit_for_bit(tmp_path, impl):
    """attention_dropout=0.1 at 2 ranks (DDP): 6 steps in one run, and a run of 6 steps
    stopped after step 4 then a resume (resume_from_checkpoint=True): the resumed
    steps' losses are the uninterrupted run's, bitwise, for DckptTrainer as for the
    stock Trainer."""
    whole = _losses(run(tmp_path / "whole", impl, 2, "--steps", "6", "--every", "2",
                        "--losses"))
    assert sorted(whole) == [1, 2, 3, 4, 5, 6], whole
    first = _losses(run(tmp_path / "cut", impl, 2, "--steps", "6", "--every", "2",
                        "--losses", "--stop-at", "4"))
    rest = _losses(run(tmp_path / "cut", impl, 2, "--steps", "6", "--every", "2",
                       "--losses", "--resume"))
    assert {s: first[s] for s in range(1, 5)} == {s: whole[s] for s in range(1, 5)}
    assert sorted(rest) == [5, 6] and all(rest[s] == whole[s] for s in (5, 6)), (rest, whole)
