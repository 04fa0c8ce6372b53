"""Every Trainer checkpoint is a model folder (one process): ``from_pretrained`` of
``checkpoint-N`` gives the model at step N, tied weights tied, next to the stock Trainer
in the same test; the tokenizer loads; a LoRA run's checkpoint loads with
``PeftModel.from_pretrained``; the model's bytes are written once (the checkpoint's size
with the model folder on is its size off plus the index and small JSON files);
``dckpt verify`` passes; ``save_total_limit`` removes whole folders; the switch."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from .hf_helpers import fresh_accelerate_state, tiny_llama, training_args  # noqa: E402,F401

BOTH = pytest.mark.parametrize("use_dckpt", [False, True], ids=["stock", "dckpt"])


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]")


class _Snap:
    """A callback keeping the model's weights at every save (what checkpoint-N holds)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def callback(self):
        from transformers import TrainerCallback

        snap = self

        class Snap(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kw):
                if state.global_step % args.save_steps == 0:
                    snap.at[state.global_step] = {k: v.detach().clone()
                                                  for k, v in model.state_dict().items()}
        return Snap()


def _trainer(use_dckpt: bool, out, model, data, *, tokenizer=None, cbs=(), **kw):
    from transformers import Trainer

    from dckpt.integrations.transformers import DckptTrainer

    dk = {k: kw.pop(k) for k in ("model_folder", "async_save", "compression") if k in kw}
    cls = DckptTrainer if use_dckpt else Trainer
    return cls(model=model, args=training_args(out, **kw), train_dataset=data,
               processing_class=tokenizer, callbacks=list(cbs), **(dk if use_dckpt else {}))


def _size(folder: str, skip=()) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, n)) and n not in skip)


@BOTH
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_checkpoint_loads_with_from_pretrained(tmp_path, use_dckpt, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, data = tiny_llama()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    snap = _Snap()
    t = _trainer(use_dckpt, tmp_path, model, data, tokenizer=_tokenizer(),
                 cbs=[snap.callback()], max_steps=4)
    t.train()
    for step in (2, 4):
        ck = tmp_path / f"checkpoint-{step}"
        got = AutoModelForCausalLM.from_pretrained(str(ck))
        sd = got.state_dict()
        for k, v in snap.at[step].items():
            assert torch.equal(sd[k], v), (step, k)
        if tied:
            assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
        tok = AutoTokenizer.from_pretrained(str(ck))
        assert tok("w3 w5")["input_ids"] == [3, 5]
    if use_dckpt:
        from dckpt.catalog.verify import verify_checkpoint

        for step in (2, 4):
            assert verify_checkpoint(str(tmp_path / f"checkpoint-{step}")).ok


def test_model_bytes_are_written_once(tmp_path):
    """The checkpoint with the model folder on is the same size as with it off, but for
    the index and the small JSON files save_pretrained writes."""
    small = {"model.safetensors.index.json", "config.json", "generation_config.json"}
    sizes = {}
    for on in (True, False):
        model, data = tiny_llama()
        out = tmp_path / str(on)
        _trainer(True, out, model, data, model_folder=on, max_steps=2).train()
        ck = str(out / "checkpoint-2")
        names = set(os.listdir(ck))
        assert ("model.safetensors.index.json" in names) == on
        assert "model.safetensors" not in names  # never the stock copy
        sizes[on] = _size(ck, skip=small | {"trainer_state.json", "training_args.json"})
        assert any(n.startswith("model-") for n in names) == on
    # data files + side files (on) == data files (off): the same tensors, the same bytes
    # but for one more shard header
    assert abs(sizes[True] - sizes[False]) < 16 * 1024, sizes


def test_model_folder_off_writes_no_weights_and_still_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    model, data = tiny_llama()
    _trainer(True, tmp_path, model, data, model_folder=False, max_steps=2).train()
    ck = tmp_path / "checkpoint-2"
    assert (ck / "config.json").exists()
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(str(ck))
    model, data = tiny_llama()
    t = _trainer(True, tmp_path, model, data, model_folder=False, max_steps=4)
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 4


def test_model_folder_switch_is_checked(tmp_path):
    from dckpt.errors import CheckpointError

    model, data = tiny_llama()
    with pytest.raises(CheckpointError, match="model_folder"):
        _trainer(True, tmp_path, model, data, model_folder="yes", max_steps=2)


@BOTH
def test_lora_checkpoint_loads_with_peft(tmp_path, use_dckpt):
    peft = pytest.importorskip("peft")
    model, data = tiny_llama()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    t = _trainer(use_dckpt, tmp_path, lora, data, max_steps=2)
    t.train()
    want = {k: v.detach().clone() for k, v in lora.state_dict().items() if "lora_" in k}
    base, _ = tiny_llama()
    got = peft.PeftModel.from_pretrained(base, str(tmp_path / "checkpoint-2"))
    have = {k: v for k, v in got.state_dict().items() if "lora_" in k}
    assert sorted(have) == sorted(want)
    assert all(torch.equal(have[k], want[k]) for k in want)


def test_rotation_removes_whole_folders(tmp_path):
    model, data = tiny_llama()
    _trainer(True, tmp_path, model, data, max_steps=6, save_total_limit=2).train()
    names = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert names == ["checkpoint-4", "checkpoint-6"], names
    for n in names:
        idx = json.loads((tmp_path / n / "model.safetensors.index.json").read_text())
        assert all((tmp_path / n / f).exists() for f in set(idx["weight_map"].values()))


def test_async_save_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model, data = tiny_llama()
    snap = _Snap()
    t = _trainer(True, tmp_path, model, data, cbs=[snap.callback()], max_steps=4,
                 async_save=True)
    t.train()
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint-2")).state_dict()
    assert all(torch.equal(got[k], v) for k, v in snap.at[2].items())


def test_compression_keeps_a_plain_copy(tmp_path):
    """Compressed saves cannot share their bytes with safetensors: stock's plain
    model.safetensors is written into the checkpoint (documented)."""
    pytest.importorskip("zstandard")
    from transformers import AutoModelForCausalLM

    model, data = tiny_llama()
    snap = _Snap()
    _trainer(True, tmp_path, model, data, cbs=[snap.callback()], max_steps=2,
             compression="zstd").train()
    ck = tmp_path / "checkpoint-2"
    assert (ck / "model.safetensors").exists()
    got = AutoModelForCausalLM.from_pretrained(str(ck)).state_dict()
    assert all(torch.equal(got[k], v) for k, v in snap.at[2].items())


@pytest.mark.parametrize("use_dckpt", [False, True], ids=["stock", "dckpt"])
def test_accelerate_checkpoint_loads_its_model_weights(tmp_path, use_dckpt):
    """``save_state``'s folder holds model 0's weights where readers look: stock's
    ``model.safetensors``; dckpt's side files and their index
    (``load_checkpoint_in_model`` of the folder), written once."""
    from accelerate.utils import load_checkpoint_in_model
    from safetensors.torch import load_file

    from .hf_helpers import accelerator

    model, _ = tiny_llama()
    acc = accelerator("dckpt" if use_dckpt else "stock")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    out = str(tmp_path / "ck")
    acc.save_state(out)
    want = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    fresh, _ = tiny_llama()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    if use_dckpt:
        assert "model.safetensors.index.json" in os.listdir(out)
        load_checkpoint_in_model(fresh, out)
        got = fresh.state_dict()
    else:
        got = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in want.items() if k in got)
    assert set(want) - set(got) <= {"lm_head.weight"}  # stock drops the tied copy
