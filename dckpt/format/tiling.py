"""Pure check that a set of boxes tiles a tensor exactly once.

Linear in the number of boxes for the layouts DTensor produces (the boxes are the cells
of a grid: one breakpoint list per dim). Any other layout gets an exact-cover test by
signed corner counts, O(2**k * n log n) for boxes that cut k dims (k is 1 to 3 for any
real layout); where 2**k * n is over a cap, a pairwise test pruned by a sort, itself
capped: a manifest cannot make the check run for minutes (issue 34: 200,000 chunks in
list form took minutes, the pairwise test being quadratic for them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Tensors have at most this many dims (numpy's own limit is 64); a manifest or plan with
# more is refused, so no cost below can grow with an attacker's choice of ndim.
MAX_NDIM = 64
# The corner count makes one int64 key per corner of each box over the cut dims:
# (n + 1) * 2**k of them (32 MiB at the cap). Beyond it the pairwise test runs.
_MAX_CORNERS = 1 << 22
# The pairwise test gives up (an error, not a verdict on the layout) past this many
# candidate pairs: about a second of vectorised work.
_MAX_PAIRS = 1 << 24
# Candidate pairs tested per vectorised step of the pairwise test (bounds its memory).
_PAIR_BLOCK = 1 << 16


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
    of ``shape`` exactly once. Pure; O(ndim * n log n) for grid layouts, O(2**k * n log
    n) for any other whose boxes cut k dims, and bounded where that is over a cap (see
    :func:`_disjoint`). Refuses (as an error in the result, never raising) more than
    ``MAX_NDIM`` dims, and a layout too irregular to check within the caps."""
    ndim = len(shape)
    if ndim > MAX_NDIM:
        return Tiling(f"the tensor has {ndim} dims; at most {MAX_NDIM} are supported")
    n = len(offsets)
    offsets = np.asarray(offsets, np.int64).reshape(n, ndim)
    sizes = np.asarray(sizes, np.int64).reshape(n, ndim)
    numel = math.prod(shape)
    # offsets > shape - sizes, not offsets + sizes > shape: the sum can wrap around int64
    if n and ((sizes <= 0).any() or (offsets < 0).any()
              or (offsets > np.asarray(shape, np.int64) - sizes).any()):
        return Tiling("a chunk is empty or lies outside the tensor")
    if numel == 0:
        return Tiling(None if n == 0 else "chunks given for an empty tensor")
    # each box lies inside, so its volume is <= numel; only the sum can overflow int64
    # column by column: numpy's reduce over a short second axis is slow
    vol = np.ones(n, np.int64)
    for d in range(ndim):
        vol *= sizes[:, d]
    covered = int(vol.sum()) if n * numel < 1 << 63 else sum(vol.tolist())
    if covered != numel:
        return Tiling(f"chunks cover {covered} elements of {numel} (overlap or gap)")
    if ndim == 0:
        return Tiling(None if n == 1 else "several chunks for a scalar", (), np.zeros(1, np.int64))
    split = _split_one_dim(shape, offsets, sizes)
    if split is not None:
        return split
    cgrid = _c_order_grid(shape, offsets, sizes)
    if cgrid is not None:
        return cgrid
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
        # the cells' C-order index; np.ravel_multi_index stops short of 64 dims
        lin = np.zeros(n, np.int64)
        for d in range(ndim):
            lin = lin * dims[d] + lo[d]
        order = np.full(n, -1, np.int64)
        order[lin] = np.arange(n)
        if (order >= 0).all():
            return Tiling(None, tuple(tuple(b.tolist()) for b in bps), order)
        return Tiling("two chunks overlap")
    return Tiling(_disjoint(lo, hi, dims))


def _split_one_dim(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> Tiling | None:
    """The grid of boxes that span every dim whole but one, along which they follow each
    other in order (FSDP's Shard(0), a Shard on one mesh dim, a single box), found
    without the sorts and searches of the general grid test; None for any other layout
    (then the general test decides). The caller has checked that the boxes are non-empty,
    lie inside the tensor and cover exactly its volume. O(n * ndim), no sort: at 16,384
    ranks this is most of the planner's per-tensor cost otherwise."""
    n, ndim = offsets.shape
    # column by column: numpy's reduce over a short second axis is slow
    cut = [d for d in range(ndim) if offsets[:, d].any() or (sizes[:, d] != shape[d]).any()]
    if len(cut) == 0:  # every box is the whole tensor; the volume check left only one
        return Tiling(None, tuple((0, int(x)) for x in shape), np.zeros(1, np.int64)) if n == 1 else None
    if len(cut) > 1:
        return None
    d = cut[0]
    o = offsets[:, d]
    e = o + sizes[:, d]
    if o[0] != 0 or e[-1] != shape[d] or (o[1:] != e[:-1]).any():
        return None  # not in order along d: the general test sorts
    bp = tuple(o.tolist()) + (int(shape[d]),)
    return Tiling(None, tuple(bp if k == d else (0, int(x)) for k, x in enumerate(shape)),
                  np.arange(n, dtype=np.int64))


def _c_order_grid(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> Tiling | None:
    """The grid whose cells the boxes are, in C order (FSDP2 over TP's rowwise weights:
    dp splits dim 0, tp dim 1, and the planner sorts boxes by offsets), found without
    a sort: each cut dim's cell count is where its offset first wraps to 0 along the
    rows where every later cut dim is at its first cell; then every column must repeat
    its breakpoints in that pattern. None for any other layout (the general test
    decides). The caller has checked bounds and volume. O(n * cut dims)."""
    n, ndim = offsets.shape
    cut = [d for d in range(ndim) if offsets[:, d].any() or (sizes[:, d] != shape[d]).any()]
    if len(cut) < 2:
        return None
    stride, pattern = 1, {}
    for d in reversed(cut):
        col = offsets[::stride, d]
        wrap = np.flatnonzero(col[1:] == 0)
        g = int(wrap[0]) + 1 if len(wrap) else len(col)
        pattern[d] = (stride, g)
        stride *= g
    if stride != n:
        return None
    grid = []
    for d in range(ndim):
        if d not in pattern:
            grid.append((0, int(shape[d])))
            continue
        st, g = pattern[d]
        bo, bs = offsets[:g * st:st, d], sizes[:g * st:st, d]
        if bo[0] != 0 or bo[-1] + bs[-1] != shape[d] or (bo[1:] != bo[:-1] + bs[:-1]).any():
            return None
        reps = n // (g * st)
        if ((offsets[:, d] != np.tile(np.repeat(bo, st), reps)).any()
                or (sizes[:, d] != np.tile(np.repeat(bs, st), reps)).any()):
            return None
        grid.append(tuple(bo.tolist()) + (int(shape[d]),))
    return Tiling(None, tuple(grid), np.arange(n, dtype=np.int64))


def _disjoint(lo: list[np.ndarray], hi: list[np.ndarray], dims: tuple[int, ...]) -> str | None:
    """None when no two boxes (given as cell-index ranges, one array per dim, over a grid
    of ``dims`` cells) share a cell, else the error. The caller has checked that the
    boxes lie inside and that their volumes add up to the tensor's: then they tile it
    iff they are disjoint iff their signed corner counts are the tensor's own.

    Only the dims some box cuts count (a dim every box spans whole changes nothing).
    O(2**k * n log n) for n boxes cutting k dims while that is under _MAX_CORNERS; else
    the pairwise test, O(k * n log n + pairs), with pairs capped at _MAX_PAIRS (past it
    the layout is refused as too irregular to check: no real layout comes near)."""
    n = len(lo[0])
    if n < 2:
        return None
    cut = [d for d in range(len(dims)) if (lo[d] != 0).any() or (hi[d] != dims[d]).any()]
    if not cut:
        return "two chunks overlap"  # every box is the whole tensor
    los = np.stack([lo[d] for d in cut], 1)
    his = np.stack([hi[d] for d in cut], 1)
    if (n + 1) << len(cut) <= _MAX_CORNERS:
        ok = _disjoint_corners(los, his, [dims[d] for d in cut])
        return None if ok else "two chunks overlap"
    ok = _disjoint_pairwise(los, his)
    if ok is None:
        return (f"{n} chunks cut {len(cut)} dims in no grid, with too many overlapping "
                "candidate pairs to check")
    return None if ok else "two chunks overlap"


def _disjoint_corners(lo: np.ndarray, hi: np.ndarray, dims: list[int]) -> bool:
    """Exact cover by signed corner counts, with no grid allocated: each box adds
    (-1)**(its corner's count of hi coordinates) at each of its 2**k corners, the whole
    tensor's box subtracts the same, and the net must be 0 at every point. The net is
    the k-fold finite difference of (coverage count - 1) over the cell grid, and prefix
    sums invert it: zero everywhere iff every cell is covered exactly once (the dense
    coverage count this replaces did those prefix sums over every cell). Sparse: the
    points are sorted as int64 keys, re-ranked whenever the mixed radix would pass
    2**62, so no product of extents can overflow. (n, k) cell ranges; O(2**k * n *
    (k + log n)) time, O(2**k * n) memory."""
    n, k = lo.shape
    lo = np.vstack([lo, np.zeros((1, k), np.int64)])  # the whole tensor, subtracted
    hi = np.vstack([hi, np.asarray(dims, np.int64).reshape(1, k)])
    corners = np.arange(1 << k, dtype=np.int64)
    key = np.zeros((1 << k, n + 1), np.int64)
    span = 1
    for d in range(k):
        ext = dims[d] + 1
        if span * ext >= 1 << 62:  # re-rank: the keys' order and equality stay
            _, inv = np.unique(key, return_inverse=True)
            key = inv.reshape(key.shape).astype(np.int64)
            span = int(key.max()) + 1
        take_hi = ((corners >> d) & 1).astype(bool)[:, None]
        key = key * ext + np.where(take_hi, hi[:, d], lo[:, d])
        span *= ext
    parity = np.zeros(1 << k, np.int64)
    for d in range(k):
        parity ^= (corners >> d) & 1
    sign = (1 - 2 * parity)[:, None] * np.concatenate((np.ones(n, np.int64), [-1]))
    key, sign = key.ravel(), sign.ravel()
    order = np.argsort(key, kind="stable")
    key, sign = key[order], sign[order]
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    return not np.add.reduceat(sign, starts).any()


def _disjoint_pairwise(lo: np.ndarray, hi: np.ndarray) -> bool | None:
    """Pairwise test of (n, ndim) cell ranges, pruned by a sort on one dim: after sorting
    by start on dim d, box k can only meet the boxes after it that start before it ends
    there. The dim that leaves the fewest candidate pairs is used, tested _PAIR_BLOCK at
    a time; O(ndim * n log n) to count them, then O(pairs). None (no verdict) when over
    _MAX_PAIRS pairs remain: O(n**2) at worst (boxes that all overlap on every dim)."""
    n, ndim = lo.shape
    best = None
    for d in range(ndim):
        order = np.argsort(lo[:, d], kind="stable")
        end = np.searchsorted(lo[order, d], hi[order, d], side="left")
        count = np.maximum(end - np.arange(1, n + 1), 0)  # candidates after box k
        total = int(count.sum())
        if best is None or total < best[0]:
            best = (total, order, count)
        if total == 0:
            return True
    total, order, count = best
    if total > _MAX_PAIRS:
        return None
    lo, hi = lo[order], hi[order]
    first = np.cumsum(count) - count  # flat index of box k's first candidate pair
    for p0 in range(0, total, _PAIR_BLOCK):
        p = np.arange(p0, min(p0 + _PAIR_BLOCK, total))
        row = np.searchsorted(first, p, side="right") - 1
        # rows with no candidates share their `first` with the next row: searchsorted
        # lands on the last of them, which is the one that owns pair p
        col = row + 1 + (p - first[row])
        if (np.maximum(lo[row], lo[col]) < np.minimum(hi[row], hi[col])).all(axis=1).any():
            return False
    return True
