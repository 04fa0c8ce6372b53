"""A rank's local save plan and its compact binary encoding (no pickle).

Wire format: ``u64 len | keys JSON | u64 len | extra JSON | int64 boxes``. The keys JSON
lists ``[key, dtype, shape]`` per item; it is byte-identical on every rank of an FSDP job,
so the coordinator parses it once for all ranks. ``boxes`` holds, per item, its offsets
then its sizes. ``extra`` carries JSON values, a local error, if any, the keys of int
dict keys and of bytes values stored as items, and a content hash of each such bytes
value (when there are any: the coordinator compares them, as it compares values).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format import codec

_U64 = struct.Struct("<Q")


@dataclass
class LocalPlan:
    """What one rank holds. ``items[i] = (key, dtype_code, global_shape)``; ``boxes`` is
    flat int64: offsets then sizes of item 0, then item 1..."""

    items: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    boxes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    values: dict[str, Any] = field(default_factory=dict)
    error: dict[str, str] | None = None  # {"type": ..., "message": ...}
    int_keys: list[str] = field(default_factory=list)  # see dckpt.state.flatten.Flat
    bytes_keys: list[str] = field(default_factory=list)  # items that are bytes values (Flat)
    # bytes key -> XXH3-128 hex of its value (:func:`bytes_digest`), filled from
    # ``tensors`` when not given: ranks holding one key with different bytes conflict
    bytes_digests: dict[str, str] = field(default_factory=dict)
    keys_json: bytes = b""  # set by decode: the raw key table, used as a cache key
    # not encoded: the flattened tensors a save planned from, for a plan by rule
    # (dckpt.protocol.rulesig builds its signature only when it is offered)
    tensors: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.tensors:  # decoded, or built without its tensors: nothing to hash
            return
        for k in self.bytes_keys:
            if k not in self.bytes_digests and k in self.tensors:
                self.bytes_digests[k] = bytes_digest(self.tensors[k])


def table_json(items: list) -> bytes:
    """The key table of ``items`` as :func:`encode` writes it. O(items)."""
    return json.dumps([[k, d, list(s)] for k, d, s in items], separators=(",", ":")).encode()


def key_table(plan: LocalPlan) -> bytes:
    """The plan's key table as bytes, what the planner groups ranks by: the raw table
    of a decoded plan, else (a plan built in memory) its JSON, computed once and kept in
    ``plan.keys_json``. O(items) the first time."""
    if not plan.keys_json:
        plan.keys_json = table_json(plan.items)
    return plan.keys_json


def bytes_digest(t) -> str:
    """The content hash a plan carries for a bytes value held as a 1-D uint8 CPU tensor
    (dckpt.state.flatten.bytes_tensor): XXH3-128 of its bytes, as 32 hex digits.
    O(len) at ~10 GB/s, no copy."""
    return codec._xxh().xxh3_128_hexdigest(memoryview(t.numpy()))


def encode(plan: LocalPlan) -> bytes:
    """Serialise a local plan. O(items), no I/O."""
    keys = table_json(plan.items)
    extra = json.dumps({"values": plan.values, "error": plan.error,
                        **({"int_keys": plan.int_keys} if plan.int_keys else {}),
                        **({"bytes_keys": plan.bytes_keys} if plan.bytes_keys else {}),
                        **({"bytes_digests": plan.bytes_digests} if plan.bytes_digests else {})},
                       separators=(",", ":"), allow_nan=True).encode()
    return b"".join((_U64.pack(len(keys)), keys, _U64.pack(len(extra)), extra,
                     np.ascontiguousarray(plan.boxes, dtype="<i8").tobytes()))


def structure_views(blob: bytes) -> tuple[memoryview, memoryview]:
    """The parts of :func:`encode`'s output that describe a plan's structure: (the key
    table with its length prefix, the boxes), as views of ``blob`` (no copy). What a
    plan cache hashes; kept here, beside the encoding it reads. Raises struct.error on
    a blob too short to hold them."""
    mv = memoryview(blob)
    (n,) = _U64.unpack_from(mv, 0)
    (m,) = _U64.unpack_from(mv, 8 + n)
    return mv[:8 + n], mv[16 + n + m:]


def _last_table(cache: dict | None, data: bytes, n: int) -> bytes | None:
    """The cache's newest key table (dicts keep insertion order) when ``data`` carries
    the same bytes, else None. Ranks of one job send byte-identical tables: comparing
    against the newest one (a memcmp) and handing back that very bytes object skips
    hashing a new ~30 KB copy per rank here, and again wherever the planner looks the
    table up (a bytes object caches its hash). At 16,384 ranks that was 0.5 s. O(n)."""
    if not cache or not isinstance(data, bytes):
        return None
    last = next(reversed(cache))
    return last if len(last) == n and data.startswith(last, 8) else None


def decode(data: bytes, cache: dict[bytes, list] | None = None) -> LocalPlan:
    """Parse :func:`encode`'s output. ``cache`` maps key-table bytes to parsed tables so
    identical tables are parsed once. Raises ValueError on malformed input."""
    mv = memoryview(data)
    try:
        (n,) = _U64.unpack_from(mv, 0)
        keys_raw = _last_table(cache, data, n)
        if keys_raw is None:
            keys_raw = bytes(mv[8:8 + n])
        pos = 8 + n
        (m,) = _U64.unpack_from(mv, pos)
        extra = json.loads(bytes(mv[pos + 8:pos + 8 + m]))
        pos += 8 + m
        items = None if cache is None else cache.get(keys_raw)
        if items is None:
            items = [(k, d, tuple(s)) for k, d, s in json.loads(keys_raw)]
            if cache is not None:
                cache[keys_raw] = items
        boxes = np.frombuffer(mv[pos:], dtype="<i8")
        bkeys = extra.get("bytes_keys") or []
        if not isinstance(bkeys, list) or not all(isinstance(k, str) for k in bkeys):
            raise TypeError("bytes_keys is not a list of strings")
        digests = extra.get("bytes_digests") or {}
        if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
            raise TypeError("bytes_digests is not an object of strings")
        return LocalPlan(items, boxes, extra.get("values") or {}, extra.get("error"),
                         extra.get("int_keys") or [], bkeys, digests, keys_raw)
    except (struct.error, TypeError, AttributeError) as e:
        raise ValueError(f"malformed local plan ({e})") from None
