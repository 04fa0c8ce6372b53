"""The common case of :func:`dckpt.layout.plan.plan_global` without a sort.

When every rank sent the same key table (FSDP, DDP, tensor parallel: one table) and each
key's boxes ascend with the rank (torch.chunk shards do), the (key, box, rank) order the
planner needs is simply "key, then rank". This module builds that order straight from the
ranks' flat box arrays: one (ranks, width) stack, one transpose to key-major, then one
1-D array per offset/size dim (struct of arrays: numpy reduces over a short second axis
slowly, and a sort or a gather over millions of (row, dim) pairs is what made the general
path cost seconds at 16,384 ranks). Pure numpy, no torch.distributed.

Any doubt (several tables, a malformed plan, a box outside its tensor, boxes that do not
ascend) returns None: the general path then sorts, and raises the error messages. So this
module never decides an error on its own and cannot change the plan, only its cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .localplan import LocalPlan


@dataclass(frozen=True, eq=False)
class Rows:
    """The kept (non-empty) boxes of every rank, sorted by (key, box, rank).

    ``offs[d]`` / ``sizes[d]`` are the 1-D columns of dim ``d`` (padded with offset 0 and
    size 1 past a key's ndim); ``new[i]`` is False when row i repeats row i-1's box of
    the same key (a replica)."""

    kid: np.ndarray
    rank: np.ndarray
    local: np.ndarray
    offs: list[np.ndarray]
    sizes: list[np.ndarray]
    new: np.ndarray


def rows(plans: list[LocalPlan], table_ids: dict[bytes, np.ndarray], shapes: np.ndarray,
         ndims: np.ndarray) -> Rows | None:
    """The sorted kept rows when every rank sent one key table (``table_ids`` has one
    entry, key ids 0..n-1) and the boxes of each key ascend with the rank; else None.
    ``shapes`` is (keys, dmax) with 1 past each key's ndim, ``ndims`` its ndims.
    Cost: O(ranks x width) memory traffic (a stack and a transpose of the box numbers)
    plus a few vectorised passes over the rows; no sort, no Python loop over ranks."""
    if len(table_ids) != 1 or not plans:
        return None
    ids = next(iter(table_ids.values()))
    world, n = len(plans), len(ids)
    if n == 0 or not np.array_equal(ids, np.arange(n)):
        return None
    nd = np.asarray(ndims, np.int64)
    width = int(2 * nd.sum())
    if any(len(p.boxes) != width for p in plans):
        return None  # malformed: the general path names the rank
    dmax = shapes.shape[1]
    # key-major: row c of `cols` is box number c of every rank, ranks along the row
    cols = np.ascontiguousarray(np.stack([p.boxes for p in plans]).T) if width else None
    start = np.concatenate(([0], np.cumsum(2 * nd)[:-1])).astype(np.int64)
    offs2, sizes2 = [], []  # per dim: (keys, ranks)
    bad = np.zeros((n, world), bool)
    for d in range(dmax):
        has = nd > d
        o = _gather(cols, (start + d)[has], has, 0, world)
        s = _gather(cols, (start + nd + d)[has], has, 1, world)
        # o > shape - s, not o + s > shape: the sum of two hostile numbers can wrap
        bad |= (o < 0) | (s < 0) | (o > shapes[:, d, None] - s)
        offs2.append(o)
        sizes2.append(s)
    del cols
    if bad.any():
        return None
    keep = np.ones((n, world), bool)
    for s in sizes2:
        keep &= s > 0  # empty shards write nothing
    kk = keep.ravel()
    if kk.all():
        kid = np.repeat(np.arange(n, dtype=np.int64), world)
        rank = np.tile(np.arange(world, dtype=np.int64), n)
        offs = [o.ravel() for o in offs2]
        sizes = [s.ravel() for s in sizes2]
    else:
        at = np.flatnonzero(kk)
        kid, rank = np.divmod(at, world)
        offs = [o.ravel()[kk] for o in offs2]
        sizes = [s.ravel()[kk] for s in sizes2]
    del offs2, sizes2, bad, keep
    new = _ascending(kid, offs + sizes)
    if new is None:
        return None
    return Rows(kid, rank, kid, offs, sizes, new)  # one table: local index = key id


def _gather(cols: np.ndarray | None, idx: np.ndarray, has: np.ndarray, pad: int,
            world: int) -> np.ndarray:
    """Rows ``idx`` of ``cols`` for the keys where ``has``; ``pad`` for the others."""
    if has.all():
        return cols[idx]
    out = np.full((len(has), world), pad, np.int64)
    if idx.size:
        out[has] = cols[idx]
    return out


def _ascending(kid: np.ndarray, columns: list[np.ndarray]) -> np.ndarray | None:
    """``new`` (box differs from the previous row's, or the key changes) when the rows of
    each key are non-decreasing in the lexicographic order of ``columns``; else None.
    A column is compared only where all earlier ones tie, and the loop stops as soon as
    no pair ties (for FSDP: after the first column). O(rows) per column looked at."""
    new = np.ones(len(kid), bool)
    if len(kid) < 2:
        return new
    tie = kid[1:] == kid[:-1]  # pairs of one key whose boxes are equal so far
    for c in columns:
        if not tie.any():
            break
        a, b = c[1:], c[:-1]
        if (tie & (a < b)).any():
            return None
        tie &= a == b
    new[1:] = ~tie
    return new
