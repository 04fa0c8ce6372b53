"""Pure resharding math: saved chunks x a wanted box -> what to read and where it goes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
               files: np.ndarray) -> list[ReadItem]:
    """Every chunk overlapping ``want``, with the overlap in both coordinate systems.
    Vectorised over chunks: O(chunks) numpy work plus O(overlaps) Python."""
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
    for i, l, h, o, z, f in zip(hit.tolist(), lo[hit].tolist(), hi[hit].tolist(),
                                offsets[hit].tolist(), sizes[hit].tolist(), files[hit].tolist()):
        src = tuple(slice(a - c, b - c) for a, b, c in zip(l, h, o))
        dst = tuple(slice(a - c, b - c) for a, b, c in zip(l, h, wl))
        whole_chunk = l == o and h == [c + n for c, n in zip(o, z)]
        out.append(ReadItem(i, int(f), src, dst, whole_chunk, l == wl and h == wh))
    return out


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
