"""Interop across world sizes: a transformers causal LM trained with FSDP2 at 2 ranks
and saved through TrainingState is exported in one process and loaded by
``from_pretrained``; a DCP checkpoint saved at 2 ranks is imported and restored at 3;
Hugging Face safetensors are imported and loaded into FSDP2 at 2 ranks."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

import dckpt

# Checked without importing it: the ranks import this module too, and transformers
# takes seconds to import in each of them (only the tests that use it pay that).
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed (pip install dckpt[hf])")


def _config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)


def _llama(tie: bool, seed: int, fsdp: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(tie))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full(model) -> dict:
    """Every parameter and buffer as a full CPU tensor (collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _train_and_save(path: str, tie: bool) -> dict:
    """FSDP2 at this pool's world size, two AdamW steps, saved through TrainingState."""
    model = _llama(tie, seed=0, fsdp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        ids = torch.randint(0, 128, (2, 8), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    dckpt.save({"train": dckpt.TrainingState(model, opt), "step": 2}, path)
    return _full(model)


def _from_pretrained(out: str, tie: bool, **kw):
    from transformers import AutoModelForCausalLM

    _config(tie).save_pretrained(out)
    return AutoModelForCausalLM.from_pretrained(out, **kw)


def _assert_params(model, want: dict, dtype=None, what: str = "") -> None:
    sd = model.state_dict()
    assert set(sd) == set(want), (what, set(sd) ^ set(want))
    for k, w in want.items():
        w = w if dtype is None else w.to(dtype)
        assert sd[k].dtype == w.dtype and torch.equal(sd[k], w), (what, k)


# One test for everything transformers: importing it in each rank is the slow part, and
# one test keeps it on one pytest-xdist worker (and one rank pool).
@needs_hf
def test_llama_fsdp2_exports_load_with_from_pretrained_and_hf_imports_load(ranks, tmp_path):
    trained = {}
    for tie in (False, True):
        path = str(tmp_path / f"ckpt-tie{int(tie)}")
        trained[tie] = path, ranks(2).run(_train_and_save, path, tie)[0]
        m = dckpt.format.manifest.parse(open(os.path.join(path, "manifest.json"), "rb").read())
        # really sharded: a weight matrix saved as one chunk per rank; TrainingState's
        # state dict holds a tied head under both names
        assert len(m.tensors["train.model.model.layers.0.mlp.up_proj.weight"].chunks) == 2
        assert {"train.model.lm_head.weight", "train.model.model.embed_tokens.weight"} <= \
            set(m.tensors)

        # one model.safetensors, tied or not
        out = str(tmp_path / f"hf-tie{int(tie)}")
        assert dckpt.export(path, out, prefix="train.model.").files == ("model.safetensors",)
        model = _from_pretrained(out, tie)
        _assert_params(model, trained[tie][1], what=f"single file, tie={tie}")
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie

    # shards + index
    path, want = trained[False]
    out = str(tmp_path / "hf-sharded")
    info = dckpt.export(path, out, prefix="train.model.", max_shard_size="20KB")
    assert len(info.files) > 2
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(want)
    assert set(index["weight_map"].values()) == set(info.files)
    _assert_params(_from_pretrained(out, False), want, what="sharded")

    # --dtype bf16
    out = str(tmp_path / "hf-bf16")
    dckpt.export(path, out, prefix="train.model.", dtype="bf16")
    _assert_params(_from_pretrained(out, False, dtype=torch.bfloat16), want, torch.bfloat16,
                   what="bf16")

    # a tied model's checkpoint holding the embedding once (no lm_head.weight): the
    # head is tied to it when from_pretrained loads
    path, want = trained[True]
    once = {k: v for k, v in want.items() if k != "lm_head.weight"}
    dckpt.save({"m": once}, str(tmp_path / "once"))
    out = str(tmp_path / "hf-once")
    dckpt.export(str(tmp_path / "once"), out, prefix="m.")
    model = _from_pretrained(out, True)
    _assert_params(model, want, what="embedding once")

    # prefix errors name what exists
    with pytest.raises(dckpt.CheckpointError, match=r"'train\.modl\.'.*'train\.model\.'"):
        dckpt.export(path, str(tmp_path / "hf-x"), prefix="train.modl")
    assert not os.path.exists(tmp_path / "hf-x")

    _hf_import_loads_into_fsdp2(ranks, tmp_path)


# ---------------------------------------------------------------- DCP 2 -> dckpt -> 3

SHAPES = {"a": (13, 6), "b": (5, 11), "c": (7, 4, 3)}


def _value(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=g)


def _dcp_save(path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"model": {"a": distribute_tensor(_value("a"), mesh, [Shard(0)]),
                       "b": distribute_tensor(_value("b"), mesh, [Shard(1)]),
                       "c": distribute_tensor(_value("c"), mesh, [Replicate()])},
             "bias": torch.arange(4), "step": 42, "lr": 0.25}
    dcp.save(state, checkpoint_id=path)


def _dckpt_load_at_3(path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place = {"a": [Shard(1)], "b": [Shard(0)], "c": [Shard(2)]}
    state = {"imported": {
        "model": {k: distribute_tensor(torch.zeros(s), mesh, place[k]) for k, s in SHAPES.items()},
        "bias": torch.zeros(4, dtype=torch.int64), "step": 0, "lr": 0.0}}
    dckpt.load(state, path)
    s = state["imported"]
    return {"full": {k: v.full_tensor() for k, v in s["model"].items()}, "bias": s["bias"],
            "step": s["step"], "lr": s["lr"], "local": s["model"]["a"].to_local().shape}


def test_dcp_import_restores_at_another_world_size(ranks, tmp_path):
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "imported")
    ranks(2).run(_dcp_save, src)
    dckpt.import_checkpoint(src, dst, prefix="imported.", max_shard_size=300)
    for r, got in enumerate(ranks(3).run(_dckpt_load_at_3, dst)):
        assert got["step"] == 42 and got["lr"] == 0.25
        assert torch.equal(got["bias"], torch.arange(4))
        assert got["local"] == (13, 2)  # Shard(1) of 6 columns over 3 ranks
        for k in SHAPES:
            assert torch.equal(got["full"][k], _value(k)), (r, k)

    # A training job's DCP checkpoint (FSDP2 model + AdamW through torch's state_dict
    # helpers, as torchtitan saves them) resumes in TrainingState under "train".
    src, dst = str(tmp_path / "dcp-train"), str(tmp_path / "imported-train")
    want = ranks(2).run(_dcp_save_training, src)[0]
    dckpt.import_checkpoint(src, dst, prefix="train.")
    for got in ranks(3).run(_resume_training, dst):
        assert got.keys() == want.keys()
        for k in want:
            assert (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                    else got[k] == want[k]), k


def _small_fsdp2(seed: int):
    from statekit import fsdp2_mlp

    return fsdp2_mlp((8, 13, 4), seed)


def _full_training(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    out.update({f"optim.{k}": v for k, v in osd.items()})
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _dcp_save_training(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = _small_fsdp2(0)
    for step in range(2):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
    msd, osd = get_state_dict(model, opt,
                              options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return _full_training(model, opt)


def _resume_training(path: str) -> dict:
    model, opt = _small_fsdp2(7)
    dckpt.load({"train": dckpt.TrainingState(model, opt)}, path)
    return _full_training(model, opt)


# ---------------------------------------------------------------- HF -> dckpt -> FSDP2

def _load_fsdp2(path: str, tie: bool) -> dict:
    model = _llama(tie, seed=99, fsdp=True)
    dckpt.load({"train": dckpt.TrainingState(model)}, path)
    return _full(model)


def _hf_import_loads_into_fsdp2(ranks, tmp_path) -> None:
    """Hugging Face safetensors (shards + index as a directory; a tied model's single
    model.safetensors as a file) imported and loaded into FSDP2 at 2 ranks."""
    for tie in (False, True):
        src = _llama(tie, seed=5, fsdp=False)
        want = {k: v.detach().clone() for k, v in src.state_dict().items()}
        hf = str(tmp_path / f"hf-tie{int(tie)}")
        if tie:  # one model.safetensors, imported as a file
            src.save_pretrained(hf)
            source = os.path.join(hf, "model.safetensors")
            assert "model.safetensors.index.json" not in os.listdir(hf)
        else:  # shards and their index, imported as a directory
            src.save_pretrained(hf, max_shard_size="20KB")
            source = hf
            assert "model.safetensors.index.json" in os.listdir(hf)
        dst = str(tmp_path / f"imported-tie{int(tie)}")
        # save_pretrained drops a tied lm_head.weight; TrainingState's state dict has it
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tie else None
        dckpt.import_checkpoint(source, dst, prefix="train.model.", aliases=aliases)
        for got in ranks(2).run(_load_fsdp2, dst, tie):
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), (tie, k)
