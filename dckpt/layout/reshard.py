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
    out = []
    for i in hit:
        src = tuple(slice(int(a - o), int(b - o)) for a, b, o in zip(lo[i], hi[i], offsets[i]))
        dst = tuple(slice(int(a - o), int(b - o)) for a, b, o in zip(lo[i], hi[i], w_lo))
        whole_chunk = bool((lo[i] == offsets[i]).all() and (hi[i] == offsets[i] + sizes[i]).all())
        whole_target = bool((lo[i] == w_lo).all() and (hi[i] == w_hi).all())
        out.append(ReadItem(int(i), int(files[i]), src, dst, whole_chunk, whole_target))
    return out
