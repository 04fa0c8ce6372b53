"""The common case of :func:`dckpt.layout.plan.plan_global` without a sort.

When every rank sent the same key table (FSDP, DDP, tensor parallel: one table) and each
key's boxes ascend with the rank (torch.chunk shards do), the (key, box, rank) order the
planner needs is simply "key, then rank". When they do not (FSDP2 over TP: a strided
placement puts rank (dp, tp)'s rows after those of rank (dp + 1, tp - 1)), a stable
sort of each such key's boxes along the ranks restores it, still without the general
path's lexsort over every (rank, key) row. This module builds that order straight from the
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
    entry, key ids 0..n-1) and the boxes of each key ascend with the rank, or do so
    once each key's boxes are sorted along the ranks; else None.
    ``shapes`` is (keys, dmax) with 1 past each key's ndim, ``ndims`` its ndims.
    Cost: O(ranks x width) memory traffic (a stack and a transpose of the box numbers)
    plus a few vectorised passes over the rows; no Python loop over ranks, and a sort
    only of the keys whose boxes do not ascend with the rank."""
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
    # Boxes that do not ascend with the rank (FSDP2 over TP: rank (dp, tp) holds row
    # block tp * DP + dp): each such key's boxes are sorted along the ranks, stably (ties
    # keep the rank order). Timsort finds the interleaved runs: ~0.03 s for 500 keys x
    # 16,384 ranks, against seconds for the general path's lexsort. Dim 0 decides up
    # front (one comparison pass); the full check after the flatten catches the rest.
    perm = _order(offs2) if dmax and (offs2[0][:, 1:] < offs2[0][:, :-1]).any() else None
    for attempt in range(2):
        kid, rank, offs, sizes = _flatten(offs2, sizes2, perm, n, world)
        new = _ascending(kid, offs + sizes)
        if new is not None:
            return Rows(kid, rank, kid, offs, sizes, new)  # one table: local index = key id
        if attempt or perm is not None:
            return None
        perm = _order(offs2)
    return None


def _flatten(offs2: list[np.ndarray], sizes2: list[np.ndarray], perm: np.ndarray | None,
             n: int, world: int):
    """(kid, rank, offs, sizes) of the non-empty boxes of (keys, world) columns, key
    major; ``perm[k]`` is the order of key k's columns (None: the rank order). One
    gather per column either way."""
    keep = np.ones((n, world), bool)
    for z in sizes2:
        keep &= z > 0  # empty shards write nothing
    if perm is None:
        kk = keep.ravel()
        if kk.all():
            kid = np.repeat(np.arange(n, dtype=np.int64), world)
            rank = np.tile(np.arange(world, dtype=np.int64), n)
            return kid, rank, [o.ravel() for o in offs2], [z.ravel() for z in sizes2]
        at = np.flatnonzero(kk)
    else:
        at = (perm + (np.arange(n, dtype=np.int64) * world)[:, None]).ravel()
        at = at[keep.ravel()[at]]
    kid, rank = np.divmod(at, world)
    return kid, rank, [o.ravel()[at] for o in offs2], [z.ravel()[at] for z in sizes2]


def _order(offs2: list[np.ndarray]) -> np.ndarray:
    """(keys, world) column order sorting each key's boxes by offsets (lexicographic,
    stable), for the keys whose offsets do not already ascend; identity elsewhere.
    Least significant dim first, one stable argsort along the ranks per dim (skipped
    while the order is still the identity and the dim does not decrease)."""
    keys, world = offs2[0].shape if offs2 else (0, 0)
    perm = np.broadcast_to(np.arange(world, dtype=np.int64), (keys, world)).copy()
    down = [(o[:, 1:] < o[:, :-1]).any(1) for o in offs2]
    sel = np.flatnonzero(np.logical_or.reduce(down)) if down else np.zeros(0, np.int64)
    if not len(sel):
        return perm
    p = None
    for o, dn in zip(reversed(offs2), reversed(down)):
        if p is None and not dn[sel].any():
            continue  # already ascending in rank order: its stable sort is the identity
        col = o[sel] if p is None else np.take_along_axis(o[sel], p, 1)
        q = np.argsort(col, axis=1, kind="stable")
        p = q if p is None else np.take_along_axis(p, q, 1)
    perm[sel] = p
    return perm


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
