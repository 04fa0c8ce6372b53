"""Bytes values held as plan items: which rank's copy a save keeps. Pure, numpy.

A save keeps a bytes value over 64 KiB as a 1-D U8 item of the rank that holds it
(``LocalPlan.bytes_keys``, with a content hash in ``bytes_digests``); a smaller one is a
``{"$bytes"}`` tag among that rank's JSON values. Either way it is a *value*, and the
values rule applies to its key: the lowest rank holding the key gives what is saved
(its tag, or its data-file entry), every other holder's copy is dropped, and a holder
whose copy differs is reported in the plan's ``conflicts`` (the warning every differing
value gets). So a rank-local blob saved under a shared key saves whatever the sizes
(60 KiB here and 70 KiB there, one inline, one not; or 70 and 80 KiB), and a key of its
own per rank (torchtitan's ``dp_rank_<r>``) is that rank's alone, as before.

:func:`settle` runs before the tensor planning of :func:`dckpt.layout.plan.plan_global`.
A dropped item of the kept one's size stays in its plan, a replica of the kept box that
is never picked to write (so an FSDP job keeps one key table and the planner's fast
path); any other dropped item is cut out of a copy of its rank's plan, whose write mask
:meth:`Settled.expand` puts back on the rank's own items. :func:`check_rows` refuses a
key that is a bytes value on one rank and a tensor on another, and names each bytes
key's writer. An inline copy and a data-file copy always differ (their sizes are on
either side of 64 KiB); two data-file copies are compared by length and content hash.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import StateMismatchError
from .localplan import LocalPlan, key_table, table_json


@dataclass
class Settled:
    """What :func:`settle` decided. ``plans``: the plans the tensor planning sees (a
    rank that lost a bytes item of another size, or to a JSON value, gets a copy
    without it); ``kept[r]``: the indexes of rank r's own items its copy kept (only for
    such ranks); ``dropped``: ``rank << 32 | item`` of every other lost item (the same
    dtype and shape as the kept one: left in the plan, so ranks keep one key table,
    and never picked as the writer); ``owned``: bytes key -> the rank whose item is
    saved; ``shadowed``: bytes key -> the lowest rank whose item was dropped because a
    lower rank gave the key as a JSON value (the plan cache replans when that value
    goes away)."""

    plans: list[LocalPlan]
    kept: dict[int, np.ndarray] = field(default_factory=dict)
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    owned: dict[str, int] = field(default_factory=dict)
    shadowed: dict[str, int] = field(default_factory=dict)

    def expand(self, writes: list[np.ndarray], counts: list[int]) -> list[np.ndarray]:
        """The write masks over every rank's own items (``counts[r]`` of them), from
        masks over the settled plans' items: a dropped item is not written. O(items) of
        the ranks whose plan was copied."""
        out = list(writes)
        for r, kept in self.kept.items():
            full = np.zeros(counts[r], bool)
            full[kept] = writes[r]
            out[r] = full
        return out


def settle(plans: list[LocalPlan], values: dict, first: dict[str, int],
           conflicts: dict[str, int]) -> Settled | None:
    """Apply the values rule to the bytes keys of ``plans``: None when no plan holds a
    bytes item (nothing to do). ``values``/``first``/``conflicts`` are the JSON values
    merged over the ranks (the lowest rank's), the rank each came from, and the first
    differing rank per key; a bytes key's entries in them are corrected here, in
    place (its value dropped when a lower rank's item wins; its conflict the lowest
    rank whose copy, inline or not, differs from the kept one).

    Cost: O(bytes keys) dict operations over the ranks that hold any (torchtitan's
    ``dp_rank_<r>``: one per rank, no copy; one key on every rank with the same size:
    no copy either); a rank that loses an item of another size, or to a JSON value,
    costs O(its items) once per distinct (key table, dropped items) and one gather of
    its boxes. Raises StateMismatchError naming the key and rank for a plan that lists
    a bytes key it does not hold as an item, or whose boxes do not match its key
    table."""
    holders = [r for r, p in enumerate(plans) if p.bytes_keys]
    if not holders:
        return None
    world = len(plans)
    owner: dict[str, int] = {}  # the lowest rank holding the key as an item
    for r in holders:
        for k in plans[r].bytes_keys:
            owner.setdefault(k, r)
    out = Settled(list(plans))
    differs: dict[str, int] = {}  # key -> lowest dropped item rank whose copy differs
    index: dict[tuple, dict[str, int]] = {}  # bytes key -> item index, per key table
    owners: dict[int, dict[str, int]] = {}  # the same, per owning rank
    groups: dict[tuple, tuple] = {}  # (key table, dropped indexes) -> the settled table
    dropped: list[int] = []
    for r in holders:
        p = plans[r]
        drop = [k for k in p.bytes_keys if owner[k] != r or first.get(k, world) < r]
        if not drop:
            continue
        at = _index(p, r, index)
        inplace = True
        for k in drop:
            w = owner[k]
            if first.get(k, world) < w:  # a lower rank's JSON value takes the key
                inplace = False
                continue
            wat = owners.get(w)
            if wat is None:
                wat = owners[w] = _index(plans[w], w, index)
            same = plans[w].items[wat[k]][1:] == p.items[at[k]][1:]  # dtype, shape
            inplace &= same
            # the same bytes: the same length and hash (a plan built in memory may
            # carry no hash: then the length alone)
            if k not in differs and not (same and plans[w].bytes_digests.get(k) ==
                                         p.bytes_digests.get(k)):
                differs[k] = r
        if inplace:
            dropped += [r << 32 | at[k] for k in drop]
        else:
            out.plans[r], out.kept[r] = _without(p, r, sorted(at[k] for k in drop), groups)
    out.dropped = np.array(dropped, np.int64)
    for k, w in owner.items():
        v = first.get(k, world)
        if v < w:  # a lower rank's JSON value (its inline tag): every item is dropped
            out.shadowed[k] = w
            conflicts[k] = min(conflicts.get(k, world), w)
            continue
        out.owned[k] = w
        if v < world:  # a higher rank's inline copy: dropped, and it differs
            del values[k]
        lowest = min(v, differs.get(k, world))
        if lowest < world:
            conflicts[k] = lowest
        else:
            conflicts.pop(k, None)
    return out


def _index(p: LocalPlan, r: int, cache: dict) -> dict[str, int]:
    """Rank r's bytes keys -> the index of its item, once per distinct key table and
    bytes key list. O(items). Raises StateMismatchError for a listed key that is not
    an item."""
    ck = (key_table(p), tuple(p.bytes_keys))
    at = cache.get(ck)
    if at is None:
        want = set(p.bytes_keys)
        at = cache[ck] = {k: j for j, (k, _, _) in enumerate(p.items) if k in want}
        missing = [k for k in p.bytes_keys if k not in at]
        if missing:
            raise StateMismatchError(f"rank {r} lists {missing[0]!r} as a bytes value but "
                                     "holds no item under that key (a malformed plan)")
    return at


def _without(p: LocalPlan, r: int, drop: list[int], groups: dict) -> tuple[LocalPlan, np.ndarray]:
    """A copy of rank r's plan without the items at ``drop`` (sorted), and the indexes
    of the items it keeps. The new key table is built once per distinct (table, drop),
    as the wire writes it (so it is the very table of a rank that never held those
    keys); per rank, one gather of the boxes. Raises StateMismatchError when the boxes
    do not match the key table."""
    ck = (key_table(p), tuple(drop))
    got = groups.get(ck)
    if got is None:
        keep = np.ones(len(p.items), bool)
        keep[drop] = False
        nd = np.array([len(s) for _, _, s in p.items], np.int64)
        items = [it for it, k in zip(p.items, keep) if k]
        gone = {p.items[j][0] for j in drop}
        got = groups[ck] = (items, table_json(items), np.flatnonzero(np.repeat(keep, 2 * nd)),
                            int(2 * nd.sum()), np.flatnonzero(keep),
                            [k for k in p.bytes_keys if k not in gone])
    items, table, cols, width, kept, bkeys = got
    if len(p.boxes) != width:
        raise StateMismatchError(f"rank {r} sent a malformed plan ({len(p.boxes)} box "
                                 f"numbers for {width})")
    return LocalPlan(items, np.asarray(p.boxes)[cols], p.values, None, p.int_keys, bkeys,
                     {}, table), kept


def check_rows(settled: Settled, names: list[str], meta: list, kid: np.ndarray,
               rank: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Check the planner's rows (sorted by key, box, rank) of the bytes keys, and return
    the owner of each key id (-1: not a bytes key). A bytes key must be planned as a
    1-D U8 item, and every row of it must be its owner's or an item :func:`settle`
    dropped in place (a replica of the owner's box, after it in the rank order): any
    other is a tensor under a bytes key (one of them would load back as the other's
    kind). O(bytes keys x log rows + rows of bytes keys) numpy. Raises
    StateMismatchError naming the key and rank."""
    ids = {n: i for i, n in enumerate(names)} if settled.owned else {}
    own = np.full(len(names), -1, np.int64)
    for k, w in settled.owned.items():
        i = ids.get(k)
        if i is None or meta[i][0] != "U8" or len(meta[i][1]) != 1:
            raise StateMismatchError(f"key {k!r} is listed as a bytes value but is not "
                                     "planned as a 1-D U8 item (a malformed plan)")
        own[i] = w
    kids = np.flatnonzero(own >= 0)
    lo, hi = np.searchsorted(kid, kids), np.searchsorted(kid, kids, side="right")
    n = hi - lo
    at = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))  # their rows
    other = at[rank[at] != own[kid[at]]]
    if len(other):
        bad = other[~np.isin(rank[other] << 32 | local[other], settled.dropped)]
        if len(bad):
            i = int(bad[0])
            raise StateMismatchError(
                f"key {names[kid[i]]!r} is a bytes value on one rank and a uint8 tensor on "
                f"rank {int(rank[i])}: give them different keys")
    return own
