"""The coordinator's global save plan. Pure: numpy, no torch.distributed.

Given every rank's :class:`LocalPlan`, :func:`plan_global` checks that ranks agree on
each tensor's dtype and global shape, that every box lies inside its tensor, and that the
boxes of each tensor (after dropping duplicates held by replicas) tile it exactly once;
then it picks one writer per distinct box, spreading replicated boxes across their
holders. Cost: O(N log N) in the number N of (rank, tensor) items, vectorised, and O(N)
without a sort in the common case of one key table whose boxes ascend with the rank
(:mod:`.keymajor`); key tables that are byte-identical across ranks are handled once.
JSON values, and bytes values whether inline or planned as items (:mod:`.bytesplan`),
follow the values rule: the lowest rank holding a key gives what is saved.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Container, Sequence

import numpy as np

from ..errors import StateMismatchError
from ..format import manifest as mf
from ..format.dtypes import ITEMSIZE
from . import bytesplan, keymajor
from ..format import tiling
from .localplan import LocalPlan, key_table


@dataclass(frozen=True, eq=False)
class PlannedTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    # (n, ndim) distinct non-empty boxes, grid C order when grid; None when ``grid`` is
    # set and the boxes were never built (a derived plan: dckpt.layout.derive)
    offsets: np.ndarray | None
    sizes: np.ndarray | None
    writer: np.ndarray  # (n,) rank that writes each box
    grid: tuple[tuple[int, ...], ...] | None


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    tensors: dict[str, PlannedTensor]
    values: dict
    writes: list[np.ndarray]  # per rank: bool mask over that rank's local items
    bytes_per_rank: np.ndarray
    # keys whose value differs between ranks -> the first rank that differs from the
    # lowest one (whose value is kept): a rank-local value saved under a shared key
    conflicts: dict = field(default_factory=dict)
    int_keys: list[str] = field(default_factory=list)  # union over ranks, sorted
    # encode_writes' bytes, when the plan was built with them (a derived plan has no
    # per-rank mask list: ``writes`` is empty)
    packed_writes: bytes | None = None
    # tensors that are bytes values (dckpt.state.flatten.Flat.bytes_keys), sorted: the
    # manifest marks their entries, so a load hands back bytes. Each is written by the
    # lowest rank holding its key (the values rule: dckpt.layout.bytesplan)
    bytes_keys: list[str] = field(default_factory=list)
    # bytes key -> the lowest rank whose bytes item the plan dropped because a lower
    # rank gave the key as a JSON value (a plan cache must replan once that value is gone)
    shadowed: dict[str, int] = field(default_factory=dict)


def _same(a, b) -> bool:
    """JSON leaves equal in value and type (True is not 1; NaN equals NaN)."""
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _key_table(plans: list[LocalPlan], blobs: Container[str] = ()):
    """Global key order, dtype and shape; item -> global key id per distinct table.
    ``blobs``: the bytes keys, named as such when a rank holds a tensor under one."""
    keys: dict[str, int] = {}
    meta: list[tuple[str, tuple[int, ...], int]] = []  # dtype, shape, first rank
    table_ids: dict[bytes, np.ndarray] = {}
    for r, p in enumerate(plans):
        if key_table(p) in table_ids:  # a table seen on a lower rank
            continue
        ids = np.empty(len(p.items), np.int64)
        for j, (k, dt, shape) in enumerate(p.items):
            kid = keys.get(k)
            if kid is None:
                kid = keys[k] = len(meta)
                meta.append((dt, tuple(shape), r))
            else:
                mdt, mshape, r0 = meta[kid]
                if (mdt, mshape) != (dt, tuple(shape)):
                    what = (f"key {k!r} is a bytes value on one rank and a tensor on another"
                            if k in blobs else f"ranks disagree about tensor {k!r}")
                    raise StateMismatchError(
                        f"{what}: rank {r0} has dtype {mdt} shape "
                        f"{list(mshape)}, rank {r} has dtype {dt} shape {list(shape)}")
            ids[j] = kid
        # A key listed more than once is a tensor of which the rank holds several
        # boxes (a strided placement); a box listed twice is refused after the sort.
        table_ids[p.keys_json] = ids
    return list(keys), meta, table_ids


def _items(plans, meta, table_ids, dmax):
    """Stack every rank's boxes into (N, dmax) arrays padded with offset 0 / size 1."""
    groups: dict[bytes, list[int]] = {}
    for r, p in enumerate(plans):
        groups.setdefault(p.keys_json, []).append(r)
    kid_l, rank_l, local_l, off_l, size_l = [], [], [], [], []
    for kj, ranks in groups.items():
        items = plans[ranks[0]].items
        ids = table_ids[kj]
        nd = np.array([len(s) for _, _, s in items], np.int64)
        width = int(2 * nd.sum())
        bad = [r for r in ranks if len(plans[r].boxes) != width]
        if bad:
            raise StateMismatchError(f"rank {bad[0]} sent a malformed plan ({len(plans[bad[0]].boxes)} "
                                     f"box numbers for {width})")
        flat = np.stack([plans[r].boxes for r in ranks]) if width else np.zeros((len(ranks), 0), np.int64)
        # Column index of offset/size d of item j; pads point at two extra columns.
        start = np.concatenate(([0], np.cumsum(2 * nd)[:-1])).astype(np.int64)
        d = np.arange(dmax)
        valid = d[None, :] < nd[:, None]
        oidx = np.where(valid, start[:, None] + d[None, :], width)
        sidx = np.where(valid, start[:, None] + nd[:, None] + d[None, :], width + 1)
        ext = np.concatenate([flat, np.zeros((len(ranks), 1), np.int64),
                              np.ones((len(ranks), 1), np.int64)], axis=1)
        n = len(items)
        off_l.append(ext[:, oidx].reshape(len(ranks) * n, dmax))
        size_l.append(ext[:, sidx].reshape(len(ranks) * n, dmax))
        kid_l.append(np.tile(ids, len(ranks)))
        rank_l.append(np.repeat(np.asarray(ranks, np.int64), n))
        local_l.append(np.tile(np.arange(n, dtype=np.int64), len(ranks)))
    cat = (lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape, np.int64))
    return (cat(kid_l, 0), cat(rank_l, 0), cat(local_l, 0),
            cat(off_l, (0, dmax)), cat(size_l, (0, dmax)))


def shape_table(meta) -> tuple[np.ndarray, np.ndarray]:
    """(shapes, ndims) of a key table's ``meta`` rows: one row per key, padded with 1s
    to the largest ndim. Pure; O(keys x dims)."""
    ndims = np.array([len(s) for _, s, _ in meta], np.int64)
    shapes = np.ones((len(meta), int(ndims.max(initial=0))), np.int64)
    for i, (_, s, _) in enumerate(meta):
        shapes[i, :len(s)] = s
    return shapes, ndims


def _sorted_rows(plans, meta, table_ids, names, shapes) -> keymajor.Rows:
    """The general path: every rank's boxes stacked, checked, and sorted by (key, box,
    rank) with a lexsort. O(N log N) in the number N of (rank, tensor) items. Raises
    StateMismatchError for a malformed plan or a box outside its tensor."""
    dmax = shapes.shape[1]
    kid, rank, local, offs, sizes = _items(plans, meta, table_ids, dmax)
    # offs > shape - sizes, not offs + sizes > shape: the sum of hostile numbers can wrap
    bad = (offs < 0).any(1) | (sizes < 0).any(1) | (offs > shapes[kid] - sizes).any(1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise StateMismatchError(
            f"rank {rank[i]} holds a box of tensor {names[kid[i]]!r} outside its shape "
            f"{list(meta[kid[i]][1])}: offsets {offs[i].tolist()} sizes {sizes[i].tolist()}")
    keep = (sizes > 0).all(1)  # empty shards write nothing
    kid, rank, local, offs, sizes = kid[keep], rank[keep], local[keep], offs[keep], sizes[keep]
    order = np.lexsort(tuple([rank] + [sizes[:, d] for d in reversed(range(dmax))]
                             + [offs[:, d] for d in reversed(range(dmax))] + [kid]))
    kid, rank, local, offs, sizes = kid[order], rank[order], local[order], offs[order], sizes[order]
    new = np.ones(len(kid), bool)
    if len(kid) > 1:
        new[1:] = ((kid[1:] != kid[:-1]) | (offs[1:] != offs[:-1]).any(1)
                   | (sizes[1:] != sizes[:-1]).any(1))
        twice = np.flatnonzero(~new[1:] & (rank[1:] == rank[:-1]))
        if len(twice):  # equal rows sort next to each other, ranks ascending
            i = int(twice[0]) + 1
            raise StateMismatchError(
                f"rank {rank[i]} lists the box at offsets {offs[i].tolist()} sizes "
                f"{sizes[i].tolist()} of tensor {names[kid[i]]!r} twice")
    return keymajor.Rows(kid, rank, local, list(offs.T), list(sizes.T), new)


def _ascending(order: np.ndarray) -> bool:
    """Whether a permutation is the identity (it ascends). O(n)."""
    return len(order) < 2 or bool((order[1:] > order[:-1]).all())


def _at(cols: list[np.ndarray], nd: int, rows, count: int) -> np.ndarray:
    """(count, nd) array of the first ``nd`` columns at ``rows`` (indexes or a slice)."""
    if nd == 0:
        return np.zeros((count, 0), np.int64)
    return np.stack([c[rows] for c in cols[:nd]], axis=1)


def plan_global(plans: list[LocalPlan]) -> GlobalPlan:
    """Validate all local plans and assign writers. Pure; raises StateMismatchError
    naming the tensor (and rank) at fault. Cost: with one key table whose boxes ascend
    with the rank (FSDP, DDP, TP), O(N) vectorised passes (:mod:`.keymajor`); else a
    lexsort of the N items. Then O(boxes) per tensor for its tiling check. Values,
    bytes values planned as items included, keep the lowest rank's (:mod:`.bytesplan`:
    O(bytes keys), plus O(items) of a rank whose item another rank's copy replaces)."""
    world = len(plans)
    counts = [len(p.items) for p in plans]  # of each rank's own items (write masks)
    values: dict = {}
    given: dict[str, int] = {}  # the rank each value came from
    conflicts: dict[str, int] = {}
    for r, p in enumerate(plans):  # the lowest rank holding a key gives its value
        for k, v in p.values.items():
            if k not in values:
                values[k], given[k] = v, r
            elif k not in conflicts and not _same(values[k], v):
                conflicts[k] = r
    settled = bytesplan.settle(plans, values, given, conflicts)
    if settled is not None:
        plans = settled.plans
    names, meta, table_ids = _key_table(plans, settled.owned if settled else ())
    clash = set(values) & set(names)
    if clash:
        raise StateMismatchError(f"key {sorted(clash)[0]!r} is a tensor on one rank and a "
                                 "plain value on another")
    shapes, ndims = shape_table(meta)
    # Sorted by (key, box, rank): equal boxes of one key are replicas.
    rows = keymajor.rows(plans, table_ids, shapes, ndims)
    if rows is None:
        rows = _sorted_rows(plans, meta, table_ids, names, shapes)
    kid, rank, local, offs, sizes, new = (rows.kid, rows.rank, rows.local, rows.offs,
                                          rows.sizes, rows.new)
    own = bytesplan.check_rows(settled, names, meta, kid, rank, local) if settled else None
    gstart = np.flatnonzero(new)
    distinct = len(gstart) == len(kid)  # no replicas: every row is its own group
    gcount = np.diff(np.append(gstart, len(kid)))

    itemsize = np.array([ITEMSIZE[dt] for dt, _, _ in meta], np.int64)
    gk = kid if distinct else kid[gstart]
    gbytes = itemsize[gk]
    for c in sizes:
        gbytes = gbytes * (c if distinct else c[gstart])  # padded dims have size 1
    # Writer choice: boxes held by one rank are written by it. Replicated boxes go round
    # robin over their holders, largest first, so replicated bytes spread evenly. The
    # round robin runs separately over each holder set (a fingerprint of the holding
    # ranks), starting at a different holder per set: one global counter taken modulo
    # the holder count would, for HSDP (every box on 2 ranks, boxes of one set 2 apart in
    # the order), give every box of a set to the same rank and leave its replica idle.
    pick = np.zeros(len(gstart), np.int64)
    rep = np.flatnonzero(gcount > 1)
    if len(rep):
        salt = np.random.default_rng(0).integers(1, 1 << 62, max(world, 1), dtype=np.int64)
        fp = np.add.reduceat(salt[rank], gstart)[rep]  # rows of a group are contiguous
        by = np.lexsort((-gbytes[rep], fp))  # holder set, then largest first, stable
        first = np.ones(len(by), bool)
        first[1:] = fp[by[1:]] != fp[by[:-1]]
        cls = np.cumsum(first) - 1
        pos = np.arange(len(by)) - np.flatnonzero(first)[cls]
        pick[rep[by]] = (pos + cls) % gcount[rep[by]]
        if own is not None:  # a bytes value: its owner's row, the group's first, writes
            pick[rep[own[kid[gstart[rep]]] >= 0]] = 0
    if distinct:  # every box has one holder, its writer (FSDP): no gathers
        wr, wl = rank, local
    else:
        writer_row = gstart + pick
        wr, wl = rank[writer_row], local[writer_row]
    base = np.concatenate(([0], np.cumsum([len(p.items) for p in plans], dtype=np.int64)))
    mask = np.zeros(int(base[-1]), bool)
    mask[base[wr] + wl] = True
    writes = np.split(mask, base[1:-1])
    if settled is not None:
        writes = settled.expand(writes, counts)
    bytes_per_rank = np.bincount(wr, weights=gbytes, minlength=world).astype(np.int64)

    # Per-key tiling over the distinct boxes.
    kstart = np.searchsorted(gk, np.arange(len(meta)))
    kend = np.searchsorted(gk, np.arange(len(meta)), side="right")
    tensors: dict[str, PlannedTensor] = {}
    for k, name in enumerate(names):
        dt, shape, _ = meta[k]
        nd = len(shape)
        sl = slice(kstart[k], kend[k])
        at = sl if distinct else gstart[sl]
        o, s = _at(offs, nd, at, sl.stop - sl.start), _at(sizes, nd, at, sl.stop - sl.start)
        t = tiling.analyse(shape, o, s)
        if t.error:
            raise StateMismatchError(
                f"tensor {name!r} is not fully and exactly covered by the ranks' shards: "
                f"{t.error}. Plain tensors must be identical on every rank; DTensors must "
                "use Shard/Replicate placements")
        w = wr[sl]
        if (t.grid is not None and t.order is not None and len(t.order) == len(o)
                and not _ascending(t.order)):  # already in grid order (FSDP): no copies
            o, s, w = o[t.order], s[t.order], w[t.order]
        tensors[name] = PlannedTensor(name, dt, shape, o, s, w, t.grid)
    int_keys = sorted({k for p in plans for k in p.int_keys})
    if settled is None:
        return GlobalPlan(tensors, values, writes, bytes_per_rank, conflicts, int_keys)
    return GlobalPlan(tensors, values, writes, bytes_per_rank, conflicts, int_keys,
                      bytes_keys=sorted(settled.owned), shadowed=settled.shadowed)


def encode_writes(plan: GlobalPlan) -> bytes:
    """Pack every rank's write mask: int64 counts then packed bits. O(items)."""
    if plan.packed_writes is not None:
        return plan.packed_writes
    counts = np.array([len(w) for w in plan.writes], "<i8")
    bits = np.packbits(np.concatenate(plan.writes)) if plan.writes else np.zeros(0, np.uint8)
    return len(counts).to_bytes(8, "little") + counts.tobytes() + bits.tobytes()


def decode_writes(data: bytes, rank: int) -> np.ndarray:
    """This rank's write mask out of :func:`encode_writes`'s bytes."""
    world = int.from_bytes(data[:8], "little")
    counts = np.frombuffer(data, "<i8", count=world, offset=8)
    bits = np.unpackbits(np.frombuffer(data, np.uint8, offset=8 + 8 * world))
    start = int(counts[:rank].sum())
    return bits[start:start + int(counts[rank])].astype(bool)


def to_manifest(gp: GlobalPlan, files: Sequence[mf.FileEntry], save_id: str, world: int,
                meta: dict | None = None, missing_ok: bool = False,
                side: tuple[str, dict[int, int]] | None = None) -> mf.Manifest:
    """Assemble the manifest from the plan and the files the ranks reported
    (``files[i].rank`` wrote file i; a :class:`dckpt.format.manifest.FileTable` or any
    sequence of FileEntry). Pure, O(chunks + files) numpy (reused tensor entries: O(files)).
    With ``missing_ok``, a chunk whose writer reported no file gets file -1 (an
    incremental save referenced it: :func:`dckpt.layout.delta.attach` fills it in).
    ``side``: (key prefix, {rank: index of its side file in ``files``}): the chunks of
    keys under the prefix are in their writer's side file, the others in its data file."""
    if not isinstance(files, mf.FileTable):
        files = mf.FileTable.from_entries(files, save_id)
    index = np.full(world, -1, np.int64)
    if side is None:
        index[files.rank] = np.arange(len(files))  # a rank's last file, as a loop would
        tensors = _reused_entries(gp, index, missing_ok)
        if tensors is None:
            tensors = _entries(gp, index, missing_ok)
    else:
        main = np.ones(len(files), bool)
        main[list(side[1].values())] = False
        index[files.rank[main]] = np.flatnonzero(main)
        sindex = np.full(world, -1, np.int64)
        for r, i in side[1].items():
            sindex[r] = i
        tensors = _entries(gp, index, missing_ok, (side[0], sindex))
    meta = dict(meta or {})
    if gp.int_keys:
        meta["int_keys"] = gp.int_keys
    return mf.Manifest(save_id, world, time.time(), files, tensors, gp.values, meta)


# The last manifest's tensor entries, by the plan's tensors and the file index they
# were built with: a save whose plan was cached (dckpt.protocol.plancache) reuses them,
# and then manifest.to_json reuses their encoding (entries are immutable).
_LAST_ENTRIES: tuple = (None, b"", None)


def _reused_entries(gp: GlobalPlan, index: np.ndarray, missing_ok: bool) -> dict | None:
    planned, key, entries = _LAST_ENTRIES
    if planned is gp.tensors and key == index.tobytes() and not missing_ok:
        return entries
    return None


def _entries(gp: GlobalPlan, index: np.ndarray, missing_ok: bool,
             side: tuple[str, np.ndarray] | None = None) -> dict:
    global _LAST_ENTRIES
    tensors = {}
    memo: dict = {}  # a derived plan shares writer arrays between tensors: and file arrays
    blobs = set(gp.bytes_keys)
    for k, t in gp.tensors.items():
        use = side[1] if side is not None and len(k) > len(side[0]) and k.startswith(side[0]) \
            else index
        fidx = memo.get((id(t.writer), id(use)))
        if fidx is None:
            fidx = memo[(id(t.writer), id(use))] = use[t.writer]
        if (fidx < 0).any() and not missing_ok:
            raise StateMismatchError(f"tensor {k!r}: rank {int(t.writer[fidx < 0][0])} was to "
                                     "write a chunk but reported no file")
        tensors[k] = mf.TensorEntry(k, t.dtype, t.shape, mf.Chunks(t.offsets, t.sizes, fidx, t.grid),
                                    bytes_value=k in blobs)
    if not missing_ok and side is None:
        _LAST_ENTRIES = (gp.tensors, index.tobytes(), tensors)
    return tensors
