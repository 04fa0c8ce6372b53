"""Shard files: plain safetensors, with CRC32 checksums of every block of every tensor.

Layout of a file: ``u64 header length | header JSON (space padded to 8) | data``. The
header's ``__metadata__`` holds ``dckpt.block`` (block size in bytes) and, per tensor,
``crc32:<name>``: 8 hex digits per block of that tensor's bytes, and ``at:<name>``: the
global offsets of the chunk it holds (decimal, joined by ``,``; files written before
have none, see :mod:`.chunknames`). The manifest records the
length and CRC32 of the header, so every byte of a file is covered by a checksum, and a
partial read can be verified block by block. Any safetensors reader loads the file.
"""
from __future__ import annotations

import json
import math
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import IntegrityError
from .checksum import crc32
from .dtypes import ITEMSIZE

BLOCK = 256 << 10  # bytes per checksum: a partial read widens a region by < 2 blocks
# The largest block a header may declare: a partial read or a verify reads whole blocks,
# so a huge block (1 GiB) turns every slice into a read of the whole tensor. 64x BLOCK.
MAX_BLOCK = 16 << 20
MAX_HEADER = 100 << 20  # as safetensors: refuse absurd headers before allocating
_U64 = struct.Struct("<Q")
MAX_DIMS = 64  # as the manifest: a tensor has at most 64 dims
# An ``at:<name>`` value: at most MAX_DIMS decimal offsets below 2**63 (19 digits), no
# leading zeros, joined by ",". Checked by length first, then by this bounded pattern:
# linear in the (bounded) value, whatever bytes a hostile header holds.
_AT_CHARS = MAX_DIMS * 20
_AT = re.compile(r"(?:0|[1-9][0-9]{0,18})(?:,(?:0|[1-9][0-9]{0,18})){0,%d}" % (MAX_DIMS - 1))
_I63 = 1 << 63


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard file, as its header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int
    crcs: np.ndarray  # uint32, one per block
    # the global offsets of the chunk it holds, as its header records them (``at:``);
    # None in a file written before offsets were recorded
    at: tuple[int, ...] | None = None


def block_crcs(buf: memoryview, block: int = BLOCK) -> list[int]:
    """CRC32 of each ``block`` bytes of ``buf``. Releases the GIL."""
    return [crc32(buf[i:i + block]) for i in range(0, len(buf), block)] or [0]


def header_json(entries, crcs: list[list[int]] | None = None, block: int = BLOCK,
                align: int = 8, length: int | None = None,
                at: dict[str, tuple[int, ...]] | None = None, prefix: str = "",
                meta: dict[str, str] | None = None) -> bytes:
    """The header JSON (no length prefix) of ``entries`` in file order, padded. Without
    ``crcs``: plain safetensors (``__metadata__`` only ``{"format": "pt"}``). ``at``:
    {stored name: the global offsets of its chunk}, recorded as ``at:<name>`` (with
    ``crcs`` only; every entry must have one). ``prefix``: the key prefix every stored
    name lacks (a side file: a model folder's names), recorded as ``dckpt.prefix`` (with
    ``crcs`` only). ``meta``: more ``__metadata__`` entries (a plain file's).
    Pure, O(header)."""
    meta = {**(meta or {}), "format": "pt"}
    if crcs is not None:
        meta["dckpt.block"] = str(block)
    if prefix and crcs is not None:
        meta["dckpt.prefix"] = prefix
    body: dict = {}
    pos = 0
    for i, (name, dtype, shape, nbytes) in enumerate(entries):
        if crcs is not None:
            meta["crc32:" + name] = "".join(f"{x:08x}" for x in crcs[i])
            if at is not None:
                meta["at:" + name] = ",".join(str(int(x)) for x in at[name])
        body[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps({"__metadata__": meta, **body}, separators=(",", ":")).encode()
    if length is not None:  # a header reserved before the sizes were known
        assert len(raw) <= length, "header outgrew its reservation"
        return raw + b" " * (length - len(raw))
    # Spaces pad the header (safetensors allows them) so that the data starts at a
    # multiple of ``align`` (8 at least, as safetensors writes; a direct-I/O writer
    # asks for its block size so the data can go out without a bounce copy).
    return raw + b" " * (-(8 + len(raw)) % max(8, align))


def order_entries(entries: list[tuple[str, str, tuple[int, ...], int]]) -> list[int]:
    """Indexes of ``entries`` in file order: larger items first, so each tensor starts at
    a multiple of its item size (safetensors' own rule); within an item size, tensors
    whose length is a multiple of 4 KiB first, so that they all start 4 KiB-aligned and
    a direct-I/O writer sends them without a copy; then as given."""
    return sorted(range(len(entries)),
                  key=lambda i: (-ITEMSIZE[entries[i][1]], entries[i][3] % 4096 != 0))


def write_shard(writer, entries: list[tuple[str, str, tuple[int, ...], int]],
                buffers: list, random_write: bool, block: int = BLOCK,
                at: dict[str, tuple[int, ...]] | None = None,
                prefix: str = "") -> tuple[int, int, int]:
    """Write one shard file through ``writer`` (a storage Writer, not yet committed).

    ``entries[i] = (name, dtype, shape, nbytes)`` in file order, ``buffers[i]`` its bytes.
    With a random-access writer the data goes first while a thread computes checksums,
    then the header; otherwise checksums are computed first and the file is streamed.
    Returns (file size, header length, header crc32). Blocking I/O; raises OSError.

    A buffer may instead be a callable returning the bytes (an encoded chunk, made
    while the previous one is written); its entry's size is then an upper bound, and
    the header, reserved for the bounds, is padded to the reservation. Or a streamed
    source (``len()`` and ``blocks(multiple)``, see dckpt.engine.devstream): its bytes
    arrive a bounded block at a time and are checksummed as they are written (twice
    produced for a streaming writer, which needs the checksums first).

    ``at``: {name: global offsets of the chunk} for every entry, recorded in the header
    (``at:<name>``) so that a reader can tell which chunk a file holds; dckpt's writers
    always pass it (None writes a file as dckpt did before offsets were recorded).
    ``prefix``: see :func:`header_json` (entries are named without it)."""
    if any(callable(b) for b in buffers):
        return _write_lazy(writer, entries, buffers, random_write, block, at, prefix)
    align = getattr(writer, "alignment", 8)
    placeholder = [[0] * max(1, -(-n // block)) for (_, _, _, n) in entries]
    hlen = len(header_json(entries, placeholder, block, align, at=at, prefix=prefix))
    data_start = 8 + hlen
    if random_write:
        with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as side:
            futs = [None if is_streamed(b) else pool.submit(block_crcs, b, block)
                    for b in buffers]
            pos = data_start
            for i, b in enumerate(buffers):
                if is_streamed(b):
                    futs[i] = _write_blocks(writer, b, pos, block, side)
                else:
                    writer.pwrite(b, pos)
                pos += len(b)
            crcs = [f if isinstance(f, list) else f.result() for f in futs]
        head = _U64.pack(hlen) + header_json(entries, crcs, block, align, at=at, prefix=prefix)
        writer.pwrite(head, 0)
    else:
        crcs = [_streamed_crcs(b, block) if is_streamed(b) else block_crcs(b, block)
                for b in buffers]
        head = _U64.pack(hlen) + header_json(entries, crcs, block, align, at=at, prefix=prefix)
        writer.write(head)
        pos = data_start
        for b in buffers:
            for v in (b.blocks(block) if is_streamed(b) else (b,)):
                writer.write(v)
            pos += len(b)
    assert len(head) == data_start, "header length changed between layout and write"
    return pos, hlen, crc32(head)


def is_streamed(b) -> bool:
    """Whether a buffer handed to :func:`write_shard` is a streamed source (it has
    ``blocks(multiple)``, see dckpt.engine.devstream) rather than bytes."""
    return hasattr(b, "blocks")


def _write_blocks(writer, src, pos: int, block: int, side: ThreadPoolExecutor) -> list[int]:
    """Write streamed ``src`` at ``pos``, checksumming each of its views in ``side``
    while it is written (both release the GIL). Returns its block checksums."""
    crcs: list[int] = []
    for v in src.blocks(block):
        f = side.submit(block_crcs, v, block)
        writer.pwrite(v, pos)
        pos += len(v)
        crcs += f.result()  # before the next view: this one's buffer is then reused
    return crcs or [0]


def _streamed_crcs(src, block: int) -> list[int]:
    return [c for v in src.blocks(block) for c in block_crcs(v, block)] or [0]


def _write_lazy(writer, entries, buffers, random_write: bool, block: int,
                at: dict | None, prefix: str = "") -> tuple[int, int, int]:
    entries = list(entries)
    if not random_write:  # a stream: the header goes first, so everything is made first
        bufs = [b() if callable(b) else b for b in buffers]
        for i, b in enumerate(bufs):
            if callable(buffers[i]):
                entries[i] = (entries[i][0], entries[i][1], (len(b),), len(b))
        return write_shard(writer, entries, [memoryview(b) for b in bufs], False, block, at)
    align = getattr(writer, "alignment", 8)
    # Upper bounds give the longest header: as many CRCs, offsets with as many digits.
    bound = [[0xFFFFFFFF] * max(1, -(-n // block)) for (_, _, _, n) in entries]
    hlen = len(header_json(entries, bound, block, align, at=at, prefix=prefix))
    pos = 8 + hlen
    crcs: list = []
    with ThreadPoolExecutor(2) as pool:
        nxt = pool.submit(_make, buffers[0]) if buffers else None
        for i in range(len(buffers)):
            b = nxt.result()
            if i + 1 < len(buffers):  # make the next one while this one is written
                nxt = pool.submit(_make, buffers[i + 1])
            if callable(buffers[i]):
                entries[i] = (entries[i][0], entries[i][1], (len(b),), len(b))
            crcs.append(pool.submit(block_crcs, b, block))
            writer.pwrite(b, pos)
            pos += len(b)
        crcs = [f.result() for f in crcs]
    head = _U64.pack(hlen) + header_json(entries, crcs, block, align, hlen, at, prefix)
    writer.pwrite(head, 0)
    return pos, hlen, crc32(head)


def _make(b) -> memoryview:
    return memoryview(b() if callable(b) else b).cast("B")


def check_entry(name: str, t, data_start: int, size: int) -> tuple[str, tuple[int, ...], int, int]:
    """Check one tensor's entry ``t`` of a safetensors header (any safetensors file, no
    dckpt metadata needed): a dtype dckpt stores, a shape of non-negative ints, a byte
    range that matches them and lies inside the file (``size`` bytes, data from
    ``data_start``). Returns (dtype code, shape, absolute start, nbytes). Pure. Raises
    ValueError naming the tensor, or KeyError/TypeError for a malformed entry."""
    s, e = t["data_offsets"]
    shape = t["shape"]
    if not (isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape)):
        raise ValueError(f"tensor {name!r} has a bad shape")
    if not (type(s) is int and type(e) is int and 0 <= s <= e and data_start + e <= size) \
            or t["dtype"] not in ITEMSIZE \
            or e - s != math.prod(shape) * ITEMSIZE[t["dtype"]]:
        raise ValueError(f"tensor {name!r} has bad offsets or dtype")
    return t["dtype"], tuple(shape), data_start + s, e - s


def load_json(raw: bytes, what: str = "the header") -> dict:
    """The JSON object in ``raw`` (a safetensors header without its length prefix, or
    another small JSON file read from an untrusted place). Pure, O(len(raw)). Raises
    ValueError for anything else: not UTF-8, not JSON, not an object, or nested too
    deeply for Python's recursive parser (which raises RecursionError, not an error a
    caller of a file parser expects)."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to be JSON dckpt reads") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} is not a JSON object")
    return doc


# The longest key prefix a side file's header may record (dckpt.prefix): a model's
# prefix in a training tree is a few words.
MAX_PREFIX = 1024


def parse_header(head: bytes, file: str, size: int) -> tuple[dict[str, StoredTensor], int]:
    """Parse a shard header (``head`` = the first 8+hlen bytes, already checksummed).
    Returns ({name: StoredTensor}, block). Pure, O(header). Raises IntegrityError naming
    ``file`` (and the tensor where one is at fault) for a malformed header, and for a
    block size over MAX_BLOCK or not a multiple of a tensor's item size (even where
    every checksum matches: reads of such blocks cannot be served), and for recorded
    offsets (``at:<name>``) that are malformed, or recorded for some tensors only."""
    try:
        (hlen,) = _U64.unpack_from(head, 0)
        doc = load_json(head[8:8 + hlen])
        meta = doc.pop("__metadata__", {}) or {}
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not a JSON object")
        block = int(meta.get("dckpt.block", "0"))
        if block <= 0:
            raise ValueError("no dckpt.block in metadata")
        if block > MAX_BLOCK:
            raise ValueError(f"block size {block} is over {MAX_BLOCK} bytes (dckpt writes "
                             f"{BLOCK}): every read would widen to such blocks")
        prefix = meta.get("dckpt.prefix", "")
        if not isinstance(prefix, str) or len(prefix) > MAX_PREFIX:
            raise ValueError(f"dckpt.prefix is not a string of at most {MAX_PREFIX} characters")
        out = {}
        data_start = 8 + hlen
        for name, t in doc.items():
            dtype, shape, start, nbytes = check_entry(name, t, data_start, size)
            if block % ITEMSIZE[dtype]:
                # a block boundary inside an item: a partial read, which starts and ends
                # on block boundaries, would cut items in two and return garbage
                raise ValueError(f"tensor {name!r}: block size {block} is not a multiple "
                                 f"of its item size {ITEMSIZE[dtype]} ({dtype})")
            hexs = meta.get("crc32:" + name, "")
            crcs = np.array([int(hexs[i:i + 8], 16) for i in range(0, len(hexs), 8)], np.uint32)
            if len(crcs) != max(1, -(-nbytes // block)):
                raise ValueError(f"tensor {name!r} has {len(crcs)} checksums")
            at = meta.get("at:" + name)
            # a side file stores its chunks without the key prefix it records: held
            # here under the names every reader looks up (prefix + stored name)
            out[prefix + name] = StoredTensor(prefix + name, dtype, shape, start, nbytes, crcs,
                                              None if at is None else parse_offsets(at, name))
        _all_or_none_at(meta, out)
        return out, block
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise IntegrityError(f"shard file {file}: unreadable header ({e})") from None


def parse_offsets(value, name: str) -> tuple[int, ...]:
    """The global offsets an ``at:<name>`` value records (``"512,0"``; ``""`` for a
    scalar). Pure; the value is untrusted: its length is bounded before it is matched
    (O(MAX_DIMS) at most). Raises ValueError naming the tensor for anything but at
    most MAX_DIMS canonical decimal integers in ``[0, 2**63)`` joined by ``,``."""
    if not isinstance(value, str) or len(value) > _AT_CHARS or \
            (value and _AT.fullmatch(value) is None):
        raise ValueError(f"tensor {name!r}: malformed recorded offsets (at:{name})")
    out = tuple(int(x) for x in value.split(",")) if value else ()
    if any(x >= _I63 for x in out):
        raise ValueError(f"tensor {name!r}: a recorded offset is over 2**63 - 1")
    return out


def _all_or_none_at(meta: dict, tensors: dict[str, StoredTensor]) -> None:
    """A header records offsets for every tensor or for none (a file written before
    they were recorded), never for names it does not hold. O(metadata keys). Raises
    ValueError."""
    n = sum(1 for k in meta if k.startswith("at:"))
    if n and (n != len(tensors) or any(st.at is None for st in tensors.values())):
        raise ValueError("recorded offsets (at:<name>) for some tensors only, or for "
                         "tensors the file does not hold")


def verify(buf: memoryview, first_block: int, crcs: np.ndarray, block: int,
           what: str) -> None:
    """Check ``buf`` (which starts at block ``first_block`` of a tensor) against the
    stored checksums. CPU cost ~0.3 s/GB; raises IntegrityError naming ``what``."""
    got = block_crcs(buf, block)
    want = crcs[first_block:first_block + len(got)]
    if len(want) != len(got) or (np.asarray(got, np.uint32) != want).any():
        bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), len(want))
        raise IntegrityError(f"{what}: checksum mismatch in block {first_block + bad} "
                             "(flipped bits or a rewritten file)")


def verify_segments(segments: list, first_block: int, crcs: np.ndarray, block: int,
                    what: str) -> None:
    """Like :func:`verify` for bytes split over several buffers (a head and tail read
    into scratch space around a middle read straight into its destination): CRCs run
    across the segment boundaries."""
    views = [memoryview(s).cast("B") for s in segments if len(s)]
    b, crc, filled = first_block, 0, 0
    for v in views:
        pos = 0
        while pos < len(v):
            n = min(block - filled, len(v) - pos)
            crc = crc32(v[pos:pos + n], crc)
            pos, filled = pos + n, filled + n
            if filled == block:
                check_block(crc, b, crcs, what)
                b, crc, filled = b + 1, 0, 0
    if filled:
        check_block(crc, b, crcs, what)


def check_block(crc: int, b: int, crcs: np.ndarray, what: str) -> None:
    if b >= len(crcs) or crc != int(crcs[b]):
        raise IntegrityError(f"{what}: checksum mismatch in block {b} "
                             "(flipped bits or a rewritten file)")
