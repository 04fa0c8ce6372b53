"""Reading a torch.distributed.checkpoint (DCP) directory for an import.

DCP's ``.metadata`` file is a pickle. It is read here with a restricted unpickler that
only builds DCP's own metadata classes, torch dtypes/sizes and a few builtins, and
refuses any other global: a hand-made ``.metadata`` cannot run code through it. That is
defence in depth, not a reason to import checkpoints from untrusted places: DCP itself
(and this import) trusts the directory it reads. Non-tensor entries, which DCP stores as
pickled bytes, are loaded with ``torch.load(weights_only=True)`` rather than DCP's own
unrestricted ``torch.load``. Tensor data go through DCP's ``FileSystemReader`` and
``dcp.load(..., no_dist=True)``: one process, plain full tensors, whatever world size
and placements saved them.
"""
from __future__ import annotations

import io
import logging
import math
import os
import pickle
import warnings
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedValueError, preview
from ..format.dtypes import to_code
from ..state.flatten import flatten
from .common import trim_heap
from .dcp_check import check_metadata
from .sources import Source, SourceTensor, _rows

log = logging.getLogger("dckpt.interop")
MAX_METADATA = 1 << 30
SINGLE_LOAD = 4 << 20  # tensors at least this large get a dcp.load call of their own

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what a DCP ``.metadata`` holds; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout,
                                                                torch.memory_format))):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}, which is not part of "
                                     "DCP's metadata; dckpt does not unpickle it")


def read_metadata(src: str):
    """The parsed ``.metadata`` of DCP directory ``src``, through the restricted
    unpickler. Reads one file (at most 1 GiB). Raises CheckpointError naming the file."""
    path = os.path.join(src, ".metadata")
    try:
        if os.path.getsize(path) > MAX_METADATA:
            raise CheckpointError(f"{path} is over {MAX_METADATA >> 20} MiB: not DCP metadata")
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except Exception as e:  # UnpicklingError, EOFError, a class's own check...
        raise CheckpointError(f"{path} is not DCP metadata dckpt can read: "
                              f"{type(e).__name__}: {e}") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(md).__name__})")
    return md


def _reader_cls():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        """DCP's file reader, with the metadata parsed once by the restricted unpickler."""

        def __init__(self, path: str, metadata) -> None:
            super().__init__(path)
            self._md = metadata

        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(self._md, "storage_meta", None) is None:
                self._md.storage_meta = StorageMeta()
            self._md.storage_meta.load_id = self.load_id
            return self._md

    return Reader


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        """DCP's planner, loading non-tensor entries with weights_only=True."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return Planner()


class DCPSource(Source):
    """A DCP checkpoint directory. Tensors are loaded whole (DCP reads a tensor into a
    full target in one process), the ones one output file needs in one ``dcp.load``
    call, and freed once written."""

    kind = "dcp"

    def __init__(self, src: str, prefix: str) -> None:
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                           TensorStorageMetadata)

        self.src = src
        self.md = read_metadata(src)
        check_metadata(self.md, src)  # sizes against the files' bytes, before any use
        self.cache: dict[str, torch.Tensor] = {}
        self.meta_of: dict[str, Any] = {}
        self.tensors, byte_keys = [], []
        for fqn, m in self.md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                dtype = m.properties.dtype
                to_code(dtype, fqn)  # UnsupportedValueError naming the key
                self.meta_of[fqn] = m
                self.tensors.append(SourceTensor(prefix + fqn, fqn, dtype, tuple(m.size)))
            elif isinstance(m, BytesStorageMetadata):
                byte_keys.append(fqn)
            else:
                raise CheckpointError(f"{src}: entry {fqn!r} has unknown metadata "
                                      f"{type(m).__name__}")
        self.values: dict[str, Any] = {}
        self.int_keys: list[str] = []
        if byte_keys:
            self._load_values(byte_keys, prefix)

    def _dcp_load(self, state: dict, what: str) -> None:
        """``dcp.load`` of ``state`` (fqn -> target) from this directory, in this process.
        Raises CheckpointError naming ``what`` and the directory."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=_reader_cls()(self.src, self.md),
                         planner=_planner(), no_dist=True)
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            if isinstance(e, CheckpointException):  # its str() is a whole traceback
                e = next((f[0] for f in e.failures.values()), e)
            msg = " ".join(str(e).split())[:800]
            raise CheckpointError(f"reading {what} from DCP checkpoint {self.src} failed: "
                                  f"{type(e).__name__}: {msg}") from None

    def _load_values(self, keys: list[str], prefix: str) -> None:
        """The non-tensor entries, flattened as dckpt.save would store them (a bytes
        value over 64 KiB, such as torchtitan's pickled dataloader state, as a uint8
        tensor the import writes as a bytes entry). Raises UnsupportedValueError naming
        the key for an object that is not plain data, or a bytes value over 4 GiB."""
        state: dict[str, Any] = {k: None for k in keys}
        try:
            self._dcp_load(state, f"{len(keys)} non-tensor entries ({preview(keys, 3)})")
        except CheckpointError:
            for k in keys:  # again one by one, to name the entry that is not plain data
                try:
                    self._dcp_load({k: None}, f"entry {k!r}")
                except CheckpointError as e:
                    raise UnsupportedValueError(f"{e} (weights_only=True loads only plain "
                                                "data: tensors, numbers, strings, lists, "
                                                "dicts)") from None
            raise
        for k, v in state.items():
            try:
                flat = flatten({k: v}, blobs=True)  # large bytes values: data-file entries
            except CheckpointError as e:
                raise UnsupportedValueError(f"{self.src}: entry {k!r}: {e}") from None
            blobs = set(flat.bytes_keys)
            for name, t in flat.tensors.items():  # a tensor inside a pickled object, or bytes
                self.cache[name] = t
                self.tensors.append(SourceTensor(prefix + name, name, t.dtype, tuple(t.shape),
                                                 name in blobs))
            self.values.update({prefix + n: x for n, x in flat.values.items()})
            self.int_keys += [prefix + n for n in flat.int_keys]

    def prepare(self, names: list[str]) -> None:
        """Load the tensors of ``names`` not loaded yet. Memory: those tensors, plus
        DCP's temporaries while it reads a saved chunk (measured: about twice the chunk).

        Tensors of at least SINGLE_LOAD bytes are loaded one ``dcp.load`` each, largest
        first, the rest in one call: the temporaries of a large tensor then come while
        little else is held, and those of the later, smaller ones are small, so the peak
        stays near the group's own size (one call for the whole group peaked at the
        group plus two of its largest chunks). Small tensors share a call because each
        call costs DCP a planning pass."""
        want = [n for n in dict.fromkeys(names) if n not in self.cache]
        nbytes = {n: math.prod(self.meta_of[n].size) * self.meta_of[n].properties.dtype.itemsize
                  for n in want}
        big = sorted((n for n in want if nbytes[n] >= SINGLE_LOAD), key=lambda n: -nbytes[n])
        small = [n for n in want if nbytes[n] < SINGLE_LOAD]
        for group in [[n] for n in big] + ([small] if small else []):
            state = {n: torch.empty(tuple(self.meta_of[n].size),
                                    dtype=self.meta_of[n].properties.dtype) for n in group}
            self._dcp_load(state, f"tensor(s) {preview(group, 3)}")
            self.cache.update(state)
            trim_heap()  # DCP's freed temporaries, before the next tensor's

    def read(self, name: str, r0: int, r1: int) -> torch.Tensor:
        if name not in self.cache:
            self.prepare([name])
        return _rows(self.cache[name], r0, r1)

    def done(self, name: str) -> None:
        self.cache.pop(name, None)

    def close(self) -> None:
        self.cache.clear()
