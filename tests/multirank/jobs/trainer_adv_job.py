"""Adversarial DckptTrainer job (tests/multirank/test_trainer_adversarial.py): a tiny
Llama trained by the real transformers Trainer on gloo CPU ranks (torchrun, DDP).

    [torchrun --nproc-per-node N] trainer_adv_job.py --out DIR --steps S [--every E]
        [--limit L] [--resume [PATH]] [--fault-at STEP --fault SPEC] [--async-save]
        [--model-only-rank R] [--compression-rank R] [--raise-at STEP --raise-rank R]

``--fault SPEC`` arms DCKPT_FAULT=SPEC in the save at step STEP. ``--model-only-rank R``:
rank R alone has save_only_model=True. ``--compression-rank R``: rank R alone
compresses (zstd). ``--raise-at S --raise-rank R``: rank R raises RuntimeError at the
start of step S. Prints "RESUMED step=<n> from=<path>" once the RNG is restored and
"DONE step=<n>" at the end.
"""
from __future__ import annotations

import argparse
import os

import torch

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
p.add_argument("--limit", type=int, default=None)
p.add_argument("--resume", nargs="?", const=True, default=None)
p.add_argument("--fault-at", type=int, default=None)
p.add_argument("--fault", default=None)
p.add_argument("--async-save", action="store_true")
p.add_argument("--model-only-rank", type=int, default=None)
p.add_argument("--compression-rank", type=int, default=None)
p.add_argument("--raise-at", type=int, default=None)
p.add_argument("--raise-rank", type=int, default=0)
a = p.parse_args()

from transformers import (LlamaConfig, LlamaForCausalLM, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from dckpt.integrations.transformers import DckptTrainer  # noqa: E402

rank = int(os.environ.get("RANK", "0"))


class Job(DckptTrainer):
    def _save_checkpoint(self, model, trial):
        armed = a.fault_at == self.state.global_step and a.fault
        if armed:  # the earlier async save first: its background commit reads it too
            self._dckpt.finish()
            os.environ["DCKPT_FAULT"] = a.fault
        super()._save_checkpoint(model, trial)
        if armed:  # this save's background part reads it too
            self._dckpt.finish()
        os.environ.pop("DCKPT_FAULT", None)
        print(f"SAVED step={self.state.global_step} rank={rank}", flush=True)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        print(f"RESUMED step={self.state.global_step} from={checkpoint}", flush=True)


class Raise(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        if a.raise_at is not None and state.global_step == a.raise_at and rank == a.raise_rank:
            raise RuntimeError(f"rank {rank} fails at step {state.global_step}")


torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
model = LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (48, 8), generator=g)]
args = TrainingArguments(output_dir=a.out, max_steps=a.steps, save_strategy="steps",
                         save_steps=a.every, save_total_limit=a.limit, logging_steps=1000,
                         per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True,
                         report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=7,
                         save_only_model=(a.model_only_rank == rank))
kw = {}
if a.async_save:
    kw["async_save"] = True
if a.compression_rank == rank:
    kw["compression"] = "zstd"
trainer = Job(model=model, args=args, train_dataset=data, callbacks=[Raise()], **kw)
trainer.train(resume_from_checkpoint=a.resume)
print(f"DONE step={trainer.state.global_step} rank={rank}", flush=True)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
os._exit(0)
