"""torch.distributed.checkpoint's API on dckpt: switch with one import line.

    import torch.distributed.checkpoint as dcp      # before
    from dckpt.compat import dcp                     # after

``save``, ``async_save`` and ``load`` (and the deprecated ``save_state_dict`` /
``load_state_dict``) take DCP's arguments and follow DCP's semantics, checked by
running PyTorch's own DCP tests through this module (tests/test_dcp_reference.py,
tests/multirank/test_dcp_reference.py; the differences are listed in
docs/DCP_COMPAT.md):

- ``save`` replaces what is at ``checkpoint_id`` (DCP overwrites; here atomically: the
  old checkpoint stays loadable until the new one commits);
  ``FileSystemWriter(path, overwrite=False)`` onto an existing checkpoint raises
  CheckpointException ("Checkpoint already exists").
- ``load`` fills ``state_dict`` in place and ignores checkpoint keys it does not ask
  for; a key it asks for that the checkpoint lacks raises CheckpointException
  ("Missing key in checkpoint state_dict: k.") unless the planner is
  ``DefaultLoadPlanner(allow_partial_load=True)``: then it keeps its value. A tensor
  of another size raises ("Size mismatch ..."); one saved in another dtype is
  converted (as DCP's copy does); a meta tensor is replaced by a loaded one. In place
  means: nested dicts and lists stay the same objects (a dict or list held elsewhere
  sees the loaded values), tensors and DTensors keep their identity and storage,
  other leaves are replaced inside their own container, tuples are rebuilt. A list or
  tuple holding no tensor and no dict is one value, as in DCP: it loads as the saved
  one whatever its length (:mod:`dckpt.compat.dcp_values`). No
  container of ``state_dict`` changes before every rank has read and verified its
  part (tensor bytes may: see :func:`dckpt.load`).
- Stateful values (``state_dict()``/``load_state_dict()``: modules, optimizers,
  schedulers, your own; at any depth) are saved through ``state_dict()`` and restored
  by ``load_state_dict()`` with the loaded values, inner ones first, and stay the same
  objects; both are called in sorted key order on every rank, so they may run
  collectives. Other top-level values are assigned back (``state_dict[key] = ...``).
- Non-tensor values: None, bool, int, float, str, nested dict/list/tuple, and ``bytes``
  / ``io.BytesIO`` (stored as uint8 tensors, never pickled; a loaded BytesIO is at
  position 0). Anything else DCP would pickle is refused naming its key.
- ``checkpoint_id`` may be a str, an ``os.PathLike`` or an fsspec URL; or give a
  ``FileSystemWriter``/``FileSystemReader`` (DCP's or this module's) holding the path.

Errors are DCP's ``CheckpointException`` and dckpt's ``CheckpointError`` at once (see
:mod:`dckpt.compat.dcp_errors`), raised on every rank alike; an unknown URL scheme is a
RuntimeError ("Cannot detect ...") as in DCP. Refused (no dckpt equivalent): custom
planners, storage writers/readers other than the file-system ones, ``no_dist=True`` in
a multi-rank group. Accepted and ignored: the writers' tuning knobs, ``use_collectives``,
``coordinator_rank``, ``async_checkpointer_type``; ``async_stager`` is accepted and its
staging emulated (dckpt snapshots in the call). ``save`` returns a
:class:`dckpt.CheckpointInfo` (DCP returns its Metadata); ``async_save`` a
``concurrent.futures.Future`` (:class:`SaveFuture`), or with an asynchronous stager
DCP's ``AsyncSaveResponse``, as DCP does.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from ..protocol.async_save import SaveHandle
from ..protocol.async_save import async_save as _async_save
from ..errors import CheckpointError, NotCommittedError
from ..format import manifest as mf
from ..format import sealed
from ..protocol.collectives import Comm, agree, rank0_bytes
from ..protocol.commit import CheckpointInfo
from ..protocol.commit import save as _save
from ..protocol.restore import load as _load
from ..protocol.restore import read_manifest_bytes
from ..storage.fsspec_storage import make_storage
from .dcp_errors import CheckpointException, StorageDetectionError, as_dcp
from .dcp_state import BYTES_KEY, as_bytes, fill_back, prepare_load, resolve
from .dcp_values import EMPTY_KEY, Saved, empty_keys, into, records

log = logging.getLogger(__name__)

__all__ = ["save", "async_save", "load", "save_state_dict", "load_state_dict",
           "FileSystemWriter", "FileSystemReader", "DefaultSavePlanner", "DefaultLoadPlanner",
           "Stateful", "CheckpointException"]


class FileSystemWriter:
    """A path holder, so ``storage_writer=dcp.FileSystemWriter(path)`` keeps working;
    ``overwrite`` (default True, as in DCP) is honoured, other knobs are ignored."""

    def __init__(self, path: str | os.PathLike, *args: Any, overwrite: bool = True,
                 **kwargs: Any) -> None:
        self.path, self.overwrite = path, overwrite


class FileSystemReader:
    """A path holder, so ``storage_reader=dcp.FileSystemReader(path)`` keeps working."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        self.path = path


def _dcp_errors(fn):
    """Raise dckpt's errors as DCP's exception type (still CheckpointErrors)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CheckpointError as e:
            converted = as_dcp(e)
            if converted is e:
                raise
            raise converted from e

    return wrapper


class SaveFuture(cf.Future):
    """What :func:`async_save` returns: a real ``concurrent.futures.Future`` (frameworks
    check ``isinstance(f, Future)``: torchtitan does), resolved with the save's
    :class:`dckpt.CheckpointInfo` once it commits, or with its error as DCP's exception
    type (a CheckpointException that is also a CheckpointError). ``handle`` is dckpt's
    own :class:`dckpt.SaveHandle` of the same save (its blocking and staging times)."""

    handle: SaveHandle

    @classmethod
    def of(cls, handle: SaveHandle) -> "SaveFuture":
        fut = cls()
        fut.handle = handle
        fut.set_running_or_notify_cancel()

        def done(h: SaveHandle) -> None:  # the persist thread, or now when already over
            try:
                fut.set_result(h.result())
            except CheckpointError as e:
                fut.set_exception(as_dcp(e))
            except BaseException as e:  # noqa: BLE001 (any error belongs to the future)
                fut.set_exception(e)

        handle.add_done_callback(done)
        return fut


def _response(fut: SaveFuture) -> Any:
    """DCP's ``AsyncSaveResponse(staging_completion, upload_completion)``: the staging
    is already complete (dckpt snapshots in the call), the upload is ``fut``."""
    staged: cf.Future = cf.Future()
    staged.set_result(None)
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    except ImportError:  # an older torch: the same two fields
        return _AsyncSaveResponse(staged, fut)
    return AsyncSaveResponse(staging_completion=staged, upload_completion=fut)


@dataclass
class _AsyncSaveResponse:
    staging_completion: cf.Future
    upload_completion: cf.Future


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
        path = os.fspath(checkpoint_id)
    except TypeError:
        raise CheckpointError(f"dckpt.compat.dcp.{what}: checkpoint_id must be a str or "
                              f"os.PathLike, not {type(checkpoint_id).__name__}") from None
    if "://" in path and not path.startswith("file://"):
        import fsspec

        try:
            fsspec.get_filesystem_class(path.split("://", 1)[0])
        except (ValueError, ImportError) as e:
            raise StorageDetectionError(
                f"Cannot detect which StorageReader or StorageWriter to use for "
                f"checkpoint_id: {path}: no fsspec file system for it ({e})") from None
    return path


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


# ---------------------------------------------------------------- the API
@_dcp_errors
def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False, use_collectives: bool = True) -> CheckpointInfo:
    """DCP's ``save``: replaces the checkpoint at ``checkpoint_id`` atomically (unless
    ``storage_writer`` is a FileSystemWriter with ``overwrite=False``: then an existing
    checkpoint is an error). Collective, blocking I/O (see :func:`dckpt.save`); calls
    the Stateful values' ``state_dict()`` in sorted key order. Raises
    CheckpointException (also a CheckpointError) on every rank. A Hugging Face storage
    writer is DCP's own path, run by DCP (:func:`_hf`)."""
    if _hf(storage_writer):
        return torch_dcp.save(state_dict, checkpoint_id=checkpoint_id,
                                 storage_writer=storage_writer, planner=planner,
                                 process_group=process_group, no_dist=no_dist,
                                 use_collectives=use_collectives)
    out, path, group, overwrite = _to_save(state_dict, checkpoint_id, storage_writer,
                                           planner, process_group, no_dist, "save")
    return _save(out, path, process_group=group, overwrite=overwrite)


def _hf(storage: Any) -> bool:
    """Whether ``storage`` is one of DCP's Hugging Face storage writers/readers
    (torchtitan passes them for ``last_save_in_hf`` / ``initial_load_in_hf``). Those
    calls go to DCP itself, unchanged: the files are Hugging Face safetensors (with a
    JSON index), which DCP writes and reads without pickle, and a framework asking
    for that format gets exactly DCP's output. No I/O."""
    kinds = tuple(getattr(torch_dcp, n) for n in ("HuggingFaceStorageWriter",
                                                  "HuggingFaceStorageReader",
                                                  "QuantizedHuggingFaceStorageReader")
                  if hasattr(torch_dcp, n))
    return bool(kinds) and isinstance(storage, kinds)


def _to_save(state_dict: dict, checkpoint_id: Any, storage_writer: Any, planner: Any,
             process_group: Any, no_dist: bool, what: str) -> tuple[dict, str, Any, bool]:
    """(what dckpt saves, path, group, overwrite) for save/async_save. Collective: the
    ranks agree on a failure of the state's walk (a Stateful's ``state_dict()``
    included) before any of them starts the save. Raises CheckpointError."""
    path = _checkpoint_path(checkpoint_id, storage_writer, what)
    _check_planner(planner, what, "DefaultSavePlanner")
    group = _group(process_group, no_dist, what)
    out, err = None, None
    try:
        r = resolve(state_dict, what)
        out = r.target
        empties = empty_keys(out)  # they leave no leaf: a load needs them to load "[]"
        # one record per rank: ranks may hold different keys (torchtitan's dataloader
        # state has a dp_rank_<r> bytes key per rank), and one key written by every
        # rank would keep only one rank's record
        rank = Comm(group).rank
        if r.kinds:
            out[f"{BYTES_KEY}.{rank}"] = json.dumps(r.kinds, sort_keys=True)
        if empties:
            out[f"{EMPTY_KEY}.{rank}"] = json.dumps(empties)
    except Exception as e:
        err = e
    agree(Comm(group), err, f"{what} to {path}")
    return out, path, group, bool(getattr(storage_writer, "overwrite", True))


@_dcp_errors
def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None,
               async_checkpointer_type: Any = None, async_stager: Any = None,
               no_dist: bool = False, use_collectives: bool = True) -> Any:
    """DCP's ``async_save``: returns once the state is snapshotted (changing it after
    is safe). Returns a ``concurrent.futures.Future`` (:class:`SaveFuture`) whose
    ``result()`` waits for the commit, or, with an ``async_stager`` that stages
    asynchronously (DCP's DefaultStager with ``use_async_staging=True``, or another
    stager), DCP's ``AsyncSaveResponse(staging_completion, upload_completion)``, as DCP
    returns then (torchtitan's ``async_with_pinned_mem`` waits on the first before the
    optimizer step). The stager (DCP's ``DefaultStager``/``StagingOptions`` or any
    other) is accepted and its staging emulated: dckpt snapshots into its own reusable
    host buffers (pinned for CUDA tensors) during the call, so the staging completion
    is already done when this returns; the stager itself stays the caller's (DCP's
    contract: the caller closes it). Collective. Raises CheckpointException (also a
    CheckpointError): argument errors at once, save errors from ``result()``."""
    if _hf(storage_writer):
        kw = {} if async_checkpointer_type is None else {
            "async_checkpointer_type": async_checkpointer_type}
        return torch_dcp.async_save(state_dict, checkpoint_id=checkpoint_id,
                                       storage_writer=storage_writer, planner=planner,
                                       process_group=process_group, async_stager=async_stager,
                                       no_dist=no_dist, use_collectives=use_collectives, **kw)
    out, path, group, overwrite = _to_save(state_dict, checkpoint_id, storage_writer,
                                           planner, process_group, no_dist, "async_save")
    fut = SaveFuture.of(_async_save(out, path, process_group=group, overwrite=overwrite))
    return _response(fut) if _stages_async(async_stager) else fut


def _stages_async(stager: Any) -> bool:
    """Whether DCP would answer with an AsyncSaveResponse for ``stager``: it does when
    the stager's ``stage()`` returns a Future, which DCP's DefaultStager does with
    ``StagingOptions(use_async_staging=True)``; any other stager is taken to (a
    framework passes one for exactly that). No stager: a Future."""
    if stager is None:
        return False
    config = getattr(stager, "_config", None)
    return bool(getattr(config, "use_async_staging", True))


@_dcp_errors
def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: Any = None, planner: Any = None, process_group: Any = None,
         no_dist: bool = False) -> None:
    """DCP's ``load``: fills ``state_dict`` in place (see the module docstring).
    Collective. Steps: resolve the state (Stateful ``state_dict()`` calls, sorted);
    rank 0 reads the manifest for everyone; match the state against it with DCP's
    rules (:func:`~dckpt.compat.dcp_state.prepare_load`); the ranks agree on any
    failure so far (one small all-gather); :func:`dckpt.load` fills a parallel
    structure holding the caller's own tensors; the caller's containers are filled
    back and each Stateful's ``load_state_dict`` called, in sorted key order. One
    more walk of the state and one more manifest read than :func:`dckpt.load`; no
    copy of a tensor except dtype conversions. Raises CheckpointException (also a
    CheckpointError) on every rank: "Missing key in checkpoint state_dict: k.",
    "Size mismatch ...", integrity and manifest errors; what a Stateful's
    ``load_state_dict`` raises comes through as it is."""
    if _hf(storage_reader):  # DCP's own Hugging Face path (see _hf)
        torch_dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                          planner=planner, process_group=process_group, no_dist=no_dist)
        return
    path = _checkpoint_path(checkpoint_id, storage_reader, "load")
    partial = _check_planner(planner, "load", "DefaultLoadPlanner")
    group = _group(process_group, no_dist, "load")
    comm = Comm(group)
    err: BaseException | None = None
    r = None
    try:
        r = resolve(state_dict, "load")
    except Exception as e:
        err = e
    m = mf.parse(rank0_bytes(comm, lambda: _manifest_bytes(path), f"load from {path}"), path)
    prep = None
    if err is None:
        try:
            saved_kinds = records(m, BYTES_KEY, dict)
            saved = Saved(m, records(m, EMPTY_KEY, list))
            prep = prepare_load(r.target, m, saved_kinds, partial, saved, r.stateful)
        except Exception as e:
            err = e
    agree(comm, err, f"load from {path}")
    try:
        _load(r.target, path, process_group=group, strict=False, cast=True)
    finally:
        for container, k, v in prep.held:  # a Stateful's state_dict gets them back
            container[k] = v
    for t, tmp in prep.converted.values():
        with torch.no_grad():
            t.copy_(tmp)  # DCP's copy: any dtype to any dtype

    def get(key: str, old: Any) -> Any:
        if key in prep.kept:
            return old  # allow_partial_load: the checkpoint lacks it
        if key in prep.whole:
            return into(old, prep.whole[key])  # a plain value: replaced whole, as DCP does
        if key in prep.bytes_:
            return as_bytes(prep.bytes_[key], saved_kinds[key])
        if key in prep.replaced:
            return prep.replaced[key]  # was a meta tensor
        if isinstance(old, torch.Tensor):
            return old  # filled in place (or kept by allow_partial_load)
        # absent: a kept partial entry; a native save's bytes value comes back as bytes
        return sealed.user_value(m.values[key]) if key in m.values else old

    fill_back(state_dict, r.stateful, get, whole=prep.whole.keys() | prep.kept)


def _manifest_bytes(path: str) -> bytes:
    """Rank 0's read of the manifest; a DCP checkpoint (``.metadata``, no manifest)
    gets an error that says how to convert it."""
    storage, root = make_storage(path, None)
    try:
        return read_manifest_bytes(storage, root)
    except NotCommittedError:
        try:
            is_dcp = storage.exists(storage.join(root, ".metadata"))
        except Exception:
            is_dcp = False
        if is_dcp:
            raise NotCommittedError(
                f"{root} is a torch.distributed.checkpoint checkpoint (.metadata), not a "
                f"dckpt one: convert it once with `dckpt import {root} NEW_PATH` (it "
                "unpickles DCP's metadata: only for checkpoints you trust), then load "
                "NEW_PATH") from None
        raise


def save_state_dict(state_dict: dict[str, Any], storage_writer: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False,
                    planner: Any = None) -> CheckpointInfo:
    """DCP's deprecated ``save_state_dict``: :func:`save` with a storage writer."""
    return save(state_dict, storage_writer=storage_writer, process_group=process_group,
                no_dist=no_dist, planner=planner)


def load_state_dict(state_dict: dict[str, Any], storage_reader: Any, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False,
                    planner: Any = None) -> None:
    """DCP's deprecated ``load_state_dict``: :func:`load` with a storage reader."""
    load(state_dict, storage_reader=storage_reader, process_group=process_group,
         no_dist=no_dist, planner=planner)
