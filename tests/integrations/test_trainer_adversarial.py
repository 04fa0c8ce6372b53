"""Adversarial review of DckptTrainer (dckpt/integrations/transformers/trainer.py) with the
real transformers Trainer in one process: each test pins a defect found by the review
on 38c9984 (it failed there) and fixed since, or a behaviour the spec (issue 45, part 2)
demands. A tiny Llama (2 layers, hidden 16) on CPU."""
from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from .hf_helpers import tiny_llama, training_args  # noqa: E402


_tiny, _args = tiny_llama, training_args  # (the names other test modules import)


def _seen(seen: dict):
    """A callback recording the global step when training begins (after a resume)."""
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen["step"] = state.global_step

    return Seen()


def _trainer(out, seen: dict | None = None, callbacks=(), **kw):
    from dckpt.integrations.transformers import DckptTrainer

    async_save = kw.pop("async_save", False)
    model, data = _tiny()
    cbs = list(callbacks) + ([_seen(seen)] if seen is not None else [])
    return DckptTrainer(model=model, train_dataset=data, callbacks=cbs or None,
                        async_save=async_save, args=_args(out, **kw))


def ckpts(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


def test_a_trainer_state_whose_step_disagrees_with_the_commit_is_not_resumed(tmp_path):
    from dckpt import CheckpointError

    _trainer(tmp_path, max_steps=4).train()
    p = tmp_path / "checkpoint-4" / "trainer_state.json"
    text = p.read_text()
    assert '"global_step": 4' in text
    p.write_text(text.replace('"global_step": 4', '"global_step": 5'))  # one byte damaged
    seen: dict = {}
    t = _trainer(tmp_path, seen, max_steps=6)
    try:
        t.train(resume_from_checkpoint=True)
    except CheckpointError:
        return  # refused: fine
    assert seen["step"] != 5, "resumed the step-4 model and optimizer as global step 5"


def test_a_newest_checkpoint_without_its_manifest_is_warned_and_the_run_goes_on(
        tmp_path, caplog):
    _trainer(tmp_path, max_steps=4).train()
    os.remove(tmp_path / "checkpoint-4" / "manifest.json")  # damaged by hand / a bad copy
    seen: dict = {}
    t = _trainer(tmp_path, seen, max_steps=6)
    with caplog.at_level(logging.WARNING):
        t.train(resume_from_checkpoint=True)
    assert seen["step"] == 2
    assert t.state.global_step == 6
    assert any("checkpoint-4" in r.getMessage() for r in caplog.records
               if r.levelno >= logging.WARNING), caplog.text


def test_an_explicit_dckpt_folder_without_its_manifest_is_not_committed_error(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    from dckpt.errors import NotCommittedError

    _trainer(tmp_path, max_steps=4).train()
    os.remove(tmp_path / "checkpoint-4" / "manifest.json")
    last = get_last_checkpoint(str(tmp_path))  # HF's example scripts' pattern
    assert last == str(tmp_path / "checkpoint-4")
    with pytest.raises(NotCommittedError):
        _trainer(tmp_path, max_steps=6).train(resume_from_checkpoint=last)


def _flaky_manifest(monkeypatch, name: str, armed: dict) -> None:
    """The next read of ``name``'s manifest while ``armed["on"]`` fails once with EIO
    (a transient I/O error), through the function every listing uses."""
    from dckpt.integrations.common import place

    real = place.read_manifest

    def flaky(path, *a, **k):
        if armed.get("on") and os.path.basename(str(path).rstrip("/")) == name:
            armed["on"] = False
            armed["fired"] = armed.get("fired", 0) + 1
            raise OSError(5, "Input/output error (transient)", path)
        return real(path, *a, **k)

    monkeypatch.setattr(place, "read_manifest", flaky)


def test_a_transient_manifest_read_error_at_resume_never_silently_rewinds(
        tmp_path, monkeypatch, caplog):
    _trainer(tmp_path, max_steps=4).train()
    armed = {"on": True}
    _flaky_manifest(monkeypatch, "checkpoint-4", armed)
    seen: dict = {}
    t = _trainer(tmp_path, seen, max_steps=6)
    with caplog.at_level(logging.WARNING):
        t.train(resume_from_checkpoint=True)
    assert armed.get("fired") == 1
    warned = any("checkpoint-4" in r.getMessage() for r in caplog.records
                 if r.levelno >= logging.WARNING)
    assert seen["step"] == 4 or warned, f"resumed step {seen['step']} silently"


def test_a_transient_manifest_read_error_at_rotation_never_removes_a_newer_checkpoint(
        tmp_path, monkeypatch):
    from transformers import TrainerCallback

    armed: dict = {}
    _flaky_manifest(monkeypatch, "checkpoint-4", armed)

    class Arm(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                armed["on"] = True  # the next read of checkpoint-4's manifest: rotation at 6

    t = _trainer(tmp_path, callbacks=[Arm()], max_steps=6, save_total_limit=2)
    t.train()
    assert armed.get("fired") == 1
    assert ckpts(tmp_path) == ["checkpoint-4", "checkpoint-6"]


def test_a_full_run_resuming_a_model_only_checkpoint_is_warned(tmp_path, caplog):
    from transformers.utils import logging as hf_logging

    _trainer(tmp_path, max_steps=2, save_only_model=True).train()
    seen: dict = {}
    t = _trainer(tmp_path, seen, max_steps=4)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            t.train(resume_from_checkpoint=True)
    finally:
        hf_logging.disable_propagation()
    assert seen["step"] == 2
    msgs = [r.getMessage().lower() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("optimizer" in m or "model only" in m or "model-only" in m for m in msgs), msgs


def test_a_second_jobs_save_into_the_same_output_dir_never_strips_this_save(tmp_path):
    import subprocess
    import sys

    from dckpt import CheckpointError
    from dckpt.integrations.transformers import DckptTrainer

    other = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); "
             "from dckpt.integrations.common.commit import Committer; "
             f"Committer(None).plan({str(tmp_path / 'checkpoint-99')!r})")

    class JobA(DckptTrainer):
        def _dckpt_contents(self, rank):
            if self.state.global_step == 4:  # job B (another process) starts its save now
                subprocess.run([sys.executable, "-c", other], check=True, timeout=120)
            return super()._dckpt_contents(rank)

    model, data = _tiny()
    t = JobA(model=model, train_dataset=data, args=_args(tmp_path, max_steps=4))
    try:
        t.train()
    except CheckpointError:
        assert not os.path.exists(tmp_path / "checkpoint-4")
        return  # refused loudly, nothing placed: fine
    names = os.listdir(tmp_path / "checkpoint-4")
    assert "trainer_state.json" in names and "config.json" in names, names


def test_a_trainer_record_whose_model_only_is_not_a_bool_is_refused(tmp_path):
    """A manifest edited (and re-sealed) so that the Trainer's record says
    ``"model_only": "yes"``: the resume raises a ManifestError naming the field, never
    reads the string as true (a full checkpoint loaded as weights only, its optimizer,
    scheduler and RNG silently dropped)."""
    import json

    from dckpt.errors import ManifestError
    from dckpt.format import manifest as mf

    _trainer(tmp_path, max_steps=2).train()
    ck = os.path.join(tmp_path, "checkpoint-2", "manifest.json")
    with open(ck, "rb") as f:
        m = mf.parse(f.read(), ck)
    key = next(k for k in m.values if k.startswith("__") and "transformers" in k)
    rec = json.loads(m.values[key])
    rec["model_only"] = "yes"
    m.values[key] = json.dumps(rec, sort_keys=True)
    with open(ck, "wb") as f:
        f.write(mf.to_json(m))
    with pytest.raises(ManifestError, match="model_only"):
        _trainer(tmp_path, max_steps=4).train(resume_from_checkpoint=True)
