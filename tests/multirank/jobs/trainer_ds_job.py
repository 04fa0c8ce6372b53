"""The transformers Trainer under DeepSpeed ZeRO (CPU, gloo) with stock's Trainer or
DckptTrainer: ``python -m torch.distributed.run ... trainer_ds_job.py IMPL OUT STAGE
[resume] [only] [local] [kill4]`` (``only``: ``save_only_model=True``; ``local``: the
fast tier in OUT-local/<rank> (a node per rank); ``kill4``: every rank SIGKILLed once
checkpoint-4 is committed on the fast tier, before its durable copy). A tiny Llama, 6 steps, a checkpoint every 2; prints ``DONE <rank> <losses>``.
At step 4 the full fp32 masters are written to OUT/full4.pt (rank 0); a resumed run
compares the engine's full masters with them at the start of training (``LOADED ok``)."""
from __future__ import annotations

import importlib
import os
import sys

import torch

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT op
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

impl, out, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
resume = "resume" in sys.argv[4:]
only = "only" in sys.argv[4:]
local = "local" in sys.argv[4:]
kill4 = "kill4" in sys.argv[4:]
if impl == "dckpt":
    from dckpt.integrations.transformers import DckptTrainer

    class Trainer(DckptTrainer):  # noqa: F811
        def _save_checkpoint(self, model, trial):
            if kill4 and self.state.global_step == 4:
                self._dckpt.finish()  # the earlier saves' commits and copies first
                self._dckpt_tier.drain()
                os.environ["DCKPT_FAULT"] = "committed:*:kill"
            super()._save_checkpoint(model, trial)


class Data(Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, 61, (9,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def full(model) -> dict:
    return {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}


class Probe(TrainerCallback):
    def __init__(self) -> None:
        self.trainer = None

    def on_train_begin(self, args, state, control, **kw):
        if resume and os.path.exists(os.path.join(out, "full4.pt")):
            want = torch.load(os.path.join(out, "full4.pt"))
            got = full(self.trainer.model_wrapped.module)
            bad = [n for n in want if not torch.equal(want[n], got[n])]
            os.write(1, (f"LOADED {'ok' if not bad else 'differ ' + str(bad[:4])} "
                         f"at step {state.global_step}\n").encode())  # one write per line

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 4 and not resume:
            f = full(self.trainer.model_wrapped.module)
            if int(os.environ["RANK"]) == 0:
                torch.save(f, os.path.join(out, "full4.pt"))


ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "train_batch_size": "auto", "zero_optimization": {"stage": stage},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=6,
                         save_steps=2, deepspeed=ds, report_to=[], use_cpu=True,
                         logging_steps=1, save_total_limit=2, save_only_model=only)
conf = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=37, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1)
torch.manual_seed(0)
probe = Probe()
extra = ({"local_root": os.path.join(out + "-local", os.environ["LOCAL_RANK"])}
         if local else {})
trainer = Trainer(model=LlamaForCausalLM(conf), args=args, train_dataset=Data(),
                  callbacks=[probe], **extra)
probe.trainer = trainer
try:
    trainer.train(resume_from_checkpoint=True if resume else None)
except Exception as e:  # one line, whole: the test reads each rank's error
    os.write(1, f"FAILED {os.environ['RANK']} {type(e).__name__}: {e}\n".encode())
    os._exit(3)
losses = [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h]
os.write(1, f"DONE {os.environ['RANK']} {losses}\n".encode())
sys.stdout.flush()
os._exit(0)  # no interpreter teardown (gloo's threads abort it now and then)
