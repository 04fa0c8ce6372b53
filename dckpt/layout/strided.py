"""Pure layout math for any DTensor placements, ``_StridedShard`` included: the global
boxes a rank's local tensor holds, each paired with the region of the local tensor it
occupies.

Placements are ``("S", dim)`` (Shard), ``("R",)`` (Replicate) and ``("SS", dim, sf)``
(``_StridedShard(dim, split_factor=sf)``). The model is torch's own
(``torch/distributed/tensor/_utils.py``, ``_compute_local_shape_and_global_offset``):
placements apply left to right over the mesh dims, and each tensor dim carries the list
of global indices its local positions hold. ``Shard`` on a mesh dim of size m keeps
piece ``coord`` of ``torch.chunk(indices, m)``; ``_StridedShard`` first chunks the
indices into ``sf`` pieces, chunks each of those into m, and keeps the concatenation of
piece ``coord`` of each (``placement_types._StridedShard._split_tensor``). So a local
tensor is, per dim, an increasing list of global indices, and the rank's boxes are the
cartesian product over dims of that list's maximal runs of consecutive indices.

Index lists are never materialised: each dim is a list of runs (global start, length),
and every step is a few numpy passes over the runs and the ``sf`` pieces, never a Python
loop per row block (while there are at most a few dozen of them, plain Python lists do
the same work faster). FSDP2 over TP (``[_StridedShard(0, sf=tp), Shard(0)]``) leaves
one run per dim, so one box per rank, as a plain Shard does: 27 us per tensor.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .chunks import Box, chunk_range, local_box


@dataclass(frozen=True, eq=False)
class LocalBoxes:
    """What one rank holds of a tensor: ``offsets``/``sizes`` ((n, ndim) int64) are its
    global boxes, ``local`` ((n, ndim)) where each starts in the local tensor, whose
    shape is ``local_shape``. Boxes appear in C order of the local regions. A rank that
    holds nothing has one box with a zero size (n == 1), as :func:`local_box` gives."""

    offsets: np.ndarray
    sizes: np.ndarray
    local: np.ndarray
    local_shape: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.offsets)

    def boxes(self) -> list[Box]:
        """The global boxes as :class:`Box` objects. O(n * ndim) Python."""
        return [Box(tuple(o), tuple(s)) for o, s in zip(self.offsets.tolist(), self.sizes.tolist())]

    def regions(self) -> list[tuple[slice, ...]]:
        """Each box's region of the local tensor, as slices. O(n * ndim) Python."""
        return [tuple(slice(a, a + s) for a, s in zip(lo, sz))
                for lo, sz in zip(self.local.tolist(), self.sizes.tolist())]


def is_strided(placements: Sequence[tuple]) -> bool:
    """Whether any placement is a ``_StridedShard``."""
    return any(p[0] == "SS" for p in placements)


def _chunks(length: np.ndarray, parts: int, index) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`dckpt.layout.chunks.chunk_range`: (start, size) of piece
    ``index`` of ``torch.chunk`` of each ``length`` into ``parts`` (padded with empty
    pieces, as DTensor pads)."""
    step = -(-length // parts)
    start = np.minimum(index * step, length)
    return start, np.minimum(step, length - start)


def take(g: np.ndarray, n: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs holding local positions ``[lo[k], hi[k])`` of the runs ``(g, n)``
    (global start and length, in local order), concatenated over ``k`` in order.
    O(runs + ranges + output), no Python loop."""
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    if not len(lo) or not len(n):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    cum = np.concatenate(([0], np.cumsum(n)))
    first = np.searchsorted(cum, lo, side="right") - 1
    last = np.searchsorted(cum, hi, side="left") - 1
    cnt = last - first + 1
    rng = np.repeat(np.arange(len(lo)), cnt)
    idx = np.repeat(first, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    s = np.maximum(cum[idx], lo[rng])
    e = np.minimum(cum[idx + 1], hi[rng])
    return g[idx] + (s - cum[idx]), e - s


def merge(g: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Join runs that continue each other (``g[k+1] == g[k] + n[k]``). O(runs)."""
    if len(g) < 2:
        return g, n
    head = np.concatenate(([True], g[1:] != g[:-1] + n[:-1]))
    if head.all():
        return g, n
    at = np.flatnonzero(head)
    return g[at], np.add.reduceat(n, at)


# Up to this many runs and ranges per step, plain Python lists beat numpy's per-call
# cost (about 0.5 ms per tensor through numpy, 15 us through lists, for FSDP2 over TP):
# the common case stays cheap on every save, and a layout with many row blocks still
# takes the vectorised path (no Python loop per block beyond this bound).
_SMALL = 64


def _take_small(g: list, n: list, ranges: list) -> tuple[list, list]:
    """:func:`take` then :func:`merge` on Python lists, for a few runs and ranges."""
    og: list[int] = []
    on: list[int] = []
    for lo, hi in ranges:
        pos = 0
        for a, k in zip(g, n):
            s, e = max(pos, lo), min(pos + k, hi)
            if e > s:
                start = a + s - pos
                if og and og[-1] + on[-1] == start:
                    on[-1] += e - s
                else:
                    og.append(start)
                    on.append(e - s)
            pos += k
            if pos >= hi:
                break
    return og, on


def _ranges_small(cur: int, p: tuple, m: int, c: int) -> list[tuple[int, int]]:
    """The local position ranges a placement keeps (see :func:`dim_runs`), in Python."""
    if p[0] == "S":
        lo, size = chunk_range(cur, m, c)
        return [(lo, lo + size)]
    out = []
    sf = p[2]
    step = -(-cur // sf)
    for j in range(sf):  # chunk_range, inlined: this is the per-save hot path
        a = min(j * step, cur)
        ln = min(step, cur - a)
        step2 = -(-ln // m)
        b = min(c * step2, ln)
        out.append((a + b, a + min(b + step2, ln)))
    return out


def dim_runs(length: int, steps: Sequence[tuple[tuple, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The runs (global start, length) of one tensor dim of ``length`` after ``steps``:
    (placement, mesh dim size, coordinate) of every placement on this dim, in mesh-dim
    order. Merged: no two runs continue each other. O(runs + split factors) per step:
    numpy once they number more than a few dozen."""
    g, n = _dim_runs(length, steps)
    return np.asarray(g, np.int64), np.asarray(n, np.int64)


def _dim_runs(length: int, steps) -> tuple:
    """:func:`dim_runs` as lists while small, numpy arrays once large."""
    g: list | np.ndarray = [0] if length else []
    n: list | np.ndarray = [length] if length else []
    for p, m, c in steps:
        width = p[2] if p[0] == "SS" else 1
        if isinstance(g, list) and len(g) + width <= _SMALL:
            g, n = _take_small(g, n, _ranges_small(sum(n), p, m, c))
            continue
        g, n = np.asarray(g, np.int64), np.asarray(n, np.int64)
        cur = np.int64(n.sum())
        if p[0] == "S":
            lo, size = _chunks(cur, m, c)
            lo, hi = np.array([lo]), np.array([lo + size])
        else:  # ("SS", dim, sf): chunk into sf pieces, each into m, keep piece c of each
            a, ln = _chunks(cur, p[2], np.arange(p[2], dtype=np.int64))
            b, s = _chunks(ln, m, c)
            lo, hi = a + b, a + b + s
        g, n = merge(*take(g, n, lo, hi))
    return g, n


def check(global_shape: Sequence[int], mesh_shape: Sequence[int],
          coordinate: Sequence[int], placements: Sequence[tuple]) -> None:
    """Raise ValueError for placements this module does not describe: mismatched
    lengths, a placement other than S/SS/R, a shard dim out of range, a split factor
    below 1."""
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise ValueError("mesh shape, coordinate and placements must have equal lengths")
    for p in placements:
        if p[0] == "R":
            continue
        if p[0] not in ("S", "SS"):
            raise ValueError(f"placement {p!r} is not Shard, _StridedShard or Replicate")
        if not 0 <= p[1] < len(global_shape):
            raise ValueError(f"Shard({p[1]}) on a {len(global_shape)}-d tensor")
        if p[0] == "SS" and (not isinstance(p[2], int) or p[2] < 1):
            raise ValueError(f"_StridedShard split factor {p[2]!r} is not a positive int")


def local_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int],
                coordinate: Sequence[int], placements: Sequence[tuple]) -> LocalBoxes:
    """The boxes held by the rank at ``coordinate`` of a mesh of ``mesh_shape``, each
    with its place in the local tensor. Without a strided placement this is
    :func:`local_box`'s one box. Pure; numpy over runs and split factors, a Python loop
    over dims and mesh dims only. Raises ValueError as :func:`check`."""
    check(global_shape, mesh_shape, coordinate, placements)
    ndim = len(global_shape)
    if not is_strided(placements):
        b = local_box(global_shape, mesh_shape, coordinate, placements)
        row = np.asarray([b.offsets], np.int64).reshape(1, ndim)
        return LocalBoxes(row, np.asarray([b.sizes], np.int64).reshape(1, ndim),
                          np.zeros((1, ndim), np.int64), b.sizes)
    runs = []
    for d in range(ndim):
        steps = [(p, m, c) for p, m, c in zip(placements, mesh_shape, coordinate)
                 if p[0] != "R" and p[1] == d]
        runs.append(_dim_runs(int(global_shape[d]), steps))
    local_shape = tuple(int(sum(n)) for _, n in runs)
    counts = [len(g) for g, _ in runs]
    if 0 in counts:  # an empty dim: one empty box, as local_box gives
        z = np.zeros((1, ndim), np.int64)
        return LocalBoxes(z, np.asarray([local_shape], np.int64).reshape(1, ndim), z.copy(),
                          local_shape)
    if math.prod(counts) <= _SMALL:  # a few boxes (FSDP2 over TP: one): in Python
        per = []
        for g, n in runs:
            g, n = list(map(int, g)), list(map(int, n))
            per.append(list(zip(g, n, itertools.accumulate([0] + n[:-1]))))
        cells = list(itertools.product(*per))
        rows = [[x for cell in c for x in cell] for c in cells]  # (g, n, l) per dim
        arr = np.asarray(rows, np.int64).reshape(len(cells), ndim, 3)
        return LocalBoxes(arr[:, :, 0].copy(), arr[:, :, 1].copy(), arr[:, :, 2].copy(),
                          local_shape)
    runs = [(np.asarray(g, np.int64), np.asarray(n, np.int64)) for g, n in runs]
    idx = np.indices(counts).reshape(ndim, -1)  # C order over the runs of every dim
    offsets = np.stack([runs[d][0][idx[d]] for d in range(ndim)], axis=1)
    sizes = np.stack([runs[d][1][idx[d]] for d in range(ndim)], axis=1)
    local = np.stack([(np.cumsum(runs[d][1]) - runs[d][1])[idx[d]] for d in range(ndim)], axis=1)
    return LocalBoxes(offsets.astype(np.int64), sizes.astype(np.int64), local.astype(np.int64),
                      local_shape)
