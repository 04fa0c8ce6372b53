"""The manifest: the one commit point of a checkpoint, as versioned JSON.

Pure (numpy, no torch.distributed). See docs/FORMAT.md for the schema. Parsing validates
everything a hostile manifest could abuse: file names stay inside the checkpoint, sizes
and shapes are non-negative integers, chunks lie inside their tensor and tile it.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ManifestError
from ..layout import tiling
from . import intarray
from .dtypes import ITEMSIZE
from .shards import MAX_HEADER

FORMAT = "dckpt"
VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
# A file reference is one plain name inside the checkpoint directory: no separators,
# no "..", no scheme, no leading dot.
_SMALL = 64  # below this many values, plain Python is faster than numpy
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")

JsonLeaf = None | bool | int | float | str


@dataclass(frozen=True)
class FileEntry:
    """One data file: its name (relative to the checkpoint), total size, and the length
    and CRC32 of its safetensors header (which holds the chunk checksums)."""

    name: str
    size: int
    header_len: int
    header_crc32: int
    rank: int


@dataclass(frozen=True, eq=False)
class Chunks:
    """The saved boxes of one tensor: ``offsets`` and ``sizes`` are (n, ndim) int64,
    ``file`` is (n,) int64 indexes into ``Manifest.files``. ``grid`` is the per-dim
    breakpoints when the boxes are the cells of a grid (C order), else None."""

    offsets: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    grid: tuple[tuple[int, ...], ...] | None = None

    def __len__(self) -> int:
        return len(self.file)


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Chunks

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest. Construct with :func:`parse` or :func:`build`."""

    save_id: str
    world_size: int
    created: float
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]
    values: dict[str, JsonLeaf]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def grid_cells(grid: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and sizes (n, ndim) of the cells of a grid, C order. O(cells)."""
    if not grid:
        return np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64)
    ncells = math.prod(len(b) - 1 for b in grid)
    if ncells <= _SMALL:
        # Most tensors have a handful of cells: plain Python beats numpy's per-call cost
        # (this runs once per tensor on every rank of every load).
        cells = list(itertools.product(*(list(zip(b[:-1], b[1:])) for b in grid)))
        offsets = np.array([[lo for lo, _ in c] for c in cells], np.int64)
        sizes = np.array([[hi - lo for lo, hi in c] for c in cells], np.int64)
        return offsets.reshape(ncells, len(grid)), sizes.reshape(ncells, len(grid))
    bps = [np.asarray(b, np.int64) for b in grid]
    if len(bps) == 1:  # the common case (FSDP): no index arithmetic
        return bps[0][:-1, None].copy(), np.diff(bps[0])[:, None]
    idx = np.indices([len(b) - 1 for b in bps]).reshape(len(bps), -1)
    offsets = np.stack([b[:-1][i] for b, i in zip(bps, idx)], axis=1)
    sizes = np.stack([np.diff(b)[i] for b, i in zip(bps, idx)], axis=1)
    return offsets, sizes


def _grid_dim(obj: Any, key: str, d: int, extent: int, nfiles: int) -> tuple[int, ...]:
    """Validate one dim's breakpoints: integers rising strictly from 0 to ``extent``,
    at most ``nfiles + 1`` of them. Raises ValueError."""
    if isinstance(obj, list) and len(obj) <= _SMALL:  # fast path, no numpy
        b = obj
        ok = all(type(x) is int for x in b)
    else:
        arr = intarray.decode(obj, f"tensor {key!r} grid", nfiles + 1)
        # values inside [0, extent] first, so the differences cannot overflow
        ok = not ((arr < 0).any() or (arr > extent).any() or (len(arr) > 1 and (np.diff(arr) <= 0).any()))
        b = arr.tolist()
    if not (ok and len(b) >= 2 and len(b) <= nfiles + 1 and b[0] == 0 and b[-1] == extent
            and all(x < y for x, y in zip(b, b[1:]))):
        raise ValueError(f"tensor {key!r}: grid of dim {d} must rise strictly from 0 to {extent}")
    return tuple(b)


# ----------------------------------------------------------------------------- writing

def to_json(m: Manifest) -> bytes:
    """Serialise a manifest. Cost: O(tensors + chunk-table size), no I/O."""
    tensors = {}
    for key, t in m.tensors.items():
        c = t.chunks
        if c.grid is not None:
            enc: dict[str, Any] = {"grid": [intarray.encode(np.asarray(b)) for b in c.grid]}
        else:
            enc = {"offsets": c.offsets.tolist(), "sizes": c.sizes.tolist()}
        enc["file"] = intarray.encode(c.file)
        tensors[key] = {"dtype": t.dtype, "shape": list(t.shape), "chunks": enc}
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "created": m.created,
        "meta": m.meta,
        "files": [[f.name, f.size, f.header_len, f.header_crc32, f.rank] for f in m.files],
        "tensors": tensors,
        "values": m.values,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


# ----------------------------------------------------------------------------- parsing

def _int(x: Any, what: str, lo: int = 0) -> int:
    if type(x) is not int or x < lo:
        raise ManifestError(f"manifest: {what} must be an integer >= {lo}, got {x!r}")
    return x


def _parse_file(i: int, f: Any) -> FileEntry:
    if not (isinstance(f, list) and len(f) == 5):
        raise ManifestError(f"manifest: files[{i}] must be [name, size, header_len, crc, rank]")
    name = f[0]
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise ManifestError(
            f"manifest: files[{i}] name {name!r} is not a plain file name inside the "
            "checkpoint (absolute paths, '..', separators and URLs are refused)")
    size = _int(f[1], f"files[{i}].size")
    hlen = _int(f[2], f"files[{i}].header_len", 1)
    if hlen + 8 > size:
        raise ManifestError(f"manifest: files[{i}] {name}: header_len {hlen} exceeds size {size}")
    if hlen > MAX_HEADER:  # refused before any reader allocates a buffer that large
        raise ManifestError(f"manifest: files[{i}] {name}: header_len {hlen} is over the "
                            f"{MAX_HEADER}-byte limit for shard headers")
    return FileEntry(name, size, hlen, _int(f[3], f"files[{i}].header_crc32"),
                     _int(f[4], f"files[{i}].rank"))


def _parse_chunks(key: str, shape: tuple[int, ...], obj: Any, nfiles: int) -> Chunks:
    if not isinstance(obj, dict):
        raise ManifestError(f"manifest: tensor {key!r}: chunks must be an object")
    ndim = len(shape)
    # A file holds at most one chunk of a tensor (safetensors names are unique), so no
    # tensor has more chunks than there are files: a cheap cap against hostile sizes.
    try:
        file = intarray.decode(obj.get("file"), f"tensor {key!r} chunk files", nfiles)
        if "grid" in obj:
            g = obj["grid"]
            if not isinstance(g, list) or len(g) != ndim:
                raise ValueError(f"tensor {key!r}: grid needs one breakpoint list per dim")
            grid = tuple(_grid_dim(b, key, d, shape[d], nfiles) for d, b in enumerate(g))
            if math.prod(len(b) - 1 for b in grid) > max(nfiles, 1):
                raise ValueError(f"tensor {key!r}: grid has more cells than there are files")
            offsets, sizes = grid_cells(grid)
        else:
            grid = None
            offsets, sizes = obj.get("offsets"), obj.get("sizes")
            if not (isinstance(offsets, list) and isinstance(sizes, list)
                    and len(offsets) == len(sizes) <= nfiles
                    and all(isinstance(r, list) and len(r) == ndim
                            and all(type(x) is int and 0 <= x < 1 << 63 for x in r)
                            for r in offsets + sizes)):
                raise ValueError(f"tensor {key!r}: offsets and sizes must be equal (n, ndim) "
                                 "lists of non-negative integers")
            offsets = np.asarray(offsets, dtype=np.int64).reshape(len(offsets), ndim)
            sizes = np.asarray(sizes, dtype=np.int64).reshape(len(sizes), ndim)
    except (ValueError, TypeError, OverflowError) as e:
        raise ManifestError(f"manifest: {e}") from None
    if len(file) != len(offsets):
        raise ManifestError(f"manifest: tensor {key!r}: {len(file)} file indexes for "
                            f"{len(offsets)} chunks")
    if len(file) and (file.min() < 0 or file.max() >= nfiles):
        raise ManifestError(f"manifest: tensor {key!r}: chunk file index out of range")
    if grid is None:
        err = tiling.analyse(shape, offsets, sizes).error
        if err:
            raise ManifestError(f"manifest: tensor {key!r}: {err}")
    return Chunks(offsets, sizes, file, grid)


def parse(data: bytes, where: str = "manifest.json") -> Manifest:
    """Parse and validate manifest bytes. Pure, O(size). Raises ManifestError naming
    ``where`` and the offending field."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES} cap")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{where} is not a dckpt manifest (no \"format\": \"dckpt\")")
    if type(doc.get("version")) is not int or doc["version"] != VERSION:
        raise ManifestError(f"{where}: manifest version {doc.get('version')!r} is not supported "
                            f"by this dckpt (reads version {VERSION}); upgrade dckpt")
    try:
        files_raw = doc["files"]
        tensors_raw = doc["tensors"]
        values = doc["values"]
        if not isinstance(files_raw, list) or not isinstance(tensors_raw, dict) \
                or not isinstance(values, dict):
            raise ManifestError(f"{where}: files/tensors/values have the wrong JSON types")
        files = tuple(_parse_file(i, f) for i, f in enumerate(files_raw))
        if len({f.name for f in files}) != len(files):
            raise ManifestError(f"{where}: a file is listed twice")
        tensors: dict[str, TensorEntry] = {}
        for key, t in tensors_raw.items():
            if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) \
                    or t["dtype"] not in ITEMSIZE:
                raise ManifestError(f"{where}: tensor {key!r} has no valid dtype")
            if not isinstance(t.get("shape"), list):
                raise ManifestError(f"{where}: tensor {key!r} has no shape list")
            shape = tuple(_int(s, f"tensor {key!r} shape") for s in t["shape"])
            if math.prod(shape) * ITEMSIZE[t["dtype"]] >= 1 << 63:
                raise ManifestError(f"{where}: tensor {key!r} of shape {list(shape)} is too large")
            tensors[key] = TensorEntry(key, t["dtype"], shape,
                                       _parse_chunks(key, shape, t.get("chunks"), len(files)))
        for key, v in values.items():
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise ManifestError(f"{where}: value {key!r} is not a JSON scalar")
            if key in tensors:
                raise ManifestError(f"{where}: key {key!r} is both a tensor and a value")
        created = doc.get("created", 0.0)
        if type(created) not in (int, float):
            raise ManifestError(f"{where}: created must be a number, got {created!r}")
        return Manifest(
            save_id=str(doc.get("save_id", "")),
            world_size=_int(doc.get("world_size"), "world_size", 1),
            created=float(created),
            files=files,
            tensors=tensors,
            values=values,
            meta=doc.get("meta") if isinstance(doc.get("meta"), dict) else {},
        )
    except KeyError as e:
        raise ManifestError(f"{where}: missing field {e}") from None
