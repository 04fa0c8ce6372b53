"""DckptTrainer with ``local_root`` (the fast tier), one process (the real Trainer, a
tiny Llama on CPU): saves commit locally and their copies to ``checkpoint-N`` land with
trainer_state.json; ``save_total_limit`` takes name and slot together (the best kept);
with every durable copy failing, ``resume_from_checkpoint=True`` resumes the newest
fast-tier commit (the Trainer reads its trainer_state.json from a per-rank folder made
from the commit's metadata)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from dckpt.catalog.verify import verify_checkpoint  # noqa: E402

from .test_trainer_adversarial import _args, _seen, _tiny, ckpts  # noqa: E402


def make(out, local, seen=None, **kw):
    from dckpt.integrations.transformers import DckptTrainer

    model, data = _tiny()
    async_save = kw.pop("async_save", False)
    return DckptTrainer(model=model, train_dataset=data, local_root=str(local),
                        async_save=async_save,
                        callbacks=[_seen(seen)] if seen is not None else None,
                        args=_args(out, **kw))


def weights(t) -> dict:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_are_copied_with_trainer_state_rotated_and_resumed(tmp_path, async_save):
    out, local = tmp_path / "out", tmp_path / "local"
    t = make(out, local, max_steps=6, save_total_limit=2, async_save=async_save)
    t.train()  # waits for the copies
    assert ckpts(out) == ["checkpoint-4", "checkpoint-6"]
    for n in ckpts(out):
        assert verify_checkpoint(str(out / n)).ok
        assert {"trainer_state.json", "config.json", "training_args.json"} <= set(
            os.listdir(out / n))
    assert len(os.listdir(local)) == 2  # checkpoint-2's slot went with its name
    seen: dict = {}
    t = make(out, local, seen, max_steps=8, save_total_limit=2, async_save=async_save)
    t.train(resume_from_checkpoint=True)
    assert seen["step"] == 6
    assert ckpts(out) == ["checkpoint-6", "checkpoint-8"]
    assert not [n for n in os.listdir(local) if n.startswith(".trainer-resume")]
    t = make(out, local, seen, max_steps=6)
    t.train(resume_from_checkpoint=str(out / "checkpoint-6"))  # an explicit name
    assert seen["step"] == 6


def test_durable_copies_failing_resume_the_newest_fast_tier_commit(tmp_path, monkeypatch,
                                                                   caplog):
    out, local = tmp_path / "out", tmp_path / "local"
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")  # every durable copy fails
    t = make(out, local, max_steps=4)
    with caplog.at_level("ERROR"):
        t.train()
    assert "durable copy of" in caplog.text
    assert ckpts(out) == []  # nothing reached output_dir
    want = weights(t)
    monkeypatch.delenv("DCKPT_FAULT")
    seen: dict = {}
    got = {}

    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            got.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    t = make(out, local, seen, max_steps=6)
    t.add_callback(Grab())
    t.train(resume_from_checkpoint=True)
    assert seen["step"] == 4
    assert all(torch.equal(v, want[k]) for k, v in got.items())
    assert ckpts(out) == ["checkpoint-6"]  # the copies work again
