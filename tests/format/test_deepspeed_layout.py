"""The pure range arithmetic of DeepSpeed's ZeRO partitions
(dckpt.integrations.common.zero.layout): every element of every parameter held by
exactly one rank, at the place DeepSpeed's flat buffers hold it."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dckpt.integrations.common.zero.layout import Fragment, grouped, mine, split, zero3_partition


def _brute_grouped(numels, offsets, part, world):
    """element -> (rank, offset in its partition), by walking the flat."""
    out = {}
    for i, (n, o) in enumerate(zip(numels, offsets)):
        for e in range(n):
            flat = o + e
            out[(i, e)] = (flat // part, flat % part)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.integers(1, 5),
       st.integers(0, 6), st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_group_fragments_tile_each_parameter_where_the_flat_puts_it(numels, world, extra, gaps):
    offsets, at = [], 0
    for n, g in zip(numels, gaps):
        at += g  # per-parameter alignment padding
        offsets.append(at)
        at += n
    part = -(-(at + extra) // world)
    frags = grouped(numels, part, world, offsets)
    want = _brute_grouped(numels, offsets, part, world)
    got = {}
    for i, fs in enumerate(frags):
        assert [f.rank for f in fs] == sorted({f.rank for f in fs})  # rank order, one each
        for f in fs:
            assert f.numel > 0
            for e in range(f.numel):
                assert (i, f.start + e) not in got
                got[(i, f.start + e)] = (f.rank, f.flat + e)
    assert got == want


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(1, 9))
def test_zero3_pieces_are_ceil_sized_and_tile_the_parameter(numel, world):
    c = zero3_partition(numel, world)
    frags = split(numel, world)
    covered = [e for f in frags for e in range(f.start, f.start + f.numel)]
    assert covered == list(range(numel))
    for f in frags:
        assert f.start == f.rank * c and f.numel <= c
    assert mine(frags, world - 1) is None or mine(frags, world - 1).numel <= c


def test_group_fragments_match_deepspeeds_mapping_of_a_real_example():
    """DeepSpeed 0.19.8, two Linear layers (5x7 + 7, 7x3 + 3 = 66 elements) at 2 ranks:
    flat 68 elements, 34 per rank; rank 0 holds a.weight[0:34], rank 1 a.weight[34:35]
    at 0, a.bias at 1, b.weight at 8, b.bias at 29 (their ``_hp_mapping``)."""
    frags = grouped([35, 7, 21, 3], 34, 2)
    assert frags[0] == [Fragment(0, 0, 34, 0), Fragment(1, 34, 1, 0)]
    assert frags[1] == [Fragment(1, 0, 7, 1)]
    assert frags[2] == [Fragment(1, 0, 21, 8)]
    assert frags[3] == [Fragment(1, 0, 3, 29)]


def test_parameters_that_overflow_or_overlap_are_refused():
    with pytest.raises(ValueError, match="past"):
        grouped([10, 10], 9, 2)
    with pytest.raises(ValueError, match="overlaps"):
        grouped([10, 10], 20, 2, offsets=[0, 5])
