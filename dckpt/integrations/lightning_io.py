"""The dckpt side shared by the Lightning and Fabric strategies
(:mod:`dckpt.integrations.lightning`, :mod:`dckpt.integrations.fabric`): the
checkpoint's layout, its atomic placement under the name Lightning chose, its whole
removal, and the load that reshards.

Layout of one checkpoint (a dckpt checkpoint directory; ``dckpt ls/inspect/verify``
read it): the distributed module's sharded state under its key (``state_dict`` for the
Trainer, the user's key for Fabric), each optimizer's FQN-keyed state under its key
(``optimizer_0``...; the user's key for Fabric), both as torch's distributed
state_dict helpers give them (so any world size and sharding loads them), and
everything else under ``__lightning__`` (:mod:`.lightning_meta`: JSON in the manifest,
tensors, and only if needed a pickled leftover).

Placement (local paths): Lightning takes a folder for a checkpoint as soon as its name
exists (``ModelCheckpoint._find_last_checkpoints`` picks the newest ``last*.ckpt`` by
mtime and checks only that it exists). So a new name is written under a hidden sibling
``.<name>.dckpt-partial-<id>`` and renamed into place after the commit; a name that
already holds a committed dckpt checkpoint (``last.ckpt``, overwritten on every save)
is overwritten in place by dckpt's own atomic overwrite (the old manifest stays until
the new one commits). On object stores (no rename) the save goes to the name itself:
the manifest is the commit, a load of an uncommitted prefix raises NotCommittedError.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
import uuid
from typing import Any

import torch

from ..errors import CheckpointError, NotCommittedError, StateMismatchError
from ..format.manifest import MANIFEST_NAME
from ..storage.local import _fsync_dir  # fsync of a directory entry (the rename is durable)
from ..protocol.async_save import SaveHandle, async_save
from ..protocol.collectives import Comm, agree
from ..protocol.commit import save
from ..protocol.restore import load
from ..view.open import MissingKeyError
from . import lightning_meta

log = logging.getLogger(__name__)
META_KEY = "__lightning__"
PARTIAL = ".dckpt-partial-"
REMOVING = ".dckpt-removing-"


class BadStateError(CheckpointError, ValueError):
    """A state that cannot be saved or loaded as asked (no distributed module, two of
    them, a reserved key); a ValueError as Lightning's own check is."""


def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=strict)


class ModelState:
    """A (FSDP2/TP) module as a dckpt Stateful: torch's ``get_model_state_dict`` (the
    live sharded parameters, no copy) and ``set_model_state_dict``. ``state_dict()`` is
    computed once per object (the load's strictness check and its fill share it)."""

    def __init__(self, module: torch.nn.Module, strict: bool = True) -> None:
        self.module, self.strict = module, strict
        self._sd: dict | None = None

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self._sd is None:
            self._sd = get_model_state_dict(self.module)
        return self._sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, sd, options=_options(self.strict))


class OptimizerState:
    """An optimizer of a (FSDP2/TP) module as a dckpt Stateful: its state keyed by
    parameter name (torch's ``get_optimizer_state_dict``; a fresh optimizer's state is
    initialised first, by a zero-learning-rate step) and ``set_optimizer_state_dict``."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, optim_state_dict=sd)


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """Linux renameat2(2): True when done, False when the call or flag is unsupported
    (then the caller falls back). Raises OSError otherwise."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _rm(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _sweep(parent: str, name: str) -> None:
    """Remove what killed saves and removals of ``name`` left in ``parent``."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return
    for e in entries:
        if e.startswith(f".{name}{PARTIAL}") or (e.startswith(".") and REMOVING in e):
            _rm(os.path.join(parent, e))


def place(tmp: str, final: str) -> None:
    """Move the committed checkpoint ``tmp`` to ``final`` in one step: a rename when
    nothing is there, an atomic exchange (renameat2) with what is there (a stock
    checkpoint, a file) and then its removal. Local paths; blocking I/O (one rename and
    a directory fsync, plus the removal of what was replaced)."""
    parent = os.path.dirname(final) or "."
    if not os.path.lexists(final):
        if not _renameat2(tmp, final, 1):  # RENAME_NOREPLACE
            os.rename(tmp, final)
    elif _renameat2(tmp, final, 2):  # RENAME_EXCHANGE: the old one is now at tmp
        _rm(tmp)
    else:
        trash = os.path.join(parent, f".{os.path.basename(final)}{REMOVING}{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        _rm(trash)
    _fsync_dir(parent)


def remove_whole(path: str, storage_options: dict | None = None) -> None:
    """Remove the checkpoint at ``path`` whole (rank 0's job). Local: renamed to a
    hidden name first (one step: no half-removed folder ever carries the name), then
    deleted. Object stores: the manifest first (the rest is then an uncommitted
    leftover no load takes), then the prefix. Missing: nothing. Blocking I/O."""
    if is_url(path):
        from fsspec.core import url_to_fs

        fs, p = url_to_fs(path, **(storage_options or {}))
        man = p.rstrip("/") + "/" + MANIFEST_NAME
        if fs.exists(man):
            fs.rm(man)
        if fs.exists(p):
            fs.rm(p, recursive=True)
        return
    path = _local(path)
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        parent, name = os.path.split(os.path.abspath(path))
        trash = os.path.join(parent, f".{name}{REMOVING}{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.remove(path)
    log.debug("removed checkpoint %s", path)


def kind(path: str, storage_options: dict | None = None) -> str:
    """"dckpt" (a committed dckpt checkpoint), "other" (a file, or a folder holding
    Lightning's ``meta.pt``: a stock checkpoint) or "none" (nothing complete: missing,
    or a dckpt save that never committed). Blocking I/O (a few stats)."""
    if is_url(path):
        from fsspec.core import url_to_fs

        fs, p = url_to_fs(path, **(storage_options or {}))
        p = p.rstrip("/")
        if fs.exists(p + "/" + MANIFEST_NAME):
            return "dckpt"
        return "other" if fs.isfile(p) or fs.exists(p + "/meta.pt") else "none"
    path = _local(path)
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return "dckpt"
    return "other" if os.path.isfile(path) or os.path.isfile(os.path.join(path, "meta.pt")) \
        else "none"


class Committer:
    """Saves, loads and removes dckpt checkpoints under the names Lightning gives; one
    per strategy. ``async_save``: a save returns once its snapshot is started (the
    fenced optimizers' next ``step()`` waits for the copy), commits in the background
    and is renamed into place there; removals asked for meanwhile run after that
    commit, so an older checkpoint is never deleted before a newer one exists."""

    def __init__(self, storage_options: dict | None = None, async_save: bool = False,
                 compression: str | None = None) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise CheckpointError(f"storage_options must be a dict, got {storage_options!r}")
        if compression not in (None, "zstd", "lz4"):
            raise CheckpointError(f"compression must be None, 'zstd' or 'lz4', got {compression!r}")
        self.storage_options = storage_options
        self.async_save = bool(async_save)
        self.compression = compression
        self._handle: SaveHandle | None = None
        self._placed = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[str] = []  # removals waiting for the save in flight
        self._error: BaseException | None = None  # rank 0's error placing/removing

    # ------------------------------------------------------------------ saving
    def save(self, tree: dict, path: str, *, fence: list | None = None,
             storage_options: dict | None = None) -> None:
        """Commit ``tree`` (a dckpt state) as the checkpoint ``path`` (rank 0's path is
        used). Collective. Synchronous: returns after the commit and the rename into
        place; asynchronous: after the snapshot (see the class). Raises the commit's
        CheckpointError on every rank alike (an asynchronous save's error is raised by
        the next :meth:`save` or :meth:`finish`); nothing is placed then."""
        self.finish()
        comm = Comm()
        opts = {**(self.storage_options or {}), **(storage_options or {})} or None
        plan, err = None, None
        if comm.rank == 0:
            try:
                plan = self._plan(path, opts)
            except Exception as e:
                err = e
        agree(comm, err, f"save to {path}")
        final, target, staged = _broadcast(comm, plan)
        kw = dict(overwrite=not staged, storage_options=opts, compression=self.compression)
        if not self.async_save:
            save(tree, target, **kw)
            err = None
            if comm.rank == 0 and staged:
                try:
                    place(target, final)
                except Exception as e:
                    err = e
            agree(comm, err, f"move {target} to {final}")
            return
        self._placed.clear()
        handle = async_save(tree, target, fence=fence or None, **kw)
        self._handle = handle

        def done(h: SaveHandle) -> None:
            ok = h.exception() is None
            try:
                if ok and staged and comm.rank == 0:
                    place(target, final)
            except Exception as e:  # raised on every rank by the next finish()
                log.error("after the save to %s: %s", final, e)
                self._error, ok = e, False
            with self._lock:  # remove() queues or removes under the same lock
                todo, self._pending = self._pending, []
                try:
                    if ok:
                        for p in todo:
                            remove_whole(p, self.storage_options)
                    elif todo:
                        log.warning("save to %s failed: the %d checkpoint(s) to remove "
                                    "after it are kept: %s", final, len(todo), todo)
                except Exception as e:
                    log.error("removing %s after the save to %s: %s", todo, final, e)
                    self._error = self._error or e
                finally:
                    self._placed.set()

        handle.add_done_callback(done)

    def _plan(self, path: str, opts: dict | None) -> tuple[str, str, bool]:
        """Rank 0: (final, where to save, staged?). Sweeps leftovers of this name."""
        if is_url(path):
            return path, path, False
        final = os.path.abspath(_local(path))
        parent, name = os.path.split(final)
        os.makedirs(parent, exist_ok=True)
        _sweep(parent, name)
        if kind(final) == "dckpt" and not os.path.islink(final):  # never through a link
            return final, final, False
        return final, os.path.join(parent, f".{name}{PARTIAL}{uuid.uuid4().hex[:12]}"), True

    def finish(self) -> None:
        """Wait for the asynchronous save in flight (its commit and placement) and raise
        its error, or a placement's or removal's, on every rank. Collective when a save
        was in flight (every rank has one then); else a no-op."""
        h, self._handle = self._handle, None
        if h is None:
            return
        h.result()  # the commit's error: the same on every rank
        self._placed.wait()
        err, self._error = self._error, None
        agree(Comm(), err, f"finish the save to {h.path}")

    def remove(self, path: str, is_rank0: bool) -> None:
        """Remove the checkpoint at ``path`` whole, on rank 0 (others: no-op). With a
        save in flight, after it commits. Not collective; blocking I/O."""
        if not is_rank0:
            return
        with self._lock:
            if self._handle is not None and not self._placed.is_set():
                self._pending.append(path)
                return
        remove_whole(path, self.storage_options)

    # ------------------------------------------------------------------ loading
    def load(self, target: dict, path: str, *, strict: bool, modules: list[str],
             weights_only: bool | None = None) -> tuple[Any, dict]:
        """Fill ``target`` ({key: ModelState | OptimizerState}) from the checkpoint at
        ``path`` and return (the Lightning metadata, its role table). Collective.
        ``strict``: the checkpoint must hold every key of ``target`` and every parameter
        of each ModelState, and no parameter of those modules that they lack (checked
        against the manifest before any byte is read); else what is missing stays as it
        is, and extra parameters are ignored. Keys of the checkpoint not asked for are
        ignored (a partial load). Raises on every rank alike: NotCommittedError (no
        committed checkpoint there), MissingKeyError (a requested key the checkpoint
        lacks), StateMismatchError (parameters, shapes, dtypes), IntegrityError."""
        self.finish()
        found: dict[str, Any] = {}

        def extra(m) -> dict:
            tops = {k.split(".", 1)[0] for k in (*m.tensors, *m.values)}
            for key in list(target):
                if key not in tops:
                    if strict:
                        raise MissingKeyError(
                            f"checkpoint {path} has no entry {key!r} that the state asks "
                            "for (pass strict=False to skip it)")
                    del target[key]  # not loaded at all (no empty set_state_dict call)
            if strict:
                for key in modules:
                    obj = target.get(key)
                    if isinstance(obj, ModelState):
                        have = {f"{key}.{k}" for k in obj.state_dict()}
                        extra_keys = sorted(k for k in (*m.tensors, *m.values)
                                            if k.startswith(key + ".") and k not in have)
                        if extra_keys:
                            raise StateMismatchError(
                                f"checkpoint {path} holds {len(extra_keys)} entries the model "
                                f"{key!r} lacks, e.g. {extra_keys[:4]} (strict loading; "
                                "pass strict=False to ignore them)")
            meta = lightning_meta.target(m, META_KEY)
            found["meta"] = meta
            return {META_KEY: meta} if meta is not None else {}

        try:
            load(target, path, storage_options=self.storage_options, strict=False,
                 allow_missing=not strict, extra=extra)
        except CheckpointError as e:  # every rank raised it in extra(): keep its type
            if isinstance(e.__cause__, MissingKeyError):
                raise MissingKeyError(str(e.__cause__)) from None
            raise
        enc = found.get("meta")
        if enc is None:
            raise NotCommittedError(f"{path} is a dckpt checkpoint without Lightning's "
                                    f"metadata ({META_KEY}): not saved by this strategy")
        doc = lightning_meta.decode(enc, path, weights_only)
        if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict):
            raise CheckpointError(f"{path}: Lightning metadata is not a dict")
        return doc["meta"], doc


def _broadcast(comm: Comm, obj: Any) -> Any:
    """Rank 0's small JSON-able ``obj`` on every rank (one broadcast)."""
    import json

    data = comm.broadcast_bytes(json.dumps(obj).encode() if comm.rank == 0 else None)
    return json.loads(data)


def meta_entry(meta: dict, modules: list[str], optimizers: list[str]) -> dict:
    """The ``__lightning__`` entry for ``meta`` (rank 0 saves it): the metadata and
    which keys hold modules and optimizers."""
    return lightning_meta.encode({"meta": meta, "modules": list(modules),
                                  "optimizers": list(optimizers)})
