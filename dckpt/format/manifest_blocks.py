"""Parsing a tensor's ``blocks`` (docs/INCREMENTAL.md): block hashes and the block tables
of encoded chunks, validated before any reader trusts them. Pure (numpy).

A reader follows a table's rows to read and decode each block: every number in it is
checked here, in numpy, against what the manifest itself states (the files' sizes, the
chunk's bytes, the block size), so that a hostile table is refused at parse with a
ManifestError naming the tensor, chunk and block, never read as garbage, allowed to
allocate more than one block's bytes, or failed on with a raw Python error.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from ..errors import ManifestError
from . import codec, intarray, sealed
from .filetable import _int
from .manifest_types import TABLE_COLS, ChunkBlocks, Chunks, FileTable


def parse(key: str, obj: Any, chunks: Chunks, itemsize: int,
          files: FileTable) -> tuple[ChunkBlocks, ...]:
    """``key``'s blocks, one ChunkBlocks per chunk of ``chunks`` (elements of
    ``itemsize`` bytes; ``files``: the manifest's). O(blocks) numpy. Raises
    ManifestError naming the tensor (and chunk and block) for a block size that is not
    whole elements or is over :data:`codec.HASH_BLOCK`, hashes that are not 16 bytes a
    block, and any table row :func:`bad_rows` refuses."""
    if not isinstance(obj, dict):
        raise ManifestError(f"tensor {key!r}: blocks must be an object")
    # dckpt writes 1 MiB blocks. A reader serves any size of whole elements up to that:
    # a block boundary inside an element made a slice read garbage (a partial read
    # starts on a block boundary), and a larger block let a few KiB of compressed
    # frame decode to that many bytes before its hash was checked (codec._decompress).
    size = _int(obj.get("size"), f"tensor {key!r} block size", 1, codec.HASH_BLOCK)
    if size % itemsize:
        raise ManifestError(f"tensor {key!r}: block size {size} is not a multiple of its "
                            f"item size {itemsize}: a block boundary would cut an element")
    nbytes = [int(np.prod(s)) * itemsize for s in chunks.sizes]
    counts = [codec.nblocks(n, size) for n in nbytes]
    try:
        hashes = base64.b64decode(obj.get("hash", ""), validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ManifestError(f"tensor {key!r}: block hashes are not base64") from None
    if len(hashes) != codec.HASH_BYTES * sum(counts):
        raise ManifestError(f"tensor {key!r}: {len(hashes)} bytes of block hashes for "
                            f"{sum(counts)} blocks")
    enc = obj.get("enc", {})
    if not isinstance(enc, dict):
        raise ManifestError(f"tensor {key!r}: blocks.enc must be an object")
    tables: dict[int, np.ndarray] = {}
    for ci, flat in enc.items():
        # canonical decimal only: "03" (or "٣", a str.isdigit digit) named chunk 3 twice
        if not (isinstance(ci, str) and len(ci) <= 10 and ci.isascii() and ci.isdigit()
                and ci == str(int(ci)) and int(ci) < len(counts)):
            raise ManifestError(f"tensor {key!r}: encoded chunk {sealed.short(ci)} does not exist")
        n = counts[int(ci)]
        try:
            table = intarray.decode(flat, f"tensor {key!r} chunk {ci} blocks", TABLE_COLS * n)
        except (ValueError, TypeError) as e:
            raise ManifestError(str(e)) from None
        if len(table) != TABLE_COLS * n:
            raise ManifestError(f"tensor {key!r} chunk {ci}: block table of {len(table)} "
                                f"numbers for {n} blocks")
        tables[int(ci)] = np.ascontiguousarray(table.reshape(TABLE_COLS, n).T)
    if tables:  # every table of the tensor in one pass: not numpy calls per chunk
        _check_tables(key, tables, size, nbytes, data_room(files))
    out, pos = [], 0
    for ci, n in enumerate(counts):
        h = codec.HASH_BYTES * n
        out.append(ChunkBlocks(size, hashes[pos:pos + h], tables.get(ci)))
        pos += h
    return tuple(out)


def _check_tables(key: str, tables: dict[int, np.ndarray], size: int, nbytes: list[int],
                  room: np.ndarray) -> None:
    """Raise ManifestError naming ``key``, the chunk and the block for the first row of
    ``tables`` (chunk index -> its (n, 8) table) that :func:`bad_rows` refuses."""
    cis = list(tables)
    t = np.concatenate([tables[ci] for ci in cis])
    raw = np.concatenate([np.minimum(size, nbytes[ci] - size * np.arange(
        len(tables[ci]), dtype=np.int64)) for ci in cis])
    bad, why = bad_rows(t, raw, room)
    if bad.any():
        j = int(np.argmax(bad))
        ends = np.cumsum([len(tables[ci]) for ci in cis])
        c = int(np.searchsorted(ends, j, side="right"))
        k = j - (int(ends[c - 1]) if c else 0)
        raise ManifestError(f"tensor {key!r} chunk {cis[c]} block {k}: {why(j)}")


def data_room(files: FileTable) -> np.ndarray:
    """Per file, the bytes after its safetensors header (0 at least): where its stored
    entries, and so every block a table names in it, lie. O(files) numpy."""
    return np.maximum(files.size - 8 - files.header_len, 0)


def bad_rows(t: np.ndarray, raw: np.ndarray, room: np.ndarray):
    """Which rows of block table rows ``t`` ((n, 8) int64, any chunks; ``raw``: each
    block's raw bytes) a reader cannot follow, as (bool mask, a function of a row index
    saying why). A row can be followed when its block and, for a delta, its anchor are
    each in a file of the manifest (``room``: :func:`data_room`), with a codec flag set
    :func:`codec.encode` writes (an anchor's never a delta), stored inside that file's
    data in at most the block's raw bytes (exactly those, stored raw: no writer stores
    a block larger than it is); a block that is no delta names no anchor (-1 x 4).
    Offsets and lengths are compared without overflowing, whatever their values.
    O(n) numpy, a fixed number of calls."""
    delta = _known(t[:, 3], codec.CODECS) & ((t[:, 3] & codec.XOR) != 0)
    parts = []
    for cols, codecs in ((slice(0, 4), codec.CODECS), (slice(4, 8), codec.ANCHOR_CODECS)):
        f, off, ln, fl = t[:, cols].T
        f_ok = (f >= 0) & (f < len(room))
        room_f = np.zeros(len(t), np.int64)
        room_f[f_ok] = room[f[f_ok]]
        # off + ln <= room as off <= room - ln: no int64 overflow for 0 <= ln <= raw
        fits = (ln >= 0) & (ln <= raw) & (off >= 0) & (off <= room_f - np.clip(ln, 0, raw))
        parts.append(~(f_ok & fits & _known(fl, codecs) & ((fl != codec.RAW) | (ln == raw))))
    stray = (t[:, 4:] != -1).any(1) & ~delta
    bad = parts[0] | (parts[1] & delta) | stray

    def why(j: int) -> str:
        if not parts[0][j] and stray[j]:
            return "a block that is not a delta names an anchor"
        name, cols = ("block", slice(0, 4)) if parts[0][j] else ("anchor", slice(4, 8))
        f, off, ln, fl = t[j, cols].tolist()
        return (f"its {name} (file {f}, offset {off}, length {ln}, codec {fl}) is not one "
                f"a reader can follow: it needs a file index in [0, {len(room)}), a codec "
                f"dckpt writes{' (never a delta)' if name == 'anchor' else ''}, and at most "
                f"{int(raw[j])} bytes (exactly that many stored raw) inside the file's data")
    return bad, why


def _known(flags: np.ndarray, codecs: frozenset) -> np.ndarray:
    """Per entry of ``flags``, whether it is in ``codecs`` (a lookup, not np.isin)."""
    lut = np.zeros(codec.VALID + 1, bool)
    lut[list(codecs)] = True
    inside = (flags >= 0) & (flags <= codec.VALID)
    return inside & lut[np.where(inside, flags, 0)]
