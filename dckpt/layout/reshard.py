"""Pure resharding math: saved chunks x a wanted box -> what to read and where it goes."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..format.grid import cells, search
from .chunks import Box


@dataclass(frozen=True)
class ReadItem:
    """Copy ``src`` (a region of saved chunk ``chunk``, in chunk coordinates) into
    ``dst`` (the same elements, in coordinates of the wanted box)."""

    chunk: int
    file: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    whole_chunk: bool  # the region is the entire chunk
    whole_target: bool  # the region is the entire wanted box


def plan_reads(want: Box, offsets: np.ndarray, sizes: np.ndarray,
               files: np.ndarray, ids: np.ndarray | None = None) -> list[ReadItem]:
    """Every chunk overlapping ``want``, with the overlap in both coordinate systems.
    ``ids``: the chunks' indexes when the rows are a subset (:func:`plan_grid_reads`),
    else row i is chunk i. Vectorised over chunks: O(chunks) numpy work plus
    O(overlaps) Python."""
    if want.numel == 0 or len(offsets) == 0:
        return []
    w_lo = np.asarray(want.offsets, np.int64)
    w_hi = w_lo + np.asarray(want.sizes, np.int64)
    lo = np.maximum(offsets, w_lo)
    hi = np.minimum(offsets + sizes, w_hi)
    hit = np.flatnonzero((hi > lo).all(axis=1)) if offsets.shape[1] else np.arange(len(offsets))
    # Per overlap, plain Python ints: numpy scalars cost ~1 us per operation, which at a
    # few hundred tensors was most of a load's planning time.
    wl, wh = w_lo.tolist(), w_hi.tolist()
    out = []
    chunk = hit if ids is None else ids[hit]
    for i, l, h, o, z, f in zip(chunk.tolist(), lo[hit].tolist(), hi[hit].tolist(),
                                offsets[hit].tolist(), sizes[hit].tolist(), files[hit].tolist()):
        src = tuple(slice(a - c, b - c) for a, b, c in zip(l, h, o))
        dst = tuple(slice(a - c, b - c) for a, b, c in zip(l, h, wl))
        whole_chunk = l == o and h == [c + n for c, n in zip(o, z)]
        out.append(ReadItem(i, int(f), src, dst, whole_chunk, l == wl and h == wh))
    return out


def plan_grid_reads(want: Box, grid: tuple, file_of: Callable[[np.ndarray], np.ndarray]
                    ) -> list[ReadItem]:
    """:func:`plan_reads` for chunks that are the cells of ``grid`` (per dim, rising
    breakpoints: a tuple, an int64 array or :class:`dckpt.format.runs.Runs`; cells in C
    order), found by rule: per dim, a binary search on the breakpoints gives the run of
    cells that ``want`` overlaps; only those cells are built (their boxes, and their
    files through ``file_of(cell indexes)``). The same items, in the same order, as
    :func:`plan_reads` over every cell (tests/layout/test_grid_reads.py). Cost:
    O(ndim log(cuts)) plus O(overlapping cells) numpy and Python, whatever the number of
    cells. ``want`` must lie inside the grid's shape (a load matched the shapes)."""
    if want.numel == 0:
        return []
    first, counts = [], []
    for d, b in enumerate(grid):
        lo, hi = want.offsets[d], want.offsets[d] + want.sizes[d]
        i0 = max(search(b, lo, "right") - 1, 0)  # the cell holding lo
        i1 = min(search(b, hi, "left"), len(b) - 1)  # one past the cell holding hi - 1
        if i1 <= i0:
            return []
        first.append(i0)
        counts.append(i1 - i0)
    if math.prod(counts) <= _FEW:
        return _few_reads(want, grid, first, counts, file_of)
    offsets, sizes = cells(tuple(_cut(b, i0, i0 + n + 1) for b, i0, n in zip(grid, first, counts)),
                           None)
    # each sub-grid cell's index in the whole grid, C order as cells() builds them
    ids = np.zeros(1, np.int64)
    for b, i0, n in zip(grid, first, counts):
        ids = (ids[:, None] * (len(b) - 1) + np.arange(i0, i0 + n, dtype=np.int64)).ravel()
    return plan_reads(want, offsets, sizes, np.asarray(file_of(ids), np.int64), ids)


# At most this many overlapping cells are planned in plain Python: a rank's box
# overlaps one to a few chunks, and numpy's per-call cost was most of the planning
# time per tensor (500 tensors: 0.12 s against 0.03 s).
_FEW = 16


def _few_reads(want: Box, grid: tuple, first: list[int], counts: list[int],
               file_of: Callable[[np.ndarray], np.ndarray]) -> list[ReadItem]:
    """:func:`plan_grid_reads` for a few overlapping cells: the same items as
    :func:`plan_reads` computes (C order; every cell here overlaps ``want``)."""
    dims = []  # per dim: (cell index, cell lo, cell hi, overlap lo, overlap hi)
    for d, (b, i0, n) in enumerate(zip(grid, first, counts)):
        wl, wh = want.offsets[d], want.offsets[d] + want.sizes[d]
        row = []
        for i in range(i0, i0 + n):
            cl, ch = int(b[i]), int(b[i + 1])
            row.append((i, cl, ch, max(cl, wl), min(ch, wh)))
        dims.append(row)
    cellsets = list(itertools.product(*dims))
    ids = []
    for cs in cellsets:
        idx = 0
        for b, c in zip(grid, cs):
            idx = idx * (len(b) - 1) + c[0]
        ids.append(idx)
    files = file_of(np.asarray(ids, np.int64)).tolist()
    out = []
    for idx, f, cs in zip(ids, files, cellsets):
        src = tuple(slice(l - cl, h - cl) for _, cl, _, l, h in cs)
        dst = tuple(slice(l - w, h - w) for (_, _, _, l, h), w in zip(cs, want.offsets))
        whole_chunk = all(l == cl and h == ch for _, cl, ch, l, h in cs)
        whole_target = all(l == w and h == w + z for (_, _, _, l, h), w, z
                           in zip(cs, want.offsets, want.sizes))
        out.append(ReadItem(idx, int(f), src, dst, whole_chunk, whole_target))
    return out


def _cut(b, a: int, z: int):
    """Breakpoints ``a..z-1`` of one dim: a tuple or an int64 array (never the whole
    dim expanded: Runs compute just these)."""
    if isinstance(b, (tuple, np.ndarray)):
        return b[a:z]
    return b.take(np.arange(a, z, dtype=np.int64))


def strides(sizes) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``sizes``."""
    out, acc = [], 1
    for s in reversed(tuple(sizes)):
        out.append(acc)
        acc *= int(s)
    return tuple(reversed(out))


def byte_span(chunk_sizes, region: tuple[slice, ...], itemsize: int) -> tuple[int, int]:
    """The smallest byte range ``[start, end)`` of a C-contiguous chunk holding
    ``region``: from its first element to just past its last."""
    st = strides(chunk_sizes)
    first = sum(r.start * s for r, s in zip(region, st))
    last = sum((r.stop - 1) * s for r, s in zip(region, st))
    return first * itemsize, (last + 1) * itemsize


def split_item(item: ReadItem, chunk_sizes, itemsize: int, budget: int) -> list[ReadItem]:
    """Cut ``item`` into pieces whose byte spans fit ``budget``, along the outermost dim
    with more than one index (recursing inward when one index is still too big), so a
    read never needs a buffer larger than ``budget`` (or one element row of the
    innermost dim). Pure."""
    a, b = byte_span(chunk_sizes, item.src, itemsize)
    if b - a <= budget:
        return [item]
    d = next((i for i, r in enumerate(item.src) if r.stop - r.start > 1), None)
    if d is None:
        return [item]
    one = item.src[:d] + (slice(item.src[d].start, item.src[d].start + 1),) + item.src[d + 1:]
    oa, ob = byte_span(chunk_sizes, one, itemsize)
    step_bytes = strides(chunk_sizes)[d] * itemsize
    k = max(1, (budget - (ob - oa)) // step_bytes + 1) if ob - oa <= budget else 1
    out: list[ReadItem] = []
    s0, t0 = item.src[d].start, item.dst[d].start
    for lo in range(s0, item.src[d].stop, k):
        hi = min(lo + k, item.src[d].stop)
        src = item.src[:d] + (slice(lo, hi),) + item.src[d + 1:]
        dst = item.dst[:d] + (slice(t0 + lo - s0, t0 + hi - s0),) + item.dst[d + 1:]
        piece = ReadItem(item.chunk, item.file, src, dst, False, False)
        out += split_item(piece, chunk_sizes, itemsize, budget) if k == 1 else [piece]
    return out
