"""Sources an import reads: Hugging Face safetensors and ``torch.save`` files (the DCP
source lives in :mod:`dckpt.interop.dcp_source`).

A source lists its tensors (name, dtype, shape) without reading their data, gives
their JSON values, and reads any slab of rows of a tensor on request, so the importer
holds one output file's worth of data at a time. Safetensors files are read with
``pread`` through their own (validated) header, never mapped: mapped pages would stay
resident and count in the process's memory. Nothing here unpickles anything outside
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, preview
from ..format.dtypes import to_code, to_torch
from ..format.shards import MAX_HEADER, check_entry, load_json
from ..state.flatten import flatten
from ..storage.base import FileTooLargeError
from ..storage.local import LocalReader, LocalStorage
from .common import drop_pages, file_mappings

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX = MAX_HEADER  # an index is a small weight map: bounded like a header
_PLAIN = re.compile(r"^[^/\\\x00]+\.safetensors$")


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a source: its dckpt key (prefix included), the source's own name
    for it, dtype and shape. ``bytes_value``: a bytes value over 64 KiB held as a 1-D
    uint8 tensor (dckpt.state.flatten with ``blobs``), written as a bytes entry, as
    dckpt.save writes one (manifest version 5)."""

    key: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bytes_value: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Source:
    """The interface the importer uses. ``tensors`` and ``values`` are filled by the
    constructor (metadata only); ``read`` returns rows ``[r0, r1)`` of a tensor as a
    contiguous CPU tensor; ``done(name)`` says a tensor will not be read again (a
    source may free it); ``close`` releases everything."""

    kind = "?"
    tensors: list[SourceTensor]
    values: dict[str, Any]
    int_keys: list[str]

    def read(self, name: str, r0: int, r1: int) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, names: list[str]) -> None:
        """Get ready to read ``names`` soon (a source that loads whole tensors loads
        them together here). Default: nothing."""

    def done(self, name: str) -> None:
        """``name`` will not be read again."""

    def close(self) -> None:
        """Release files and memory."""


def _rows(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    return t.reshape(()) if t.dim() == 0 else t[r0:r1]


# ------------------------------------------------------------------ safetensors

@dataclass(frozen=True)
class _Stored:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the data in the file
    nbytes: int


def read_safetensors_header(path: str, storage=None) -> dict[str, _Stored]:
    """Parse and check the header of safetensors file ``path``, read through ``storage``
    (a dckpt Storage; None: the local file system). Nothing in the file is trusted
    before it is bounded: the 8-byte length prefix is at most MAX_HEADER and inside the
    file, the header is a JSON object of bounded nesting, every tensor's dtype is one
    dckpt stores, its shape is a list of non-negative ints, its byte range matches the
    shape and lies inside the file, and no two tensors share bytes. Blocking I/O (the
    header only: two small reads and a stat). Raises CheckpointError naming the file and
    tensor."""
    storage = storage if storage is not None else _local()
    try:
        size = storage.size(path)
        head = storage.read(path, 0, 8) if size >= 8 else b""
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path} is not a safetensors file (header length "
                                  f"{n}, file size {size})")
        raw = storage.read(path, 8, n)
        if len(raw) != n:
            raise CheckpointError(f"{path}: short read of its header (the file shrank)")
        doc = load_json(raw, "the safetensors header")
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    out = {}
    for name, t in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype = to_torch(t["dtype"])
        except (KeyError, TypeError):
            d = t.get("dtype") if isinstance(t, dict) else t
            # a string as it is; anything else by its type: a hostile value's repr can
            # be huge or nested too deeply to print
            shown = repr(d[:40]) if isinstance(d, str) else f"a JSON {type(d).__name__}"
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {shown}, which dckpt "
                                  "does not store (or no dtype)") from None
        try:
            _, shape, start, nbytes = check_entry(name, t, 8 + n, size)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a bad shape or byte range "
                                  "(a damaged or truncated file)") from None
        out[name] = _Stored(path, dtype, shape, start, nbytes)
    _check_disjoint(path, out)
    return out


def _check_disjoint(path: str, stored: dict[str, _Stored]) -> None:
    """Refuse two tensors whose byte ranges overlap (safetensors itself writes them
    back to back; a file that aliases bytes is damaged or forged). O(n log n)."""
    spans = sorted((st.start, st.start + st.nbytes, name) for name, st in stored.items()
                   if st.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap in the file "
                                  "(a damaged or forged header)")


_LOCAL_STORAGE: list = []


def _local():
    if not _LOCAL_STORAGE:
        _LOCAL_STORAGE.append(LocalStorage(direct_io=False))
    return _LOCAL_STORAGE[0]


def safetensors_files(src: str, storage=None) -> tuple[list[str], dict | None]:
    """The safetensors files of ``src`` and the index's weight_map (None without one):
    the file itself; in a directory, the files of ``model.safetensors.index.json`` when
    there is one, else every ``*.safetensors``. Read through ``storage`` (a dckpt
    Storage; None: the local file system). Listing and index read only (the index at
    most MAX_INDEX bytes). Raises CheckpointError: nothing at ``src``, no file, a bad
    index, an index naming a file outside the directory or missing from it."""
    storage = storage if storage is not None else _local()
    try:
        if not storage.is_dir(src):
            if storage.exists(src):
                return [src], None
            raise CheckpointError(f"{src} does not exist")
        entries = {e.name for e in storage.listdir(src) if not e.is_dir}
    except OSError as e:
        raise CheckpointError(f"cannot list {src}: {e}") from None
    index = storage.join(src, INDEX_NAME)
    if INDEX_NAME in entries:
        try:
            try:
                raw = storage.read_file(index, MAX_INDEX)
            except FileTooLargeError:
                raise ValueError(f"over {MAX_INDEX >> 20} MiB") from None
            wm = load_json(raw, "the index").get("weight_map")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no weight_map of tensor name -> file name")
        bad = sorted({v for v in wm.values() if not _PLAIN.match(v) or v.startswith(".")})
        if bad:
            raise CheckpointError(f"{index}: weight_map names {preview(bad)}, which are not "
                                  "safetensors files in that directory")
        files = list(dict.fromkeys(wm.values()))
        missing = [v for v in files if v not in entries]
        if missing:
            raise CheckpointError(f"{index} names file(s) missing from {src}: {preview(missing)}")
        return [storage.join(src, v) for v in files], wm
    files = sorted(n for n in entries if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{src} holds no .safetensors file")
    return [storage.join(src, n) for n in files], None


def check_weight_map(index: str, wm: dict, stored: dict[str, _Stored]) -> None:
    """Every tensor the index's weight_map names is in the file it names. Pure. Raises
    CheckpointError naming the index and the tensors."""
    wrong = [k for k, v in wm.items()
             if os.path.basename(stored.get(k, _NONE).path) != v]
    if wrong:
        raise CheckpointError(f"{index}: tensor(s) {preview(wrong)} are not in the "
                              "file the weight_map names")


class SafetensorsSource(Source):
    """A Hugging Face safetensors file or directory; tensors keep the files' order."""

    kind = "safetensors"

    def __init__(self, src: str, prefix: str) -> None:
        self.src, self.values, self.int_keys = src, {}, []
        self.stored: dict[str, _Stored] = {}
        paths, wm = safetensors_files(src)  # the index read once, checked
        for path in paths:
            for name, st in read_safetensors_header(path).items():
                if name in self.stored:
                    raise CheckpointError(f"tensor {name!r} is in both {self.stored[name].path} "
                                          f"and {path}")
                self.stored[name] = st
        if wm is not None:
            check_weight_map(os.path.join(src, INDEX_NAME), wm, self.stored)
        self.tensors = [SourceTensor(prefix + n, n, s.dtype, s.shape)
                        for n, s in self.stored.items()]
        self.files: dict[str, LocalReader] = {}

    def read(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``name``, read with preadv into a new tensor. Blocking
        I/O of those bytes only. Raises CheckpointError on a short read."""
        st = self.stored[name]
        rows = st.shape[0] if st.shape else 1
        row = st.nbytes // rows if rows else 0
        shape = (r1 - r0, *st.shape[1:]) if st.shape else ()
        out = torch.empty(shape, dtype=st.dtype)
        want = out.numel() * st.dtype.itemsize
        if not want:
            return out
        f = self.files.get(st.path)
        if f is None:
            f = self.files[st.path] = LocalReader(st.path)
        if f.readv(st.start + r0 * row, [out.reshape(-1).view(torch.uint8).numpy()]) < want:
            raise CheckpointError(f"{st.path}: short read of tensor {name!r} (the file "
                                  "shrank while being imported)")
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


_NONE = _Stored("", torch.uint8, (), 0, 0)


# ------------------------------------------------------------------ torch.save

class TorchSaveSource(Source):
    """A ``torch.save`` file (the zip format of torch >= 1.6), loaded with
    ``weights_only=True`` and ``mmap=True``: tensors are views of the mapped file, read
    when written out. Nested dicts/lists become dotted keys as ``dckpt.save`` makes
    them; JSON scalars become values; bytes values as ``dckpt.save`` keeps them (over
    64 KiB: a bytes entry of a data file, up to 4 GiB). The pages of each tensor are
    dropped from memory once it has been written (see :func:`drop_pages`)."""

    kind = "torch.save"

    def __init__(self, src: str, prefix: str) -> None:
        try:
            obj = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" in str(e):
                raise CheckpointError(
                    f"{src} was saved in torch's legacy (non-zip) format, which cannot be "
                    "memory-mapped: load and re-save it with torch.save first") from None
            raise CheckpointError(f"{src}: torch.load(weights_only=True) failed: {e}") from None
        except Exception as e:  # an UnpicklingError for anything but plain data
            raise CheckpointError(f"{src}: torch.load(weights_only=True) failed: "
                                  f"{' '.join(str(e).split())[:500]}") from None
        self.maps = file_mappings(src)
        try:
            flat = flatten(obj, blobs=True)  # large bytes values: data-file entries
        except CheckpointError as e:  # e.g. the file holds one tensor, not a dict
            raise type(e)(f"{src}: {e}") from None
        self.t = dict(flat.tensors)
        for k, v in self.t.items():
            if v.layout != torch.strided or v.is_quantized:
                raise CheckpointError(f"{src}: tensor {k!r} has layout {v.layout}; dckpt "
                                      "stores dense tensors")
            to_code(v.dtype, k)  # UnsupportedValueError (a CheckpointError) naming it
        self.values = {prefix + k: v for k, v in flat.values.items()}
        self.int_keys = [prefix + k for k in flat.int_keys]
        blobs = set(flat.bytes_keys)
        self.tensors = [SourceTensor(prefix + k, k, v.dtype, tuple(v.shape), k in blobs)
                        for k, v in self.t.items()]

    def read(self, name: str, r0: int, r1: int) -> torch.Tensor:
        return _rows(self.t[name], r0, r1).contiguous()

    def done(self, name: str) -> None:
        drop_pages(self.t[name], self.maps)

    def close(self) -> None:
        self.t.clear()


def detect(src: str) -> str:
    """``"dcp"``, ``"safetensors"`` or ``"torch"`` for the source at ``src``, from what
    is there: a directory with ``.metadata`` is DCP; a ``.safetensors`` file or a
    directory of them is safetensors; a file that starts like a zip (``PK``) is a
    torch.save file. A few bytes read. Raises CheckpointError when it is none of them."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, ".metadata")):
            return "dcp"
        if os.path.isfile(os.path.join(src, INDEX_NAME)) or any(
                n.endswith(".safetensors") for n in os.listdir(src)):
            return "safetensors"
        raise CheckpointError(f"{src} is a directory with neither a DCP .metadata file nor "
                              ".safetensors files")
    if not os.path.exists(src):
        raise CheckpointError(f"import source {src} does not exist (sources are local paths)")
    try:
        with open(src, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CheckpointError(f"cannot read {src}: {e}") from None
    if src.endswith(".safetensors"):
        return "safetensors"
    if head.startswith(b"PK"):
        return "torch"
    if len(head) == 8 and 0 < int.from_bytes(head, "little") <= MAX_HEADER:
        return "safetensors"  # a safetensors file under another name
    raise CheckpointError(f"{src} is not a DCP directory, a safetensors file or a "
                          "torch.save (zip) file; pass format= to say which it is")
