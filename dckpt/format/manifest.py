"""The manifest: the one commit point of a checkpoint, as versioned JSON.

Pure (numpy, no torch.distributed). See docs/FORMAT.md for the schema. Version 2 carries
a CRC32 of its own bytes, so a flipped bit anywhere in it (a stored step or learning rate
included) is refused rather than loaded; version 1 manifests (no checksum) still load.
Version 3 adds references to sibling files and block tables, version 4 the columnar file
table (:mod:`.filetable`), version 5 bytes values stored in data files (tensor entries
marked ``"bytes": true``); each is written only when a manifest needs it.
Parsing validates everything a hostile manifest could abuse: file names stay inside the
checkpoint, sizes and shapes are bounded integers, chunks lie inside their tensor and
tile it, and malformed JSON of any kind raises ManifestError, never another exception.
"""
from __future__ import annotations

import base64
import json
import math
import sys
from typing import Any

import numpy as np

from ..errors import ManifestError
from . import filetable, manifest_blocks, tiling
from . import intarray, sealed
from .grid import grid_cells  # noqa: F401  (public here: readers and tools use it)
from .grid import cells as _cells, parse_dim as _grid_dim
from . import runs
from .runs import Runs
from .sealed import seal  # noqa: F401  (public here: tools and tests reseal with it)
from . import codec
from .dtypes import ITEMSIZE
# The data model lives in .manifest_types; it is public here, where callers import it.
from .manifest_types import (  # noqa: F401
    TABLE_COLS, ChunkBlocks, Chunks, FileEntry, FileTable, JsonLeaf, Manifest, TensorEntry)
from .filetable import SAFE_NAME  # noqa: F401  (public here, as before)
from .shards import MAX_HEADER  # noqa: F401  (public here, as before)

FORMAT = "dckpt"
VERSION = 3  # written when a manifest references sibling files or has block tables
TABLE_VERSION = 4  # written when its files are a table (filetable.use_table)
BYTES_VERSION = 5  # written when a tensor entry holds a bytes value (sealed.check_bytes_entry)
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MANIFEST_NAME = "manifest.json"
# Values a CheckpointManager records about the timeline (the save id a commit continues,
# the newest commit time its manager had seen): bookkeeping, not state. A load never
# reports them as keys the state_dict lacks.
PARENT_VALUE, AFTER_VALUE = "manager.parent", "manager.after"
TIMELINE_VALUES = (PARENT_VALUE, AFTER_VALUE)
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = tiling.MAX_NDIM
# A file holds at most this many chunks of one tensor (a strided DTensor's local tensor
# is several boxes; dckpt's save refuses more), so a tensor has at most this many
# chunks per file: the cap on what a hostile manifest's grid can make a reader allocate.
MAX_CHUNKS_PER_FILE = 1024
# The most chunks all tensors of one manifest may declare (grid cells count: a load
# builds their boxes): 268M, 4 GiB of boxes. A save of 131,072 ranks x 500 FSDP tensors
# declares 65.5M. Bounds what a hostile manifest can make a reader allocate.
MAX_CHUNKS_TOTAL = 1 << 28
_I64_MAX = (1 << 63) - 1
_EAGER_CELLS = 64  # grids of at most this many cells get their boxes at parse time
_MAX_META_DEPTH = 32


# ----------------------------------------------------------------------------- writing

def to_json(m: Manifest) -> bytes:
    """Serialise a manifest, checksummed (strict JSON: non-finite floats in ``values``
    and ``meta`` are tagged objects), as the lowest version that holds it: 2, 3 with
    references or block tables, 4 when its files are written as a table
    (:func:`.filetable.use_table`: older readers still read the rest). Cost:
    O(tensors + chunk-table size + files), no I/O; a later manifest of the same tensor
    entries (a cached plan) reuses their JSON text, so costs O(files) numpy. Raises
    ValueError when ``created`` is not finite or the tensors declare more chunks than a
    reader accepts (:data:`MAX_CHUNKS_TOTAL`) or its bytes exceed
    :data:`MAX_MANIFEST_BYTES`, TypeError when ``meta`` holds something
    JSON cannot encode."""
    nchunks = sum(len(t.chunks) for t in m.tensors.values())
    if nchunks > MAX_CHUNKS_TOTAL:  # never commit what no reader parses
        raise ValueError(f"the manifest would declare {nchunks} chunks; a reader accepts at "
                         f"most {MAX_CHUNKS_TOTAL} (fewer tensors or ranks per checkpoint)")
    files = filetable.to_json_obj(m.files, m.save_id, m.world_size)
    version = BYTES_VERSION if any(t.bytes_value for t in m.tensors.values()) else \
        TABLE_VERSION if isinstance(files, dict) else VERSION if (
            m.files.references or any(t.blocks is not None for t in m.tensors.values())) else 2
    parts = [("format", _dumps(FORMAT)), ("version", _dumps(version)),
             ("save_id", _dumps(m.save_id)), ("world_size", _dumps(m.world_size)),
             ("created", _dumps(m.created)), ("meta", _dumps(sealed.tag_floats(m.meta))),
             ("files", _dumps(files)), ("tensors", _tensors_json(m.tensors)),
             ("values", _dumps({k: sealed.tag_floats(v) for k, v in m.values.items()}))]
    # what json.dumps of the whole document writes, byte for byte, by parts
    data = sealed.seal_body(("{" + ",".join(f'"{k}":{v}' for k, v in parts) + "}").encode())
    if len(data) > MAX_MANIFEST_BYTES:  # parse refuses it: never commit it
        raise ValueError(f"the manifest would be {len(data)} bytes; a reader accepts at most "
                         f"{MAX_MANIFEST_BYTES} (its block hashes grow with ranks x tensors)")
    return data


def _dumps(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"), allow_nan=False)


# The JSON text of the last manifest's tensor table, by the identity of that table: a
# steady-state save whose plan was cached reuses the same (immutable) entries, so its
# manifest is serialised without encoding the chunk tables again.
_LAST_TENSORS: tuple = (None, "")


def _tensors_json(entries: dict) -> str:
    global _LAST_TENSORS
    owner, text = _LAST_TENSORS  # one read: another thread may swap the pair meanwhile
    if owner is entries:
        return text
    text = _dumps(_encoded_tensors(entries))
    _LAST_TENSORS = (entries, text)
    return text


def _encoded_tensors(entries: dict) -> dict:
    tensors = {}
    memo: dict = {}  # id(array) -> its encoding: a derived plan shares arrays between tensors
    for key, t in entries.items():
        c = t.chunks
        if c.grid is not None:
            # fromiter: twice as fast as asarray on a tuple of 16,384 ints (FSDP at scale)
            enc: dict[str, Any] = {"grid": [_encode_memo(b, memo) for b in c.grid]}
        else:
            enc = {"offsets": c.offsets.tolist(), "sizes": c.sizes.tolist()}
        enc["file"] = _encode_memo(c.file_ids, memo)
        tensors[key] = {"dtype": t.dtype, "shape": list(t.shape), "chunks": enc}
        if t.blocks is not None:
            tensors[key]["blocks"] = _blocks_json(t.blocks)
        if t.bytes_value:
            tensors[key]["bytes"] = True
    return tensors


def _encode_memo(b, memo: dict):
    """intarray.encode of one breakpoint or file array, once per array object (the
    entries keep the arrays alive, so an id is not reused meanwhile)."""
    if isinstance(b, Runs):  # a parsed manifest's runs: written back as they came
        return b.encode()
    if not isinstance(b, np.ndarray):
        # fromiter: twice as fast as asarray on a tuple of 16,384 ints (FSDP at scale)
        return intarray.encode(np.fromiter(b, np.int64, len(b)))
    got = memo.get(id(b))
    if got is None:
        got = memo[id(b)] = intarray.encode(b)
    return got


def _blocks_json(blocks: tuple[ChunkBlocks, ...]) -> dict:
    size = blocks[0].size if blocks else codec.HASH_BLOCK
    # Column-major: offsets and lengths of a chunk's blocks form runs that encode short.
    enc = {str(i): intarray.encode(b.table.T.ravel()) for i, b in enumerate(blocks)
           if b.table is not None}
    out: dict[str, Any] = {"size": size,
                           "hash": base64.b64encode(b"".join(b.hashes for b in blocks)).decode()}
    if enc:
        out["enc"] = enc
    return out


# ----------------------------------------------------------------------------- parsing
# Helpers raise ManifestError naming the field; parse() prefixes the file (``where``).

_int = filetable._int  # raises ManifestError naming the field


def _parse_chunks(key: str, shape: tuple[int, ...], obj: Any, nfiles: int,
                  budget: list[int] | None = None) -> Chunks:
    if not isinstance(obj, dict):
        raise ManifestError(f"tensor {key!r}: chunks must be an object")
    ndim = len(shape)
    # A file holds at most MAX_CHUNKS_PER_FILE chunks of a tensor, so no tensor has
    # more than that many per file: a cheap cap against hostile sizes. ``budget[0]``:
    # the chunks the rest of the manifest may still declare (MAX_CHUNKS_TOTAL): a
    # version-4 file table declares millions of files in a few bytes, so the cap alone
    # let 400 bytes of runs make a reader allocate tens of GB before any check.
    left = MAX_CHUNKS_TOTAL if budget is None else budget[0]
    cap = min(max(nfiles, 1) * MAX_CHUNKS_PER_FILE, left)
    try:
        # a list of boxes (paid for in bytes) bounds the file indexes decoded for it
        boxes = obj.get("offsets")
        limit = cap if "grid" in obj or not isinstance(boxes, list) else min(cap, len(boxes))
        # a long run-form file list (FSDP: 0, 1, ..., R - 1) stays runs: O(runs)
        file = runs.from_json(obj.get("file"), limit)
        if file is None:
            file = intarray.decode(obj.get("file"), f"tensor {key!r} chunk files", limit)
        if "grid" in obj:
            g = obj["grid"]
            if not isinstance(g, list) or len(g) != ndim:
                raise ValueError(f"tensor {key!r}: grid needs one breakpoint list per dim")
            # a dim of extent e has at most e cells: bounded before decoding
            dims = [_grid_dim(b, key, d, shape[d], max(min(cap, shape[d]), 1))
                    for d, b in enumerate(g)]
            grid = tuple(b for b, _ in dims)
            ncells = math.prod(len(b) - 1 for b in grid)
            if ncells > cap:
                raise ValueError(f"tensor {key!r}: grid has more cells than "
                                 f"{MAX_CHUNKS_PER_FILE} per file, or than the "
                                 f"{MAX_CHUNKS_TOTAL} chunks a manifest may declare")
            # cells are built on first use (Chunks.offsets): O(grid) here, not O(cells)
            offsets, sizes = (None, None) if ncells > _EAGER_CELLS else \
                _cells(grid, [a for _, a in dims])
        else:
            grid = None
            offsets, sizes = obj.get("offsets"), obj.get("sizes")
            if not (isinstance(offsets, list) and isinstance(sizes, list)
                    and len(offsets) == len(sizes) <= cap
                    and all(isinstance(r, list) and len(r) == ndim
                            and all(type(x) is int and 0 <= x <= _I64_MAX for x in r)
                            for r in offsets + sizes)):
                raise ValueError(f"tensor {key!r}: offsets and sizes must be equal (n, ndim) "
                                 "lists of non-negative integers")
            offsets = np.asarray(offsets, dtype=np.int64).reshape(len(offsets), ndim)
            sizes = np.asarray(sizes, dtype=np.int64).reshape(len(sizes), ndim)
    except (ValueError, TypeError, OverflowError) as e:
        raise ManifestError(str(e)) from None
    nchunks = ncells if grid is not None else len(offsets)
    if len(file) != nchunks:
        raise ManifestError(f"tensor {key!r}: {len(file)} file indexes for {nchunks} chunks")
    if budget is not None:
        budget[0] -= nchunks
    if len(file) and (file.min() < 0 or file.max() >= nfiles):
        raise ManifestError(f"tensor {key!r}: chunk file index out of range")
    if grid is None:
        err = tiling.analyse(shape, offsets, sizes).error
        if err:
            raise ManifestError(f"tensor {key!r}: {err}")
    return Chunks(offsets, sizes, file, grid)


def _parse_tensor(key: str, t: Any, files: FileTable,
                  budget: list[int] | None = None) -> TensorEntry:
    if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) or t["dtype"] not in ITEMSIZE:
        raise ManifestError(f"tensor {key!r} has no valid dtype")
    raw_shape = t.get("shape")
    is_bytes = sealed.check_bytes_entry(key, t.get("bytes"), t["dtype"], raw_shape)
    if not isinstance(raw_shape, list):
        raise ManifestError(f"tensor {key!r} has no shape list")
    if len(raw_shape) > MAX_NDIM:  # before any cost that grows with ndim
        raise ManifestError(f"tensor {key!r} has {len(raw_shape)} dims; dckpt supports at "
                            f"most {MAX_NDIM}")
    shape = tuple(_int(s, f"tensor {key!r} shape") for s in raw_shape)
    if math.prod(shape) * ITEMSIZE[t["dtype"]] > _I64_MAX:
        raise ManifestError(f"tensor {key!r} of shape {list(shape)} is too large")
    chunks = _parse_chunks(key, shape, t.get("chunks"), len(files), budget)
    blocks = None
    if "blocks" in t:
        blocks = manifest_blocks.parse(key, t["blocks"], chunks, ITEMSIZE[t["dtype"]], files)
    return TensorEntry(key, t["dtype"], shape, chunks, blocks, is_bytes)


def _parse_value(key: str, v: Any) -> JsonLeaf:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if sealed.is_bytes_tag(v):  # kept as the tag: Manifest.values is the manifest's JSON
        return sealed.check_bytes_tag(v, key)
    x = sealed.untag_float(v)
    if x is None:
        raise ManifestError(f"value {key!r} is not a JSON scalar (null, bool, number, string), "
                            'a non-finite float {"$float": "nan" | "inf" | "-inf"} nor bytes '
                            '{"$bytes": "<base64>"}')
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
    files_raw = _field(doc, "files", dict if version >= TABLE_VERSION and
                       isinstance(doc.get("files"), dict) else list)
    tensors_raw = _field(doc, "tensors", dict)
    values_raw = _field(doc, "values", dict)
    world_size = _int(doc.get("world_size"), "world_size", 1)
    files = filetable.parse(files_raw, version, doc.get("save_id", ""), world_size, at)
    tensors: dict[str, TensorEntry] = {}
    budget = [MAX_CHUNKS_TOTAL]
    for key, t in tensors_raw.items():
        at[0] = f"tensor {key!r}"
        tensors[key] = _parse_tensor(key, t, files, budget)
        if tensors[key].bytes_value and version < BYTES_VERSION:
            raise ManifestError(f"tensor {key!r} is marked as bytes, which version "
                                f"{version} does not have (version {BYTES_VERSION} does)")
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
        world_size=world_size,
        created=float(created),
        files=files,
        tensors=tensors,
        values=values,
        meta={k: _parse_meta(v, 1) for k, v in meta.items()},  # meta itself stays a dict
    )


def parse(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest bytes (version 2, or version 1 as older dckpt wrote
    it). Pure, O(size) (a non-grid chunk list costs O(2**k * chunks log chunks)
    for chunks that cut k dims, and is capped beyond: see dckpt.format.tiling).

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
