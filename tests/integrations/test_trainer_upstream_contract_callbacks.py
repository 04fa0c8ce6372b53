"""The Trainer's best-model, rotation and callback contract, as transformers' own tests
pin it (tests/trainer/test_trainer_checkpointing.py and test_trainer_callback.py at the
tested version, 5.24), checked with ``transformers.Trainer`` ("stock") and with
``DckptTrainer`` ("dckpt") alike: the best checkpoint found and loaded at the end, which
checkpoints ``save_total_limit`` keeps, the callbacks' events in order, stateful
callbacks and ``TrainerControl`` restored at a resume. Metrics are scripted (a
``compute_metrics`` returning given values) so the best step is known in advance.
Written from the behaviours those tests pin, not from their code (issue 51)."""
from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

from .hf_helpers import fresh_accelerate_state, tiny_llama  # noqa: E402,F401 (autouse)
from .trainer_contract_helpers import (  # noqa: E402
    KINDS, Scripted, checkpoints, make, same, weights)

pytestmark = pytest.mark.parametrize("kind", KINDS)


def _evaluated(kind, out, values, callbacks=(), **kw):
    """A Trainer of ``kind`` that evaluates on 4 samples (one batch) with the scripted
    ``accuracy`` ``values`` (greater is better)."""
    model, data = tiny_llama()
    base = dict(eval_strategy="steps", metric_for_best_model="accuracy", greater_is_better=True,
                per_device_eval_batch_size=4)
    base.update(kw)
    return make(kind, out, model=model, data=data, eval_data=data[:4],
                compute_metrics=Scripted(values), callbacks=callbacks, **base)


def _weights_at_save():
    """A callback keeping the model's weights at each ``on_save`` (what that
    checkpoint holds), by global step, in ``.at``."""

    class AtSave(TrainerCallback):
        def __init__(self):
            self.at: dict = {}

        def on_save(self, args, state, control, model=None, **k):
            self.at[state.global_step] = {n: v.detach().clone()
                                          for n, v in model.state_dict().items()}

    return AtSave()


# ------------------------------------------------------------------ the best model
def test_load_best_model_at_end_loads_the_best_checkpoints_weights(kind, tmp_path):
    rec = _weights_at_save()
    t = _evaluated(kind, tmp_path, [0.5, 0.9, 0.7, 0.6], callbacks=[rec], max_steps=8,
                   eval_steps=2, save_steps=2, load_best_model_at_end=True)
    t.train()
    assert t.state.best_global_step == 4 and t.state.best_metric == 0.9
    assert t.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    assert checkpoints(tmp_path) == [2, 4, 6, 8]
    same(rec.at[4], weights(t))
    assert not all(v.equal(rec.at[8][k]) for k, v in rec.at[4].items())  # not the last


def test_load_best_model_at_end_with_save_only_model_loads_the_best(kind, tmp_path):
    rec = _weights_at_save()
    t = _evaluated(kind, tmp_path, [0.5, 0.9, 0.7], callbacks=[rec], max_steps=6,
                   eval_steps=2, save_steps=2, load_best_model_at_end=True,
                   save_only_model=True)
    t.train()
    assert t.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    same(rec.at[4], weights(t))


def test_save_strategy_best_saves_only_new_bests_and_loads_the_best(kind, tmp_path):
    rec = _weights_at_save()
    t = _evaluated(kind, tmp_path, [0.6, 0.65, 0.64, 0.63], callbacks=[rec], max_steps=8,
                   eval_steps=2, save_strategy="best", load_best_model_at_end=True,
                   save_total_limit=2)
    t.train()
    assert checkpoints(tmp_path) == [2, 4]
    assert t.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    same(rec.at[4], weights(t))


def test_the_best_checkpoint_with_epoch_strategies_is_the_best_epochs(kind, tmp_path):
    t = _evaluated(kind, tmp_path, [0.59, 0.57, 0.55], eval_strategy="epoch",
                   save_strategy="epoch", num_train_epochs=3, per_device_train_batch_size=8)
    t.train()  # 2 steps an epoch
    assert t.state.best_metric == 0.59 and t.state.best_global_step == 2
    assert t.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert checkpoints(tmp_path) == [2, 4, 6]


def test_no_best_checkpoint_is_named_when_evaluations_and_saves_never_meet(kind, tmp_path):
    t = _evaluated(kind, tmp_path, [0.9, 0.8], max_steps=6, eval_steps=3, save_steps=2)
    t.train()
    assert t.state.best_metric == 0.9 and t.state.best_global_step == 3
    assert t.state.best_model_checkpoint is None
    assert checkpoints(tmp_path) == [2, 4, 6]


# ------------------------------------------------------------------ rotation
def test_save_total_limit_keeps_the_newest_checkpoints(kind, tmp_path):
    t = make(kind, tmp_path, max_steps=5, save_steps=1, save_total_limit=2)
    t.train()
    assert checkpoints(tmp_path) == [4, 5]
    assert t.state.best_model_checkpoint is None


def test_save_total_limit_one_without_evaluation_keeps_only_the_last(kind, tmp_path):
    t = make(kind, tmp_path, max_steps=3, save_steps=1, save_total_limit=1)
    t.train()
    assert checkpoints(tmp_path) == [3]
    assert t.state.best_metric is None and t.state.best_model_checkpoint is None


def test_save_total_limit_keeps_the_best_checkpoint_beside_the_newest(kind, tmp_path):
    t = _evaluated(kind, tmp_path, [0.6, 0.9, 0.7, 0.6, 0.5], max_steps=5, eval_steps=1,
                   save_steps=1, save_total_limit=2, load_best_model_at_end=True)
    t.train()
    assert checkpoints(tmp_path) == [2, 5]


@pytest.mark.parametrize("best_at, kept", [(1, [1, 4]), (4, [4])])
def test_save_total_limit_one_with_a_best_model_keeps_the_best_and_the_newest(
        kind, tmp_path, best_at, kept):
    """... while training; the end of training then keeps the best only."""
    listed: dict = {}

    class AtSave(TrainerCallback):
        def on_save(self, args, state, control, **k):
            listed[state.global_step] = checkpoints(args.output_dir)

    values = [0.9, 0.8, 0.7, 0.6] if best_at == 1 else [0.6, 0.7, 0.8, 0.9]
    t = _evaluated(kind, tmp_path, values, callbacks=[AtSave()], max_steps=4, eval_steps=1,
                   save_steps=1, save_total_limit=1, load_best_model_at_end=True)
    t.train()
    assert t.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best_at}")
    assert listed[4] == kept
    assert checkpoints(tmp_path) == [best_at]


# ------------------------------------------------------------------ callback events
def _recorder():

    names = ["on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
             "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end",
             "on_step_end", "on_evaluate", "on_predict", "on_save", "on_log",
             "on_prediction_step"]

    def hook(name):
        def record(self, args, state, control, **k):
            self.events.append(name)
        return record

    body = {n: hook(n) for n in names}
    body["__init__"] = lambda self: setattr(self, "events", [])
    return type("Recorder", (TrainerCallback,), body)()


def _expected_events(epochs, per_epoch, max_steps, log_every, save_every,
                     eval_every=None, eval_each_epoch=False):
    """The events stock's loop sends for these settings (one evaluation batch)."""
    evaluation = ["on_prediction_step", "on_log", "on_evaluate"]
    out, step = ["on_init_end", "on_train_begin"], 0
    for _ in range(epochs):
        out.append("on_epoch_begin")
        for _ in range(per_epoch):
            if step == max_steps:
                break
            step += 1
            out += ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
            if step % log_every == 0:
                out.append("on_log")
            if eval_every and (step % eval_every == 0 or step == max_steps):
                out += evaluation
            if step % save_every == 0 or step == max_steps:
                out.append("on_save")
        out.append("on_epoch_end")
        if eval_each_epoch:
            out += evaluation
    return out + ["on_log", "on_train_end"]


@pytest.mark.parametrize("setting", ["saves", "evaluations", "epoch_evaluations"])
def test_callbacks_get_their_events_in_the_training_loops_order(kind, tmp_path, setting):
    rec = _recorder()
    if setting == "saves":
        t = make(kind, tmp_path, callbacks=[rec], max_steps=7, save_steps=3, logging_steps=2)
        expected = _expected_events(1, 8, 7, 2, 3)
    elif setting == "evaluations":
        t = _evaluated(kind, tmp_path, [0.5] * 9, callbacks=[rec], max_steps=7, eval_steps=2,
                       save_steps=4, logging_steps=3)
        expected = _expected_events(1, 8, 7, 3, 4, eval_every=2)
    else:
        t = _evaluated(kind, tmp_path, [0.5] * 9, callbacks=[rec], eval_strategy="epoch",
                       num_train_epochs=2, per_device_train_batch_size=8, save_steps=3)
        expected = _expected_events(2, 2, 4, 1000, 3, eval_each_epoch=True)
    t.train()
    assert rec.events == expected


def test_at_on_save_the_checkpoint_of_the_step_is_on_disk(kind, tmp_path):
    from transformers import TrainerState

    seen: dict = {}

    class Look(TrainerCallback):
        def on_save(self, args, state, control, **k):
            p = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            f = os.path.join(p, "trainer_state.json")
            seen[state.global_step] = (TrainerState.load_from_json(f).global_step
                                       if os.path.isfile(f) else None)

    make(kind, tmp_path, callbacks=[Look()], max_steps=4, save_steps=2).train()
    assert seen == {2: 2, 4: 4}


def test_the_epoch_strategy_saves_once_when_max_steps_ends_the_epoch(kind, tmp_path):

    flagged = []

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **k):
            flagged.extend(["step"] if control.should_save else [])

        def on_epoch_end(self, args, state, control, **k):
            flagged.extend(["epoch"] if control.should_save else [])

    make(kind, tmp_path, callbacks=[Count()], max_steps=2, save_strategy="epoch").train()
    assert len(flagged) == 1
    assert checkpoints(tmp_path) == [2]


def test_a_callback_stopping_training_ends_it_without_an_unscheduled_save(kind, tmp_path):

    class StopAt1(TrainerCallback):
        def on_step_end(self, args, state, control, **k):
            control.should_training_stop = state.global_step >= 1

    t = make(kind, tmp_path, callbacks=[StopAt1()], max_steps=10, save_steps=2)
    t.train()
    assert t.state.global_step == 1
    assert checkpoints(tmp_path) == []


# ------------------------------------------------------------------ stateful callbacks
def _early_stopping(**kw):
    from transformers import EarlyStoppingCallback

    return EarlyStoppingCallback(**kw)


def _find(trainer, cls):
    return [c for c in trainer.callback_handler.callbacks if isinstance(c, cls)]


def test_early_stopping_settings_and_counter_are_restored_at_a_resume(kind, tmp_path):
    from transformers import EarlyStoppingCallback

    kw = dict(max_steps=4, eval_steps=2, save_steps=2, load_best_model_at_end=True)
    cb = _early_stopping(early_stopping_patience=5, early_stopping_threshold=0.2)
    _evaluated(kind, tmp_path, [0.9, 0.5], callbacks=[cb], **kw).train()
    assert cb.early_stopping_patience_counter == 1
    at_begin: list = []

    class Look(TrainerCallback):  # what the resumed run starts with
        def on_train_begin(self, args, state, control, **k):
            at_begin.extend((c.early_stopping_patience, c.early_stopping_threshold,
                             c.early_stopping_patience_counter)
                            for c in self.handler.callbacks
                            if isinstance(c, EarlyStoppingCallback))

    look = Look()
    t = _evaluated(kind, tmp_path, [0.1], callbacks=[_early_stopping(), look],
                   restore_callback_states_from_checkpoint=True, **kw)
    look.handler = t.callback_handler
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert at_begin == [(5, 0.2, 1)]
    (back,) = _find(t, EarlyStoppingCallback)
    assert (back.early_stopping_patience, back.early_stopping_threshold) == (5, 0.2)


class _Labelled(TrainerCallback, ExportableState):
    """A stateful callback whose only state is its ``label`` (an init argument)."""

    def __init__(self, label="default"):
        self.label = label

    def state(self):
        return {"args": {"label": self.label}, "attributes": {}}


def test_two_instances_of_one_stateful_callback_are_restored_in_order(kind, tmp_path):
    kw = dict(max_steps=2, save_steps=2)
    make(kind, tmp_path, callbacks=[_Labelled("first"), _Labelled("second")], **kw).train()
    t = make(kind, tmp_path, callbacks=[_Labelled(), _Labelled()],
             restore_callback_states_from_checkpoint=True, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert [c.label for c in _find(t, _Labelled)] == ["first", "second"]


def test_a_stateful_callback_missing_at_the_resume_is_warned_by_name(kind, tmp_path):
    kw = dict(max_steps=2, eval_steps=2, save_steps=2, load_best_model_at_end=True)
    _evaluated(kind, tmp_path, [0.5], callbacks=[_early_stopping()], **kw).train()
    t = _evaluated(kind, tmp_path, [0.5], restore_callback_states_from_checkpoint=True, **kw)

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    h = Keep(logging.WARNING)
    logging.getLogger("transformers").addHandler(h)
    try:
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    finally:
        logging.getLogger("transformers").removeHandler(h)
    assert any("EarlyStoppingCallback" in m and "not included" in m for m in lines), lines


def test_the_trainer_control_is_saved_with_the_checkpoint(kind, tmp_path):
    from transformers import TrainerState

    make(kind, tmp_path, max_steps=2, save_steps=2).train()
    state = TrainerState.load_from_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    assert state.stateful_callbacks["TrainerControl"]["args"]["should_training_stop"] is True
    t = make(kind, tmp_path, max_steps=2, restore_callback_states_from_checkpoint=True)
    t.state = state
    t._load_callback_state()
    assert t.control.should_training_stop
