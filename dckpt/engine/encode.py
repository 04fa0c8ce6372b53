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

A delta needs the anchor's bytes, read back from the base (verified). A chunk first
peeks at SAMPLE bytes of its first changed block's anchor (unverified: it only decides),
then tries the whole block: when either says the delta is not worth it (the chunk
changed densely, as in pre-training), the chunk's other blocks are not read.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..format import codec
from ..format.shards import is_streamed
from ..format import manifest as mf
from ..format.dtypes import ITEMSIZE
from ..layout import delta
from .openfiles import OpenFiles as _Files
from .reader import ChunkReader

log = logging.getLogger(__name__)


@dataclass
class Encoding:
    """How a save encodes: the compressor bits and the base (parsed manifest and a
    reader rooted at it, for anchors), or no base."""

    compressor: int = codec.RAW
    base: mf.Manifest | None = None
    base_reader: ChunkReader | None = None
    # False: never read the base (no XOR deltas), only its manifest's hashes: a staged
    # durable upload must not download its base (dckpt.tiers.stage_encoded)
    deltas: bool = True

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


def plan_pieces(pieces: list, buffers: list, enc: Encoding,
                pool: ThreadPoolExecutor) -> list[Planned]:
    """Hash every piece's blocks (in ``pool``) and decide how each is written. CPU only
    (XXH3 releases the GIL on large blocks). A streamed buffer (a GPU tensor, see
    dckpt.engine.devstream; only when ``enc`` is not active) is planned plain, its
    hashes left for :func:`hashing` to fill while it is written."""
    hashes = list(pool.map(lambda b: b"" if is_streamed(b) else codec.block_hashes(b), buffers))
    out = []
    unhashed = [0]  # chunks of a base without block hashes read to compare
    for p, buf, h in zip(pieces, buffers, hashes):
        offsets = [int(x) for x in p.box.offsets]
        rep = delta.ChunkReport(p.key, offsets, h)
        if is_streamed(buf):
            assert not enc.active, "a streamed piece needs its bytes whole to be encoded"
            out.append(Planned(rep, True))
            continue
        bc = None
        if enc.base is not None:
            bc = delta.base_chunk(enc.base, p.key, p.dtype, p.shape, p.box.offsets, p.box.sizes)
            if bc is not None and bc.hashes is None:
                bc = _hash_base(p, buf, bc, enc, unhashed)
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
        k = int(np.argmax(ch))
        worth = enc.deltas and _sample_pays(p, buf, bc, enc, k)
        if ch.all() and not enc.compressor and not (worth and _delta_pays(p, buf, bc, enc, k)):
            out.append(Planned(rep, True))  # changed everywhere: plain
            continue
        out.append(_encoded(p, buf, rep, bc, ch, enc, pool, try_delta=worth))
    if unhashed[0]:
        log.info("the base recorded no block hashes (saved without block_hashes=True): "
                 "read %d of its chunks back to compare", unhashed[0])
    return out


HASH_READ = 64 << 20  # bytes of a base's chunk read at a time to hash it
LOOKS = 4  # places of a chunk looked at before reading an unhashed base's chunk back


def _changed_densely(p, buf: memoryview, bc: delta.BaseChunk, r: ChunkReader, files) -> bool:
    """Whether SAMPLE bytes at each of LOOKS evenly spaced places of the chunk differ
    densely from the base's (unverified peeks: they only decide). Every place, not just
    the start: an embedding whose first rows (frequent tokens) changed densely is mostly
    unchanged, and must still be compared. Blocking I/O: LOOKS small reads."""
    isz = ITEMSIZE[p.dtype]
    n = min(SAMPLE, len(buf)) // isz * isz
    if n < 64:
        return False
    last = (len(buf) - n) // isz
    for at in sorted({last * i // (LOOKS - 1) * isz for i in range(LOOKS)}):
        mine = np.frombuffer(buf[at:at + n], np.uint8)
        theirs = np.frombuffer(r.peek(bc.plain_file, p.key, at, n, files, p.box.offsets),
                               np.uint8)
        if np.count_nonzero(mine != theirs) <= DENSE * n:
            return False
    return True


def _hash_base(p, buf: memoryview, bc: delta.BaseChunk, enc: Encoding,
               count: list) -> delta.BaseChunk | None:
    """``bc`` (a plain chunk of a base saved without block hashes) with the hashes of
    its bytes, read from the base in HASH_READ slabs, each verified against the base
    file's checksums; None (the chunk is then written in full) when the base must not
    be read (a staged copy: never a download), when the two differ densely wherever
    :func:`_changed_densely` looks (pre-training changes every block: a few small
    unverified reads rule it out), or when it cannot be read (with a warning: a damaged
    base must not fail a new save). Blocking I/O: the chunk's bytes, once; memory: one
    slab."""
    nbytes = len(buf)
    r = enc.base_reader
    if r is None or not enc.deltas or bc.plain_file is None:
        return None
    out = []
    try:
        with _Files(r.storage) as files:
            if _changed_densely(p, buf, bc, r, files):
                return None
            for off in range(0, nbytes, HASH_READ):
                n = min(HASH_READ, nbytes - off)
                out.append(codec.block_hashes(
                    r.stored_bytes(bc.plain_file, p.key, off, n, files, p.box.offsets)))
    except Exception as e:  # noqa: BLE001 - any failure: this chunk is written in full
        log.warning("tensor %r: the base's chunk cannot be read to compare (%s); writing "
                    "it in full", p.key, e)
        return None
    count[0] += 1
    bc.hashes = b"".join(out)
    return bc


class _Hashing:
    """A streamed source that fills ``report.hashes`` with its block hashes as the
    writer reads it (the hash blocks divide the views it asks for)."""

    def __init__(self, src, report: delta.ChunkReport) -> None:
        self.src, self.report = src, report

    def __len__(self) -> int:
        return len(self.src)

    def blocks(self, multiple: int):
        step = math.lcm(multiple, codec.HASH_BLOCK)
        if self.report.hashes:  # a sequential writer's second pass: the same bytes
            yield from self.src.blocks(step)
            return
        hashes = []
        for v in self.src.blocks(step):
            hashes.append(codec.block_hashes(v))
            yield v
        self.report.hashes = b"".join(hashes)


def hashing(buf, report: delta.ChunkReport):
    """``buf`` as written: a streamed one wrapped to fill ``report``'s hashes."""
    return _Hashing(buf, report) if is_streamed(buf) else buf


SAMPLE = 64 << 10  # bytes of an anchor peeked at to rule a delta out cheaply
PEEK_STORED = 160 << 10  # stored bytes of a compressed anchor read to decode SAMPLE
# (a zstd or lz4 frame decodes block by block: up to 128 KiB in)
DENSE = 0.25  # a sample with more bytes changed than this is a dense change


def _sample_pays(p, buf: memoryview, bc: delta.BaseChunk, enc: Encoding, k: int) -> bool:
    """Whether a delta of block ``k`` may pay, from its first SAMPLE bytes and the
    anchor's, read unverified (a dense change, as in pre-training, is ruled out with
    one small read per chunk instead of a verified read of a whole block). True when
    the anchor is stored encoded (no cheap look): the whole block decides then."""
    af = delta.anchor(bc.rows[k])
    isz = ITEMSIZE[p.dtype]
    block = buf[k * codec.HASH_BLOCK:(k + 1) * codec.HASH_BLOCK]
    n = min(SAMPLE, len(block)) // isz * isz
    if n < 64 or (af[3] != codec.RAW and not af[3] & codec.COMPRESSOR):
        return True
    try:
        with _Files(enc.base_reader.storage) as files:
            if af[3] == codec.RAW:
                a = enc.base_reader.peek(af[0], p.key, af[1], n, files, p.box.offsets)
            else:  # a compressed anchor: decode the start of its stream
                a = enc.base_reader.peek(af[0], p.key, af[1], min(af[2], PEEK_STORED), files,
                                         p.box.offsets)
    except Exception:  # noqa: BLE001 - the verified read, if any, reports it
        return True
    if af[3] == codec.RAW:
        flags, _ = codec.encode(block[:n], p.dtype, isz, enc.compressor, a)
        return bool(flags & codec.XOR)
    head = codec.decode_prefix(af[3], a, n)
    if head is None:
        return True
    mine = np.frombuffer(block, np.uint8)
    if af[3] & codec.SHUFFLE:  # the stream starts with byte 0 of every element
        mine = mine[0::isz]
    mine = mine[:len(head)]
    theirs = np.frombuffer(head, np.uint8)[:len(mine)]
    # Sparse changes leave most bytes equal; a dense change alters nearly every
    # element's low byte.
    return np.count_nonzero(mine != theirs) <= DENSE * len(mine)


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
            stored = r.stored_bytes(af[0], p.key, af[1], af[2], files, p.box.offsets)
            return codec.decode(af[3], stored, size, ITEMSIZE[p.dtype])
    except Exception as e:  # noqa: BLE001 - any failure: no delta for this block
        log.warning("tensor %r block %d: the base's block cannot be read (%s); writing it "
                    "in full", p.key, k, e)
        return None


def _encoded(p, buf: memoryview, rep: delta.ChunkReport, bc: delta.BaseChunk | None,
             ch: np.ndarray, enc: Encoding, pool: ThreadPoolExecutor,
             try_delta: bool = True) -> Planned:
    """An encoded entry: ``produce()`` returns its bytes and fills ``rep.table``.
    Deltas are tried (first changed block first) when there is a base and
    ``try_delta``."""
    n = len(buf)
    nb = codec.nblocks(n)
    table = np.full((nb, mf.TABLE_COLS), -1, np.int64)
    if bc is not None:
        table[~ch] = bc.rows[~ch]
    rep.table = table
    isz = ITEMSIZE[p.dtype]
    todo = np.flatnonzero(ch).tolist()
    try_delta = [bc is not None and try_delta]

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
