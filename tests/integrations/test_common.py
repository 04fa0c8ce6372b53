"""The shared integration core's pure parts (dckpt.integrations.common): the object
codec round-trips exactly, rotation keeps the newest in commit order."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings, strategies as st

from dckpt.errors import UnsupportedValueError
from dckpt.integrations.common import codec
from dckpt.integrations.common.rotation import Committed, commit_order, to_remove

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=20))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.booleans(), st.none())
tensors = st.builds(lambda n, s: torch.arange(n, dtype=torch.float32) * s,
                    st.integers(0, 4), st.floats(-3, 3))
trees = st.recursive(st.one_of(scalars, tensors), lambda c: st.one_of(
    st.lists(c, max_size=3), st.lists(c, max_size=3).map(tuple),
    st.dictionaries(keys, c, max_size=3)), max_leaves=12)


def equal(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(trees)
def test_codec_round_trips_types_keys_order_nan_tensors_and_bytes(obj):
    assert equal(codec.decode(codec.encode(obj)), obj)


def test_codec_refuses_what_it_cannot_store_naming_the_path():
    import pytest

    with pytest.raises(UnsupportedValueError, match=r"state\['a'\]\[1\].*set"):
        codec.encode({"a": [1, {2}]})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.text("ab", max_size=3)), max_size=8,
                unique_by=lambda t: t), st.integers(1, 5), st.data())
def test_rotation_keeps_the_newest_in_commit_order_and_never_the_one_just_saved(
        raw, limit, data):
    entries = [Committed(f"p{i}", c, s) for i, (c, s) in enumerate(raw)]
    keep = data.draw(st.sampled_from([e.path for e in entries] + [None]))
    gone = to_remove(entries, limit, keep)
    left = [e for e in commit_order(entries) if e.path not in gone]
    assert keep not in gone
    assert len(left) == max(min(limit, len(entries)), 1 if keep in {e.path for e in entries} else 0)
    others_left = [e for e in left if e.path != keep]
    removed = [e for e in commit_order(entries) if e.path in gone]
    # every removed one is older (in commit order) than every other one kept
    order = commit_order(entries)
    assert all(order.index(r) < order.index(k) for r in removed for k in others_left)
