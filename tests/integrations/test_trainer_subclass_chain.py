"""Issue 51, defects 1 and 6: a Trainer subclass's save and load chains run with dckpt's
commit and load as their terminal steps. Each test runs the real classes (TRL's
SFTTrainer, peft's LoRA, hand-written subclasses of the stock Trainer as TRL writes
them) next to the stock class, on CPU with a 2-layer Llama."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from .hf_helpers import (fresh_accelerate_state, tiny_llama, training_args,  # noqa: E402,F401
                         weights_in)

BOTH = pytest.mark.parametrize("use_dckpt", [False, True], ids=["stock", "dckpt"])


def _compose(base: type, use_dckpt: bool, **kw) -> type:
    """``base`` itself (stock), or ``class T(DckptTrainerMixin, base)`` as the docs say."""
    if not use_dckpt:
        return base
    from dckpt.integrations.transformers import DckptTrainerMixin

    return type(f"Dckpt{base.__name__}", (DckptTrainerMixin, base), {})


def _names(folder) -> set[str]:
    return set(os.listdir(folder))


def _visible(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


# --------------------------------------------------------------- hand-written subclasses
def _stateful_base():
    """A subclass as TRL's GRPOTrainer writes one: its own state file written into the
    checkpoint after ``super()._save_checkpoint`` (through ``_get_output_dir``), a second
    before it, read back in ``_load_optimizer_and_scheduler`` / ``_load_from_checkpoint``."""
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class Stateful(Trainer):
        coef: float = 0.0
        loaded: dict

        def _folder(self, trial) -> str:
            return os.path.join(self._get_output_dir(trial=trial),
                                f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

        def _save_checkpoint(self, model, trial):
            self.coef = 10.0 * self.state.global_step
            folder = self._folder(trial)
            if self.args.should_save:  # before super(): as TRL's async distillation
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "rollout_state.json"), "w") as f:
                    json.dump({"prompt_index": self.state.global_step * 2}, f)
            super()._save_checkpoint(model, trial)
            if self.args.should_save:  # after super(): as TRL's GRPO entropy controller
                with open(os.path.join(folder, "entropy_ctrl_state.json"), "w") as f:
                    json.dump({"entropy_coef": self.coef}, f)

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            with open(os.path.join(resume_from_checkpoint, "rollout_state.json")) as f:
                self.loaded = dict(getattr(self, "loaded", {}), **json.load(f))

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            path = os.path.join(checkpoint, "entropy_ctrl_state.json")
            with open(path) as f:
                self.loaded = dict(getattr(self, "loaded", {}), **json.load(f))

    return Stateful


@BOTH
def test_a_subclass_state_files_commit_with_the_checkpoint_and_are_read_at_resume(
        tmp_path, use_dckpt):
    cls = _compose(_stateful_base(), use_dckpt)
    model, data = tiny_llama()
    cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=4)).train()
    for step in (2, 4):
        names = _names(tmp_path / f"checkpoint-{step}")
        assert {"entropy_ctrl_state.json", "rollout_state.json", "trainer_state.json"} <= names
        assert ("manifest.json" in names) == use_dckpt
    assert _visible(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=6))
    t.train(resume_from_checkpoint=True)
    assert t.loaded == {"entropy_coef": 40.0, "prompt_index": 8}


@BOTH
def test_a_save_override_runs_at_each_checkpoint_and_its_files_commit(tmp_path, use_dckpt):
    from transformers import Trainer

    seen: list[tuple[str, bool]] = []

    class OwnSave(Trainer):
        def _save(self, output_dir=None, state_dict=None):
            super()._save(output_dir, state_dict)
            final = os.path.join(self.args.output_dir, os.path.basename(output_dir))
            # under dckpt the folder written is hidden until committed: the final
            # name does not exist yet while the chain writes
            seen.append((output_dir, os.path.exists(final)))
            with open(os.path.join(output_dir, "own_save.txt"), "w") as f:
                f.write("x")

    cls = _compose(OwnSave, use_dckpt)
    model, data = tiny_llama()
    cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=4)).train()
    assert len(seen) == 2
    for step in (2, 4):
        names = _names(tmp_path / f"checkpoint-{step}")
        assert {"own_save.txt", "config.json"} <= names and weights_in(names)
    if use_dckpt:
        for path, final_existed in seen:
            assert not final_existed, path
            assert os.path.relpath(path, tmp_path).startswith("."), path


@BOTH
def test_a_subclass_writing_into_the_final_name_before_super_is_adopted(tmp_path, use_dckpt):
    """Defect 6: ``class Mine(DckptTrainer)`` whose ``_save_checkpoint`` writes into
    ``checkpoint-N`` (the final name) before ``super()``: not refused, and its file is
    in the committed checkpoint."""
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer

    class Early(DckptTrainer if use_dckpt else Trainer):
        def _save_checkpoint(self, model, trial):
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "early.json"), "w") as f:
                json.dump({"step": self.state.global_step}, f)
            super()._save_checkpoint(model, trial)

    model, data = tiny_llama()
    Early(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=4)).train()
    for step in (2, 4):
        names = _names(tmp_path / f"checkpoint-{step}")
        assert "early.json" in names and "trainer_state.json" in names
        assert ("manifest.json" in names) == use_dckpt
    if use_dckpt:
        from dckpt.integrations.common.place import kind

        assert kind(str(tmp_path / "checkpoint-4")) == "dckpt"


@BOTH
def test_sft_trainer_writes_its_model_card_and_model_folder(tmp_path, use_dckpt):
    """``class T(DckptTrainerMixin, trl.SFTTrainer)``: SFT's ``_save_checkpoint`` writes
    its model card, stock's ``save_model`` the model folder (config, weights, tokenizer)
    into the checkpoint, and the stateful callbacks' states are in trainer_state.json
    once, as stock."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    cls = _compose(trl.SFTTrainer, use_dckpt)
    model, data = tiny_llama()
    ds = Dataset.from_list([{"input_ids": d["input_ids"].tolist()} for d in data])
    args = trl.SFTConfig(output_dir=str(tmp_path), save_strategy="steps", save_steps=2,
                         max_steps=4, per_device_train_batch_size=2, use_cpu=True,
                         report_to=[], disable_tqdm=True)
    cls(model=model, args=args, train_dataset=ds, processing_class=_tokenizer()).train()
    assert (tmp_path / "README.md").is_file()
    names = _names(tmp_path / "checkpoint-4")
    assert {"config.json", "tokenizer.json", "trainer_state.json"} <= names and weights_in(names)
    assert ("manifest.json" in names) == use_dckpt
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["TrainerControl"]["args"]["should_save"] is True
    assert state["global_step"] == 4


def _tokenizer():
    """A 64-token word-level tokenizer for the tiny Llama (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(64)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
                                   pad_token="t0", eos_token="t1", unk_token="t0")


def _counter_callback():
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class Counter(TrainerCallback, ExportableState):
        def __init__(self) -> None:
            self.n = 0

        def on_step_end(self, args, state, control, **kw):
            self.n += 1

        def state(self) -> dict:
            return {"args": {}, "attributes": {"n": self.n}}

    return Counter


def test_stateful_callback_states_are_recorded_as_stock_does(tmp_path):
    """Two callbacks of one ExportableState class: stock appends their states to a list
    at each save; dckpt's chain must record exactly what stock records (not twice)."""
    from transformers import Trainer

    Counter = _counter_callback()
    got = {}
    for use_dckpt in (False, True):
        out = tmp_path / str(use_dckpt)
        cls = _compose(Trainer, use_dckpt)
        model, data = tiny_llama()
        cls(model=model, train_dataset=data, callbacks=[Counter(), Counter()],
            args=training_args(out, max_steps=4)).train()
        state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
        got[use_dckpt] = state["stateful_callbacks"]
    assert isinstance(got[False]["Counter"], list) and len(got[False]["Counter"]) > 2
    assert got[True] == got[False]


@BOTH
def test_best_model_checkpoint_names_the_final_folder(tmp_path, use_dckpt):
    from transformers import Trainer

    cls = _compose(Trainer, use_dckpt)
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, eval_dataset=data[:4],
            args=training_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2,
                               metric_for_best_model="loss", greater_is_better=False))
    t.train()
    best = t.state.best_model_checkpoint
    assert best is not None and os.path.dirname(os.path.abspath(best)) == str(tmp_path)
    assert os.path.basename(best) in ("checkpoint-2", "checkpoint-4")
    for step in (2, 4):
        state = json.loads((tmp_path / f"checkpoint-{step}" / "trainer_state.json").read_text())
        b = state["best_model_checkpoint"]
        assert b is not None and os.path.dirname(os.path.abspath(b)) == str(tmp_path), b
        assert not os.path.basename(b).startswith(".")


@BOTH
def test_the_push_reads_the_placed_checkpoint(tmp_path, use_dckpt):
    """``_push_from_checkpoint`` (stock: after trainer_state.json is written) is given
    the checkpoint's final name, once it holds the whole checkpoint."""
    from transformers import Trainer

    pushed: list[tuple[str, set]] = []

    class Pushing(Trainer):
        def _push_from_checkpoint(self, checkpoint_folder):
            pushed.append((checkpoint_folder, _names(checkpoint_folder)))

    cls = _compose(Pushing, use_dckpt)
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=2))
    t.args.push_to_hub = True  # set after construction: no Hub repository is created
    t.train()
    assert len(pushed) == 1
    folder, names = pushed[0]
    assert os.path.abspath(folder) == str(tmp_path / "checkpoint-2")
    assert "trainer_state.json" in names and weights_in(names)
    assert ("manifest.json" in names) == use_dckpt


def test_peft_lora_checkpoint_holds_the_adapter_files_as_stock(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer

    found = {}
    for name, cls in (("stock", Trainer), ("dckpt", DckptTrainer)):
        out = tmp_path / name
        model, data = tiny_llama()
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                               "v_proj"]))
        cls(model=model, train_dataset=data, args=training_args(out, max_steps=2)).train()
        found[name] = _names(out / "checkpoint-2")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= found["stock"]
    assert {"adapter_model.safetensors", "adapter_config.json",
            "manifest.json"} <= found["dckpt"]


def test_fsdp_sharded_internal_save_model_neither_gathers_nor_exports(tmp_path, monkeypatch):
    """Under FSDP with sharded state, the chain's ``save_model(_internal_call=True)``
    writes nothing (dckpt's shards hold the weights): no export, no gather, and a
    ``save_model`` override of the class after the mixin is not run there (documented);
    config.json is still written."""
    from transformers import Trainer

    from dckpt.integrations.transformers import export

    calls: list[str] = []
    monkeypatch.setattr(export, "sharded", lambda trainer: True)
    monkeypatch.setattr(export, "save_sharded_model", lambda t, out: calls.append(out))

    class Own(Trainer):
        def save_model(self, output_dir=None, _internal_call=False):
            calls.append(f"override {output_dir}")
            super().save_model(output_dir, _internal_call)

    cls = _compose(Own, True)
    model, data = tiny_llama()
    t = cls(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=2))
    t.train()
    names = _names(tmp_path / "checkpoint-2")
    assert {"manifest.json", "trainer_state.json", "config.json"} <= names
    assert "model.safetensors" not in names
    assert calls == []
    t.save_model(str(tmp_path / "final"))  # a user's call still exports
    assert calls == [str(tmp_path / "final")]


def test_a_dckpt_resume_never_runs_the_stock_model_load(tmp_path, monkeypatch):
    """dckpt's load is the chain's terminal step: stock ``_load_from_checkpoint``
    (which would read model.safetensors of the checkpoint's model folder) and stock
    ``_load_optimizer_and_scheduler`` are not run for a dckpt checkpoint."""
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer

    model, data = tiny_llama()
    DckptTrainer(model=model, train_dataset=data,
                 args=training_args(tmp_path, max_steps=2)).train()

    def refuse(*a, **k):
        raise AssertionError("stock load ran on a dckpt checkpoint")

    monkeypatch.setattr(Trainer, "_load_from_checkpoint", refuse)
    monkeypatch.setattr(Trainer, "_load_optimizer_and_scheduler", refuse)
    model, data = tiny_llama()
    t = DckptTrainer(model=model, train_dataset=data, args=training_args(tmp_path, max_steps=4))
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 4
