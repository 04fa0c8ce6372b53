"""The manifest: the one commit point of a checkpoint, as versioned JSON.

Pure (numpy, no torch.distributed). See docs/FORMAT.md for the schema. Version 2 carries
a CRC32 of its own bytes, so a flipped bit anywhere in it (a stored step or learning rate
included) is refused rather than loaded; version 1 manifests (no checksum) still load.
Parsing validates everything a hostile manifest could abuse: file names stay inside the
checkpoint, sizes and shapes are bounded integers, chunks lie inside their tensor and
tile it, and malformed JSON of any kind raises ManifestError, never another exception.
"""
from __future__ import annotations

import itertools
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ManifestError
from ..layout import tiling
from . import intarray, sealed
from .sealed import seal  # noqa: F401  (public here: tools and tests reseal with it)
from .dtypes import ITEMSIZE
from .shards import MAX_HEADER

FORMAT = "dckpt"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = tiling.MAX_NDIM
# A file reference is one plain name inside the checkpoint directory: no separators,
# no "..", no scheme, no leading dot.
_SMALL = 64  # below this many values, plain Python is faster than numpy
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_I64_MAX = (1 << 63) - 1
_MAX_META_DEPTH = 32

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
    """Offsets and sizes (n, ndim) of the cells of a grid, C order. O(cells * ndim)."""
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
    # Cell i's index along dim d, C order; not np.indices, which needs ndim + 1 <= 64 dims.
    cell = np.arange(ncells)
    offsets = np.empty((ncells, len(bps)), np.int64)
    sizes = np.empty((ncells, len(bps)), np.int64)
    stride = ncells
    for d, b in enumerate(bps):
        stride //= len(b) - 1
        i = cell // stride % (len(b) - 1)
        offsets[:, d], sizes[:, d] = b[:-1][i], np.diff(b)[i]
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
    """Serialise a manifest as version 2 (checksummed, strict JSON: non-finite floats in
    ``values`` and ``meta`` are tagged objects). Cost: O(tensors + chunk-table size), no
    I/O. Raises ValueError when ``created`` is not finite, TypeError when ``meta`` holds
    something JSON cannot encode."""
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
        "meta": sealed.tag_floats(m.meta),
        "files": [[f.name, f.size, f.header_len, f.header_crc32, f.rank] for f in m.files],
        "tensors": tensors,
        "values": {k: sealed.tag_floats(v) for k, v in m.values.items()},
    }
    return sealed.seal(doc)


# ----------------------------------------------------------------------------- parsing
# Helpers raise ManifestError naming the field; parse() prefixes the file (``where``).

def _int(x: Any, what: str, lo: int = 0, hi: int = _I64_MAX) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise ManifestError(f"{what} must be an integer in [{lo}, {hi}], got {sealed.short(x)}")
    return x


def _parse_file(i: int, f: Any) -> FileEntry:
    if not (isinstance(f, list) and len(f) == 5):
        raise ManifestError(f"files[{i}] must be [name, size, header_len, crc, rank]")
    name = f[0]
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise ManifestError(
            f"files[{i}] name {sealed.short(name)} is not a plain file name inside the "
            "checkpoint (absolute paths, '..', separators and URLs are refused)")
    size = _int(f[1], f"files[{i}].size")
    hlen = _int(f[2], f"files[{i}].header_len", 1)
    if hlen + 8 > size:
        raise ManifestError(f"files[{i}] {name}: header_len {hlen} exceeds size {size}")
    if hlen > MAX_HEADER:  # refused before any reader allocates a buffer that large
        raise ManifestError(f"files[{i}] {name}: header_len {hlen} is over the "
                            f"{MAX_HEADER}-byte limit for shard headers")
    return FileEntry(name, size, hlen, _int(f[3], f"files[{i}].header_crc32", 0, 0xFFFFFFFF),
                     _int(f[4], f"files[{i}].rank"))


def _parse_chunks(key: str, shape: tuple[int, ...], obj: Any, nfiles: int) -> Chunks:
    if not isinstance(obj, dict):
        raise ManifestError(f"tensor {key!r}: chunks must be an object")
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
                            and all(type(x) is int and 0 <= x <= _I64_MAX for x in r)
                            for r in offsets + sizes)):
                raise ValueError(f"tensor {key!r}: offsets and sizes must be equal (n, ndim) "
                                 "lists of non-negative integers")
            offsets = np.asarray(offsets, dtype=np.int64).reshape(len(offsets), ndim)
            sizes = np.asarray(sizes, dtype=np.int64).reshape(len(sizes), ndim)
    except (ValueError, TypeError, OverflowError) as e:
        raise ManifestError(str(e)) from None
    if len(file) != len(offsets):
        raise ManifestError(f"tensor {key!r}: {len(file)} file indexes for {len(offsets)} chunks")
    if len(file) and (file.min() < 0 or file.max() >= nfiles):
        raise ManifestError(f"tensor {key!r}: chunk file index out of range")
    if grid is None:
        err = tiling.analyse(shape, offsets, sizes).error
        if err:
            raise ManifestError(f"tensor {key!r}: {err}")
    return Chunks(offsets, sizes, file, grid)


def _parse_tensor(key: str, t: Any, nfiles: int) -> TensorEntry:
    if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) or t["dtype"] not in ITEMSIZE:
        raise ManifestError(f"tensor {key!r} has no valid dtype")
    raw_shape = t.get("shape")
    if not isinstance(raw_shape, list):
        raise ManifestError(f"tensor {key!r} has no shape list")
    if len(raw_shape) > MAX_NDIM:  # before any cost that grows with ndim
        raise ManifestError(f"tensor {key!r} has {len(raw_shape)} dims; dckpt supports at "
                            f"most {MAX_NDIM}")
    shape = tuple(_int(s, f"tensor {key!r} shape") for s in raw_shape)
    if math.prod(shape) * ITEMSIZE[t["dtype"]] > _I64_MAX:
        raise ManifestError(f"tensor {key!r} of shape {list(shape)} is too large")
    return TensorEntry(key, t["dtype"], shape, _parse_chunks(key, shape, t.get("chunks"), nfiles))


def _parse_value(key: str, v: Any) -> JsonLeaf:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    x = sealed.untag_float(v)
    if x is None:
        raise ManifestError(f"value {key!r} is not a JSON scalar (null, bool, number, string) "
                            'nor a non-finite float {"$float": "nan" | "inf" | "-inf"}')
    return x


def _parse_meta(obj: Any, depth: int = 0) -> Any:
    """meta with its float tags decoded; nesting is capped (recursion stays shallow)."""
    if depth > _MAX_META_DEPTH:
        raise ManifestError(f"meta is nested deeper than {_MAX_META_DEPTH} levels")
    if isinstance(obj, dict):
        x = sealed.untag_float(obj)
        return x if x is not None else {k: _parse_meta(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_parse_meta(v, depth + 1) for v in obj]
    return obj


def _field(doc: dict, name: str, kind: type) -> Any:
    if name not in doc:
        raise ManifestError(f"missing field {name!r}")
    if not isinstance(doc[name], kind):
        raise ManifestError(f"field {name!r} has the wrong JSON type ({kind.__name__} expected)")
    return doc[name]


def _parse_doc(data: bytes, at: list[str]) -> Manifest:
    """parse() without the file name; ``at[0]`` names the part being read."""
    doc, constants = sealed.load_json(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError('not a dckpt manifest (no "format": "dckpt")')
    # A version-2 document is checksummed: the version it states is trusted only once the
    # checksum matches, so a damaged prefix or version can never pass as version 1.
    is_sealed = data.startswith(sealed.CHECKSUM_HEAD) or "checksum" in doc
    if is_sealed:
        sealed.check_checksum(data)
    version = doc.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ManifestError(f"manifest version {sealed.short(version)} is not supported by this dckpt "
                            f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); "
                            "upgrade dckpt")
    if version >= 2 and not is_sealed:
        raise ManifestError(sealed.MISMATCH + ' (no "checksum" prefix)')
    if version >= 2 and constants:
        raise ManifestError(f"holds {constants[0]}, which is not JSON (version 2 writes "
                            'non-finite floats as {"$float": ...})')
    files_raw = _field(doc, "files", list)
    tensors_raw = _field(doc, "tensors", dict)
    values_raw = _field(doc, "values", dict)
    files = []
    for i, f in enumerate(files_raw):
        at[0] = f"files[{i}]"
        files.append(_parse_file(i, f))
    if len({f.name for f in files}) != len(files):
        raise ManifestError("a file is listed twice")
    tensors: dict[str, TensorEntry] = {}
    for key, t in tensors_raw.items():
        at[0] = f"tensor {key!r}"
        tensors[key] = _parse_tensor(key, t, len(files))
    values: dict[str, JsonLeaf] = {}
    for key, v in values_raw.items():
        at[0] = f"value {key!r}"
        values[key] = _parse_value(key, v)
        if key in tensors:
            raise ManifestError(f"key {key!r} is both a tensor and a value")
    at[0] = "created"
    created = doc.get("created", 0.0)
    # abs() <= max, not math.isfinite: an integer over 1e308 makes that raise
    if type(created) not in (int, float) or not abs(created) <= sys.float_info.max:
        raise ManifestError(f"created must be a finite number, got {sealed.short(created)}")
    save_id = doc.get("save_id", "")
    if not isinstance(save_id, str):
        raise ManifestError(f"save_id must be a string, got {sealed.short(save_id)}")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise ManifestError(f"meta must be an object, got {sealed.short(meta)}")
    at[0] = "meta"
    return Manifest(
        save_id=save_id,
        world_size=_int(doc.get("world_size"), "world_size", 1),
        created=float(created),
        files=tuple(files),
        tensors=tensors,
        values=values,
        meta={k: _parse_meta(v, 1) for k, v in meta.items()},  # meta itself stays a dict
    )


def parse(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest bytes (version 2, or version 1 as older dckpt wrote
    it). Pure, O(size) (a non-grid chunk list costs at most O(ndim * chunks**2)).

    Raises:
        ManifestError: naming ``where`` and the offending field, for any input that is
            not a valid manifest: too large, not JSON, a checksum mismatch, an unknown
            version, or a field of the wrong type or range. No other exception escapes
            for malformed input (MemoryError excepted).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES} cap")
    at = ["the document"]
    try:
        return _parse_doc(bytes(data), at)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a case the checks above missed: still malformed
        raise ManifestError(f"{where}: {at[0]} cannot be read ({type(e).__name__}: "
                            f"{sealed.short(str(e), 200)}); the checkpoint is corrupt") from e
