"""A tiny Llama (2 layers, hidden 16) trained by the real transformers Trainer on CPU
ranks (torchrun, gloo: DDP or FSDP2), with dckpt's DckptTrainer or the stock Trainer.

    [torchrun --nproc-per-node N] trainer_job.py --impl dckpt|stock --out DIR
        --steps S [--every E] [--limit L] [--resume [PATH]] [--kill-at STEP] [--fsdp]
        [--async-save] [--save-model DIR] [--local-root DIR] [--losses [--stop-at S]]

Saves every E steps to DIR/checkpoint-<step>. After each save, rank r writes
DIR/../refs/save-<step>-r<r>.pt: the full model and optimizer state, the scheduler's
state, the global step and the torch RNG state the save captured. ``--resume``:
train(resume_from_checkpoint=True or PATH); once the RNG is restored, the same record as
refs/resumed-<world>-r<r>.pt and a line "RESUMED step=<global_step>". ``--kill-at S``:
every rank is SIGKILLed in the save at step S, before it is complete: dckpt before its
commit (the fault point "commit"), stock after the model is written (in
_save_optimizer_and_scheduler). ``--fsdp``: FSDP2 through the CPU shim (Accelerate
runs FSDP only on accelerators; as accelerate_job.py), else DDP (gloo).
``--async-save``: DckptTrainer(async_save=True); a save's record is then taken while
its commit may still run (the state recorded is the snapshot's: the optimizer's next
step waits for the copy). ``--save-model DIR``: trainer.save_model(DIR) after training,
and the full model's state then as refs/final-r<r>.pt. ``--local-root DIR``: the fast
tier (``--kill-at`` then kills every rank after its local commit). ``--losses``: the
model with attention_dropout=0.1, and rank 0 prints every step's loss as "LOSS <step>
<repr>"; ``--stop-at S`` ends training after step S (and its save).
``--kill-in-export S``: every rank SIGKILLed in the background export of checkpoint-S's
model folder (its files written, before the index). ``--tokenizer``: a word-level
tokenizer as the processing class (saved into each checkpoint).
"""
from __future__ import annotations

import argparse
import os
import signal

import torch

p = argparse.ArgumentParser()
p.add_argument("--impl", choices=["dckpt", "stock"], required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
p.add_argument("--limit", type=int, default=None)
p.add_argument("--resume", nargs="?", const=True, default=None)
p.add_argument("--kill-at", type=int, default=None)
p.add_argument("--fsdp", action="store_true")
p.add_argument("--async-save", action="store_true")
p.add_argument("--save-model", default=None)
p.add_argument("--local-root", default=None)
p.add_argument("--losses", action="store_true")
p.add_argument("--stop-at", type=int, default=None)
p.add_argument("--kill-in-export", type=int, default=None)
p.add_argument("--tokenizer", action="store_true")
a = p.parse_args()

from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
refs = os.path.join(os.path.dirname(os.path.abspath(a.out)), "refs")
os.makedirs(refs, exist_ok=True)

if a.impl == "dckpt":
    from dckpt.integrations.transformers import DckptTrainer as Base
else:
    Base = Trainer


def full_state(t) -> dict:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         get_optimizer_state_dict)

    o = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    msd = get_model_state_dict(t.model, options=o)
    osd = get_optimizer_state_dict(t.model, t.optimizer.optimizer, options=o)
    return {"model": {k: v.detach().clone() for k, v in msd.items()},
            "optim": {k: (v.detach().clone() if torch.is_tensor(v) else v)
                      for k, v in osd.items()},
            "sched": {k: v for k, v in t.lr_scheduler.state_dict().items()
                      if k in ("last_epoch", "_step_count", "_last_lr", "base_lrs")},
            "step": t.state.global_step}


class Job(Base):
    def _save_checkpoint(self, model, trial):
        if a.kill_at == self.state.global_step and a.impl == "dckpt":
            # the fast tier: every rank killed once its local commit is written (its
            # durable copy not begun); else rank 0 before the commit
            self._dckpt.finish()  # an earlier async save's commit reads the fault too
            if a.local_root:  # the earlier copies first: "committed" is their point too
                self._dckpt_tier.drain()
            os.environ["DCKPT_FAULT"] = "committed:*:kill" if a.local_root else "commit:0:kill"
        if a.kill_in_export == self.state.global_step and a.impl == "dckpt":
            # every rank killed in the model folder's background export: its own files
            # written, before rank 0's index; the earlier save's export must be done
            # first (its thread reads the fault too: killed there, this save never runs)
            self._dckpt.finish()  # an async save starts its export once placed
            self._dckpt_export.join()
            os.environ["DCKPT_FAULT"] = "export:*:kill"
        rng = torch.get_rng_state().clone()
        super()._save_checkpoint(model, trial)
        torch.save({**full_state(self), "rng": rng},
                   os.path.join(refs, f"save-{self.state.global_step}-r{rank}.pt"))

    def _save_optimizer_and_scheduler(self, output_dir):
        if a.kill_at == self.state.global_step and a.impl == "stock":
            os.kill(os.getpid(), signal.SIGKILL)  # stock: the model is written
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        torch.save({**full_state(self), "rng": torch.get_rng_state().clone()},
                   os.path.join(refs, f"resumed-{world}-r{rank}.pt"))
        print(f"RESUMED step={self.state.global_step} from={checkpoint}", flush=True)


torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                  attention_dropout=0.1 if a.losses else 0.0)
model = LlamaForCausalLM(cfg)
g = torch.Generator().manual_seed(1)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (48, 8), generator=g)]
args = TrainingArguments(output_dir=a.out, max_steps=a.steps, save_strategy="steps",
                         save_steps=a.every, save_total_limit=a.limit,
                         logging_steps=1 if a.losses else 1000,
                         per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True,
                         report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=7,
                         lr_scheduler_type="linear", warmup_steps=1)
class Losses(TrainerCallback):
    """``--losses``: rank 0 prints each step's logged loss (repr: bitwise)."""

    def on_log(self, args, state, control, logs=None, **kw):
        if rank == 0 and logs and "loss" in logs:
            print(f"LOSS {state.global_step} {logs['loss']!r}", flush=True)

    def on_step_end(self, args, state, control, **kw):
        if a.stop_at == state.global_step:  # a run cut short (its save still happens)
            control.should_training_stop = True


tokenizer = None
if a.tokenizer:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
trainer = Job(model=model, args=args, train_dataset=data, processing_class=tokenizer,
              callbacks=[Losses()] if a.losses else None,
              **({"async_save": True} if a.async_save else {}),
              **({"local_root": a.local_root} if a.local_root else {}))
if a.fsdp:  # the CPU shim (as accelerate_job.py): Accelerate runs FSDP only on accelerators
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            state_dict_type="SHARDED_STATE_DICT")
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    trainer.is_fsdp_enabled = True
trainer.train(resume_from_checkpoint=a.resume)
if a.save_model:
    trainer.save_model(a.save_model)
    torch.save(full_state(trainer)["model"], os.path.join(refs, f"final-r{rank}.pt"))
print(f"DONE step={trainer.state.global_step} fsdp={trainer.is_fsdp_enabled} "
      f"model={type(trainer.model).__name__}", flush=True)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
# skip the interpreter's teardown: gloo's threads racing it abort the process now and
# then ("terminate called without an active exception"), which is no part of this test
os._exit(0)
