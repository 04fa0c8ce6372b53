"""Plans by rule: a compact signature of a rank's save plan, and the hash of its boxes.

A DTensor's boxes on every rank follow from its global shape, its mesh (shape and the
global rank at each position) and its placements, ``_StridedShard`` included; a plain
tensor is the whole tensor on every rank. So instead of its boxes a rank can send a
*signature*: the group's ranks, the distinct layouts (mesh ranks, mesh shape,
placements) and, per tensor, its key, dtype, global shape and layout. Tensors share
layouts, and every rank of a job builds the same signature bytes, so rank 0 receives
one signature and a 16-byte hash of it from every other rank. It derives every rank's
boxes itself (:mod:`.derive`).

A wrong derivation must never commit: every rank also sends :func:`plan_hash` of the
boxes it will really write; rank 0 computes the same hash from the derived boxes and
checks them rank by rank. The hash is a sum over the rank's boxes of a 64-bit mix
(splitmix64's finaliser, two lanes with different seeds) of the box's numbers and its
tensor's index, so rank 0 computes it for all ranks with a few numpy passes per
layout, without a rank-major copy of every box. An empty box (a size 0 anywhere)
hashes as the all-zero box: what it writes is nothing, whatever offsets it carries.

Pure: numpy and JSON, no torch.distributed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..format import intarray

PLAIN = -1  # layout id of a plain tensor: the whole tensor on every rank
EXPLICIT = -2  # a tensor whose boxes follow no rule here (a ShardedTensor): not derivable
_SEEDS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_KEY = np.uint64(0x2545F4914F6CDD1D)


@dataclass(frozen=True)
class Layout:
    """A device mesh and placements: ``ranks`` the global rank at each mesh position
    (C order), ``shape`` the mesh shape, ``placements`` as :mod:`.strided` spells them."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    placements: tuple[tuple, ...]


@dataclass
class Signature:
    """What determines every rank's boxes. ``items[i] = (key, dtype, shape, layout)``,
    ``layout`` an index into ``layouts``, :data:`PLAIN` or :data:`EXPLICIT`;
    ``group_ranks[g]`` is the global rank of group rank ``g``."""

    group_ranks: tuple[int, ...]
    layouts: list[Layout] = field(default_factory=list)
    items: list[tuple[str, str, tuple[int, ...], int]] = field(default_factory=list)
    int_keys: list[str] = field(default_factory=list)

    def derivable(self) -> bool:
        return all(lid != EXPLICIT for *_, lid in self.items)


def encode(sig: Signature) -> bytes:
    """The signature as compact JSON (rank lists as runs: ``range(world)`` is 3
    numbers). Deterministic: equal signatures give equal bytes. O(tensors + layouts)."""
    doc = {"ranks": intarray.encode(np.asarray(sig.group_ranks, np.int64)),
           "layouts": [[intarray.encode(np.asarray(lay.ranks, np.int64)), list(lay.shape),
                        [list(p) for p in lay.placements]] for lay in sig.layouts],
           "items": [[k, d, list(s), lid] for k, d, s, lid in sig.items],
           "int_keys": sig.int_keys}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> Signature:
    """Parse :func:`encode`'s bytes. Raises ValueError on anything malformed (a
    signature comes from another rank: checked, never trusted)."""
    try:
        doc = json.loads(data)
        ranks = intarray.decode(doc["ranks"], "signature ranks", 1 << 24)
        layouts = []
        for r, shape, pl in doc["layouts"]:
            mranks = intarray.decode(r, "signature mesh ranks", 1 << 24)
            shape = tuple(int(x) for x in shape)
            pls = tuple(_placement(p) for p in pl)
            if len(pls) != len(shape) or int(np.prod(shape)) != len(mranks) or min(shape, default=1) < 1:
                raise ValueError("a layout's mesh shape, ranks and placements disagree")
            layouts.append(Layout(tuple(mranks.tolist()), shape, pls))
        items = []
        for k, d, s, lid in doc["items"]:
            if not (isinstance(k, str) and isinstance(d, str) and type(lid) is int
                    and EXPLICIT <= lid < len(layouts)
                    and all(type(x) is int and x >= 0 for x in s)):
                raise ValueError("malformed item")
            items.append((k, d, tuple(s), lid))
        int_keys = [str(k) for k in doc.get("int_keys", [])]
        return Signature(tuple(ranks.tolist()), layouts, items, int_keys)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed plan signature ({e})") from None


def _placement(p) -> tuple:
    if p == ["R"]:
        return ("R",)
    if len(p) == 2 and p[0] == "S" and type(p[1]) is int and p[1] >= 0:
        return ("S", p[1])
    if len(p) == 3 and p[0] == "SS" and type(p[1]) is int and type(p[2]) is int and p[2] >= 1:
        return ("SS", p[1], p[2])
    raise ValueError(f"unknown placement {p!r}")


# ----------------------------------------------------------------------------- hashing

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def box_lanes(offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(n, 2) uint64: a hash of each box ``offsets[i]``/``sizes[i]`` ((n, ndim) int64),
    empty boxes as the all-zero box. Independent of the tensor: see :func:`key_lanes`."""
    offsets = np.asarray(offsets, np.int64)
    sizes = np.asarray(sizes, np.int64)
    n, nd = sizes.shape
    empty = (sizes == 0).any(1) if nd else np.zeros(n, bool)
    with np.errstate(over="ignore"):
        out = np.empty((n, 2), np.uint64)
        for lane, seed in enumerate(_SEEDS):
            v = np.full(n, seed, np.uint64)
            for d in range(nd):
                o = np.where(empty, 0, offsets[:, d]).astype(np.uint64)
                s = np.where(empty, 0, sizes[:, d]).astype(np.uint64)
                v = _mix(v ^ o)
                v = _mix(v + s)
            out[:, lane] = v
    return out


def key_lanes(lanes: np.ndarray, key_index: np.ndarray | int,
              box_index: np.ndarray | int = 0) -> np.ndarray:
    """Bind box hashes (:func:`box_lanes`) to the tensor's index in the signature and
    the box's index among that tensor's boxes on its rank."""
    ki = np.asarray(key_index, np.int64).astype(np.uint64)
    bi = np.asarray(box_index, np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        tag = _mix(ki * _KEY + bi + np.uint64(1))
        return _mix(lanes ^ np.asarray(tag)[..., None])


def fold(lanes: np.ndarray) -> bytes:
    """Sum (mod 2**64) of per-box lanes: a rank's plan hash, 16 bytes."""
    with np.errstate(over="ignore"):
        return np.asarray(lanes, np.uint64).reshape(-1, 2).sum(0, dtype=np.uint64).astype("<u8").tobytes()


def plan_hash(key_index: np.ndarray, box_index: np.ndarray, offsets: list[tuple[int, ...]],
              sizes: list[tuple[int, ...]]) -> bytes:
    """A rank's hash of the boxes it will write: item ``i`` is box ``box_index[i]`` of
    signature tensor ``key_index[i]``, ``offsets[i]``/``sizes[i]`` its numbers (items of
    any ndim). O(items), numpy per distinct ndim."""
    key_index = np.asarray(key_index, np.int64)
    box_index = np.asarray(box_index, np.int64)
    nds = np.array([len(s) for s in sizes], np.int64)
    total = np.zeros((1, 2), np.uint64)
    with np.errstate(over="ignore"):
        for nd in np.unique(nds).tolist():
            at = np.flatnonzero(nds == nd)
            o = np.asarray([offsets[i] for i in at], np.int64).reshape(len(at), nd)
            s = np.asarray([sizes[i] for i in at], np.int64).reshape(len(at), nd)
            lanes = key_lanes(box_lanes(o, s), key_index[at], box_index[at])
            total = total + lanes.sum(0, dtype=np.uint64)[None, :]
    return fold(total)
