"""Issue 51, defect 2 (the Trainer's side): with ``async_save=True`` the files written
into ``checkpoint-N`` after the save returned (an ``on_save`` callback writing
``checkpoint-N/adapter_model/`` as QLoRA scripts do; a subclass writing after
``super()._save_checkpoint``) are kept in the placed checkpoint, never deleted. The
placement is held back (``DCKPT_FAULT=place:0:sleep=...``) so the writes land while the
commit is in flight, as on a slow store. Next to the stock Trainer. Also: the chain's
files of a fast-tier (``local_root``) save travel with its copy and are read at resume."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from .hf_helpers import fresh_accelerate_state, tiny_llama, training_args  # noqa: E402,F401


def _adapter_callback():
    """An ``on_save`` callback as QLoRA's scripts write it: the adapter folder into the
    checkpoint the Trainer just saved."""
    from transformers import TrainerCallback

    class SaveAdapter(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}",
                                  "adapter_model")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "adapter_model.safetensors"), "w") as f:
                f.write(str(state.global_step))

    return SaveAdapter()


@pytest.mark.parametrize("use_dckpt", [False, True], ids=["stock", "dckpt"])
def test_an_on_save_callbacks_adapter_folder_stays_in_the_async_checkpoint(
        tmp_path, monkeypatch, use_dckpt):
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer

    monkeypatch.setenv("DCKPT_FAULT", "place:0:sleep=0.5")
    model, data = tiny_llama()
    kw = dict(async_save=True) if use_dckpt else {}
    (DckptTrainer if use_dckpt else Trainer)(
        model=model, train_dataset=data, callbacks=[_adapter_callback()],
        args=training_args(tmp_path, max_steps=4), **kw).train()
    for step in (2, 4):
        f = tmp_path / f"checkpoint-{step}" / "adapter_model" / "adapter_model.safetensors"
        assert f.read_text() == str(step)
        names = set(os.listdir(tmp_path / f"checkpoint-{step}"))
        assert "trainer_state.json" in names and ("manifest.json" in names) == use_dckpt


@pytest.mark.parametrize("compose", ["mixin-first", "subclass-of-DckptTrainer"])
def test_a_subclass_writing_after_super_keeps_its_file_with_async_save(
        tmp_path, monkeypatch, compose):
    """A subclass writing into the final name after ``super()._save_checkpoint``: with
    the mixin first its write is part of the chain (staged, committed); as a subclass of
    DckptTrainer it lands while the asynchronous commit is in flight (adopted at
    placement)."""
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer, DckptTrainerMixin

    def write_after(self, model, trial, base):
        base._save_checkpoint(model, trial)
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "after.json"), "w") as f:
            json.dump({"step": self.state.global_step}, f)

    if compose == "mixin-first":
        class After(Trainer):
            def _save_checkpoint(self, model, trial):
                write_after(self, model, trial, super())

        cls = type("T", (DckptTrainerMixin, After), {})
    else:
        class cls(DckptTrainer):  # noqa: N801
            def _save_checkpoint(self, model, trial):
                write_after(self, model, trial, super())

    monkeypatch.setenv("DCKPT_FAULT", "place:0:sleep=0.5")
    model, data = tiny_llama()
    cls(model=model, train_dataset=data, async_save=True,
        args=training_args(tmp_path, max_steps=4)).train()
    for step in (2, 4):
        folder = tmp_path / f"checkpoint-{step}"
        assert json.loads((folder / "after.json").read_text()) == {"step": step}
        assert "manifest.json" in os.listdir(folder)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "checkpoint-2", "checkpoint-4"]


@pytest.mark.parametrize("async_save", [False, True])
def test_the_chains_files_travel_with_the_fast_tier_copy_and_are_read_at_resume(
        tmp_path, async_save):
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainerMixin

    class Own(Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"checkpoint-{self.state.global_step}")
            with open(os.path.join(folder, "own_state.json"), "w") as f:
                json.dump({"coef": self.state.global_step * 10}, f)

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            with open(os.path.join(checkpoint, "own_state.json")) as f:
                self.loaded = json.load(f)

    cls = type("T", (DckptTrainerMixin, Own), {})
    out, local = tmp_path / "out", tmp_path / "local"
    model, data = tiny_llama()
    cls(model=model, train_dataset=data, local_root=str(local), async_save=async_save,
        args=training_args(out, max_steps=4)).train()
    for step in (2, 4):
        names = set(os.listdir(out / f"checkpoint-{step}"))
        assert {"own_state.json", "model.safetensors", "trainer_state.json",
                "manifest.json"} <= names
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, local_root=str(local),
            args=training_args(out, max_steps=6))
    t.train(resume_from_checkpoint=True)  # the fast tier's commit of checkpoint-4
    assert t.loaded == {"coef": 40}
