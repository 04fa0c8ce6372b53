"""Rank 0 derives every rank's boxes from a plan signature (:mod:`.rules`): the global
plan :func:`dckpt.layout.plan.plan_global` would build from the gathered plans, built
straight in grid form, without any rank's boxes.

Per layout and group of tensors whose sharded dims have the same lengths (the
unsharded dims are one whole run, whatever their length), per tensor dim: the mesh dims
that shard it give each combination of their coordinates one run of the dim (``torch.chunk`` nested
in closed form for Shard; for ``_StridedShard`` an O(dim length) numpy pass that follows
every index through the steps, as :mod:`.strided` describes them). The runs of all
combinations partition the dim, so their starts are the grid's breakpoints; a cell's
holders are the mesh positions with that combination, free over the Replicate mesh
dims. Writers follow plan_global's rule exactly (one holder: itself; replicas: round
robin per holder set, largest first, over all tensors in key order), so a derived plan
and a gathered one write the same manifest. Cost: O(ranks) once per layout and per (layout, ndim) (the holder sets),
O(ranks + cells + sharded dim lengths) per group, O(ranks) per distinct shape (the box
hashes) and per tensor (the write mask and the check hash); memory O(ranks x tensors)
bits for the masks and O(ranks) per group alive, never O(ranks x tensors)
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
class _Sets:
    """One layout on tensors of one ndim over every rank of the group: which mesh dims
    shard each tensor dim, and the holder sets. Shared by every tensor of that layout
    and ndim."""

    mg: np.ndarray  # (mesh positions,) the group rank at each
    mdims: list  # per tensor dim: the mesh dims that shard it
    combo: list  # per tensor dim: (mesh positions,) combination of those dims' coords
    radix: list  # per tensor dim: the number of combinations
    jstride: list
    holders: np.ndarray  # (sets, H) group ranks holding each set's cells, ascending
    fp: np.ndarray  # (sets,) int64: plan_global's fingerprint of each holder set


@dataclass(frozen=True, eq=False)
class _Boxes:
    """One layout on tensors whose sharded dims have the same lengths (the others any
    length: they are one run, whole), over every rank of the group. A tensor's grid,
    cell bytes and box hashes follow from it and its shape (:func:`_lanes`)."""

    sets: _Sets
    runs: list  # per dim: (starts, sizes) of each combination (None: unsharded dim)
    grid: list  # per dim: breakpoints (tuple, int64 array when long; None: unsharded)
    cell_joint: np.ndarray  # (cells,) the holder set of each cell (C order)
    cell_elems: np.ndarray  # (cells,) elements per cell over the sharded dims
    rank_cell: np.ndarray  # (ranks,) the cell each rank holds, -1: nothing
    writer1: np.ndarray | None  # (cells,) writer when H == 1 (no replicas)
    empty: bool  # the tensors have no elements: no cells, every box empty


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


def _mesh(lay: rules.Layout, group_ranks: np.ndarray) -> np.ndarray:
    """The group rank at each mesh position. O(ranks), once per layout."""
    world = len(group_ranks)
    mranks = np.asarray(lay.ranks, np.int64)
    top = int(max(mranks.max(initial=0), group_ranks.max(initial=0))) + 1
    inv = np.full(top, -1, np.int64)
    inv[group_ranks] = np.arange(world)
    mg = inv[mranks]
    if (mg < 0).any() or np.bincount(mg, minlength=world).max(initial=0) > 1:
        raise NotDerivable("a mesh holds ranks outside the save's group, or one twice")
    return mg


def _sets(lay: rules.Layout, mg: np.ndarray, nd: int, salt: np.ndarray) -> _Sets:
    """The holder sets of ``lay`` on ``nd``-d tensors. O(ranks), once per (layout, nd)."""
    for p in lay.placements:
        if p[0] != "R" and not p[1] < nd:
            raise NotDerivable(f"placement {p!r} on a {nd}-d tensor")
    coords = np.unravel_index(np.arange(len(mg)), lay.shape)
    mdims, combo, radix = [], [], []
    for d in range(nd):
        md = [i for i, p in enumerate(lay.placements) if p[0] != "R" and p[1] == d]
        ms = [lay.shape[i] for i in md]
        mdims.append(md)
        combo.append(np.ravel_multi_index([coords[i] for i in md], ms) if md
                     else np.zeros(len(mg), np.int64))
        radix.append(math.prod(ms))
    jstride = [math.prod(radix[d + 1:]) for d in range(nd)]
    joint = np.zeros(len(mg), np.int64)
    for d in range(nd):
        joint += combo[d] * jstride[d]
    nsets = math.prod(radix)
    order = np.lexsort((mg, joint))
    per = len(mg) // nsets
    holders = mg[order].reshape(nsets, per)
    fp = salt[holders].sum(1) if per else np.zeros(nsets, np.int64)
    return _Sets(mg, mdims, combo, radix, jstride, holders, fp)


def _boxes(shape: tuple[int, ...], lay: rules.Layout, sets: _Sets, world: int) -> _Boxes:
    """The cells, holders and writers of ``lay`` on tensors of ``shape``'s sharded dim
    lengths. O(ranks + cells + sharded dim lengths)."""
    nd = len(shape)
    mg = sets.mg
    numel = math.prod(shape)
    runs, rows, ridx = [], [], []
    for d in range(nd):
        if not sets.mdims[d]:
            runs.append(None)
            rows.append(np.zeros(1, np.int64))
            ridx.append(np.zeros(1, np.int64))
            continue
        if numel == 0:  # every box is empty (and hashes as the zero box)
            st = sz = np.zeros(sets.radix[d], np.int64)
        else:
            st, sz = _dim_combos(int(shape[d]), [(lay.placements[i], lay.shape[i])
                                                 for i in sets.mdims[d]])
        runs.append((st, sz))
        # the non-empty runs sorted by start (the grid's rows), each combo's row
        nz = np.flatnonzero(sz > 0)
        nz = nz[np.argsort(st[nz], kind="stable")]
        r = np.full(len(st), -1, np.int64)
        r[nz] = np.arange(len(nz))
        rows.append(nz)
        ridx.append(r)
    per = sets.holders.shape[1]
    e = np.zeros(0, np.int64)
    if numel == 0:
        return _Boxes(sets, runs, [None] * nd, e, e, np.full(world, -1, np.int64), e, True)
    ncnt = [len(r) for r in rows]
    cstride = [math.prod(ncnt[d + 1:]) for d in range(nd)]
    cell = np.zeros(len(mg), np.int64)
    ok = np.ones(len(mg), bool)
    for d in range(nd):
        if runs[d] is None:
            continue
        ri = ridx[d][sets.combo[d]]
        ok &= ri >= 0
        cell += np.maximum(ri, 0) * cstride[d]
    rank_cell = np.full(world, -1, np.int64)
    rank_cell[mg[ok]] = cell[ok]
    ncells = math.prod(ncnt)
    cid = np.arange(ncells, dtype=np.int64)
    cell_joint = np.zeros(ncells, np.int64)
    elems = np.ones(ncells, np.int64)
    grid: list = []
    for d in range(nd):
        if runs[d] is None:
            grid.append(None)
            continue
        st, sz = runs[d]
        i = cid // cstride[d] % ncnt[d] if ncnt[d] > 1 else np.zeros(ncells, np.int64)
        cell_joint += rows[d][i] * sets.jstride[d]
        elems *= sz[rows[d]][i]
        bp = np.append(st[rows[d]], shape[d])
        grid.append(tuple(bp.tolist()) if len(bp) <= _SMALL else bp)
    writer1 = sets.holders[cell_joint, 0] if per == 1 else None
    return _Boxes(sets, runs, grid, cell_joint, elems, rank_cell, writer1, False)


def _lanes(b: _Boxes, shape: tuple[int, ...], world: int) -> np.ndarray:
    """(ranks, 2): rules.box_lanes of every rank's box of a tensor of ``shape``
    (ranks off the mesh: the all-zero box). O(ranks x ndim)."""
    nd = len(shape)
    boxo = np.zeros((world, nd), np.int64)
    boxs = np.zeros((world, nd), np.int64)
    mg = b.sets.mg
    for d in range(nd):
        if b.empty:
            continue  # every box empty
        if b.runs[d] is None:
            boxs[mg, d] = shape[d]
        else:
            st, sz = b.runs[d]
            boxo[mg, d] = st[b.sets.combo[d]]
            boxs[mg, d] = sz[b.sets.combo[d]]
    return rules.box_lanes(boxo, boxs)


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
    ranks = np.arange(world, dtype=np.int64)
    nkeys = len(sig.items)
    mask = np.zeros((nkeys, world), bool)  # key-major: a row per tensor, transposed once
    hashes = np.zeros((world, 2), np.uint64)
    bytes_per_rank = np.zeros(world, np.int64)
    # Tensors of one layout whose sharded dims have the same lengths share their cells,
    # holders and writers (_boxes); only their box hashes and bytes differ. FSDP's 500
    # tensors have ~170 distinct dim-0 lengths but 230 shapes: one O(ranks) pass per
    # group, one per shape (the hashes), the rest per tensor. Groups are built one at a
    # time and dropped (unless replicated): memory O(ranks) per group alive.
    meshes: dict = {}
    setss: dict = {}
    groups: dict = {}  # (layout, ndim, empty, sharded lengths) -> {shape: [key index]}
    for k, (key, dt, shape, lid) in enumerate(sig.items):
        if dt not in ITEMSIZE or len(shape) > tiling.MAX_NDIM:
            raise NotDerivable(f"tensor {key!r}")
        lay = plain if lid == rules.PLAIN else sig.layouts[lid]
        nd = len(shape)
        mg = meshes.get(lid)
        if mg is None:
            mg = meshes[lid] = _mesh(lay, group_ranks)
        if nd == 0 and len(mg) < world:  # a 0-d box is never empty: outsiders count as holders
            raise NotDerivable("a 0-d DTensor on a mesh of part of the group")
        sets = setss.get((lid, nd))
        if sets is None:
            sets = setss[(lid, nd)] = _sets(lay, mg, nd, salt)
        skey = (lid, nd, math.prod(shape) == 0,
                tuple(x if sets.mdims[d] else -1 for d, x in enumerate(shape)))
        groups.setdefault(skey, {}).setdefault(tuple(shape), []).append(k)
    per_key: list = [None] * nkeys
    rep = []  # (key index, its boxes, cell bytes): replicated cells, assigned below
    with np.errstate(over="ignore"):
        for (lid, nd, _, _), shapes in groups.items():
            lay = plain if lid == rules.PLAIN else sig.layouts[lid]
            b = _boxes(next(iter(shapes)), lay, setss[(lid, nd)], world)
            held = b.rank_cell >= 0
            bw = None
            for shape, ks in shapes.items():
                lanes = _lanes(b, shape, world)
                factor = math.prod(x for d, x in enumerate(shape) if b.runs[d] is None)
                grid = None if b.empty else tuple(
                    (0, shape[d]) if g is None else g for d, g in enumerate(b.grid))
                for k in ks:
                    key, dt = sig.items[k][:2]
                    hashes += rules.key_lanes(lanes, k)
                    if b.writer1 is not None or not len(b.cell_joint):
                        w = b.writer1
                        mask[k] = held
                        if bw is None:
                            bw = np.bincount(w, weights=b.cell_elems, minlength=world).astype(np.int64)
                        bytes_per_rank += bw * (factor * ITEMSIZE[dt])
                    else:
                        w = None
                        rep.append((k, b, b.cell_elems * (factor * ITEMSIZE[dt])))
                    per_key[k] = (key, dt, shape, w, grid)
                del lanes
    if rep:  # plan_global's round robin per holder set, largest first, over all tensors
        rep.sort(key=lambda x: x[0])  # in key order
        fp = np.concatenate([b.sets.fp[b.cell_joint] for _, b, _ in rep])
        gb = np.concatenate([g for _, _, g in rep])
        cnt = np.concatenate([np.full(len(b.cell_joint), b.sets.holders.shape[1], np.int64)
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
            w = b.sets.holders[b.cell_joint, pick[at:at + n]]
            at += n
            key, dt, shape, _, grid = per_key[k]
            per_key[k] = (key, dt, shape, w, grid)
            held = b.rank_cell >= 0
            mask[k, held] = w[b.rank_cell[held]] == ranks[held]
            bytes_per_rank += np.bincount(w, weights=g, minlength=world).astype(np.int64)
    tensors = {}
    for key, dt, shape, w, grid in per_key:
        if grid is None:  # no elements: no chunks
            z = np.zeros((0, len(shape)), np.int64)
            tensors[key] = PlannedTensor(key, dt, shape, z, z.copy(), np.zeros(0, np.int64), None)
        else:
            tensors[key] = PlannedTensor(key, dt, shape, None, None, w, grid)
    counts = np.full(world, nkeys, "<i8")
    packed = (world.to_bytes(8, "little") + counts.tobytes()
              + np.packbits(mask.T.reshape(-1)).tobytes())
    gp = GlobalPlan(tensors, {}, [], bytes_per_rank, {}, sorted(set(sig.int_keys)),
                    packed_writes=packed)
    return Derived(gp, hashes)
