"""The Trainer's checkpoint and resume contract, as transformers' own tests pin it
(tests/trainer/test_trainer_checkpointing.py at the tested version, 5.24), checked with
``transformers.Trainer`` ("stock") and with ``DckptTrainer`` ("dckpt") alike: each test
runs once per kind and asserts what a user observes (weights, optimizer, scheduler,
``TrainerState`` after a resume equal to the uninterrupted run; which checkpoints exist;
errors and warnings). Stock's own file names (optimizer.pt, scheduler.pt,
rng_state.pth, model.safetensors) are asserted for stock only: dckpt stores those in its
shards. Written from the behaviours those tests pin, not from their code (issue 51).
Best model, rotation and callbacks: test_trainer_upstream_contract_callbacks.py."""
from __future__ import annotations

import logging
import math
import os
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from .hf_helpers import fresh_accelerate_state  # noqa: E402,F401 (autouse)
from .trainer_contract_helpers import (  # noqa: E402
    KINDS, STOCK_ONLY, checkpoints, make, outcome, same, trainer_state, weights)

pytestmark = pytest.mark.parametrize("kind", KINDS)


class _Messages(logging.Handler):
    """The messages transformers logs (its loggers do not propagate to the root)
    while installed, ``warning_once``'s memory cleared first."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        hf_logging.warning_once.cache_clear()
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _state_at(ckpt):
    from transformers import TrainerState

    return TrainerState.load_from_json(os.path.join(ckpt, "trainer_state.json"))


# ------------------------------------------------------------------ what a save writes
def test_a_checkpoint_is_written_every_save_steps_and_at_the_last_step(kind, tmp_path):
    make(kind, tmp_path, max_steps=7, save_steps=3).train()
    assert checkpoints(tmp_path) == [3, 6, 7]
    for step in (3, 6, 7):
        ckpt = tmp_path / f"checkpoint-{step}"
        assert _state_at(ckpt).global_step == step
        assert (ckpt / "config.json").is_file()
        if kind == "stock":
            for name in STOCK_ONLY:
                assert (ckpt / name).is_file(), name


def test_the_data_collators_tokenizer_is_saved_into_each_checkpoint(kind, tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, default_data_collator

    vocab = {f"w{i}": i for i in range(62)} | {"[UNK]": 62, "[PAD]": 63}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")
    tok.add_tokens(["<extra_a>", "<extra_b>"])

    class Collate:  # a collator carrying the tokenizer, no processing_class given
        tokenizer = tok

        def __call__(self, features):
            return default_data_collator(features)

    t = make(kind, tmp_path, max_steps=2, save_steps=2)
    t.data_collator = Collate()
    t.train()
    ckpt = tmp_path / "checkpoint-2"
    assert "tokenizer_config.json" in os.listdir(ckpt), sorted(os.listdir(ckpt))
    back = AutoTokenizer.from_pretrained(str(ckpt))
    assert len(back) == len(tok) == 66
    assert back("w3 <extra_b> w7")["input_ids"] == tok("w3 <extra_b> w7")["input_ids"]


# ------------------------------------------------------------------ resuming exactly
def test_resuming_mid_epoch_or_in_a_later_epoch_matches_the_uninterrupted_run(kind, tmp_path):
    kw = dict(max_steps=10, save_steps=3, per_device_train_batch_size=4)  # 4 steps an epoch
    full = make(kind, tmp_path, **kw)
    full.train()
    expected = outcome(full)
    for start in ("checkpoint-3", "checkpoint-6"):  # in epoch 1; in epoch 2
        t = make(kind, tmp_path, **kw)
        t.train(resume_from_checkpoint=str(tmp_path / start))
        same(expected, outcome(t), f"resumed from {start}")
    shutil.rmtree(tmp_path / "checkpoint-10")  # the newest is now checkpoint-9
    t = make(kind, tmp_path, **kw)
    t.train(resume_from_checkpoint=True)
    same(expected, outcome(t), "resumed from the newest")


def test_resuming_with_gradient_accumulation_matches_the_uninterrupted_run(kind, tmp_path):
    kw = dict(max_steps=6, save_steps=2, gradient_accumulation_steps=2)  # 4 steps an epoch
    full = make(kind, tmp_path, **kw)
    full.train()
    expected = outcome(full)
    for step in (2, 4):  # mid epoch; at the end of an epoch
        t = make(kind, tmp_path, **kw)
        t.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{step}"))
        same(expected, outcome(t), f"resumed from checkpoint-{step}")


def _freeze_embeddings(model):
    model.model.embed_tokens.weight.requires_grad_(False)


def test_resuming_with_frozen_parameters_matches_and_they_stay_frozen(kind, tmp_path):
    kw = dict(max_steps=6, save_steps=3)
    full = make(kind, tmp_path, prepare=_freeze_embeddings, **kw)
    full.train()
    expected = outcome(full)
    t = make(kind, tmp_path, prepare=_freeze_embeddings, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert not t.model.model.embed_tokens.weight.requires_grad
    same(expected, outcome(t))


def _freeze_norms(model):
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)


def test_resuming_an_optimizer_whose_no_decay_group_is_empty_matches(kind, tmp_path):
    """The Trainer always builds a no-decay group; with every norm frozen (or a LoRA
    model) it is empty."""
    kw = dict(max_steps=6, save_steps=3)
    full = make(kind, tmp_path, prepare=_freeze_norms, **kw)
    full.train()
    assert [len(g["params"]) for g in full.optimizer.param_groups][-1] == 0
    expected = outcome(full)
    t = make(kind, tmp_path, prepare=_freeze_norms, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    same(expected, outcome(t))


def test_resuming_an_optimizer_without_per_parameter_state_matches(kind, tmp_path):
    """Plain SGD keeps no tensors per parameter: its state is the groups' settings
    (the learning rate the scheduler last set), which a resume restores as well."""
    kw = dict(max_steps=6, save_steps=3, optim="sgd")
    full = make(kind, tmp_path, **kw)
    full.train()
    expected = outcome(full)
    lrs: list = []

    class FirstStepLr(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **k):
            if not lrs:
                lrs.extend(g["lr"] for g in optimizer.param_groups)

    t = make(kind, tmp_path, callbacks=[FirstStepLr()], **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert lrs == [full.lr_scheduler.base_lrs[0] * 3 / 6] * len(lrs)  # linear decay, step 3 of 6
    same(expected, outcome(t))


def _two_lora_adapters(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                     task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg, "first")
    model.add_adapter("second", cfg)
    return model


def test_resuming_a_model_with_two_lora_adapters_matches(kind, tmp_path):
    pytest.importorskip("peft")
    kw = dict(max_steps=6, save_steps=3)
    full = make(kind, tmp_path, prepare=_two_lora_adapters, **kw)
    full.train()
    expected = outcome(full)
    t = make(kind, tmp_path, prepare=_two_lora_adapters, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    same(expected, outcome(t))


# ------------------------------------------------------------------ resume settings
def test_a_resume_with_another_batch_size_trains_with_the_new_one(kind, tmp_path):
    make(kind, tmp_path, max_steps=2, save_steps=1, per_device_train_batch_size=2).train()
    assert _state_at(tmp_path / "checkpoint-1").train_batch_size == 2
    t = make(kind, tmp_path, max_steps=4, save_steps=1, per_device_train_batch_size=4)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert t._train_batch_size == 4
    assert t.state.global_step == 4


def test_auto_find_batch_size_resumes_with_the_batch_size_found_before(kind, tmp_path):

    class OutOfMemoryAbove2(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if state.train_batch_size > 2:
                raise RuntimeError("CUDA out of memory. (simulated)")

    first = make(kind, tmp_path, max_steps=2, save_steps=1, per_device_train_batch_size=8,
                 auto_find_batch_size=True, callbacks=[OutOfMemoryAbove2()])
    first.train()
    assert first._train_batch_size == 2  # 8, 4: "out of memory"; 2 trains
    t = make(kind, tmp_path, max_steps=3, save_steps=1, per_device_train_batch_size=8,
             auto_find_batch_size=True)
    assert t._train_batch_size == 8
    t.train(resume_from_checkpoint=True)
    assert t._train_batch_size == 2
    assert t.state.global_step == 3


def test_resume_false_trains_from_scratch_over_existing_checkpoints(kind, tmp_path):
    kw = dict(max_steps=4, save_steps=2)
    first = make(kind, tmp_path, **kw)
    first.train()
    expected = outcome(first)
    again = make(kind, tmp_path, **kw)
    again.train(resume_from_checkpoint=False)
    same(expected, outcome(again))
    assert checkpoints(tmp_path) == [2, 4]
    assert _state_at(tmp_path / "checkpoint-4").global_step == 4


def test_resuming_from_a_missing_folder_or_an_empty_output_dir_raises(kind, tmp_path):
    make(kind, tmp_path / "a", max_steps=2, save_steps=2).train()
    t = make(kind, tmp_path / "a", max_steps=4, save_steps=2)
    with pytest.raises(Exception, match="Can't find a valid checkpoint at"):
        t.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2-bogus"))
    t = make(kind, tmp_path / "empty", max_steps=2, save_steps=2)
    with pytest.raises(Exception, match="No valid checkpoint found in output directory"):
        t.train(resume_from_checkpoint=True)


def test_a_resume_warns_of_arguments_that_differ_from_the_checkpoints(kind, tmp_path):
    make(kind, tmp_path, max_steps=4, save_steps=2, eval_steps=2, logging_steps=2).train()
    t = make(kind, tmp_path, max_steps=6, save_steps=3, eval_steps=3, logging_steps=3,
             per_device_train_batch_size=4)
    with _Messages() as log:
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for line in ("save_steps: 3 (from args) != 2 (from trainer_state.json)",
                 "eval_steps: 3 (from args) != 2 (from trainer_state.json)",
                 "logging_steps: 3 (from args) != 2 (from trainer_state.json)",
                 "per_device_train_batch_size: 4 (from args) != 2 (from trainer_state.json)"):
        assert line in log.text, log.text


# ------------------------------------------------------------------ plain nn.Modules
class _Classifier(nn.Module):
    """Not a PreTrainedModel: a linear classifier returning a dict."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 2)

    def forward(self, input_ids=None, labels=None):
        logits = self.linear(input_ids)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _classifier_data(n):
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": x[i], "labels": y[i]} for i in range(n)]


def test_a_resume_into_a_new_output_dir_finishes_the_epoch_and_saves_its_last_step(
        kind, tmp_path):
    data = _classifier_data(26)
    torch.manual_seed(0)
    model = _Classifier()
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, save_steps=1)
    make(kind, tmp_path / "first", model=model, data=data, max_steps=2, **kw).train()
    assert (tmp_path / "first" / "checkpoint-2").is_dir()
    t = make(kind, tmp_path / "second", model=model, data=data, num_train_epochs=1, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    per_epoch = math.ceil(26 / (2 * 3))
    assert t.state.global_step == per_epoch == 5
    last = tmp_path / "second" / f"checkpoint-{per_epoch}"
    assert last.is_dir() and _state_at(last).global_step == per_epoch
    if kind == "stock":
        assert (last / "model.safetensors").is_file()


class _OrderRecorder(nn.Module):
    """Records, in a buffer that grows each step, the index of every sample it sees;
    its ``load_state_dict`` resizes the buffer to the saved one (as the user's model
    in upstream's batch-order test does)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)
        self.register_buffer("seen", torch.zeros(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True, **kw):
        saved = state_dict.get("seen")
        if saved is not None and saved.shape != self.seen.shape:
            self.seen = saved.clone()
        return super().load_state_dict(state_dict, strict, **kw)

    def forward(self, input_ids, labels=None):
        self.seen = torch.cat([self.seen, input_ids[:, 0].long()])
        logits = self.fc(input_ids)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_a_resume_sees_the_samples_in_the_uninterrupted_runs_order(kind, tmp_path):
    g = torch.Generator().manual_seed(7)
    x = torch.rand(8, 4, generator=g)
    x[:, 0] = torch.arange(8)  # each sample carries its index
    y = torch.randint(0, 3, (8,), generator=g)
    data = [{"input_ids": x[i], "labels": y[i]} for i in range(8)]
    kw = dict(per_device_train_batch_size=2, num_train_epochs=2, save_steps=1, learning_rate=0.1)

    torch.manual_seed(0)
    full = make(kind, tmp_path / "full", model=_OrderRecorder(), data=data, **kw)
    full.train()
    order = full.model.seen.clone()
    assert sorted(order.tolist()) == sorted(list(range(8)) * 2)

    torch.manual_seed(0)
    t = make(kind, tmp_path / "resumed", model=_OrderRecorder(), data=data, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-5"))  # epoch 2
    same(order, t.model.seen)
    same(weights(full), weights(t))
    if kind == "stock":
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "resumed" / "checkpoint-8" / "model.safetensors"))
        same(order, saved["seen"])


# ------------------------------------------------------------------ JIT and model-only
def test_a_jit_checkpoint_request_saves_a_complete_checkpoint_that_resumes_exactly(
        kind, tmp_path):
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback
    from transformers.trainer_utils import get_last_checkpoint

    kw = dict(max_steps=6, save_steps=100, enable_jit_checkpoint=True)
    full = make(kind, tmp_path / "full", **kw)
    full.train()
    expected = outcome(full)

    class RequestAt3(TrainerCallback):  # what SIGTERM's timer does
        def on_step_end(self, args, state, control, **k):
            if state.global_step == 3:
                jit = [c for c in self.handler.callbacks if isinstance(c, JITCheckpointCallback)]
                jit[0].jit_manager.is_checkpoint_requested = True

    req = RequestAt3()
    t = make(kind, tmp_path / "cut", callbacks=[req], **kw)
    req.handler = t.callback_handler
    t.train()
    assert checkpoints(tmp_path / "cut") == [3]
    ckpt = tmp_path / "cut" / "checkpoint-3"
    assert not (ckpt / "checkpoint-is-incomplete.txt").exists()
    assert get_last_checkpoint(str(tmp_path / "cut")) == str(ckpt)
    assert _state_at(ckpt).global_step == 3

    again = make(kind, tmp_path / "cut", **kw)
    again.train(resume_from_checkpoint=True)
    same(expected, outcome(again))


def test_save_only_model_checkpoints_hold_the_model_and_a_resume_starts_from_it(
        kind, tmp_path):

    saved: dict = {}
    begun: dict = {}

    class AtSave(TrainerCallback):
        def on_save(self, args, state, control, model=None, **k):
            saved[state.global_step] = {n: v.detach().clone()
                                        for n, v in model.state_dict().items()}

    class AtBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **k):
            begun["step"] = state.global_step
            begun["weights"] = {n: v.detach().clone() for n, v in model.state_dict().items()}

    kw = dict(max_steps=4, save_steps=2, save_only_model=True)
    make(kind, tmp_path, callbacks=[AtSave()], **kw).train()
    assert checkpoints(tmp_path) == [2, 4]
    ckpt = tmp_path / "checkpoint-2"
    assert _state_at(ckpt).global_step == 2 and (ckpt / "config.json").is_file()
    if kind == "stock":
        assert (ckpt / "model.safetensors").is_file()
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert not (ckpt / name).exists(), name

    t = make(kind, tmp_path, callbacks=[AtBegin()], **kw)
    t.train(resume_from_checkpoint=str(ckpt))
    assert begun["step"] == 2
    same(saved[2], begun["weights"])
    assert t.state.global_step == 4
    assert trainer_state(t)["global_step"] == 4
