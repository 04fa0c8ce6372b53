"""What the Trainer contract tests share (test_trainer_upstream_contract*.py): one
factory building either ``transformers.Trainer`` ("stock") or ``DckptTrainer`` ("dckpt")
on the tiny Llama, and the comparisons of what a run leaves behind (weights, optimizer,
lr_scheduler, ``TrainerState``)."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from .hf_helpers import tiny_llama, training_args

KINDS = ("stock", "dckpt")
# the files only stock's checkpoint holds (dckpt keeps them in its own shards)
STOCK_ONLY = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors")
# time-dependent entries of the train summary in log_history
_TIMED = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
          "total_flos")


def trainer_class(kind: str):
    if kind == "stock":
        from transformers import Trainer

        return Trainer
    from dckpt.integrations.transformers import DckptTrainer

    return DckptTrainer


def make(kind: str, out, *, model=None, data=None, eval_data=None, callbacks=None,
         compute_metrics=None, processing_class=None, prepare=None, **kw):
    """A Trainer of ``kind`` training ``model`` (default: a fresh seeded tiny Llama and
    its 16 samples) with :func:`training_args` ``(out, **kw)``. ``prepare(model)``
    runs on the model before the Trainer is built (freezing, adapters)."""
    if model is None:
        model, tiny_data = tiny_llama()
        data = tiny_data if data is None else data
    if prepare is not None:
        model = prepare(model) or model
    extra = {}
    if eval_data is not None:
        extra["eval_dataset"] = eval_data
    if compute_metrics is not None:
        extra["compute_metrics"] = compute_metrics
    if processing_class is not None:
        extra["processing_class"] = processing_class
    return trainer_class(kind)(model=model, args=training_args(out, **kw), train_dataset=data,
                               callbacks=list(callbacks) if callbacks else None, **extra)


def checkpoints(out) -> list[int]:
    """The steps of the ``checkpoint-N`` folders under ``out``, ascending."""
    steps = []
    for n in os.listdir(out):
        if n.startswith("checkpoint-") and n[len("checkpoint-"):].isdigit():
            steps.append(int(n[len("checkpoint-"):]))
    return sorted(steps)


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def optimizer_state(trainer) -> dict:
    return trainer.optimizer.state_dict()


def scheduler_state(trainer) -> dict:
    return trainer.lr_scheduler.state_dict()


def trainer_state(trainer) -> dict:
    """``TrainerState`` as a dict, without the train summary's timings (a resumed run
    measures only its own part)."""
    s = dataclasses.asdict(trainer.state)
    s["log_history"] = [{k: v for k, v in e.items() if k not in _TIMED}
                        for e in s["log_history"]]
    return s


def same(a, b, where: str = "") -> None:
    """``a`` equals ``b`` exactly: nested dicts/lists/tuples, tensors by value (and
    shape and dtype), floats by value (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, b.shape)
        assert torch.equal(a, b), (where, (a.float() - b.float()).abs().max().item())
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)),
                                                          sorted(map(str, b)))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def outcome(trainer) -> dict:
    """What a finished run leaves: weights, optimizer, scheduler and trainer state."""
    return {"weights": weights(trainer), "optimizer": optimizer_state(trainer),
            "scheduler": scheduler_state(trainer), "state": trainer_state(trainer)}


def kind_param():
    return pytest.mark.parametrize("kind", KINDS)


class Scripted:
    """``compute_metrics`` returning the given ``accuracy`` values in turn (one per
    evaluation), so the best checkpoint is known in advance."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0

    def __call__(self, _pred):
        v = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return {"accuracy": v}
