"""DckptTrainer under DeepSpeed ZeRO (transformers' Trainer with ``deepspeed=``, CPU,
gloo, torchrun), next to the stock Trainer: each checkpoint-N is one dckpt commit
holding the engine's state (no global_step folder, no pickle), resumes exactly, resumes
at another world size and ZeRO stage, and is a model folder. The job:
jobs/trainer_ds_job.py."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from .lightning_run import job_env, run_cmd, torchrun

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "trainer_ds_job.py")


def run(impl: str, out, n: int, stage: int, resume: bool = False, only: bool = False,
        ok: bool = True, *flags: str) -> str:
    """Run the job; it must exit 0 (``ok``) or fail with an error (not by the deadline)."""
    env = dict(job_env(), DS_ACCELERATOR="cpu")
    rc, text = run_cmd(torchrun(JOB, n) + [impl, str(out), str(stage)]
                       + (["resume"] if resume else []) + (["only"] if only else [])
                       + list(flags), 300, env=env)
    assert (rc == 0) == ok, text[-4000:]
    return text


def losses(text: str) -> str:
    m = re.search(r"^DONE 0 (\[.*\])$", text, re.M)
    assert m, text[-3000:]
    return m.group(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ZeRO-2 at 2 ranks, 6 steps, checkpoints at 2, 4, 6 (save_total_limit=2): stock
    and dckpt."""
    base = tmp_path_factory.mktemp("trds")
    stock = run("stock", base / "stock", 2, 2)
    dck = run("dckpt", base / "dckpt", 2, 2)
    return base, losses(stock), losses(dck)


def test_a_deepspeed_run_saves_each_checkpoint_as_one_commit_with_stocks_losses(runs):
    base, stock, dck = runs
    assert dck == stock
    names = sorted(os.listdir(base / "dckpt"))
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6"]
    ck = base / "dckpt" / "checkpoint-4"
    held = os.listdir(ck)
    assert "manifest.json" in held and not any(n.startswith("global_step") for n in held)
    assert not any(n.endswith((".pt", ".pth", ".bin")) for n in held), held  # no pickle
    r = subprocess.run([sys.executable, "-m", "dckpt", "verify", str(ck)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_resume_repeats_the_uninterrupted_runs_losses(runs, tmp_path):
    """checkpoint-6 removed: the resume takes checkpoint-4 (the engine's masters equal
    those at step 4 on every rank) and steps 5-6 repeat stock's uninterrupted run."""
    base, stock, _ = runs
    out = tmp_path / "r"
    shutil.copytree(base / "dckpt", out)
    shutil.rmtree(out / "checkpoint-6")
    text = run("dckpt", out, 2, 2, resume=True)
    assert text.count("LOADED ok at step 4") == 2, text[-3000:]
    assert losses(text) == stock


def test_a_zero2_checkpoint_resumes_at_three_ranks_under_zero3(runs, tmp_path):
    base, _, _ = runs
    out = tmp_path / "r3"
    shutil.copytree(base / "dckpt", out)
    shutil.rmtree(out / "checkpoint-6")
    text = run("dckpt", out, 3, 3, resume=True)
    assert text.count("LOADED ok at step 4") == 3, text[-3000:]


def test_a_deepspeed_checkpoint_is_a_model_folder(runs):
    """from_pretrained("checkpoint-4") has every weight equal to the engine's fp32
    masters at step 4 (written by the ranks in the background after the commit, from
    the masters: no gather)."""
    import torch
    from transformers import LlamaForCausalLM

    base, _, _ = runs
    want = torch.load(base / "dckpt" / "full4.pt")
    got = LlamaForCausalLM.from_pretrained(str(base / "dckpt" / "checkpoint-4")).state_dict()
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_a_save_only_model_checkpoint_resumes_its_weights_at_another_size_and_stage(
        tmp_path):
    """``save_only_model=True`` under DeepSpeed: checkpoint-N holds the weights (fp32
    masters, no optimizer state, no scheduler) and is a model folder; the resume at 3
    ranks under ZeRO-3 starts from step 4's weights exactly, the optimizer fresh, and
    trains to the end. Stock's resume of its own such checkpoint fails (it needs the
    engine's ``global_step*`` folder, which save_only_model does not write): the
    premise."""
    import torch
    from transformers import LlamaForCausalLM

    import dckpt

    text = run("stock", tmp_path / "stock", 2, 2, only=True)
    shutil.rmtree(tmp_path / "stock" / "checkpoint-6")
    text = run("stock", tmp_path / "stock", 2, 2, resume=True, only=True, ok=False)
    assert "Can't find a valid checkpoint" in text, text[-3000:]

    out = tmp_path / "dckpt"
    run("dckpt", out, 2, 2, only=True)
    ck = out / "checkpoint-4"
    with dckpt.open(str(ck)) as c:
        keys = list(c.keys())
    assert any(k.startswith("engine.master.") for k in keys), keys[:20]
    assert not any(k.startswith(("engine.optim.", "engine.scheduler")) for k in keys), keys
    want = torch.load(out / "full4.pt")
    got = LlamaForCausalLM.from_pretrained(str(ck)).state_dict()
    assert all(torch.equal(want[n], got[n]) for n in want)
    shutil.rmtree(out / "checkpoint-6")
    text = run("dckpt", out, 3, 3, resume=True, only=True)
    assert text.count("LOADED ok at step 4") == 3, text[-3000:]
    assert len(re.findall(r"^DONE \d ", text, re.M)) == 3, text[-3000:]


def test_the_fast_tier_resumes_a_save_killed_before_its_copy_and_serves_its_own_layout_only(
        tmp_path):
    """``local_root`` under DeepSpeed (a node per rank): every rank is SIGKILLed once
    checkpoint-4 is committed on the fast tier, before its durable copy. A resume with
    the same layout (2 ranks, ZeRO-2) takes checkpoint-4 from the fast tier, exactly. A
    resume under ZeRO-3 at the same size cannot read it there (each node holds its own
    ranges only): it resumes the newest checkpoint its layout can read, checkpoint-2's
    durable copy, and says why; never a missing-file error in the middle of train()."""
    def killed(name: str):
        out = tmp_path / name
        text = run("dckpt", out, 2, 2, False, False, False, "local", "kill4")
        assert "DONE" not in text
        held = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
        assert held == ["checkpoint-2"], held  # checkpoint-4: on the fast tier only
        return out

    text = run("dckpt", killed("same"), 2, 2, True, False, True, "local")
    assert text.count("LOADED ok at step 4") == 2, text[-3000:]  # from the fast tier
    text = run("dckpt", killed("z3"), 2, 3, True, False, True, "local")
    assert "its durable copy does" in text, text[-3000:]  # the warning naming the layout
    assert text.count("at step 2") == 2, text[-3000:]
    assert len(re.findall(r"^DONE \d ", text, re.M)) == 2, text[-3000:]
    assert "LOADED ok at step 4" not in text
