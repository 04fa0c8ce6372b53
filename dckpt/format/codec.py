"""Block codecs and content hashes for incremental and compressed checkpoints. Pure.

A chunk of an incremental or compressed checkpoint is cut into blocks of ``HASH_BLOCK``
bytes of its raw (C-order) data. Each block has a 128-bit content hash (XXH3-128: ~11
GB/s here; CRC32 would let two different blocks pass as equal too easily) and is
stored under a codec, a bit set:

- ``ZSTD`` / ``LZ4`` (bits 0-1): compressed with zstandard / lz4 frames;
- ``SHUFFLE``: the bytes of each element grouped by significance first (byte ``j`` of
  every element, then byte ``j + 1``...), which is what makes float weights compress;
- ``XOR``: the block is the XOR of the raw block and its *anchor* (the same block of an
  earlier full version), so unchanged elements become zeros;
- ``SPARSE``: (after XOR, without a compressor) the non-zero 4-byte words only, as
  ``u32 count | u32 index * count | u32 word * count``.

Every transform is lossless and checked by the block's CRCs in the shard file (stored
bytes) and by its content hash on load (raw bytes) where the reader wants to.
zstandard and lz4 are optional (``pip install dckpt[compress]``).
"""
from __future__ import annotations

import numpy as np

from ..errors import CheckpointError

HASH_BLOCK = 1 << 20  # raw bytes per block: the unit of deduplication and compression
HASH_BYTES = 16
RAW, ZSTD, LZ4 = 0, 1, 2
COMPRESSOR = 3  # mask of the compressor bits
SHUFFLE, XOR, SPARSE = 4, 8, 16
VALID = COMPRESSOR | SHUFFLE | XOR | SPARSE
# The flag sets :func:`encode` writes, the only ones a block may have (a delta's anchor:
# those without XOR). Any other set of VALID bits (SHUFFLE or XOR without a compressor,
# SPARSE with one, both compressors) is refused at parse and by :func:`decode`.
CODECS = frozenset({RAW, ZSTD, LZ4, ZSTD | SHUFFLE, LZ4 | SHUFFLE, XOR | SPARSE,
                    XOR | ZSTD, XOR | LZ4, XOR | ZSTD | SHUFFLE, XOR | LZ4 | SHUFFLE})
ANCHOR_CODECS = frozenset(c for c in CODECS if not c & XOR)
COMPRESSIONS = {None: RAW, "zstd": ZSTD, "lz4": LZ4}
USEFUL = 0.95  # a compressed block is kept only if at most this fraction of the raw size
DELTA_USEFUL = 0.5  # a delta is kept only if at most this fraction: else it is not worth
# reading the anchor for the chunk's other blocks
_ZSTD_LEVEL = 1  # measured: level 1 compresses shuffled weights almost as well as 3, 2x faster
_FLOATS = {"F64", "F32", "F16", "BF16", "C64", "F8_E4M3", "F8_E5M2"}


def _xxh():
    try:
        import xxhash
    except ImportError:  # pragma: no cover - a dependency of dckpt
        raise CheckpointError("content hashes need the xxhash package (a dependency of "
                              "dckpt): pip install xxhash") from None
    return xxhash


def block_hashes(buf: memoryview, block: int = HASH_BLOCK) -> bytes:
    """XXH3-128 of each ``block`` bytes of ``buf``, concatenated (16 bytes each; none
    for an empty buffer). ~11 GB/s; releases the GIL on large blocks."""
    h = _xxh().xxh3_128_digest
    return b"".join(h(buf[i:i + block]) for i in range(0, len(buf), block))


def nblocks(nbytes: int, block: int = HASH_BLOCK) -> int:
    return -(-nbytes // block)


def compression_flag(name: str | None) -> int:
    """The compressor bits for a user's ``compression=`` value; checks that its module
    is installed. Raises CheckpointError naming the value or the missing extra."""
    if name not in COMPRESSIONS:
        raise CheckpointError(f"compression={name!r} is not one of None, 'zstd', 'lz4'")
    flag = COMPRESSIONS[name]
    if flag:
        _module(flag)
    return flag


def _module(flag: int):
    try:
        if flag == ZSTD:
            import zstandard
            return zstandard
        import lz4.frame
        return lz4.frame
    except ImportError:
        name = "zstandard" if flag == ZSTD else "lz4"
        raise CheckpointError(f"this checkpoint needs the {name} package: pip install "
                              "'dckpt[compress]'") from None


def _compress(flag: int, data) -> bytes:
    m = _module(flag)
    if flag == ZSTD:
        return m.ZstdCompressor(level=_ZSTD_LEVEL).compress(data)
    return m.compress(data)


def _decompress(flag: int, data, size: int) -> bytes:
    """The ``size`` bytes a compressed block decodes to. Never decodes more than
    ``size + 1`` bytes (the one extra shows an overflow), whatever the frame says: a
    frame is untrusted until the block's content hash matches, and a few KiB of zstd
    can state (and decode to) hundreds of MiB. A frame whose header states a larger
    content size is refused before anything is decoded. Raises ValueError (the caller
    names the block and file)."""
    m = _module(flag)
    try:
        if flag == ZSTD:
            stated = m.frame_content_size(data)  # -1 when the frame does not say
        else:
            stated = m.get_frame_info(data)["content_size"] or -1  # 0: not stored
    except Exception as e:  # not even a frame header
        raise ValueError(f"cannot decompress ({type(e).__name__}: {e})") from None
    if stated > size:
        raise ValueError(f"its {'zstd' if flag == ZSTD else 'lz4'} frame declares {stated} "
                         f"bytes, the block holds {size}: refused without decoding it")
    try:
        if flag == ZSTD and stated >= 0:
            # the output buffer is the stated size, at most ``size`` (checked above)
            out = m.ZstdDecompressor().decompress(data)
        elif flag == ZSTD:  # a frame dckpt never writes: streamed, cut at size + 1
            out = _zstd_reader(m, data, size).read(size + 1)
        else:
            out = m.LZ4FrameDecompressor().decompress(data, max_length=size + 1)
    except Exception as e:  # a damaged frame: the caller names the block
        raise ValueError(f"cannot decompress ({type(e).__name__}: {e})") from None
    if len(out) > size:
        raise ValueError(f"its frame decodes to more than the block's {size} bytes: "
                         "refused after decoding that much")
    if len(out) != size:
        raise ValueError(f"decompressed to {len(out)} bytes, expected {size}")
    return out


def _zstd_reader(m, data, size: int):
    """A streaming reader of zstd frame ``data`` whose window (the buffer a streaming
    decoder allocates up front) may be at most the next power of two over ``size``
    (1 MiB at least): a frame compressed from ``size`` bytes never needs more, and a
    hostile one cannot make the decoder reserve zstd's default 128 MiB limit."""
    window = 1 << max(20, (size - 1).bit_length())
    return m.ZstdDecompressor(max_window_size=window).stream_reader(bytes(data))


def decode_prefix(flags: int, stored, n: int) -> bytes | None:
    """Up to the first ``n`` bytes of a compressed block's decompressed stream (still
    byte-grouped when ``flags`` has SHUFFLE), from a prefix of its stored bytes; None
    when nothing decodes. Decodes at most ``n`` bytes, whatever the frame states. For
    cheap looks at a block, never for data (unverified)."""
    comp = flags & COMPRESSOR
    if not comp or comp == COMPRESSOR or flags & (XOR | SPARSE):
        return None
    try:
        m = _module(comp)
        if comp == ZSTD:
            out = _zstd_reader(m, stored, HASH_BLOCK).read(n)
        else:
            out = m.LZ4FrameDecompressor().decompress(bytes(stored), max_length=n)
    except Exception:  # noqa: BLE001 - a damaged or cut frame: no look
        return None
    return out[:n] or None


def _shuffle(raw, itemsize: int) -> np.ndarray:
    a = np.frombuffer(raw, np.uint8)
    return np.ascontiguousarray(a.reshape(-1, itemsize).T)


def _unshuffle(data, itemsize: int) -> np.ndarray:
    a = np.frombuffer(data, np.uint8)
    return np.ascontiguousarray(a.reshape(itemsize, -1).T).reshape(-1)


def xor(a, b) -> np.ndarray:
    """Bytewise XOR of two equal-length buffers."""
    x, y = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    if len(x) % 8 == 0:  # words: 8x fewer numpy element operations
        return np.bitwise_xor(x.view(np.uint64), y.view(np.uint64)).view(np.uint8)
    return np.bitwise_xor(x, y)


def _sparse(data: np.ndarray) -> bytes | None:
    """Non-zero 4-byte words of ``data`` (length a multiple of 4), or None when that
    is not at least DELTA_USEFUL smaller."""
    w = data.view(np.uint32)
    nz = np.flatnonzero(w)
    if (1 + 2 * len(nz)) * 4 > DELTA_USEFUL * len(data):
        return None
    return (np.array([len(nz)], "<u4").tobytes() + nz.astype("<u4").tobytes()
            + w[nz].astype("<u4").tobytes())


def _unsparse(data, size: int) -> np.ndarray:
    if len(data) < 4 or size % 4:
        raise ValueError("malformed sparse block")
    (n,) = np.frombuffer(data, "<u4", count=1)
    if len(data) != 4 + 8 * int(n):
        raise ValueError("malformed sparse block")
    idx = np.frombuffer(data, "<u4", count=int(n), offset=4)
    val = np.frombuffer(data, "<u4", count=int(n), offset=4 + 4 * int(n))
    out = np.zeros(size // 4, np.uint32)
    if n and int(idx.max()) >= len(out):
        raise ValueError("malformed sparse block")
    out[idx] = val
    return out.view(np.uint8)


def encode(raw, dtype: str, itemsize: int, compressor: int,
           anchor=None) -> tuple[int, bytes | memoryview]:
    """Encode one raw block. Returns (codec flags, stored bytes): a delta against
    ``anchor`` (the raw anchor block) when it is at most DELTA_USEFUL of the size
    (flags with XOR), else the block compressed with ``compressor`` when that saves at
    least 1 - USEFUL, else the block itself (flags RAW). CPU only; the compressors
    release the GIL."""
    n = len(raw)
    shuffle = SHUFFLE if dtype in _FLOATS and itemsize > 1 and n % itemsize == 0 else 0
    if anchor is not None and len(anchor) == n:
        d = xor(raw, anchor)
        if compressor:
            src = _shuffle(d, itemsize) if shuffle else d
            out = _compress(compressor, src)
            if len(out) <= DELTA_USEFUL * n:
                return XOR | compressor | shuffle, out
        elif n % 4 == 0:
            out = _sparse(d)
            if out is not None:
                return XOR | SPARSE, out
    if compressor:
        out = _compress(compressor, _shuffle(raw, itemsize) if shuffle else raw)
        if len(out) <= USEFUL * n:
            return compressor | shuffle, out
    return RAW, raw


def decode(flags: int, stored, size: int, itemsize: int, anchor=None) -> bytes | np.ndarray:
    """The raw block of ``size`` bytes from its stored bytes (and, for XOR, the raw
    anchor block). Raises ValueError on malformed input (the caller names the block)
    and CheckpointError when the compressor's package is missing."""
    if flags not in CODECS:
        raise ValueError(f"unknown codec {flags}")
    if flags & COMPRESSOR:
        data = _decompress(flags & COMPRESSOR, stored, size)
        if flags & SHUFFLE:
            if size % itemsize:
                raise ValueError("a shuffled block is not whole elements")
            data = _unshuffle(data, itemsize)
    elif flags & SPARSE:
        data = _unsparse(stored, size)
    else:
        if len(stored) != size:
            raise ValueError(f"holds {len(stored)} bytes, expected {size}")
        data = stored
    if flags & XOR:
        if anchor is None or len(anchor) != size:
            raise ValueError("a delta block without its anchor")
        data = xor(data, anchor)
    return data
