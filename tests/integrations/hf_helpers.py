"""What the Accelerate and Trainer tests share: a fresh Accelerate process state per
test, and the tiny Llama and TrainingArguments the Trainer tests train."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate's state is a process-wide singleton: each test gets a fresh one.
    (autouse in the modules that import it.)"""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_llama():
    """A 2-layer Llama (hidden 16, vocab 64) and 16 samples of 8 tokens, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": i, "labels": i} for i in torch.randint(0, 64, (16, 8), generator=g)]
    return LlamaForCausalLM(cfg), data


def training_args(out, **kw):
    """TrainingArguments on CPU saving every 2 steps into ``out`` (``kw`` overrides)."""
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), save_strategy="steps", save_steps=2,
                per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[],
                disable_tqdm=True, logging_steps=1000)
    base.update(kw)
    return TrainingArguments(**base)


def accelerator(kind: str, project_dir=None, **kw):
    """A fresh ``accelerate.Accelerator`` (``kind="stock"``) or ``DckptAccelerator`` on
    CPU; with ``project_dir``, a ProjectConfiguration there (``auto``: automatic
    naming; ``total_limit``). dckpt-only keywords are dropped for stock."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from dckpt.integrations.accelerate import DckptAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    pc = {}
    auto, limit = kw.pop("auto", False), kw.pop("total_limit", None)
    if project_dir is not None:
        pc["project_config"] = ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=auto,
            total_limit=limit)
    if kind == "stock":
        kw.pop("async_save", None)
        return Accelerator(cpu=True, **pc, **kw)
    return DckptAccelerator(cpu=True, **pc, **kw)


def params(m) -> list[torch.Tensor]:
    """Copies of ``m``'s parameters."""
    return [p.detach().clone() for p in m.parameters()]


def weights_in(names) -> bool:
    """Whether a folder listing holds what ``from_pretrained`` reads the weights from:
    stock's ``model.safetensors``, or the index of a dckpt checkpoint's side files (the
    stock file name is never asserted of dckpt's checkpoints)."""
    return bool(set(names) & {"model.safetensors", "model.safetensors.index.json"})
