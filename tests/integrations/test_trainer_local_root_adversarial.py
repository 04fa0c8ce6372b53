"""Adversarial review of DckptTrainer's fast tier (``local_root``), one process, the
real transformers Trainer (a tiny Llama on CPU). Each test pins a defect the review
proved on 67985e5 (it failed there), fixed since."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from .test_trainer_adversarial import _args, _tiny, ckpts  # noqa: E402
from .test_trainer_local_root import make  # noqa: E402


def _slot_of(local, name: str) -> str:
    """The fast-tier slot (under ``local``) whose rank-0 view records ``name``."""
    for d in os.listdir(local):
        view = os.path.join(local, d, "manifest-00000.json")
        if os.path.isfile(view):
            with open(view, encoding="utf-8") as f:
                if json.load(f)["meta"]["owner"].endswith("/" + name):
                    return os.path.join(local, d)
    raise AssertionError(f"no slot of {name} in {os.listdir(local)}")


def _flip(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_fast_tier_commit_falls_back_to_its_intact_durable_copy(tmp_path):
    out, local = tmp_path / "out", tmp_path / "local"
    make(out, local, max_steps=4).train()  # both copies land: checkpoint-2, checkpoint-4
    assert ckpts(out) == ["checkpoint-2", "checkpoint-4"]
    slot = _slot_of(local, "checkpoint-4")
    _flip(next(os.path.join(slot, n) for n in os.listdir(slot) if n.endswith(".safetensors")))
    seen: dict = {}
    t = make(out, local, seen, max_steps=6)
    t.train(resume_from_checkpoint=True)  # IntegrityError today, from the slot's data file
    assert seen["step"] == 4  # out/checkpoint-4 is intact and verifies


def test_load_best_model_at_end_loads_a_best_held_only_in_the_fast_tier(tmp_path,
                                                                        monkeypatch):
    from transformers import TrainerCallback

    from dckpt.integrations.transformers import DckptTrainer

    snap: dict = {}

    class Snap(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kw):
            snap[state.global_step] = {k: v.detach().clone()
                                       for k, v in model.state_dict().items()}

    calls = {"n": 0}

    def metrics(_):  # the first evaluation (step 2) is the best
        calls["n"] += 1
        return {"score": 1.0 if calls["n"] == 1 else 0.0}

    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")  # the durable store is down
    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, eval_dataset=data[:4],
                     local_root=str(tmp_path / "local"), compute_metrics=metrics,
                     callbacks=[Snap()],
                     args=_args(tmp_path / "out", max_steps=6, eval_strategy="steps",
                                eval_steps=2, save_total_limit=2, load_best_model_at_end=True,
                                metric_for_best_model="score", greater_is_better=True))
    t.train()
    assert os.path.basename(t.state.best_model_checkpoint) == "checkpoint-2"
    got = t.model.state_dict()
    assert all(torch.equal(got[k], snap[2][k]) for k in got), "the best model was not loaded"


def test_jit_save_with_local_root_whose_copy_never_landed_is_passed_over(tmp_path,
                                                                          monkeypatch):
    from transformers.trainer_jit_checkpoint import CheckpointManager
    from transformers.trainer_utils import get_last_checkpoint

    from dckpt.integrations.transformers import DckptTrainer

    out = tmp_path / "out"
    model, data = _tiny()
    t = DckptTrainer(model=model, train_dataset=data, local_root=str(tmp_path / "local"),
                     args=_args(out, max_steps=2))
    t.train()  # checkpoint-2 copied
    # SIGTERM at step 3: transformers' JIT save (sentinel folder, _save_checkpoint, sentinel
    # removed); its copy is cut short (the job is SIGKILLed after the grace period)
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")
    t.state.global_step = 3
    CheckpointManager(t).execute_jit_checkpoint()
    t._dckpt_tier.drain()
    monkeypatch.delenv("DCKPT_FAULT")
    assert os.listdir(out / "checkpoint-3") == []  # what transformers left: an empty folder
    last = get_last_checkpoint(str(out))  # HF's example scripts
    assert last == str(out / "checkpoint-3")
    # the restart runs on another node: its local_root does not hold the JIT commit
    shutil.rmtree(tmp_path / "local")
    seen: dict = {}
    t = make(out, tmp_path / "local2", seen, max_steps=4)
    t.train(resume_from_checkpoint=last)  # ValueError: Can't find a valid checkpoint
    assert seen["step"] == 2
