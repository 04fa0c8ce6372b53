"""Checks of a DCP ``.metadata`` against the files it names, before an import plans
or allocates anything from it.

DCP's metadata declares each tensor's size, its chunks and, per chunk, a byte range of
a data file. Nothing in DCP checks them against each other before a load allocates
whole tensors from the declared sizes, so a ``.metadata`` stating a 2**40 x 2**20
tensor made the import plan billions of slabs (and allocate terabytes), and a negative
or non-list size raised a raw TypeError or RuntimeError. Here every declared value is
checked, and every tensor's bytes are bounded by the file bytes that store it:

- a size, a chunk's offsets and sizes: lists of non-negative ints; the chunks cover the
  tensor exactly once (save's own tiling check, which also caps dimensions at 64);
- a storage reference: a file inside the directory, a range inside that file, ranges of
  different entries never overlapping (so no byte is counted twice);
- a chunk's bytes at most its stored bytes (DCP stores a tensor whole, via
  ``torch.save`` or raw), or, stored through one of DCP's transforms (compression), at
  most :data:`MAX_RATIO` times them.

So a tensor's declared size can never exceed what its files can hold. Pure apart from
one ``stat`` per data file; raises CheckpointError naming the key (and file).
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..format import tiling

# Bytes a transformed (compressed) chunk may declare per stored byte: twice zstd's best
# ratio (32,768: a 128 KiB run in a 4-byte RLE block), so no real checkpoint is refused.
MAX_RATIO = 1 << 16
_I64_MAX = (1 << 63) - 1


def _ints(x: Any, what: str, n: int | None = None) -> tuple[int, ...]:
    """``x`` as a tuple of non-negative int64s (of length ``n`` when given)."""
    if not isinstance(x, (tuple, list)) or not all(
            type(v) is int and 0 <= v <= _I64_MAX for v in x) or (n is not None and len(x) != n):
        shown = repr(x)[:80] if isinstance(x, (tuple, list, int)) else type(x).__name__
        raise CheckpointError(f"{what} is {shown}, not a list of "
                              f"{'' if n is None else f'{n} '}non-negative integers")
    return tuple(x)


class _Files:
    """The data files of directory ``src`` that entries reference, with their sizes,
    and the byte ranges claimed so far (to refuse bytes counted twice)."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.sizes: dict[str, int] = {}
        self.ranges: list[tuple[str, int, int, str]] = []  # (file, start, end, key)

    def claim(self, key: str, info: Any) -> int:
        """Check storage reference ``info`` of entry ``key`` and record its range.
        Returns its stored length."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        what = f"entry {key!r}"
        if not isinstance(info, _StorageInfo):
            raise CheckpointError(f"{what} has no storage record (a {type(info).__name__})")
        rel = info.relative_path
        if not isinstance(rel, str) or not rel or "\x00" in rel or os.path.isabs(rel) or \
                os.path.normpath(rel).split(os.sep)[0] in ("..", "."):
            raise CheckpointError(f"{what}: data file {str(rel)[:80]!r} is not a file inside "
                                  f"{self.src}")
        off, length = info.offset, info.length
        for x, name in ((off, "offset"), (length, "stored length")):
            if type(x) is not int or not 0 <= x <= _I64_MAX:
                raise CheckpointError(f"{what}: its {name} in {rel} is {repr(x)[:40]}, not a "
                                      "non-negative integer")
        if rel not in self.sizes:
            path = os.path.join(self.src, rel)
            if not os.path.isfile(path):
                raise CheckpointError(f"{what}: data file {rel} is missing from {self.src}")
            self.sizes[rel] = os.path.getsize(path)
        if off + length > self.sizes[rel]:
            raise CheckpointError(f"{what}: bytes {off}..{off + length} of {rel} are past its "
                                  f"end ({self.sizes[rel]} bytes)")
        if length:
            self.ranges.append((rel, off, off + length, key))
        return length

    def check_overlaps(self) -> None:
        """Refuse two entries stored in the same bytes. O(n log n)."""
        self.ranges.sort()
        for a, b in zip(self.ranges, self.ranges[1:]):
            if a[0] == b[0] and b[1] < a[2]:
                raise CheckpointError(f"entries {a[3]!r} and {b[3]!r} claim overlapping bytes "
                                      f"of {a[0]} ({a[1]}..{a[2]} and {b[1]}..{b[2]})")


def _check_tensor(fqn: str, m: Any, storage: dict, files: _Files) -> None:
    """Check tensor entry ``m`` (a TensorStorageMetadata) of key ``fqn``: its dtype,
    size and chunks, and each chunk's bytes against its storage. Raises
    CheckpointError naming ``fqn``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    what = f"tensor {fqn!r}"
    dtype = getattr(getattr(m, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{what} has no torch dtype (its dtype is a "
                              f"{type(dtype).__name__})")
    shape = _ints(m.size, f"{what}: its size")
    chunks = m.chunks
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        raise CheckpointError(f"{what}: its chunks are not a list of DCP chunk records")
    offs, sizes = [], []
    for i, c in enumerate(chunks):
        o = _ints(c.offsets, f"{what}: chunk {i} offsets", len(shape))
        s = _ints(c.sizes, f"{what}: chunk {i} sizes", len(shape))
        if math.prod(s):  # an empty chunk (an empty tensor's) holds nothing to check
            offs.append(o)
            sizes.append(s)
    n = len(offs)
    o_arr = np.array(offs, np.int64).reshape(n, len(shape))
    s_arr = np.array(sizes, np.int64).reshape(n, len(shape))
    err = tiling.analyse(shape, o_arr, s_arr).error  # save's check: exact cover, <= 64 dims
    if err:
        raise CheckpointError(f"{what} of size {list(shape)[:8]}: its chunks do not cover it "
                              f"as a save would ({err})")
    for o, s in zip(offs, sizes):
        nbytes = math.prod(s) * dtype.itemsize
        info = storage.get(MetadataIndex(fqn, o))
        if info is None:
            raise CheckpointError(f"{what}: chunk at {list(o)} has no storage record")
        stored = files.claim(fqn, info)
        bound = stored * MAX_RATIO if getattr(info, "transform_descriptors", None) else stored
        if nbytes > bound:
            raise CheckpointError(
                f"{what}: chunk at {list(o)} of size {list(s)} declares {nbytes} bytes; its "
                f"stored data in {info.relative_path} holds {stored} bytes")


def _check_bytes(fqn: str, storage: dict, files: _Files) -> None:
    """Check the storage reference of non-tensor entry ``fqn``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = storage.get(MetadataIndex(fqn))
    if info is None:
        raise CheckpointError(f"entry {fqn!r} has no storage record")
    files.claim(fqn, info)


def check_metadata(md: Any, src: str) -> None:
    """Check every entry of DCP metadata ``md`` (read from directory ``src``) against
    the files it names, before anything is planned or allocated from it. Cost: one
    ``stat`` per data file, O(entries + chunks log chunks). Raises CheckpointError
    naming the key (and the file)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{src}/.metadata has no storage records (storage_data is a "
                              f"{type(storage).__name__})")
    files = _Files(src)
    try:
        for fqn, m in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise CheckpointError(f"key {repr(fqn)[:80]} is not a string")
            if isinstance(m, TensorStorageMetadata):
                _check_tensor(fqn, m, storage, files)
            elif isinstance(m, BytesStorageMetadata):
                _check_bytes(fqn, storage, files)
            else:
                raise CheckpointError(f"entry {fqn!r} has unknown metadata {type(m).__name__}")
        files.check_overlaps()
    except CheckpointError as e:
        raise CheckpointError(f"DCP checkpoint {src}: {e} (its .metadata does not match "
                              "its files)") from None
