"""Pure check that a set of boxes tiles a tensor exactly once.

Linear in the number of boxes for the layouts DTensor produces (the boxes are the cells
of a grid: one breakpoint list per dim); a coverage count over the grid's cells, or a
pairwise test, handles any other layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_MAX_COVERAGE_CELLS = 1 << 26


@dataclass(frozen=True)
class Tiling:
    """Result of :func:`analyse`: ``error`` is None when the boxes tile the tensor.
    ``grid`` (per-dim breakpoints) and ``order`` (box index of each grid cell, C order)
    are set when the boxes are exactly the cells of a grid."""

    error: str | None
    grid: tuple[tuple[int, ...], ...] | None = None
    order: np.ndarray | None = None


def analyse(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> Tiling:
    """Check that the boxes ``offsets``/``sizes`` ((n, ndim) int64) cover every element
    of ``shape`` exactly once. Pure; O(n log n) for grid layouts."""
    ndim = len(shape)
    n = len(offsets)
    offsets = np.asarray(offsets, np.int64).reshape(n, ndim)
    sizes = np.asarray(sizes, np.int64).reshape(n, ndim)
    numel = math.prod(shape)
    if n and ((sizes <= 0).any() or (offsets < 0).any()
              or (offsets + sizes > np.asarray(shape, np.int64)).any()):
        return Tiling("a chunk is empty or lies outside the tensor")
    if numel == 0:
        return Tiling(None if n == 0 else "chunks given for an empty tensor")
    covered = int(np.prod(sizes, axis=1).sum()) if n else 0
    if covered != numel:
        return Tiling(f"chunks cover {covered} elements of {numel} (overlap or gap)")
    if ndim == 0:
        return Tiling(None if n == 1 else "several chunks for a scalar", (), np.zeros(1, np.int64))
    ends = offsets + sizes
    bps, lo, hi = [], [], []
    for d in range(ndim):
        bp = np.sort(np.concatenate(([0, shape[d]], offsets[:, d], ends[:, d])))
        bp = bp[np.concatenate(([True], bp[1:] != bp[:-1]))]  # unique; faster than np.unique
        bps.append(bp)
        lo.append(np.searchsorted(bp, offsets[:, d]))
        hi.append(np.searchsorted(bp, ends[:, d]))
    dims = tuple(len(b) - 1 for b in bps)
    one_cell = all(((h - l) == 1).all() for l, h in zip(lo, hi))
    if one_cell and math.prod(dims) == n:
        lin = np.ravel_multi_index(tuple(lo), dims)
        order = np.full(n, -1, np.int64)
        order[lin] = np.arange(n)
        if (order >= 0).all():
            return Tiling(None, tuple(tuple(b.tolist()) for b in bps), order)
        return Tiling("two chunks overlap")
    return Tiling(None if _disjoint(lo, hi, dims) else "two chunks overlap")


def _disjoint(lo: list[np.ndarray], hi: list[np.ndarray], dims: tuple[int, ...]) -> bool:
    """True when no two boxes (given as cell-index ranges) share a cell."""
    n = len(lo[0])
    if math.prod(d + 1 for d in dims) <= _MAX_COVERAGE_CELLS:
        # Difference array: +-1 at the 2**ndim corners of each box, then a prefix sum
        # along every axis gives the number of boxes covering each cell.
        diff = np.zeros([d + 1 for d in dims], np.int64)
        ndim = len(dims)
        for corner in range(1 << ndim):
            idx = tuple(hi[d] if corner >> d & 1 else lo[d] for d in range(ndim))
            sign = -1 if bin(corner).count("1") % 2 else 1
            np.add.at(diff, idx, sign)
        for d in range(ndim):
            diff = np.cumsum(diff, axis=d)
        return bool((diff[tuple(slice(0, d) for d in dims)] <= 1).all())
    lo_a, hi_a = np.stack(lo, 1), np.stack(hi, 1)
    for i in range(n):  # irregular and huge: pairwise, O(n^2), vectorised per row
        overlap = ((np.maximum(lo_a[i], lo_a[i + 1:]) < np.minimum(hi_a[i], hi_a[i + 1:]))
                   .all(axis=1))
        if overlap.any():
            return False
    return True
