"""Adversarial review of DckptTrainer with the real transformers Trainer on gloo CPU ranks
(torchrun, DDP), every job under a deadline (lightning_run.run_cmd: a hang fails fast).
Job script: tests/multirank/jobs/trainer_adv_job.py. Each test pins a defect found by
the review on 38c9984 (it failed there), fixed since."""
from __future__ import annotations

import json
import os

import pytest

from .lightning_run import run_cmd, torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "trainer_adv_job.py")


def run(out, n: int | None, *args: str, timeout: float = 150) -> tuple[int, str]:
    return run_cmd(torchrun(JOB, n) + ["--out", str(out)] + list(args), timeout)


def test_save_only_model_differing_between_ranks_is_refused_or_consistent(tmp_path):
    import dckpt

    out = tmp_path / "out"
    rc, text = run(out, 2, "--steps", "2", "--model-only-rank", "0")
    if rc != 0:  # refused: the same CheckpointError on every rank, naming the setting
        assert "CheckpointError" in text and "save_only_model" in text, text[-3000:]
        return
    with dckpt.open(str(out / "checkpoint-2")) as ck:
        keys = list(ck.keys())
        meta = json.loads(ck["__transformers__"])
    has_opt = any(k.startswith("optimizers.") for k in keys)
    assert meta["model_only"] == (not has_opt), (meta, has_opt)
