"""Pure layout math: which box of a global tensor a rank holds.

A box is ``(offsets, sizes)``, one integer per dim. DTensor placements are described
here without torch: ``("S", dim)`` for Shard, ``("R",)`` for Replicate. Sharding follows
``torch.chunk``: a dim of length n split k ways gives pieces of ceil(n/k) elements, the
last ones shorter or empty; several Shard placements on one dim nest left to right, as
DTensor does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Placement = tuple  # ("S", dim) | ("R",)


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def chunk_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of piece ``index`` of ``torch.chunk(range(length), parts)``, padded
    with empty pieces up to ``parts``."""
    step = -(-length // parts) if length else 0
    start = min(index * step, length)
    return start, min(step, length - start)


def local_box(global_shape: Sequence[int], mesh_shape: Sequence[int],
              coordinate: Sequence[int], placements: Sequence[Placement]) -> Box:
    """The box held by the rank at ``coordinate`` of a mesh of ``mesh_shape``.

    Raises ValueError for a placement that is neither Shard nor Replicate, a shard dim
    out of range, or mismatched lengths."""
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise ValueError("mesh shape, coordinate and placements must have equal lengths")
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if p[0] == "R":
            continue
        if p[0] != "S":
            raise ValueError(f"placement {p!r} is not Shard or Replicate")
        d = p[1]
        if not 0 <= d < len(global_shape):
            raise ValueError(f"Shard({d}) on a {len(global_shape)}-d tensor")
        start, size = chunk_range(sizes[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offsets[d] += start
        sizes[d] = size
    return Box(tuple(offsets), tuple(sizes))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None when it is empty."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))
