"""Cached save plans: a steady-state save sends 33 bytes per rank, not its plan.

Every save builds each rank's local plan (keys, dtypes, shapes, boxes; its JSON values),
which costs O(tensors) locally. Sending it to rank 0 and validating it there costs
O(ranks x tensors): 180 MB and seconds at thousands of ranks. Between two saves of a
training job nothing of it changes but the values (a step counter, a learning rate).

So every rank fingerprints its plan: a structure hash (XXH3-128 of the key table,
boxes and int-key paths) and a values hash. A rank whose structure hash equals the one
of its last successfully planned save sends only ``b"C" | structure | values | plan
id`` (41 bytes; rank 0 adds its values), the plan id naming the global plan its write
mask came from. Rank 0 reuses its validated global plan and write
assignment when every rank's structure hash matches what it cached for that rank, and
takes each rank's values from rank 0's (same hash: the usual case, values are
replicated) or from its cache (unchanged since). Anything else (a new process with no
cache, a changed shape or dtype or key on any rank, values it does not know) makes
rank 0 answer "resend", and every rank sends its full plan (``b"F" | hashes | plan``)
in a second gather of the same save: any difference falls back for everyone. Nothing
about the commit changes: the manifest is still complete and written last.

The first save of a process (nothing cached) offers a plan by rule instead of its full
plan where it can (:mod:`dckpt.layout.rules`, issue 38): ``b"R" | structure | values |
signature hash | plan hash`` (65 bytes), rank 0 adding its signature and values. Rank 0
derives every rank's boxes (:mod:`dckpt.layout.derive`) and checks each rank's plan hash
against the derived one; anything it cannot derive, and any mismatch, answers "resend"
and the full plans are gathered as before. Set ``RULES = False`` (or the environment
variable ``DCKPT_PLAN_RULES=0``) to always gather.

Caches live per process group (a save's group and the async saver's own group), on
every rank; they are updated only by a save whose plan every rank accepted.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..format import codec
from ..layout import localplan
from ..layout import plan as gplan

CACHED, FULL, RULE = b"C", b"F", b"R"
RULES = os.environ.get("DCKPT_PLAN_RULES", "1") != "0"  # offer plans by rule (issue 38)
HASH = 16
PLAN_ID = 8
_CACHED_LEN = 1 + 2 * HASH + PLAN_ID  # a cached offer without values (every rank but 0)
_NO_HASH = bytes(HASH)


def fingerprints(plan: localplan.LocalPlan, blob: bytes) -> tuple[bytes, bytes]:
    """(structure hash, values hash) of a local plan and its encoding ``blob``: the
    structure is hashed from the key table and boxes already encoded in ``blob`` (not
    serialised again). O(plan size), no I/O."""
    table, boxes = localplan.structure_views(blob)
    h = codec._xxh().xxh3_128()
    h.update(table)
    h.update(boxes)
    h.update(json.dumps(plan.int_keys).encode())
    if plan.bytes_keys:  # a uint8 tensor and a bytes value of one shape plan alike
        h.update(json.dumps(plan.bytes_keys).encode())
    return h.digest(), values_hash(plan.values)


def values_hash(values: dict) -> bytes:
    """XXH3-128 of a plan's JSON values, independent of their order."""
    return codec._xxh().xxh3_128_digest(json.dumps(
        values, sort_keys=True, separators=(",", ":"), allow_nan=True).encode())


@dataclass
class Offer:
    """One rank's planning message, parsed."""

    cached: bool
    structure: bytes
    values_hash: bytes
    values: dict | None = None  # rank 0's own, in a cached offer
    blob: bytes = b""  # the full plan
    plan_id: bytes = b""  # the cached global plan the rank's mask belongs to
    rule: bool = False  # a plan by rule: the hashes below, rank 0's signature
    sig_hash: bytes = b""
    plan_hash: bytes = b""
    signature: bytes = b""


def encode_offer(cached: bool, fp: tuple[bytes, bytes], blob: bytes,
                 values: dict | None = None, plan_id: bytes = b"") -> bytes:
    if cached:
        tail = json.dumps(values, allow_nan=True).encode() if values is not None else b""
        return CACHED + fp[0] + fp[1] + plan_id + tail
    return FULL + fp[0] + fp[1] + blob


def encode_rule(fp: tuple[bytes, bytes], rule: tuple[bytes, bytes, bytes],
                values: dict | None = None) -> bytes:
    """A plan by rule: the hashes, and (``values`` given: rank 0) the signature and
    values."""
    sig, sig_hash, plan_hash = rule
    head = RULE + fp[0] + fp[1] + sig_hash + plan_hash
    if values is None:
        return head
    return head + len(sig).to_bytes(8, "little") + sig + json.dumps(values, allow_nan=True).encode()


def decode_offer(data: bytes) -> Offer:
    kind, s, v, rest = data[:1], data[1:1 + HASH], data[1 + HASH:1 + 2 * HASH], data[1 + 2 * HASH:]
    if kind == RULE:
        sh, ph, rest = rest[:HASH], rest[HASH:2 * HASH], rest[2 * HASH:]
        if len(ph) != HASH:
            raise ValueError("malformed planning message (short)")
        sig, values = b"", None
        if rest:
            n = int.from_bytes(rest[:8], "little")
            sig, values = rest[8:8 + n], json.loads(rest[8 + n:])
        return Offer(False, s, v, values, rule=True, sig_hash=sh, plan_hash=ph, signature=sig)
    if kind == CACHED:
        pid, rest = rest[:PLAN_ID], rest[PLAN_ID:]
        return Offer(True, s, v, json.loads(rest) if rest else None, plan_id=pid)
    if kind == FULL:
        return Offer(False, s, v, blob=rest)
    raise ValueError(f"malformed planning message (kind {kind!r})")


@dataclass
class RankCache:
    """A rank's side: the structure hash and write mask of its last accepted plan."""

    structure: bytes | None = None
    mask: np.ndarray | None = None
    plan_id: bytes = b""
    _offered: bytes = _NO_HASH  # the structure hash of the plan offered last

    def offer(self, blob: bytes, plan: localplan.LocalPlan, rank: int,
              rule=None) -> tuple[bytes, bytes]:
        """(message to send, the full message to resend if asked). ``rule()``, when
        given, returns this rank's (signature, its hash, plan hash) or None: offered
        when nothing is cached (see :data:`RULES`)."""
        if plan.error:
            fp = (_NO_HASH, _NO_HASH)
            full = encode_offer(False, fp, blob)
            self._offered = _NO_HASH
            return full, full
        fp = fingerprints(plan, blob)
        self._offered = fp[0]
        full = encode_offer(False, fp, blob)
        if self.structure is not None and self.structure == fp[0] and len(self.plan_id) == PLAN_ID:
            return encode_offer(True, fp, b"", plan.values if rank == 0 else None,
                                self.plan_id), full
        # a signature does not say which items are bytes values: those plans are gathered
        got = rule() if RULES and rule is not None and not plan.bytes_keys else None
        if got is not None:
            return encode_rule(fp, got, plan.values if rank == 0 else None), full
        return full, full

    def accept(self, mask: np.ndarray, plan_id: bytes) -> None:
        """Rank 0 accepted the offered plan as a full plan: remember it with its mask."""
        self.structure, self.mask, self.plan_id = self._offered, mask, plan_id


@dataclass
class CoordCache:
    """Rank 0's side: per rank the structure and values hashes it accepted last, the
    values by hash, and the global plan."""

    structures: list[bytes] = field(default_factory=list)
    values_hash: list[bytes] = field(default_factory=list)
    values: dict[bytes, dict] = field(default_factory=dict)
    gp: gplan.GlobalPlan | None = None
    plan_id: bytes = b""
    _pending: list | None = None  # per rank (values hash, values or None) awaiting values
    _structs: tuple | None = None  # (structures list, its (ranks, HASH) uint8 array)

    def reuse_uniform(self, blobs: list[bytes]) -> gplan.GlobalPlan | None:
        """The common later save, in numpy: every rank offered its cached structure
        under the current plan id with rank 0's values hash. Returns the plan (what
        :meth:`reuse` returns with "plan") or None when anything else holds: then decode
        the offers and call :meth:`reuse`, which decides. O(ranks) in C; 131,072
        offers decoded one by one and compared in Python took 0.4-0.6 s (issue 38)."""
        n = len(blobs)
        if self.gp is None or n < 2 or n != len(self.structures):
            return None
        try:
            own = decode_offer(blobs[0])
        except ValueError:
            return None  # the per-rank path reports it
        if not own.cached or own.values is None or own.plan_id != self.plan_id \
                or len(own.plan_id) != PLAN_ID or len(own.values_hash) != HASH \
                or own.structure != self.structures[0]:
            return None
        rest = blobs[1:]
        if set(map(len, rest)) != {_CACHED_LEN}:
            return None
        structs = self._structs
        if structs is None or structs[0] is not self.structures:
            joined = b"".join(self.structures)
            if len(joined) != HASH * n:
                return None
            structs = self._structs = (self.structures,
                                       np.frombuffer(joined, np.uint8).reshape(n, HASH))
        a = np.frombuffer(b"".join(rest), np.uint8).reshape(n - 1, _CACHED_LEN)
        row = np.frombuffer(CACHED + own.values_hash + self.plan_id, np.uint8)
        if not ((a[:, 0] == row[0]).all() and np.array_equal(a[:, 1:1 + HASH], structs[1][1:])
                and (a[:, 1 + HASH:] == row[1:]).all()):
            return None
        self._pending = None
        return self._finish([(own.values_hash, own.values)] * n)

    def reuse(self, offers: list[Offer]) -> tuple[str, Any]:
        """What to do with these offers: ("plan", global plan) when every rank offered
        its cached structure and rank 0 knows every rank's values (its own, or that
        rank's unchanged ones); ("values", ranks) when only the values of ``ranks`` are
        unknown (rank-local values that changed, such as RNG states: they send them,
        see :meth:`with_values`); ("full", None) otherwise. O(ranks) hash compares plus
        O(values) per distinct values set."""
        self._pending = None
        if self.gp is None or len(offers) != len(self.structures) or offers[0].values is None:
            return "full", None
        own = offers[0]
        per_rank: list[tuple[bytes, dict | None]] = []
        need = []
        for r, o in enumerate(offers):
            if not o.cached or o.structure != self.structures[r] or o.plan_id != self.plan_id:
                return "full", None
            if o.values_hash == own.values_hash:
                per_rank.append((o.values_hash, own.values))
            elif o.values_hash in self.values and o.values_hash == self.values_hash[r]:
                per_rank.append((o.values_hash, self.values[o.values_hash]))
            else:
                per_rank.append((o.values_hash, None))
                need.append(r)
        if need:
            self._pending = per_rank
            return "values", need
        gp = self._finish(per_rank)
        return ("plan", gp) if gp is not None else ("full", None)

    def with_values(self, blobs: list[bytes]) -> gplan.GlobalPlan | None:
        """The plan once the ranks :meth:`reuse` named sent their values (JSON; the
        others b""), or None (then everyone resends full plans)."""
        per_rank, self._pending = self._pending, None
        if per_rank is None or len(blobs) != len(per_rank):
            return None
        for r, (h, vals) in enumerate(per_rank):
            if vals is None:
                try:
                    vals = json.loads(blobs[r])
                except ValueError:
                    return None
                if not isinstance(vals, dict) or values_hash(vals) != h:
                    return None  # not the values it hashed: plan again
                per_rank[r] = (h, vals)
        return self._finish(per_rank)

    def _finish(self, per_rank: list) -> gplan.GlobalPlan | None:
        """The cached plan with these (values hash, values) per rank merged in, or None
        (plan again) when they no longer fit it: a value where a tensor was, or a bytes
        key whose first holder changed. O(distinct values sets x values + bytes keys)."""
        first: dict[str, int] = {}
        values, conflicts = merge_values(per_rank, first)
        gp, world = self.gp, len(per_rank)
        # Bytes keys follow the values rule (dckpt.layout.bytesplan): the cached masks
        # hold only while the rank that gave the key still gives it first.
        if any(first.get(k, world) > r for k, r in gp.shadowed.items()):
            return None  # the value that took the key is gone: a dropped item must write
        for k in set(values).intersection(gp.bytes_keys):
            w = int(gp.tensors[k].writer[0])
            if first[k] < w:
                return None  # a lower rank's value now takes the key: plan again
            del values[k]  # a higher rank's inline copy: the item is kept, as planned
            conflicts[k] = first[k]
        if set(values) & set(gp.tensors):
            return None  # a value where a tensor was: let the full path report it
        self.values_hash = [h for h, _ in per_rank]
        self.values = {h: v for h, v in per_rank}
        return replace(self.gp, values=values, conflicts=conflicts)

    def adopt(self, offers: list[Offer], gp: gplan.GlobalPlan) -> tuple[str, Any]:
        """Cache a plan derived for these rule offers (``gp`` without values) as the
        plan of their structures, under a new plan id. Returns ("plan", the plan with
        the ranks' values), ("values", ranks) when those ranks' values differ from rank
        0's (they send them: :meth:`with_values`), or ("full", None) when a value
        clashes with a tensor (the gathered path reports it). O(ranks)."""
        self.plan_id = os.urandom(PLAN_ID)
        self.structures = [o.structure for o in offers]
        self.values_hash, self.values, self.gp = [], {}, gp
        own = offers[0]
        per_rank: list[tuple[bytes, dict | None]] = []
        need = []
        for r, o in enumerate(offers):
            same = o.values_hash == own.values_hash
            per_rank.append((o.values_hash, own.values if same else None))
            if not same:
                need.append(r)
        if need:
            self._pending = per_rank
            return "values", need
        got = self._finish(per_rank)
        if got is None:
            self.gp = None
            return "full", None
        return "plan", got

    def store(self, offers: list[Offer], plans: list[localplan.LocalPlan],
              gp: gplan.GlobalPlan) -> bytes:
        """Remember an accepted full plan; returns its new plan id (sent to the ranks
        with their masks)."""
        self.plan_id = os.urandom(PLAN_ID)
        self.structures = [o.structure for o in offers]
        self.values_hash = [o.values_hash for o in offers]
        self.values = {o.values_hash: p.values for o, p in zip(offers, plans)}
        self.gp = gp
        return self.plan_id


def merge_values(per_rank: list[tuple[bytes, dict]],
                 first: dict[str, int] | None = None) -> tuple[dict, dict]:
    """(values, conflicts) as :func:`dckpt.layout.plan.plan_global` merges them (the
    lowest rank's value wins; a differing later rank is reported), visiting each
    distinct values set once: O(distinct sets x values), not O(ranks x values).
    ``first``, when given, receives the rank each kept value came from."""
    values: dict = {}
    conflicts: dict[str, int] = {}
    seen: set[bytes] = set()
    for r, (h, vals) in enumerate(per_rank):
        if h in seen:
            continue
        seen.add(h)
        for k, v in vals.items():
            if k not in values:
                values[k] = v
                if first is not None:
                    first[k] = r
            elif k not in conflicts and not gplan._same(values[k], v):
                conflicts[k] = r
    return values, conflicts


_CACHES: dict[Any, tuple[Any, RankCache, CoordCache]] = {}


def caches(group_key: Any, group: Any) -> tuple[RankCache, CoordCache]:
    """The caches of one process group (``group`` is kept alive with them so its id
    cannot be reused by another group)."""
    entry = _CACHES.get(group_key)
    if entry is None or entry[0] is not group:
        entry = (group, RankCache(), CoordCache())
        _CACHES[group_key] = entry
    return entry[1], entry[2]
