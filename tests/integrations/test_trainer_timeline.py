"""DckptTrainer orders its checkpoints by the run's timeline, not by rank 0's wall
clock: a run resumed on a host whose clock is behind keeps its new checkpoints (resume
and save_total_limit follow what the run reached last). Real transformers Trainer, one
process, tiny Llama on CPU."""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("transformers")

from .hf_helpers import tiny_llama, training_args  # noqa: E402


def _seen(seen: dict):
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen["step"] = state.global_step

    return Seen()


def _trainer(out, seen: dict, **kw):
    from dckpt.integrations.transformers import DckptTrainer

    model, data = tiny_llama()
    return DckptTrainer(model=model, train_dataset=data, callbacks=[_seen(seen)],
                        args=training_args(out, **kw))


def _ckpts(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


def test_a_resume_on_a_host_whose_clock_is_behind_keeps_its_new_checkpoints(
        tmp_path, monkeypatch):
    """Run 1 saves checkpoints 2 and 4; run 2 resumes on a host whose clock is a day
    behind and saves 6 and 8 with save_total_limit=2. By commit time 6 and 8 were the
    oldest: rotation removed them and the next resume took checkpoint-4."""
    seen: dict = {}
    _trainer(tmp_path, seen, max_steps=4, save_total_limit=2).train()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400.0)
    _trainer(tmp_path, seen, max_steps=8, save_total_limit=2).train(
        resume_from_checkpoint=True)
    assert seen["step"] == 4
    monkeypatch.setattr(time, "time", real)
    assert _ckpts(tmp_path) == ["checkpoint-6", "checkpoint-8"]
    _trainer(tmp_path, seen, max_steps=8, save_total_limit=2).train(
        resume_from_checkpoint=True)
    assert seen["step"] == 8


def test_a_rewind_on_a_host_whose_clock_is_behind_never_resumes_the_abandoned_branch(
        tmp_path, monkeypatch):
    """Run 1 saves 2, 4, 6; run 2 (a day behind) rewinds to checkpoint-2 and saves
    checkpoint-3 (save_steps=1, max_steps=3). checkpoint-4 and -6 belong to the
    abandoned branch; the newest on the run's timeline is checkpoint-3."""
    seen: dict = {}
    _trainer(tmp_path, seen, max_steps=6).train()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400.0)
    _trainer(tmp_path, seen, max_steps=3, save_steps=1).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    monkeypatch.setattr(time, "time", real)
    assert "checkpoint-3" in _ckpts(tmp_path)
    _trainer(tmp_path, seen, max_steps=3, save_steps=1).train(resume_from_checkpoint=True)
    assert seen["step"] == 3
