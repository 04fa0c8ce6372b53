"""Values dckpt refuses at save, before any I/O, because the files it would write could
not be read back: strings that are not valid UTF-8, integers too long for JSON."""
from __future__ import annotations

import os

import pytest
import torch

import dckpt
from dckpt.errors import UnsupportedValueError
from dckpt.state.flatten import flatten

BAD = "w\ud800"  # a lone surrogate: str, but no UTF-8 encoding exists


@pytest.mark.parametrize("state, named", [
    ({BAD: torch.zeros(2)}, BAD),
    ({"model": {BAD: torch.zeros(2)}}, "model." + BAD),
    ({"name": BAD, "w": torch.zeros(2)}, "name"),
    ({"cfg": {BAD: 3}}, "cfg." + BAD),
    ({"xs": ["ok", "b\udcff"]}, "xs.1"),
], ids=["tensor-key", "nested-key", "str-value", "value-key", "list-item"])
def test_strings_that_are_not_utf8_are_refused(tmp_path, state, named):
    path = tmp_path / "ck"
    with pytest.raises(UnsupportedValueError) as e:
        dckpt.save(state, str(path))
    assert repr(named) in str(e.value) and "UTF-8" in str(e.value)
    assert not path.exists() or os.listdir(path) == []


@pytest.mark.parametrize("v", [10 ** 4100, -(10 ** 4100), 1 << 20000],
                         ids=["4101-digits", "negative", "2**20000"])
def test_ints_too_long_for_json_are_refused(tmp_path, v):
    path = tmp_path / "ck"
    with pytest.raises(UnsupportedValueError) as e:
        dckpt.save({"opt": {"seed": v}, "w": torch.zeros(2)}, str(path))
    assert "'opt.seed'" in str(e.value) and "digits" in str(e.value)
    assert not path.exists() or os.listdir(path) == []


def test_long_but_valid_values_round_trip(tmp_path):
    big, text = -(10 ** 3000) + 7, "héllo \U0001f600 \u00e9"
    state = {text: torch.arange(3.0), "n": big, "s": text, "t": True}
    dckpt.save(state, str(tmp_path / "ck"))
    out = {text: torch.zeros(3), "n": 0, "s": "", "t": False}
    dckpt.load(out, str(tmp_path / "ck"))
    assert out["n"] == big and out["s"] == text and out["t"] is True
    assert torch.equal(out[text], torch.arange(3.0))


def test_flatten_checks_are_cheap_for_ascii():
    state = {f"layer{i}": {"w": torch.zeros(1), "name": f"n{i}", "k": i} for i in range(2000)}
    flat = flatten(state)
    assert len(flat.tensors) == 2000 and len(flat.values) == 4000
