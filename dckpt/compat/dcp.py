"""torch.distributed.checkpoint's API on dckpt: switch with one import line.

    import torch.distributed.checkpoint as dcp      # before
    from dckpt.compat import dcp                     # after

``save``, ``async_save`` and ``load`` take DCP's arguments and follow DCP's semantics,
checked against PyTorch's own DCP tests (test_e2e_save_and_load, test_save_load_api):

- ``save`` replaces what is at ``checkpoint_id`` (DCP overwrites; here atomically: the
  old checkpoint stays loadable until the new one commits).
- ``load`` fills ``state_dict`` in place and ignores checkpoint keys it does not ask for
  (a partial load); a key it asks for that the checkpoint lacks is an error unless the
  planner is ``DefaultLoadPlanner(allow_partial_load=True)``. A tensor saved in another
  floating dtype is converted, as DCP's copy does. In place means: nested dicts and
  lists stay the same objects (a dict or list held elsewhere sees the loaded values;
  DCP itself rebuilds lists), tensors and DTensors keep their identity and storage
  (the bytes are copied into them), other leaves are replaced inside their own
  container, tuples are rebuilt. No container of ``state_dict`` changes before every
  rank has read and verified its part (tensor bytes may: see :func:`dckpt.load`).
- Stateful values (anything with ``state_dict()``/``load_state_dict()``: modules,
  optimizers, schedulers, your own; at any depth) are saved through ``state_dict()``
  and restored by ``load_state_dict()`` with the loaded values, inner ones first, and
  stay the same objects in their container; other top-level values are assigned back
  (``state_dict[key] = ...``, the same dict or list, filled), as DCP does.
- Non-tensor values: None, bool, int, float, str, nested dict/list/tuple, and ``bytes``
  / ``io.BytesIO`` (stored as uint8 tensors, never pickled; a loaded BytesIO is at
  position 0). Anything else DCP would pickle is refused with UnsupportedValueError
  naming its key: dckpt never unpickles.
- ``checkpoint_id`` may be a str, an ``os.PathLike`` or an fsspec URL; or give a
  ``FileSystemWriter``/``FileSystemReader`` (DCP's or this module's) holding the path.

Refused with CheckpointError (they have no dckpt equivalent): custom planners (only
DCP's ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` are accepted), storage writers
and readers other than the file-system ones, ``async_stager``, and ``no_dist=True`` in
a multi-rank process group. Accepted and ignored: the writers' tuning knobs
(thread_count, single_file_per_rank, sync_files: dckpt always fsyncs before it
commits), ``use_collectives``, ``async_checkpointer_type`` (the save always persists
in a background thread). ``save`` returns a :class:`dckpt.CheckpointInfo` (DCP returns
its Metadata); ``async_save`` a :class:`dckpt.SaveHandle` (``result()``, ``done()``,
``exception()``, like DCP's Future).
"""
from __future__ import annotations

import io
import json
import logging
import os
from typing import Any

import torch

from ..engine.async_save import SaveHandle
from ..engine.async_save import async_save as _async_save
from ..errors import CheckpointError, UnsupportedValueError
from ..format import manifest as mf
from ..protocol.collectives import Comm, rank0_bytes
from ..protocol.commit import CheckpointInfo
from ..protocol.commit import save as _save
from ..protocol.restore import load as _load
from ..protocol.restore import read_manifest_bytes
from ..state.flatten import fill, is_stateful
from ..storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)
BYTES_KEY = "__dckpt_compat_bytes__"  # JSON value: {flat key: "bytes" | "bytesio"}

__all__ = ["save", "async_save", "load", "FileSystemWriter", "FileSystemReader"]


class FileSystemWriter:
    """A path holder, so ``storage_writer=dcp.FileSystemWriter(path)`` keeps working."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        self.path = path


class FileSystemReader:
    """A path holder, so ``storage_reader=dcp.FileSystemReader(path)`` keeps working."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        self.path = path


# ---------------------------------------------------------------- arguments
def _checkpoint_path(checkpoint_id: Any, storage: Any, what: str) -> str:
    if storage is not None:
        name = type(storage).__name__
        if name not in ("FileSystemWriter", "FileSystemReader") or not hasattr(storage, "path"):
            raise CheckpointError(
                f"dckpt.compat.dcp.{what}: storage_{'writer' if what != 'load' else 'reader'} "
                f"{name} is not supported: only FileSystemWriter/FileSystemReader (or a "
                "checkpoint_id) name where dckpt writes; dckpt has its own storage layer "
                "(fsspec URLs work as checkpoint_id)")
        if checkpoint_id is None:
            checkpoint_id = storage.path
    if checkpoint_id is None:
        raise CheckpointError(f"dckpt.compat.dcp.{what}: give checkpoint_id (or a "
                              "FileSystemWriter/Reader with a path)")
    try:
        return os.fspath(checkpoint_id)
    except TypeError:
        raise CheckpointError(f"dckpt.compat.dcp.{what}: checkpoint_id must be a str or "
                              f"os.PathLike, not {type(checkpoint_id).__name__}") from None


def _check_planner(planner: Any, what: str, default: str) -> bool:
    """Returns allow_partial_load (loads); refuses custom planners."""
    if planner is None:
        return False
    if type(planner).__name__ != default:
        raise CheckpointError(
            f"dckpt.compat.dcp.{what}: planner {type(planner).__name__} is not supported (only "
            f"{default}): dckpt plans and reshards by itself")
    return bool(getattr(planner, "allow_partial_load", False))


def _group(process_group: Any, no_dist: bool, what: str) -> Any:
    if no_dist and Comm(process_group).size > 1:
        raise CheckpointError(
            f"dckpt.compat.dcp.{what}: no_dist=True in a process group of "
            f"{Comm(process_group).size} ranks is not supported (every rank would write the "
            "same checkpoint alone); call it on every rank without no_dist")
    return process_group


# ---------------------------------------------------------------- state
def _resolve(state_dict: dict, what: str) -> tuple[dict, dict[str, tuple[Any, Any]], dict[str, str]]:
    """(what dckpt saves or loads into, {flat key: (Stateful object, the part of the
    first value that stands for its state_dict)}, {flat key: bytes kind}). A parallel
    structure: Stateful values (at any depth; modules and optimizers too, which DCP
    treats as Stateful) become their ``state_dict()``, bytes and BytesIO become uint8
    tensors; dicts, lists and tuples are new containers, tensors the caller's own
    objects (so a load fills them in place). Calls each Stateful's state_dict() once;
    copies only bytes values."""
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"dckpt.compat.dcp.{what}: state_dict must be a dict, not "
                              f"{type(state_dict).__name__}")
    stateful: dict[str, tuple[Any, Any]] = {}
    kinds: dict[str, str] = {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, (bytes, bytearray, io.BytesIO)):
            kinds[key] = "bytesio" if isinstance(obj, io.BytesIO) else "bytes"
            raw = obj.getvalue() if isinstance(obj, io.BytesIO) else bytes(obj)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
                torch.zeros(0, dtype=torch.uint8)
        if is_stateful(obj):
            sd = walk(obj.state_dict(), key)
            stateful[key] = (obj, sd)
            return sd
        if isinstance(obj, dict):
            return {k: walk(v, f"{key}.{k}") for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, f"{key}.{i}") for i, v in enumerate(obj))
        return obj

    out = {}
    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise UnsupportedValueError(f"dckpt.compat.dcp.{what}: top-level key {k!r} is not "
                                        "a str (DCP requires str keys at the top)")
        out[k] = walk(v, k)
    return out, stateful, kinds


def _as_bytes(t: torch.Tensor, kind: str) -> bytes | io.BytesIO:
    """A loaded uint8 tensor back as what was saved: bytes, or a BytesIO at position 0."""
    raw = t.numpy().tobytes()
    return io.BytesIO(raw) if kind == "bytesio" else raw


# ---------------------------------------------------------------- the API
def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False, use_collectives: bool = True) -> CheckpointInfo:
    """DCP's ``save``: replaces the checkpoint at ``checkpoint_id`` atomically.
    Collective, blocking I/O (see :func:`dckpt.save`). Raises CheckpointError."""
    out, path, group = _to_save(state_dict, checkpoint_id, storage_writer, planner,
                                process_group, no_dist, "save")
    return _save(out, path, process_group=group, overwrite=True)


def _to_save(state_dict: dict, checkpoint_id: Any, storage_writer: Any, planner: Any,
             process_group: Any, no_dist: bool, what: str) -> tuple[dict, str, Any]:
    """(what dckpt saves, path, group) for save/async_save. Raises CheckpointError."""
    path = _checkpoint_path(checkpoint_id, storage_writer, what)
    _check_planner(planner, what, "DefaultSavePlanner")
    group = _group(process_group, no_dist, what)
    out, _, kinds = _resolve(state_dict, what)
    if kinds:
        out[BYTES_KEY] = json.dumps(kinds, sort_keys=True)
    return out, path, group


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None,
               no_dist: bool = False, use_collectives: bool = True) -> SaveHandle:
    """DCP's ``async_save``: returns once the state is snapshotted (changing it after
    is safe); the handle's ``result()`` waits for the commit. Collective. Raises
    CheckpointError (argument errors at once; save errors from ``result()``)."""
    if async_stager is not None:
        raise CheckpointError("dckpt.compat.dcp.async_save: async_stager is not supported: "
                              "dckpt stages into its own reusable host buffers")
    out, path, group = _to_save(state_dict, checkpoint_id, storage_writer, planner,
                                process_group, no_dist, "async_save")
    return _async_save(out, path, process_group=group, overwrite=True)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False) -> None:
    """DCP's ``load``: fills ``state_dict`` in place (see the module docstring for the
    rules): :func:`dckpt.load` fills a parallel structure that holds the caller's own
    tensors and the Stateful objects' state_dicts, then the caller's containers are
    filled from it (``state.flatten.fill``) and each Stateful's ``load_state_dict`` is
    called. Collective: rank 0 reads the manifest once more than :func:`dckpt.load`
    (to size bytes values and apply ``allow_partial_load``); one more walk of the
    state, no copy of a tensor. Raises CheckpointError, StateMismatchError for a key
    the checkpoint lacks; what a Stateful's ``load_state_dict`` raises."""
    path = _checkpoint_path(checkpoint_id, storage_reader, "load")
    partial = _check_planner(planner, "load", "DefaultLoadPlanner")
    group = _group(process_group, no_dist, "load")
    target, stateful, _ = _resolve(state_dict, "load")
    comm = Comm(group)

    def manifest_bytes() -> bytes:
        storage, root = make_storage(path, None)
        return read_manifest_bytes(storage, root)

    m = mf.parse(rank0_bytes(comm, manifest_bytes, f"load from {path}"), path)
    saved_kinds = json.loads(m.values.get(BYTES_KEY) or "{}")
    loaded_bytes: dict[str, torch.Tensor] = {}
    _size_bytes(target, "", m, saved_kinds, loaded_bytes)
    removed: list = []
    if partial:
        _prune(target, "", m, removed)
    _load(target, path, process_group=group, strict=False, cast=True)
    for container, k, v in removed:  # a Stateful's state_dict gets them back as they were
        container[k] = v

    # Fill the caller's own containers in place, as dckpt.load does (state.flatten.fill):
    # dicts and lists keep their identity (a dict held elsewhere sees the new values),
    # tensors were copied into already (``target`` holds the caller's tensor objects),
    # other leaves are replaced inside their container, and each Stateful gets
    # load_state_dict of its loaded state_dict, inner ones first.
    def get(key: str, old: Any) -> Any:
        if key in loaded_bytes:
            return _as_bytes(loaded_bytes[key], saved_kinds[key])
        if isinstance(old, torch.Tensor):
            return old  # filled in place (or, under allow_partial_load, kept)
        return m.values[key] if key in m.values else old  # absent: a kept partial-load entry

    for k in list(state_dict):
        # One top-level key at a time: DCP calls load_state_dict on a top-level Stateful
        # and leaves its slot alone, and assigns every other top-level value back
        # (``state_dict[key] = loaded``, the same dict or list, filled).
        one = {k: state_dict[k]}
        fill(one, get, stateful)
        if not (k in stateful and stateful[k][0] is state_dict[k]):
            state_dict[k] = one[k]


def _size_bytes(obj: Any, key: str, m: mf.Manifest, kinds: dict[str, str],
                loaded: dict[str, torch.Tensor]) -> None:
    """Give each target leaf that was saved as bytes a uint8 tensor of the saved size
    (recorded in ``loaded`` by key: the load fills it, then it becomes bytes again)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if type(obj) is list else ()
    for k, v in list(items):
        sub = f"{key}.{k}" if key else str(k)
        if sub in kinds and sub in m.tensors:
            obj[k] = loaded[sub] = torch.empty(m.tensors[sub].shape, dtype=torch.uint8)
        elif isinstance(v, (dict, list)):
            _size_bytes(v, sub, m, kinds, loaded)


def _prune(obj: Any, key: str, m: mf.Manifest, removed: list) -> None:
    """allow_partial_load: take the dict entries the checkpoint lacks out of the target
    (into ``removed``, to be put back after the load: they keep their values)."""
    if not isinstance(obj, dict):
        return
    for k in list(obj):
        sub = f"{key}.{k}" if key else str(k)
        v = obj[k]
        if isinstance(v, dict):
            _prune(v, sub, m, removed)
        elif not (sub in m.tensors or sub in m.values or any(
                t.startswith(sub + ".") for t in (*m.tensors, *m.values))):
            log.info("allow_partial_load: %r is not in the checkpoint; left as it is", sub)
            removed.append((obj, k, v))
            del obj[k]
