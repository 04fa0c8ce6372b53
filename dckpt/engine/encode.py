"""Incremental and compressed saves, the writing rank's side: hash each chunk it
writes in blocks, compare with the base checkpoint, and produce what goes into its
shard file (plain bytes, or encoded blocks) and what its vote reports.

A chunk is written:
- plain (as without this module) when there is nothing to gain: no base or every
  block changed, and no compression;
- not at all when every block's hash equals the base's (a whole-chunk reference);
- else encoded: one ``U8`` safetensors entry holding its stored blocks back to back,
  unchanged blocks referencing the base's bytes where they physically are, changed
  ones compressed and/or as a delta (XOR) against the base's full block.

A delta needs the anchor's bytes, read back from the base (verified). A chunk tries it
on its first changed block only: when that delta is not worth it (the chunk changed
densely, as in pre-training), the chunk's other blocks are not read.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..format import codec
from ..format import manifest as mf
from ..format.dtypes import ITEMSIZE
from ..layout import delta
from ..reader import ChunkReader, _Files

log = logging.getLogger(__name__)


@dataclass
class Encoding:
    """How a save encodes: the compressor bits and the base (parsed manifest and a
    reader rooted at it, for anchors), or no base."""

    compressor: int = codec.RAW
    base: mf.Manifest | None = None
    base_reader: ChunkReader | None = None

    @property
    def active(self) -> bool:
        return bool(self.compressor) or self.base is not None


@dataclass
class Planned:
    """One piece's fate: ``report`` for the vote; ``write`` False for a whole-chunk
    reference; ``produce`` (None for plain bytes) makes the encoded entry's bytes."""

    report: delta.ChunkReport
    write: bool
    produce: object = None
    max_bytes: int = 0


def plan_pieces(pieces: list, buffers: list[memoryview], enc: Encoding,
                pool: ThreadPoolExecutor) -> list[Planned]:
    """Hash every piece's blocks (in ``pool``) and decide how each is written. CPU only
    (XXH3 releases the GIL on large blocks)."""
    hashes = list(pool.map(codec.block_hashes, buffers))
    out = []
    for p, buf, h in zip(pieces, buffers, hashes):
        offsets = [int(x) for x in p.box.offsets]
        rep = delta.ChunkReport(p.key, offsets, h)
        bc = None
        if enc.base is not None:
            bc = delta.base_chunk(enc.base, p.key, p.dtype, p.shape, p.box.offsets, p.box.sizes)
        if bc is None:
            if enc.compressor:
                out.append(_encoded(p, buf, rep, None, np.ones(codec.nblocks(len(buf)), bool), enc, pool))
            else:
                out.append(Planned(rep, True))
            continue
        ch = delta.changed(h, bc.hashes)
        if not ch.any():  # nothing to write: point at the base's chunk
            if bc.plain_file is not None:
                rep.ref_file = bc.plain_file
            else:
                rep.table = bc.rows.copy()
            out.append(Planned(rep, False))
            continue
        if ch.all() and not enc.compressor and not _delta_pays(p, buf, bc, enc, int(np.argmax(ch))):
            out.append(Planned(rep, True))  # changed everywhere: plain, no reads
            continue
        out.append(_encoded(p, buf, rep, bc, ch, enc, pool))
    return out


def _delta_pays(p, buf: memoryview, bc: delta.BaseChunk, enc: Encoding, k: int) -> bool:
    """Whether a delta of block ``k`` against its anchor is worth it (one anchor read)."""
    a = _anchor(p, bc, k, enc, len(buf))
    if a is None:
        return False
    raw = buf[k * codec.HASH_BLOCK:(k + 1) * codec.HASH_BLOCK]
    flags, _ = codec.encode(raw, p.dtype, ITEMSIZE[p.dtype], enc.compressor, a)
    return bool(flags & codec.XOR)


def _anchor(p, bc: delta.BaseChunk, k: int, enc: Encoding, nbytes: int):
    """Block ``k``'s anchor, decoded, or None when it cannot be read (then the block is
    written without a delta: a damaged base must not fail a new save)."""
    af = delta.anchor(bc.rows[k])
    size = min(codec.HASH_BLOCK, nbytes - k * codec.HASH_BLOCK)
    r = enc.base_reader
    try:
        with _Files(r.storage) as files:
            stored = r.stored_bytes(af[0], p.key, af[1], af[2], files)
            return codec.decode(af[3], stored, size, ITEMSIZE[p.dtype])
    except Exception as e:  # noqa: BLE001 - any failure: no delta for this block
        log.warning("tensor %r block %d: the base's block cannot be read (%s); writing it "
                    "in full", p.key, k, e)
        return None


def _encoded(p, buf: memoryview, rep: delta.ChunkReport, bc: delta.BaseChunk | None,
             ch: np.ndarray, enc: Encoding, pool: ThreadPoolExecutor) -> Planned:
    """An encoded entry: ``produce()`` returns its bytes and fills ``rep.table``."""
    n = len(buf)
    nb = codec.nblocks(n)
    table = np.full((nb, mf.TABLE_COLS), -1, np.int64)
    if bc is not None:
        table[~ch] = bc.rows[~ch]
    rep.table = table
    isz = ITEMSIZE[p.dtype]
    todo = np.flatnonzero(ch).tolist()
    try_delta = [bc is not None]

    def one(k: int):
        raw = buf[k * codec.HASH_BLOCK:(k + 1) * codec.HASH_BLOCK]
        a = _anchor(p, bc, k, enc, n) if try_delta[0] else None
        flags, data = codec.encode(raw, p.dtype, isz, enc.compressor, a)
        if a is not None and not flags & codec.XOR:
            try_delta[0] = False  # dense change: read no more anchors of this chunk
        return k, flags, data, (delta.anchor(bc.rows[k]) if flags & codec.XOR else delta.NO_ANCHOR)

    def produce() -> bytes:
        parts, pos = [], 0
        first = [one(todo[0])] if todo else []  # decides whether deltas are tried
        for k, flags, data, anc in first + list(pool.map(one, todo[1:])):
            table[k, :4] = (delta.OWN, pos, len(data), flags)
            table[k, 4:] = anc
            parts.append(data)
            pos += len(data)
        return b"".join(parts)  # bytes, memoryviews and arrays alike

    return Planned(rep, True, produce, int(ch.sum()) * codec.HASH_BLOCK)
