"""dckpt.export's message when no tensor matches the prefix (issue 27, 6): it names what
the keys do start with, quoting a one-part key as the key it is (never 'weight.'), and
suggests the full prefix when the one given matches inside the keys (a manager's keys
start with 'state.', so 'train.model.' -> 'state.train.model.')."""
from __future__ import annotations

import re

import pytest
import torch

import dckpt


def _err(path: str, tmp_path, prefix: str) -> str:
    with pytest.raises(dckpt.CheckpointError) as e:
        dckpt.export(path, str(tmp_path / "hf"), prefix=prefix)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    return str(e.value)


def test_one_part_key_is_quoted_as_a_key(tmp_path):
    path = str(tmp_path / "ckpt")
    dckpt.save({"weight": torch.ones(3), "model": {"head": {"bias": torch.zeros(2)}}}, path)
    msg = _err(path, tmp_path, "encoder.")
    assert "'weight'" in msg and "'weight.'" not in msg, msg
    assert "'model.head.'" in msg, msg
    assert "did you mean" not in msg, msg


def test_prefix_found_inside_the_keys_is_suggested_in_full(tmp_path):
    path = str(tmp_path / "ckpt")
    model = torch.nn.Linear(4, 2)
    dckpt.save({"state": {"train": {"model": model.state_dict()}}, "step": 3}, path)
    msg = _err(path, tmp_path, "train.model.")
    assert re.search(r"did you mean 'state\.train\.model\.'\?", msg), msg
    # ... which works.
    info = dckpt.export(path, str(tmp_path / "hf"), prefix="state.train.model.")
    assert info.tensors == 2 and info.files == ("model.safetensors",)
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == ["bias", "weight"] and torch.equal(got["weight"], model.weight.data)
