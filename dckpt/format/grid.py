"""The grid form of a tensor's chunks: one breakpoint list per dim, the chunks being the
cells of that grid in C order. Pure numpy. A manifest stores an FSDP tensor's 16,384
chunks as one short run of breakpoints (see :mod:`.intarray`); these helpers turn the
breakpoints into cells and validate them when a manifest is parsed.
"""
from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

import numpy as np

from . import intarray, runs
from .runs import Runs

_SMALL = 64  # below this many values, plain Python is faster than numpy


def grid_cells(grid: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and sizes (n, ndim) of the cells of a grid, C order. O(cells * ndim)."""
    return cells(grid, None)


def cells(grid: tuple[tuple[int, ...], ...],
          arrays: list[np.ndarray | None] | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`grid_cells`, given per dim the breakpoints also as an int64 array where
    the caller has one (the parser does; None where not): converting 16,384 Python ints
    back to numpy costs more than the cells themselves. Missing arrays are built only
    when needed: a grid of at most ``_SMALL`` cells never uses them."""
    if not grid:
        return np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64)
    ncells = math.prod(len(b) - 1 for b in grid)
    if ncells <= _SMALL:
        # Most tensors have a handful of cells: plain Python beats numpy's per-call cost
        # (this runs once per tensor on every rank of every load).
        pairs = list(itertools.product(*(list(zip(b[:-1], b[1:])) for b in grid)))
        offsets = np.array([[lo for lo, _ in c] for c in pairs], np.int64)
        sizes = np.array([[hi - lo for lo, hi in c] for c in pairs], np.int64)
        return offsets.reshape(ncells, len(grid)), sizes.reshape(ncells, len(grid))
    bps = [np.asarray(b).astype(np.int64, copy=False) if a is None else a
           for b, a in zip(grid, arrays or (None,) * len(grid))]
    if len(bps) == 1:  # the common case (FSDP): no index arithmetic
        return bps[0][:-1, None].copy(), np.diff(bps[0])[:, None]
    # Cell i's index along dim d, C order; not np.indices, which needs ndim + 1 <= 64 dims.
    cell = np.arange(ncells)
    offsets = np.empty((ncells, len(bps)), np.int64)
    sizes = np.empty((ncells, len(bps)), np.int64)
    stride = ncells
    for d, b in enumerate(bps):
        stride //= len(b) - 1
        if len(b) == 2:  # one cell along d (a dim not split): a constant column
            offsets[:, d], sizes[:, d] = b[0], b[1] - b[0]
            continue
        i = cell // stride % (len(b) - 1)
        offsets[:, d], sizes[:, d] = b[:-1][i], np.diff(b)[i]
    return offsets, sizes


def search(b: "tuple[int, ...] | np.ndarray | Runs", x: int, side: str = "left") -> int:
    """``np.searchsorted`` over one dim's rising breakpoints, whatever holds them (a
    tuple, an int64 array, :class:`.runs.Runs`). O(log len(b))."""
    if isinstance(b, tuple):
        return (bisect.bisect_right if side == "right" else bisect.bisect_left)(b, x)
    return int(b.searchsorted(x, side))


def find_cell(grid: tuple, offsets, sizes) -> int | None:
    """The C-order index of the cell of ``grid`` whose box is exactly
    ``offsets``/``sizes``, or None. O(ndim log cuts): no cell is built."""
    idx = 0
    for b, o, z in zip(grid, offsets, sizes):
        i = search(b, int(o))
        if i >= len(b) - 1 or int(b[i]) != o or int(b[i + 1]) != o + z:
            return None
        idx = idx * (len(b) - 1) + i
    return idx


def parse_dim(obj: Any, key: str, d: int, extent: int,
              nfiles: int) -> tuple[tuple[int, ...] | np.ndarray | Runs, np.ndarray | None]:
    """Validate one dim's breakpoints: integers rising strictly from 0 to ``extent``,
    at most ``nfiles + 1`` of them (refused before any value is decoded). Returns them
    as a tuple, a :class:`.runs.Runs` (a long dim given as a few runs: O(runs) here), or
    the int64 array they were decoded into; and that array when there is one (else
    None). Raises ValueError."""
    arr = None
    compact = runs.from_json(obj, nfiles + 1)
    if compact is not None:
        # kept as runs (an FSDP grid at 131,072 ranks: 1 MB per tensor as int64, a few
        # runs here): checked in O(runs), never expanded by the parse
        if not (compact.rising() and len(compact) >= 2 and compact[0] == 0
                and compact[-1] == extent):
            raise ValueError(f"tensor {key!r}: grid of dim {d} must rise strictly from 0 "
                             f"to {extent}")
        return compact, None
    if not (isinstance(obj, list) and len(obj) <= _SMALL):
        arr = intarray.decode(obj, f"tensor {key!r} grid", nfiles + 1)
        if len(arr) <= _SMALL:  # a few runs (an even split): the checks in Python
            obj, arr = arr.tolist(), None
    if arr is None:  # fast path, no numpy
        b = obj
        ok = all(type(x) is int for x in b) and all(x < y for x, y in zip(b, b[1:]))
    else:
        # values inside [0, extent] first, so the differences cannot overflow; rising
        # strictly is checked here, not again per element in Python
        ok = not ((arr < 0).any() or (arr > extent).any() or (len(arr) > 1 and (np.diff(arr) <= 0).any()))
        b = arr
    if not (ok and len(b) >= 2 and len(b) <= nfiles + 1 and b[0] == 0 and b[-1] == extent):
        raise ValueError(f"tensor {key!r}: grid of dim {d} must rise strictly from 0 to {extent}")
    # a long dim stays the int64 array (Chunks.grid allows it): 131,072 Python ints per
    # tensor were most of a manifest parse's time and memory at that scale
    return (tuple(b) if arr is None else arr), arr
