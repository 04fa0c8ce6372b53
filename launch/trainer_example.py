"""dckpt with the transformers Trainer, on CPU: train at 2 ranks, resume at 3.

    torchrun --standalone --nproc-per-node=2 launch/trainer_example.py --out /tmp/hf --steps 6
    torchrun --standalone --nproc-per-node=3 launch/trainer_example.py --out /tmp/hf --steps 10
    python launch/trainer_example.py --out /tmp/hf --steps 12 --final /tmp/hf-final

The one change from a stock script is the import. A tiny Llama (random weights, no
download) on synthetic tokens; the Trainer wraps it in DDP on gloo (CPU: ``use_cpu=True``).
Each save is one atomic dckpt commit at OUT/checkpoint-<step>: a killed save leaves no
folder, so ``resume_from_checkpoint=True`` (and ``get_last_checkpoint``) only ever see
complete checkpoints. The second run resumes the newest committed one at 3 ranks (model,
optimizer, scheduler, step; rank 2 gets an RNG stream derived from rank 0's); the
third, in one process, writes the final model with ``save_model`` for
``from_pretrained``.
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from dckpt.integrations.transformers import DckptTrainer as Trainer

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
p.add_argument("--final", default=None, help="save_model() here after training")
a = p.parse_args()

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
model = LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (256, 16), generator=g)]
args = TrainingArguments(output_dir=a.out, max_steps=a.steps, save_strategy="steps",
                         save_steps=a.every, save_total_limit=2, per_device_train_batch_size=2,
                         learning_rate=1e-3, lr_scheduler_type="linear", use_cpu=True,
                         logging_steps=a.every, report_to=[], disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
resume = os.path.isdir(a.out) and get_last_checkpoint(a.out) is not None
trainer.train(resume_from_checkpoint=True if resume else None)
if a.final:
    trainer.save_model(a.final)
if trainer.is_world_process_zero():
    print(f"done at step {trainer.state.global_step}; checkpoints: "
          f"{sorted(n for n in os.listdir(a.out) if n.startswith('checkpoint-'))}")
