"""Where each data-parallel rank holds each parameter under DeepSpeed ZeRO: one
contiguous range of the flattened (``view(-1)``) parameter, or nothing. Pure
arithmetic, no torch, no I/O (property-tested in tests/format/test_deepspeed_layout.py).

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``, ``BF16_Optimizer``): a param group's trainable
  parameters are concatenated into one flat buffer of ``W * partition`` elements (the
  tail is padding); rank ``r`` owns ``[r * partition, (r + 1) * partition)`` of it, so
  each parameter is cut where it crosses a rank's boundary.
- ZeRO-3: each parameter alone is split in ``c = ceil(n / W)`` element pieces, rank
  ``r`` holding ``[r * c, min(n, (r + 1) * c))`` (the last ranks' tail is padding, a
  rank may hold only padding).

A checkpoint stores each parameter's master and optimizer states as a logical 1-D
tensor of ``n`` elements built from these ranges (padding never stored), so a load at
another world size or ZeRO stage reads, per parameter, exactly its new range.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fragment:
    """Rank ``rank`` holds elements ``[start, start + numel)`` of a flattened
    parameter; in its flat buffer they start at ``flat``."""

    rank: int
    start: int
    numel: int
    flat: int = 0


def grouped(numels: list[int], partition: int, world: int,
            offsets: list[int] | None = None) -> list[list[Fragment]]:
    """ZeRO-1/2: the fragments of each parameter of one param group, in rank order
    (only non-empty ones). ``numels``: the parameters' sizes in flat order;
    ``offsets``: their starts in the flat buffer (default: packed, cumulative);
    ``partition``: each rank's share of the flat. O(params + world). Raises ValueError
    when the parameters do not fit in ``world * partition`` elements or overlap."""
    if partition < 0 or world < 1:
        raise ValueError(f"bad partition {partition} or world size {world}")
    if offsets is None:
        offsets, at = [], 0
        for n in numels:
            offsets.append(at)
            at += n
    if len(offsets) != len(numels):
        raise ValueError("one offset per parameter")
    out: list[list[Fragment]] = []
    end = 0
    for n, o in zip(numels, offsets):
        if n < 0 or o < end:
            raise ValueError(f"parameter at {o} of {n} elements overlaps the one before")
        end = o + n
        if end > world * partition:
            raise ValueError(f"parameters end at {end}, past {world} x {partition} elements")
        frags = []
        if n:
            r = o // partition if partition else 0
            while r < world and r * partition < end:
                lo, hi = max(o, r * partition), min(end, (r + 1) * partition)
                if hi > lo:
                    frags.append(Fragment(r, lo - o, hi - lo, lo - r * partition))
                r += 1
        out.append(frags)
    return out


def zero3_partition(numel: int, world: int) -> int:
    """ZeRO-3's per-rank piece of a parameter of ``numel`` elements: ``ceil(n / W)``."""
    return -(-numel // world)


def split(numel: int, world: int) -> list[Fragment]:
    """ZeRO-3: the non-empty fragments of one parameter, in rank order (``flat`` is
    the offset within the rank's own piece: 0)."""
    c = zero3_partition(numel, world)
    out = []
    for r in range(world):
        lo, hi = r * c, min(numel, (r + 1) * c)
        if hi > lo:
            out.append(Fragment(r, lo, hi - lo, 0))
    return out


def mine(frags: list[Fragment], rank: int) -> Fragment | None:
    """Rank ``rank``'s fragment in ``frags``, None when it holds nothing."""
    for f in frags:
        if f.rank == rank:
            return f
    return None
