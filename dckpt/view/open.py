"""A read-only view of one committed checkpoint, in the calling process only:
``dckpt.open(path)``.

No process group, no collective: the manifest is read once when the view opens, and
each tensor asked for is assembled from its saved chunks by :class:`dckpt.engine.reader.ChunkReader`,
the reader ``dckpt.load`` uses (any world size and placement that saved it; incremental
references into sibling checkpoints followed; compressed blocks decoded; every byte
checked against its CRC32 block checksum or content hash before it is returned). A
region read through :meth:`Checkpoint.get_slice` touches only the chunks it overlaps,
and inside them only the checksum blocks that hold part of it. See docs/OPEN.md.
"""
from __future__ import annotations

import difflib
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import CheckpointError, IntegrityError, ManifestError, NotCommittedError, preview
from ..format import manifest as mf
from ..format.dtypes import to_torch
from ..format.sealed import user_value
from ..layout.chunks import Box
from ..protocol.manifest_read import read_manifest
from ..engine.reader import DEFAULT_READ_BUDGET, ChunkReader
from ..state.flatten import tensor_bytes
from ..state.tensors import LocalPiece
from ..storage.fsspec_storage import make_storage
from .slices import SliceError, TensorSlice

__all__ = ["open", "Checkpoint", "TensorInfo", "ValueInfo", "MissingKeyError", "SliceError",
           "describe_sharding"]


class MissingKeyError(CheckpointError, KeyError):
    """The checkpoint holds no leaf under that key. Both a :class:`CheckpointError` and a
    ``KeyError`` (so ``except KeyError`` works as with a dict); its message names the key
    and the nearest keys the checkpoint has."""

    def __str__(self) -> str:  # KeyError's own str() would quote the whole message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TensorInfo:
    """What the manifest says of one saved tensor (no data read).

    ``dtype``: the torch dtype; ``shape``: the global shape (a tuple, whatever the ranks
    that saved it); ``nbytes``: the tensor's size in bytes (elements x item size, not
    what it takes on disk); ``chunks``: how many chunks were saved; ``sharding``: a short
    description of how they cut the tensor, e.g. ``"3 chunks along dim 0"``, ``"whole (1
    chunk)"`` (a replicated or plain tensor: stored once), ``"2-D grid 2x2 over dims 0,
    1 (4 chunks)"``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    sharding: str
    kind: str = "tensor"


@dataclass(frozen=True)
class ValueInfo:
    """A JSON value of the checkpoint (None, bool, int, float, str or bytes): ``value``
    is the value itself (the manifest holds it; a bytes value decoded from its base64
    tag, or read from its data file when it was too large for the manifest), ``kind``
    is ``"value"``."""

    key: str
    value: Any
    kind: str = "value"

    @property
    def type(self) -> str:
        """The value's Python type name: ``"int"``, ``"str"``, ``"bytes"``,
        ``"NoneType"``..."""
        return type(self.value).__name__


_INT_KEY = re.compile(r"-?[0-9]+")  # what str(int) writes: ASCII digits only


def _int_key(part: str, key: str, where: str) -> int:
    """The int that the dotted-key part ``part`` of ``key`` was saved as (the manifest's
    meta.int_keys says it was an int). Pure. Raises ManifestError naming the key for a
    part str(int) cannot have written: ``str.isdigit`` accepts "²" (int() refuses it)
    and int() accepts "٣" (Arabic-Indic 3), so neither test alone is safe."""
    if not _INT_KEY.fullmatch(part):
        raise ManifestError(f"checkpoint {where}: key {key!r} is recorded as an int key "
                            f"(meta.int_keys), but {part!r} is not an integer: the "
                            "manifest is damaged or forged")
    return int(part)


def describe_sharding(entry: mf.TensorEntry) -> str:
    """A short human description of how ``entry``'s chunks cut the tensor. Pure,
    O(chunks)."""
    c = entry.chunks
    n = len(c)
    if n == 0:
        return "empty (no chunk)"
    if n == 1:
        return "whole (1 chunk)"
    if c.grid is not None:
        cuts = [(d, len(b) - 1) for d, b in enumerate(c.grid) if len(b) > 2]
        if len(cuts) == 1:
            return f"{n} chunks along dim {cuts[0][0]}"
        if cuts:
            return (f"{len(cuts)}-D grid {'x'.join(str(k) for _, k in cuts)} over dims "
                    f"{', '.join(str(d) for d, _ in cuts)} ({n} chunks)")
    # No grid: boxes that are not the cells of one (interleaved strided shards...)
    varying = [d for d in range(c.offsets.shape[1]) if len(np.unique(c.offsets[:, d])) > 1]
    if len(varying) == 1:
        return f"{n} chunks along dim {varying[0]}"
    return f"{n} chunks (irregular boxes over dims {', '.join(map(str, varying))})"


def open(path: str | os.PathLike, storage_options: dict | None = None, *,  # noqa: A001
         read_budget: int = DEFAULT_READ_BUDGET, read_workers: int = 4) -> "Checkpoint":
    """Open the committed checkpoint at ``path`` (a local path, ``memory://``,
    ``s3://``... with fsspec ``storage_options``) read-only. Use it as a context
    manager: ``with dckpt.open(path) as ck: ck["model.w"]``.

    Cost: one read of the manifest (its size), parsed and validated; no data read, no
    process group needed (it works inside or outside a distributed job, on any rank).
    ``read_budget`` bounds the reader's extra memory per call (bytes, default 256 MiB),
    ``read_workers`` its reading threads. Raises NotCommittedError (no manifest there)
    and ManifestError (not a valid manifest), as ``dckpt.load`` does; where ``path``
    holds no manifest the NotCommittedError says what it is instead (a file, a root of
    checkpoints naming them, a fast-tier step: a listing, and one per subdirectory, on
    that error path only)."""
    where = os.fspath(path)
    storage, root = make_storage(where, storage_options)
    try:
        manifest, _ = read_manifest(storage, root)
    except (NotCommittedError, NotADirectoryError) as e:  # a file raises the latter
        from ..catalog.listing import not_a_checkpoint

        raise not_a_checkpoint(storage, root, where, e) from None
    return Checkpoint(storage, root, manifest, path=where, read_budget=read_budget,
                      read_workers=read_workers)


class Checkpoint:
    """A read-only view of one committed checkpoint; made by :func:`open`.

    Keys are the dotted keys of the saved state's leaves, as ``dckpt inspect`` prints
    them: tensors, then JSON values. Reads are thread-safe (serialised: one read at a
    time, each using ``read_workers`` threads). After :meth:`close` every method raises
    CheckpointError."""

    def __init__(self, storage, root: str, manifest: mf.Manifest, *, path: str | None = None,
                 read_budget: int = DEFAULT_READ_BUDGET, read_workers: int = 4) -> None:
        self._m = manifest
        self.path = path if path is not None else root
        self._reader: ChunkReader | None = ChunkReader(storage, root, manifest)
        self._budget, self._workers = max(1, int(read_budget)), max(1, int(read_workers))
        self._keys = list(manifest.tensors) + list(manifest.values)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the reader (its cached file headers; data files are only open during
        a read). Idempotent."""
        with self._lock:
            self._reader = None

    @property
    def closed(self) -> bool:
        return self._reader is None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._reader is None:
            raise CheckpointError(f"checkpoint {self.path} was closed: open it again "
                                  "(dckpt.open) to read from it")

    # ------------------------------------------------------------------ what it holds
    @property
    def manifest(self) -> mf.Manifest:
        """The parsed, validated manifest (immutable): for tools that walk chunks."""
        return self._m

    @property
    def save_id(self) -> str:
        return self._m.save_id

    @property
    def world_size(self) -> int:
        """How many ranks saved it."""
        return self._m.world_size

    @property
    def created(self) -> float:
        """When it was committed (seconds since the epoch)."""
        return self._m.created

    def keys(self) -> list[str]:
        """Every leaf's dotted key: the tensors in the manifest's order, then the JSON
        values, as ``dckpt inspect`` lists them. No I/O."""
        self._check_open()
        return list(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        self._check_open()
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return isinstance(key, str) and (key in self._m.tensors or key in self._m.values)

    def info(self, key: str) -> TensorInfo | ValueInfo:
        """What the manifest says of ``key``: a :class:`TensorInfo` for a tensor, a
        :class:`ValueInfo` for a JSON value. No I/O (a bytes value is decoded from the
        manifest: O(its size)), except for a bytes value stored in a data file (over
        64 KiB), which is read and verified as ``ck[key]`` reads it. Raises
        MissingKeyError; IntegrityError as ``ck[key]``."""
        self._check_open()
        e = self._m.tensors.get(key)
        if e is not None and e.bytes_value:
            return ValueInfo(key, self[key])
        if e is not None:
            return TensorInfo(key, to_torch(e.dtype), tuple(e.shape), e.nbytes, len(e.chunks),
                              describe_sharding(e))
        if key in self._m.values:
            return ValueInfo(key, user_value(self._m.values[key]))
        raise self._missing(key)

    # ------------------------------------------------------------------ reading
    def __getitem__(self, key: str) -> Any:
        """The whole tensor at ``key``, assembled from its chunks into a new CPU tensor
        of its global shape and verified; or the JSON value (a bytes value stored in a
        data file read and verified the same way, handed back as ``bytes``). Blocking
        I/O: every chunk of that tensor once (plus one verified header per file it
        spans). Memory: the tensor plus at most ``read_budget`` bytes of temporaries
        (a bytes value: twice its size, briefly). Raises MissingKeyError;
        IntegrityError naming the key and file when a chunk of this tensor is damaged,
        truncated or missing (other keys still read)."""
        self._check_open()
        e = self._m.tensors.get(key)
        if e is None:
            if key in self._m.values:  # bytes: decoded, O(its size)
                return user_value(self._m.values[key])
            raise self._missing(key)
        if e.bytes_value:
            return tensor_bytes(self._read_box(key, (0,), tuple(e.shape), e))
        return self._read_box(key, (0,) * len(e.shape), tuple(e.shape))

    def get_tensor(self, key: str) -> torch.Tensor:
        """``ck[key]`` for a tensor (safetensors' name). Raises MissingKeyError for a
        key that is not a tensor."""
        self._tensor(key)
        return self[key]

    def get_slice(self, key: str) -> TensorSlice:
        """A handle on tensor ``key`` that reads only what an index selects:
        ``ck.get_slice("w")[0:2, ...]`` (see :class:`dckpt.view.slices.TensorSlice`).
        No I/O until indexed. Raises MissingKeyError (also for a JSON value's key)."""
        return TensorSlice(self, key)

    def to_state_dict(self, prefix: str | None = None) -> Any:
        """The saved state as nested dicts, or the sub-tree under ``prefix`` (a dotted
        key without its trailing dot: ``"model"`` gives ``{"w": ..., "b": ...}``; the
        key of a leaf gives the leaf). Dict keys are strings, except those the save
        recorded as ints (a plain optimizer's ``state``: ``{0: {...}}``). Lists and
        tuples come back as dicts keyed ``"0"``, ``"1"``...: the manifest does not
        record them. Blocking I/O: reads every tensor of the sub-tree; memory: all of
        them. Raises MissingKeyError when nothing is under ``prefix``, CheckpointError
        when a leaf's key is also a sub-tree's (``"a"`` and ``"a.b"``), ManifestError
        naming the key when the manifest records as an int key a part that is not one
        (``"a.²"``), IntegrityError as ``ck[key]``."""
        self._check_open()
        if prefix is not None and prefix.endswith("."):
            prefix = prefix[:-1]
        if prefix and prefix in self:
            return self[prefix]
        head = f"{prefix}." if prefix else ""
        keys = [k for k in self._keys if k.startswith(head)]
        if not keys:
            raise self._missing(prefix or "", subtree=True)
        ints = set(self._int_keys())
        out: dict = {}
        for key in keys:
            parts = key[len(head):].split(".")
            node, path = out, prefix or ""
            for i, part in enumerate(parts):
                path = f"{path}.{part}" if path else part
                k = _int_key(part, key, self.path) if path in ints else part
                if i == len(parts) - 1:
                    if k in node:
                        raise CheckpointError(f"checkpoint {self.path}: key {key!r} is both a "
                                              "leaf and a sub-tree's prefix; read it with "
                                              "ck[key]")
                    node[k] = self[key]
                else:
                    node = node.setdefault(k, {})
                    if not isinstance(node, dict):
                        raise CheckpointError(f"checkpoint {self.path}: key {path!r} is a "
                                              f"leaf and also the prefix of {key!r}; read "
                                              "them with ck[key]")
        return out

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._keys)} keys"
        return f"<dckpt.Checkpoint {self.path} ({state}, saved by {self._m.world_size} rank(s))>"

    # ------------------------------------------------------------------ internals
    def _int_keys(self) -> list[str]:
        ints = self._m.meta.get("int_keys") or []
        return [k for k in ints if isinstance(k, str)] if isinstance(ints, list) else []

    def _tensor(self, key: str) -> mf.TensorEntry:
        """The manifest entry of tensor ``key``. Raises MissingKeyError (also for a
        bytes value stored as an entry: it is a value, read with ``ck[key]``)."""
        self._check_open()
        e = self._m.tensors.get(key)
        if e is None or e.bytes_value:
            raise self._missing(key, value=e is not None or key in self._m.values)
        return e

    def _missing(self, key: str, value: bool = False, subtree: bool = False) -> MissingKeyError:
        """The error for a key the checkpoint lacks, with what the user may have meant."""
        if not isinstance(key, str):
            return MissingKeyError(f"checkpoint {self.path}: keys are dotted strings "
                                   f"(\"model.w\"), got {key!r}")
        what = "sub-tree" if subtree else "tensor" if value else "key"
        if value:
            return MissingKeyError(f"checkpoint {self.path}: {key!r} is a JSON value, not a "
                                   "tensor; read it with ck[key]")
        msg = f"checkpoint {self.path} has no {what} {key!r}"
        under = [k for k in self._keys if k.startswith(key + ".")] if key else []
        if under and not subtree:
            msg += (f"; it is the prefix of {len(under)} key(s) ({preview(under, 3)}): "
                    f"ck.to_state_dict({key!r}) reads that sub-tree")
        elif len(self._keys) <= 20000:  # difflib is quadratic-ish per key: keep it cheap
            near = difflib.get_close_matches(key, self._keys, n=3, cutoff=0.6)
            if near:
                msg += f"; did you mean {preview(near, 3)}?"
        if not self._keys:
            msg += " (it holds no keys)"
        return MissingKeyError(msg)

    def _read_box(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                  e: mf.TensorEntry | None = None) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of tensor ``key`` (its entry ``e``, or the
        tensor entry of that key), read and verified into a new tensor of shape
        ``sizes``. Blocking I/O of the overlapping checksum blocks only. Raises
        IntegrityError prefixed with the checkpoint and key."""
        e = e if e is not None else self._tensor(key)
        out = torch.empty(sizes, dtype=to_torch(e.dtype))
        if out.numel() == 0:
            return out
        piece = LocalPiece(key, e.dtype, tuple(e.shape), Box(tuple(offsets), tuple(sizes)), out)
        with self._lock:
            self._check_open()
            try:
                self._reader.fill_all([(piece, e)], workers=self._workers, budget=self._budget,
                                      what=f"read {key!r} of {self.path}")
            except IntegrityError as err:
                raise type(err)(f"checkpoint {self.path}, key {key!r}: {err}",
                                err.failures) from None
        return out
