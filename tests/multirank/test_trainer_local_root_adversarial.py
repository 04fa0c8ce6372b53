"""Adversarial review of DckptTrainer's fast tier (``local_root``) and ``save_model``
under SIGKILL: the real transformers Trainer as real processes (torchrun or one plain
process) under deadlines, reaped whole (tests/multirank/lightning_run.py). Each test
pins a defect the review proved on 67985e5 (it failed there), fixed since. Job script: tests/multirank/jobs/trainer_job.py."""
from __future__ import annotations

import os

import pytest

from .lightning_run import run_cmd, torchrun  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "trainer_job.py")


def run(out, n, *args: str, ok: bool = True, timeout: float = 150, script: str = JOB) -> str:
    rc, text = run_cmd(torchrun(script, n) + ["--impl", "dckpt", "--out", str(out)]
                       + list(args), timeout)
    assert (rc == 0) == ok, text[-4000:]
    return text


def test_a_killed_resumed_run_leaves_no_trainer_resume_folder_under_local_root(tmp_path):
    out, local = tmp_path / "out", str(tmp_path / "local")
    # killed after the local commit of step 4, then the restart resumes it from the fast
    # tier (its .trainer-resume-* folder made) and is killed after the commit of step 6
    run(out, None, "--steps", "6", "--every", "2", "--kill-at", "4", "--local-root", local,
        ok=False)
    text = run(out, None, "--steps", "8", "--every", "2", "--resume", "--kill-at", "6",
               "--local-root", local, ok=False)
    # (step 4, or step 2 when the kill came in checkpoint-2's copy still running)
    assert "RESUMED step=" in text and "/.trainer-resume-" in text, text[-3000:]
    text = run(out, None, "--steps", "8", "--every", "2", "--resume", "--local-root", local)
    assert "RESUMED step=" in text, text[-3000:]
    left = [n for n in os.listdir(local) if n.startswith(".trainer-resume")]
    assert not left, f"leaked under local_root: {left}"


_WRAP = '''import os, runpy, sys
if os.path.exists({arm!r}):  # the save_model's hidden checkpoint: rank 0 killed once committed
    import dckpt.integrations.transformers.export as ex
    inner = ex.save_sharded_model
    def armed(*a, **k):
        os.environ["DCKPT_FAULT"] = "committed:0:kill"
        return inner(*a, **k)
    ex.save_sharded_model = armed
sys.argv[0] = {job!r}
runpy.run_path({job!r}, run_name="__main__")
'''


def test_save_model_killed_mid_export_leaves_no_hidden_checkpoint_behind(tmp_path):
    arm, wrap = tmp_path / "arm", tmp_path / "wrap.py"
    wrap.write_text(_WRAP.format(arm=str(arm), job=JOB))
    arm.write_text("1")
    final = tmp_path / "final"
    run(tmp_path / "out", 2, "--steps", "2", "--every", "100", "--fsdp", "--save-model",
        str(final), ok=False, script=str(wrap))
    assert [n for n in os.listdir(tmp_path) if ".dckpt-model-" in n]  # the kill's leftover
    arm.unlink()
    run(tmp_path / "out", 2, "--steps", "2", "--every", "100", "--fsdp", "--save-model",
        str(final), script=str(wrap))
    assert "model.safetensors" in os.listdir(final)
    left = [n for n in os.listdir(tmp_path) if ".dckpt-model-" in n]
    assert not left, f"leaked beside the export: {left}"
