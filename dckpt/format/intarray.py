"""Compact JSON encoding of integer arrays: a plain list, or runs of arithmetic
progressions ``{"runs": [[first, step, count], ...]}`` when that is shorter.

A chunk table of an FSDP tensor sharded over 4096 ranks is ``file = 0, 1, ..., 4095``:
one run instead of 4096 numbers. Pure: numpy only.
"""
from __future__ import annotations

from typing import Any

import numpy as np

_LO, _HI = -(1 << 63), (1 << 63) - 1
_MASK = (1 << 64) - 1
_SMALL = 64  # at most this many values decode in plain Python
_FEW_RUNS = 16  # at most this many runs decode one arange each


def encode(values: np.ndarray) -> list[int] | dict[str, list[list[int]]]:
    """Encode a 1-D int64 array. O(n), vectorised."""
    v = np.asarray(values, dtype=np.int64).ravel()
    n = len(v)
    if n <= 3:
        return v.tolist()
    # Greedy runs: element 0 starts one; element i >= 2 starts one when the step into it
    # differs from the step before (d[i-1] != d[i-2]); element 1 always joins run 0.
    d = np.diff(v)
    starts = np.flatnonzero(np.concatenate(([True, False], d[1:] != d[:-1])))
    if len(starts) * 3 >= n:  # runs would not be shorter than the list
        return v.tolist()
    counts = np.diff(np.append(starts, n))
    steps = np.where(counts > 1, d[np.minimum(starts, n - 2)], 0)
    return {"runs": np.stack([v[starts], steps, counts], axis=1).tolist()}


def decode(obj: Any, what: str, limit: int = 1 << 31) -> np.ndarray:
    """Decode what :func:`encode` wrote, refusing more than ``limit`` values (a hostile
    manifest must not make a reader allocate). Raises ValueError naming ``what``."""
    # Fast path: a few short, well-formed runs (a manifest's chunk-file and grid arrays)
    # in plain Python and one numpy call; ~10 numpy calls cost more than the values.
    # Anything else -- malformed, long, over ``limit`` -- takes the general path, which
    # raises its errors, so both agree on every input (tests/test_format.py checks).
    if type(obj) is dict and len(obj) == 1 and type(runs := obj.get("runs")) is list \
            and len(runs) <= _SMALL:
        out: list[int] = []
        for r in runs:
            if not (type(r) is list and len(r) == 3):
                break
            first, step, count = r
            if not (type(first) is int and type(step) is int and type(count) is int
                    and _LO <= first <= _HI and _LO <= step <= _HI
                    and 1 <= count <= _SMALL - len(out)):
                break
            vals = [first + step * i for i in range(count)]
            if not _LO <= vals[-1] <= _HI:  # wraps modulo 2**64, as int64 arithmetic does
                vals = [((x - _LO) & _MASK) + _LO for x in vals]
            out += vals
        else:
            if not out or len(out) <= limit:
                return np.array(out, dtype=np.int64)
    return _decode_general(obj, what, limit)


def _decode_general(obj: Any, what: str, limit: int = 1 << 31) -> np.ndarray:
    """:func:`decode` without its fast path (numpy throughout); kept for the tests."""
    if isinstance(obj, list):
        if len(obj) > limit:
            raise ValueError(f"{what}: more than {limit} values")
        # types and range in C (131,072 values: a few ms, not a generator's 20)
        if obj and not (set(map(type, obj)) == {int} and _LO <= min(obj) and max(obj) <= _HI):
            raise ValueError(f"{what}: expected a list of 64-bit integers")
        return np.asarray(obj, dtype=np.int64).reshape(-1)
    if isinstance(obj, dict) and set(obj) == {"runs"} and isinstance(obj["runs"], list):
        runs = obj["runs"]
        # first and step are int64 (arithmetic wraps modulo 2**64, as encode's diff does)
        if not all(isinstance(r, list) and len(r) == 3
                   and all(type(x) is int and _LO <= x <= _HI for x in r) for r in runs):
            raise ValueError(f"{what}: runs must be [first, step, count] 64-bit integer triples")
        if not runs:
            return np.zeros(0, dtype=np.int64)
        if len(runs) <= _FEW_RUNS and all(1 <= c for _, _, c in runs) \
                and sum(c for _, _, c in runs) <= limit \
                and all(_LO <= f + s * c <= _HI for f, s, c in runs):
            # a few long runs (a grid or file array at 131,072 ranks): one arange each,
            # half the time of the repeats below; no value wraps (checked just above)
            parts = [np.arange(f, f + s * c, s, dtype=np.int64) if s else
                     np.full(c, f, np.int64) for f, s, c in runs]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        r = np.asarray(runs, dtype=np.int64)
        counts = r[:, 2]
        if (counts < 1).any() or (counts > limit).any() or counts.sum() > limit:
            raise ValueError(f"{what}: run counts must be >= 1 and add up to at most {limit}")
        firsts = np.repeat(r[:, 0], counts)
        steps = np.repeat(r[:, 1], counts)
        pos = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return firsts + steps * pos
    raise ValueError(f"{what}: expected a list of integers or {{'runs': [...]}}")
