"""Rank 0 derives every rank's boxes from a plan signature (:mod:`.rules`): the global
plan :func:`dckpt.layout.plan.plan_global` would build from the gathered plans, built
straight in grid form, without any rank's boxes.

Per distinct (global shape, layout) pair, per tensor dim: the mesh dims that shard it
give each combination of their coordinates one run of the dim (``torch.chunk`` nested
in closed form for Shard; for ``_StridedShard`` an O(dim length) numpy pass that follows
every index through the steps, as :mod:`.strided` describes them). The runs of all
combinations partition the dim, so their starts are the grid's breakpoints; a cell's
holders are the mesh positions with that combination, free over the Replicate mesh
dims. Writers follow plan_global's rule exactly (one holder: itself; replicas: round
robin per holder set, largest first, over all tensors in key order), so a derived plan
and a gathered one write the same manifest. Cost: O(ranks + cells + dim lengths) per
distinct layout, then O(ranks) numpy passes per tensor (the write masks and the
check hashes); memory O(ranks x tensors) bits for the masks, never O(ranks x tensors)
boxes. Layouts that give a rank several boxes of a tensor, meshes with ranks outside the
group, explicit (ShardedTensor) items and malformed signatures raise
:class:`NotDerivable`: the caller takes the gathered path. Pure: numpy, no
torch.distributed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..format.dtypes import ITEMSIZE
from ..format import tiling
from . import rules
from .plan import GlobalPlan, PlannedTensor

_SMALL = 64  # grid dims up to this many breakpoints stay tuples (as the parser keeps them)


class NotDerivable(Exception):
    """The signature's plan cannot be derived here: plan by gathering instead."""


@dataclass(frozen=True, eq=False)
class _Boxes:
    """One (global shape, layout) pair over every rank of the group."""

    grid: tuple | None  # per dim: breakpoints (tuple, or int64 array when long)
    cell_joint: np.ndarray  # (cells,) the holder set of each cell (C order)
    cell_elems: np.ndarray  # (cells,) elements per cell
    holders: np.ndarray  # (sets, H) group ranks holding each set's cells, ascending
    fp: np.ndarray  # (sets,) int64: plan_global's fingerprint of each holder set
    rank_cell: np.ndarray  # (ranks,) the cell each rank holds, -1: nothing
    lanes: np.ndarray  # (ranks, 2) uint64: rules.box_lanes of each rank's box
    writer1: np.ndarray | None  # (cells,) writer when H == 1 (no replicas)


def _chunk(length: np.ndarray, parts: int, index: np.ndarray):
    step = -(-length // parts)
    start = np.minimum(index * step, length)
    return start, np.minimum(step, length - start)


def _dim_combos(length: int, steps: list[tuple[tuple, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(start, size) of the one run each combination of the sharding mesh dims'
    coordinates (mixed radix, first mesh dim most significant) keeps of a dim of
    ``length``. Raises NotDerivable when a combination keeps several runs."""
    ms = [m for _, m in steps]
    if not any(p[0] == "SS" for p, _ in steps):
        idx = np.indices(ms).reshape(len(ms), -1) if ms else np.zeros((0, 1), np.int64)
        start = np.zeros(idx.shape[1], np.int64)
        ln = np.full(idx.shape[1], length, np.int64)
        for (_, m), c in zip(steps, idx):
            s, ln = _chunk(ln, m, c)
            start = start + s
        return start, ln
    pos = np.arange(length, dtype=np.int64)
    grp = np.zeros(length, np.int64)
    lens = np.array([length], np.int64)
    for p, m in steps:
        cur = lens[grp]
        cc = np.arange(m, dtype=np.int64)
        if p[0] == "S":
            step = -(-cur // m)
            c = pos // step
            newpos = pos - c * step
            _, newlens = _chunk(lens[:, None], m, cc[None, :])
        else:
            sf = p[2]
            step1 = -(-cur // sf)
            j = pos // step1
            w = pos - j * step1
            step2 = -(-np.minimum(step1, cur - j * step1) // m)
            c = w // step2
            _, lnj = _chunk(lens[:, None], sf, np.arange(sf, dtype=np.int64)[None, :])
            _, piece = _chunk(lnj[:, :, None], m, cc[None, None, :])  # (groups, sf, m)
            newpos = (np.cumsum(piece, axis=1) - piece)[grp, j, c] + (w - c * step2)
            newlens = piece.sum(1)
        grp, pos, lens = grp * m + c, newpos, newlens.reshape(-1)
    ncomb = len(lens)
    order = np.argsort(grp, kind="stable")  # by combination, then index
    g = grp[order]
    cnt = np.bincount(g, minlength=ncomb)
    first = np.cumsum(cnt) - cnt
    if not np.array_equal(pos[order], np.arange(length) - np.repeat(first, cnt)):
        raise NotDerivable("local positions do not ascend with the index")
    start = np.zeros(ncomb, np.int64)
    have = cnt > 0
    start[have] = order[first[have]]
    last = np.zeros(ncomb, np.int64)
    last[have] = order[first[have] + cnt[have] - 1]
    if (last[have] - start[have] + 1 != cnt[have]).any():
        raise NotDerivable("a rank holds several boxes of a tensor")
    return start, cnt.astype(np.int64)


def _boxes(shape: tuple[int, ...], lay: rules.Layout, group_ranks: np.ndarray,
           salt: np.ndarray) -> _Boxes:
    world = len(group_ranks)
    nd = len(shape)
    mranks = np.asarray(lay.ranks, np.int64)
    top = int(max(mranks.max(initial=0), group_ranks.max(initial=0))) + 1
    inv = np.full(top, -1, np.int64)
    inv[group_ranks] = np.arange(world)
    mg = inv[mranks]  # group rank at each mesh position
    if (mg < 0).any() or len(np.unique(mg)) != len(mg):
        raise NotDerivable("a mesh holds ranks outside the save's group, or one twice")
    if nd == 0 and len(mg) < world:  # a 0-d box is never empty: outsiders count as holders
        raise NotDerivable("a 0-d DTensor on a mesh of part of the group")
    coords = np.unravel_index(np.arange(len(mg)), lay.shape)
    for p in lay.placements:
        if p[0] != "R" and not p[1] < nd:
            raise NotDerivable(f"placement {p!r} on a {nd}-d tensor")
    numel = math.prod(shape)
    starts, sizes, combo, radix = [], [], [], []
    for d in range(nd):
        mdims = [i for i, p in enumerate(lay.placements) if p[0] != "R" and p[1] == d]
        ms = [lay.shape[i] for i in mdims]
        if numel == 0:  # every box is empty (and hashes as the zero box)
            st = sz = np.zeros(math.prod(ms), np.int64)
        else:
            st, sz = _dim_combos(int(shape[d]), [(lay.placements[i], lay.shape[i]) for i in mdims])
        starts.append(st)
        sizes.append(sz)
        combo.append(np.ravel_multi_index([coords[i] for i in mdims], ms) if mdims
                     else np.zeros(len(mg), np.int64))
        radix.append(math.prod(ms))
    # per dim: the non-empty runs sorted by start (the grid's rows), each combo's row
    rows, ridx = [], []
    for st, sz in zip(starts, sizes):
        nz = np.flatnonzero(sz > 0)
        nz = nz[np.argsort(st[nz], kind="stable")]
        r = np.full(len(st), -1, np.int64)
        r[nz] = np.arange(len(nz))
        rows.append(nz)
        ridx.append(r)
    # the holder set (joint combination) of every mesh position, and each set's holders
    jstride = [math.prod(radix[d + 1:]) for d in range(nd)]
    joint = np.zeros(len(mg), np.int64)
    for d in range(nd):
        joint += combo[d] * jstride[d]
    nsets = math.prod(radix)
    order = np.lexsort((mg, joint))
    per = len(mg) // nsets
    holders = mg[order].reshape(nsets, per)
    fp = salt[holders].sum(1) if per else np.zeros(nsets, np.int64)
    # each rank's box and cell
    boxo = np.zeros((world, nd), np.int64)
    boxs = np.zeros((world, nd), np.int64)
    rank_cell = np.full(world, -1, np.int64)
    ncnt = [len(r) for r in rows]
    cstride = [math.prod(ncnt[d + 1:]) for d in range(nd)]
    cell = np.zeros(len(mg), np.int64)
    ok = np.ones(len(mg), bool)
    for d in range(nd):
        boxo[mg, d] = starts[d][combo[d]]
        boxs[mg, d] = sizes[d][combo[d]]
        ri = ridx[d][combo[d]]
        ok &= ri >= 0
        cell += np.maximum(ri, 0) * cstride[d]
    if numel:
        rank_cell[mg[ok]] = cell[ok]
    lanes = rules.box_lanes(boxo, boxs)
    if numel == 0:
        e = np.zeros(0, np.int64)
        return _Boxes(None, e, e, holders, fp, rank_cell, lanes, e)
    ncells = math.prod(ncnt)
    cid = np.arange(ncells, dtype=np.int64)
    cell_joint = np.zeros(ncells, np.int64)
    elems = np.ones(ncells, np.int64)
    grid = []
    for d in range(nd):
        i = cid // cstride[d] % ncnt[d] if ncnt[d] > 1 else np.zeros(ncells, np.int64)
        cell_joint += rows[d][i] * jstride[d]
        elems *= sizes[d][rows[d]][i]
        bp = np.append(starts[d][rows[d]], shape[d])
        grid.append(tuple(bp.tolist()) if len(bp) <= _SMALL else bp)
    writer1 = holders[cell_joint, 0] if per == 1 else None
    return _Boxes(tuple(grid), cell_joint, elems, holders, fp, rank_cell, lanes, writer1)


@dataclass(frozen=True, eq=False)
class Derived:
    """A derived plan: ``plan`` (values empty: the caller adds them) and ``hashes``,
    (ranks, 2) uint64, the :func:`dckpt.layout.rules.plan_hash` each rank must have
    sent for its boxes."""

    plan: GlobalPlan
    hashes: np.ndarray

    def mismatch(self, got: list[bytes]) -> int | None:
        """The first rank whose sent hash differs from the derived one, or None."""
        want = np.ascontiguousarray(self.hashes.astype("<u8"))
        sent = np.frombuffer(b"".join(got), "<u8").reshape(-1, 2) if got else want[:0]
        if len(sent) != len(want) or any(len(h) != 16 for h in got):
            return 0
        bad = np.flatnonzero((sent != want).any(1))
        return int(bad[0]) if len(bad) else None


def derive(sig: rules.Signature, world: int) -> Derived:
    """Every rank's boxes, writers and write masks for ``sig`` over ``world`` ranks.
    Pure. Raises NotDerivable (see the module docstring)."""
    group_ranks = np.asarray(sig.group_ranks, np.int64)
    if len(group_ranks) != world or len(np.unique(group_ranks)) != world or (group_ranks < 0).any():
        raise NotDerivable("the signature's group does not match the save's")
    if not sig.derivable():
        raise NotDerivable("explicit items")
    keys = [k for k, *_ in sig.items]
    if len(set(keys)) != len(keys):
        raise NotDerivable("a key listed twice")
    salt = np.random.default_rng(0).integers(1, 1 << 62, max(world, 1), dtype=np.int64)
    plain = rules.Layout(tuple(group_ranks.tolist()), (world,), (("R",),))
    memo: dict = {}
    ranks = np.arange(world, dtype=np.int64)
    nkeys = len(sig.items)
    mask = np.zeros((world, nkeys), bool)
    hashes = np.zeros((world, 2), np.uint64)
    bytes_per_rank = np.zeros(world, np.int64)
    per_key = []
    rep = []  # (key index, its boxes, cell bytes): replicated cells, assigned below
    with np.errstate(over="ignore"):
        for k, (key, dt, shape, lid) in enumerate(sig.items):
            if dt not in ITEMSIZE or len(shape) > tiling.MAX_NDIM:
                raise NotDerivable(f"tensor {key!r}")
            lay = plain if lid == rules.PLAIN else sig.layouts[lid]
            b = memo.get((shape, lid))
            if b is None:
                b = memo[(shape, lid)] = _boxes(tuple(shape), lay, group_ranks, salt)
            hashes += rules.key_lanes(b.lanes, k)
            gbytes = b.cell_elems * ITEMSIZE[dt]
            if b.writer1 is not None or not len(b.cell_joint):
                w = b.writer1
                mask[:, k] = b.rank_cell >= 0
                bw = memo.get((id(b), dt))
                if bw is None:
                    bw = memo[(id(b), dt)] = np.bincount(w, weights=gbytes, minlength=world).astype(np.int64)
                bytes_per_rank += bw
            else:
                w = None
                rep.append((k, b, gbytes))
            per_key.append((key, dt, tuple(shape), b, w))
    if rep:  # plan_global's round robin per holder set, largest first, over all tensors
        fp = np.concatenate([b.fp[b.cell_joint] for _, b, _ in rep])
        gb = np.concatenate([g for _, _, g in rep])
        cnt = np.concatenate([np.full(len(b.cell_joint), b.holders.shape[1], np.int64)
                              for _, b, _ in rep])
        by = np.lexsort((-gb, fp))
        first = np.ones(len(by), bool)
        first[1:] = fp[by[1:]] != fp[by[:-1]]
        cls = np.cumsum(first) - 1
        pos = np.arange(len(by)) - np.flatnonzero(first)[cls]
        pick = np.empty(len(by), np.int64)
        pick[by] = (pos + cls) % cnt[by]
        at = 0
        for k, b, g in rep:
            n = len(b.cell_joint)
            w = b.holders[b.cell_joint, pick[at:at + n]]
            at += n
            key, dt, shape, _, _ = per_key[k]
            per_key[k] = (key, dt, shape, b, w)
            held = b.rank_cell >= 0
            mask[held, k] = w[b.rank_cell[held]] == ranks[held]
            bytes_per_rank += np.bincount(w, weights=g, minlength=world).astype(np.int64)
    tensors = {}
    for key, dt, shape, b, w in per_key:
        if b.grid is None:  # no elements: no chunks
            z = np.zeros((0, len(shape)), np.int64)
            tensors[key] = PlannedTensor(key, dt, shape, z, z.copy(), np.zeros(0, np.int64), None)
        else:
            tensors[key] = PlannedTensor(key, dt, shape, None, None, w, b.grid)
    counts = np.full(world, nkeys, "<i8")
    packed = (world.to_bytes(8, "little") + counts.tobytes()
              + np.packbits(mask.reshape(-1)).tobytes())
    gp = GlobalPlan(tensors, {}, [], bytes_per_rank, {}, sorted(set(sig.int_keys)),
                    packed_writes=packed)
    return Derived(gp, hashes)
