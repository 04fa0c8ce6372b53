"""Adversarial review of the Trainer adapter's chains (issue 51): scripts as Hugging Face
users write them (Trainer subclasses that override a piece of the load chain, a mixin
placed after the base, a subclass that picks its own run directory, two jobs on one
``local_root``, a chain writing a file named as dckpt's), each beside the stock class
where the stock class has the behaviour. One process, CPU, the tiny Llama of
hf_helpers. Each test failed on the reviewed commit and passes since its fix."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from .hf_helpers import fresh_accelerate_state, tiny_llama, training_args  # noqa: E402,F401

def both(reason: str):
    """Run with the stock class and with dckpt's; ``reason``: the defect the dckpt run
    pinned before its fix."""
    return pytest.mark.parametrize("use_dckpt", [
        False, True],
        ids=["stock", "dckpt"])


def _compose(base: type, use_dckpt: bool) -> type:
    """``base`` (stock) or ``class T(DckptTrainerMixin, base)``, as docs/HF.md says."""
    if not use_dckpt:
        return base
    from dckpt.integrations.transformers import DckptTrainerMixin

    return type(f"Dckpt{base.__name__}", (DckptTrainerMixin, base), {})


def _weights_at_train_begin():
    """A callback recording the model's weights at ``on_train_begin`` (after the
    resume's loads, before the first step)."""
    from transformers import TrainerCallback

    class Snap(TrainerCallback):
        sd: dict | None = None

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    return Snap()


# ----------------------------------------------------------- the load chain's overrides
def _fresh_optimizer_base():
    """A subclass as users write it to resume the weights with a *fresh* optimizer and
    schedule (a new learning rate after a resume): ``_load_optimizer_and_scheduler``
    overridden to do nothing. Stock loads the weights in ``_load_from_checkpoint``."""
    from transformers import Trainer

    class FreshOptimizer(Trainer):
        def _load_optimizer_and_scheduler(self, checkpoint):
            return

    return FreshOptimizer


@both("dckpt loads the model inside "
                   "_load_optimizer_and_scheduler: a subclass that skips the optimizer's "
                   "load resumes the step with untrained weights, silently")
def test_a_subclass_skipping_the_optimizer_load_still_resumes_the_weights(tmp_path, use_dckpt):
    cls = _compose(_fresh_optimizer_base(), use_dckpt)
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=2))
    t.train()
    saved = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    snap = _weights_at_train_begin()
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, callbacks=[snap],
            args=training_args(tmp_path, max_steps=4))
    t.train(resume_from_checkpoint=True)
    assert snap.sd is not None
    differ = [k for k, v in saved.items() if not torch.equal(v, snap.sd[k])]
    assert differ == [], f"resumed at step 2 without the saved weights: {differ[:3]}"


@both("DckptTrainerMixin._load_best_model never calls "
                   "super() for a dckpt best checkpoint: the override of the class after "
                   "the mixin is skipped")
def test_a_subclass_load_best_model_override_runs_at_the_end(tmp_path, use_dckpt):
    from transformers import Trainer

    calls: list[str] = []

    class OwnBest(Trainer):
        def _load_best_model(self):
            calls.append(self.state.best_model_checkpoint)
            super()._load_best_model()

    cls = _compose(OwnBest, use_dckpt)
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, eval_dataset=data[:4],
            args=training_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2,
                               load_best_model_at_end=True, metric_for_best_model="loss",
                               greater_is_better=False))
    t.train()
    assert len(calls) == 1 and os.path.basename(calls[0]) in ("checkpoint-2", "checkpoint-4")


# ------------------------------------------------------------------ class layouts
def test_the_mixin_after_the_trainer_is_refused_or_saves_dckpt(tmp_path):
    from transformers import Trainer

    from dckpt.errors import CheckpointError
    from dckpt.integrations.transformers import DckptTrainerMixin

    model, data = tiny_llama()
    try:
        cls = type("Late", (Trainer, DckptTrainerMixin), {})
        t = cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=2))
    except (TypeError, CheckpointError):
        return  # refused at once, naming the order: fine
    t.train()
    names = set(os.listdir(tmp_path / "checkpoint-2"))
    assert "manifest.json" in names and "optimizer.pt" not in names, sorted(names)


# -------------------------------------------------- a subclass with its own run folder
def test_a_subclass_run_dir_override_never_loses_the_previous_checkpoint(tmp_path,
                                                                         monkeypatch):
    from dckpt.integrations.common import tree
    from dckpt.integrations.transformers import DckptTrainer

    class OwnDir(DckptTrainer):
        def _get_output_dir(self, trial):  # e.g. a fixed folder per hyperparameter trial
            return str(self.args.output_dir)

    real = tree.build

    def failing_at_4(c, rank, key):
        if c.meta and c.meta.get("global_step") == 4:
            raise OSError("disk full (injected)")
        return real(c, rank, key)

    monkeypatch.setattr(tree, "build", failing_at_4)
    model, data = tiny_llama()
    t = OwnDir(model=model, train_dataset=data,
               args=training_args(tmp_path, max_steps=4, save_total_limit=1))
    with pytest.raises(Exception):
        t.train()
    from dckpt.integrations.common.place import kind

    visible = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert kind(str(tmp_path / "checkpoint-2")) == "dckpt", visible
    # nothing but complete checkpoints carries a checkpoint-N name
    assert visible == ["checkpoint-2"], visible


# ----------------------------------------------------- a file named as dckpt's own
def test_a_chain_file_named_manifest_json_gets_an_error_naming_it(tmp_path):
    from transformers import Trainer

    from dckpt.errors import CheckpointError

    class WritesManifest(Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)
            if self.state.global_step == 4:  # e.g. a data pipeline's manifest.json
                folder = os.path.join(self._get_output_dir(trial),
                                      f"checkpoint-{self.state.global_step}")
                with open(os.path.join(folder, "manifest.json"), "w") as f:
                    json.dump({"shards": ["a", "b"]}, f)

    cls = _compose(WritesManifest, True)
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=4))
    with pytest.raises(CheckpointError) as got:
        t.train()
    msg = str(got.value)
    assert "overwrite=True" not in msg, msg  # a hint the user cannot follow
    assert "manifest.json" in msg and "checkpoint-4" in msg and ".dckpt-partial" not in msg, msg


# --------------------------------------------------------------- the fast tier
@both("with local_root, copy.deepcopy(trainer) raises "
                   "TypeError (a thread lock in the fast tier); the stock Trainer deep-copies")
def test_a_trainer_with_local_root_deep_copies_as_stock(tmp_path, use_dckpt):
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer

    model, data = tiny_llama()
    kw = {"local_root": str(tmp_path / "local")} if use_dckpt else {}
    t = (DckptTrainer if use_dckpt else Trainer)(
        model=model, train_dataset=data, args=training_args(tmp_path / "out", max_steps=2),
        **kw)
    t.train()
    copy.deepcopy(t)


def test_a_second_job_on_the_local_root_never_removes_the_first_jobs_chain_files(tmp_path):
    """Two jobs (own output_dir) on one local_root. Job A's save is in its chain (the
    model folder written into its ``<slot>.extras``, its slot not committed yet) when job
    B saves: B's save must not touch A's files (the tier's promise: two jobs never trim
    or sweep each other's). Interleaved deterministically in one process."""
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainerMixin

    local = str(tmp_path / "local")
    model_b, data_b = tiny_llama()
    DckptB = _compose(Trainer, True)
    b = DckptB(model=model_b, train_dataset=data_b, local_root=local,
               args=training_args(tmp_path / "b", max_steps=2))
    b.train()  # B's first checkpoint, and a trainer able to save again

    class A(Trainer):
        def _save(self, output_dir=None, state_dict=None):
            super()._save(output_dir, state_dict)  # A's model folder is in its extras now
            b._save_checkpoint(b.model, None)  # job B saves meanwhile (same local_root)

    DckptA = type("DckptA", (DckptTrainerMixin, A), {})
    model_a, data_a = tiny_llama()
    a = DckptA(model=model_a, train_dataset=data_a, local_root=local,
               args=training_args(tmp_path / "a", max_steps=2))
    a.train()
    names = set(os.listdir(tmp_path / "a" / "checkpoint-2"))
    assert {"model.safetensors", "config.json", "trainer_state.json",
            "manifest.json"} <= names, sorted(names)
