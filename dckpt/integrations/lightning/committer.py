"""The dckpt side shared by the Lightning and Fabric strategies
(:mod:`dckpt.integrations.lightning`, :mod:`dckpt.integrations.fabric`): the
checkpoint's layout, its atomic placement under the name Lightning chose, its whole
removal, and the load that reshards.

Layout of one checkpoint (a dckpt checkpoint directory; ``dckpt ls/inspect/verify``
read it): the distributed module's sharded state under its key (``state_dict`` for the
Trainer, the user's key for Fabric), each optimizer's FQN-keyed state under its key
(``optimizer_0``...; the user's key for Fabric), both as torch's distributed
state_dict helpers give them (so any world size and sharding loads them), and
everything else under ``__lightning__`` (:mod:`.meta`: JSON in the manifest,
tensors, and only if needed a pickled leftover).

Placement (local paths): Lightning takes a folder for a checkpoint as soon as its name
exists (``ModelCheckpoint._find_last_checkpoints`` picks the newest ``last*.ckpt`` by
mtime and checks only that it exists). So a new name is written under a hidden sibling
``.<name>.dckpt-partial-<id>`` and renamed into place after the commit; a name that
already holds a committed dckpt checkpoint (``last.ckpt``, overwritten on every save)
is overwritten in place by dckpt's own atomic overwrite (the old manifest stays until
the new one commits). On object stores (no rename) the save goes to the name itself:
the manifest is the commit, a load of an uncommitted prefix raises NotCommittedError.
The file-system side of this is :mod:`dckpt.integrations.common.place`.

With ``local_root`` (:mod:`..common.tier`), a save commits on every node's own disk
and its copy to the name runs in the background; a load reads the node-local copy
when every rank holds it and it is not older than the name's durable copy.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError, NotCommittedError, StateMismatchError
from ...protocol.async_save import SaveHandle, async_save
from ...protocol.collectives import Comm, agree, on_rank0, rank0_bytes
from ...protocol.commit import save
from ...manager.restore import failure_causes
from ...protocol.restore import load
from ...protocol.settings import agree_settings
from ...tiers.chooser import fallback_worthy
from ...view.open import MissingKeyError
from . import meta as lightning_meta
from .state import BadStateError, ModelState, OptimizerState  # noqa: F401
from ..common.place import (PARTIAL, durable_name, durable_stamp,  # noqa: F401
                              is_url, join, kind, link_target, local_path, place,
                              place_agreed, remove_whole, stamp, sweep)
from ..common.exit import abandoned, watch
from ..common.tier import PARENT_KEY, LocalTier

log = logging.getLogger(__name__)
META_KEY = "__lightning__"
# After the training failed on this rank: how long its teardown waits for the save in
# flight (which the other ranks may be unable to finish) before giving up on it.
ABANDON_WAIT_S = float(os.environ.get("DCKPT_ABANDON_WAIT_S", "60"))
class Committer:
    """Saves, loads and removes dckpt checkpoints under the names Lightning gives; one
    per strategy. ``async_save``: a save returns once its snapshot is started (the
    fenced optimizers' next ``step()`` waits for the copy), commits in the background
    and is renamed into place there; removals asked for meanwhile run after that
    commit, so an older checkpoint is never deleted before a newer one exists."""

    def __init__(self, storage_options: dict | None = None, async_save: bool = False,
                 compression: str | None = None, local_root: str | None = None,
                 keep_last_local: int = 2) -> None:
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
        self._agreed: Any = None  # the default group the settings were agreed in
        # the fast tier: saves commit node-locally, copies to the names run behind
        self.tier = (LocalTier(local_root, keep_last_local, storage_options, compression)
                     if local_root is not None else None)

    # ------------------------------------------------------------------ saving
    def save(self, tree: dict, path: str, *, fence: list | None = None,
             storage_options: dict | None = None, step: int = 0) -> None:
        """Commit ``tree`` (a dckpt state) as the checkpoint ``path`` (rank 0's path is
        used). Collective. Synchronous: returns after the commit and the rename into
        place; asynchronous: after the snapshot (see the class). Raises the commit's
        CheckpointError on every rank alike (an asynchronous save's error is raised by
        the next :meth:`save` or :meth:`finish`); nothing is placed then. With the fast
        tier: returns after the local commit (asynchronous: after copying the state to
        host buffers); the copy to ``path`` runs behind (``step``: recorded in the
        local commit)."""
        comm = Comm()
        self._agree(comm)
        self.finish()
        opts = {**(self.storage_options or {}), **(storage_options or {})} or None
        if self.tier is not None:
            final = _broadcast(comm, durable_name(path) if comm.rank == 0 else None)
            if comm.rank == 0 and not is_url(final):
                # the checkpoint's folder exists from the save on, as with stock's
                # TorchCheckpointIO (Lightning's save_last="link" links in it at once,
                # before the durable copy lands)
                try:
                    os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
                except OSError as e:  # the copy reports the store's error
                    log.warning("cannot create %s: %s", os.path.dirname(final), e)
            tree = _share_meta(comm, tree)
            parent = self.tier.seen.get(final)
            if comm.rank == 0 and parent is not None:
                tree = {**tree, PARENT_KEY: parent}
            self.tier.save(tree, final, step, lambda: self._plan(final, opts),
                           async_=self.async_save, storage_options=opts)
            return
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
            place_agreed(comm, target, final, staged)
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

    def _agree(self, comm: Comm) -> None:
        """On the first collective call (and after a new default group): the settings
        that shape the collectives (the fast tier on or off, ``async_save``,
        ``compression``) are the same on every rank, or every rank raises the same
        CheckpointError naming them, instead of entering different collectives (a
        hang) or staging copies that never commit. One all-gather."""
        world = _world()
        if self._agreed is not None and world is self._agreed:
            return
        agree_settings(comm, {"local_root given": self.tier is not None,
                              "async_save": self.async_save,
                              "compression": self.compression}, None,
                       "dckpt's Lightning/Fabric strategy")
        self._agreed = world

    def _plan(self, path: str, opts: dict | None) -> tuple[str, str, bool]:
        """Rank 0: (final, where to save, staged?). Sweeps leftovers of this name."""
        if is_url(path):
            return path, path, False
        final = os.path.abspath(local_path(path))
        parent, name = os.path.split(final)
        os.makedirs(parent, exist_ok=True)
        sweep(parent, name)
        if kind(final) == "dckpt" and not os.path.islink(final):  # never through a link
            return final, final, False
        return final, os.path.join(parent, f".{name}{PARTIAL}{uuid.uuid4().hex[:12]}"), True

    def finish(self, drain: bool = False) -> None:
        """Wait for the asynchronous save in flight (its commit and placement) and raise
        its error, or a placement's or removal's, on every rank. Collective when a save
        was in flight (every rank has one then); else a no-op. With the fast tier: the
        local commit in flight, and with ``drain`` every copy and removal queued too
        (a copy's failure is logged, not raised: that name stays local only)."""
        if self.tier is not None:
            (self.tier.drain if drain else self.tier.wait_local)()
            return
        h, self._handle = self._handle, None
        if h is None:
            return
        h.result()  # the commit's error: the same on every rank
        self._placed.wait()
        err, self._error = self._error, None
        agree(Comm(), err, f"finish the save to {h.path}")

    def abandon(self, timeout: float = ABANDON_WAIT_S) -> None:
        """After a failure of the training (this rank raised): wait up to ``timeout``
        seconds for the save in flight, then stop waiting. Enters no collective on the
        training's process group (the other ranks may still be training: a collective
        here would pair with theirs and abort them, hiding this rank's error; the
        background commit runs on dckpt's own group). Never raises: the training's
        error is the one the user must see; the save's fate is logged."""
        try:
            if self.tier is not None:
                self.tier.abandon(timeout)
                return
            h, self._handle = self._handle, None
            if h is None:
                return
            try:
                h.result(timeout)
            except cf.TimeoutError:
                log.error("the checkpoint save to %s did not finish within %.0f s of the "
                          "training's failure: not waited for (it is not placed unless it "
                          "commits)", h.path, timeout)
                abandoned(lambda: not h.done())
                return
            self._placed.wait(timeout)
        except Exception as e:
            log.error("the checkpoint save in flight when the training failed: %s", e)

    def watch(self) -> None:
        """Fail the process at exit (status 1) if an asynchronous save of this
        Committer failed and nothing waited for it (:meth:`unobserved_error`)."""
        watch(self)

    def unobserved_error(self) -> BaseException | None:
        """Wait for the save in flight (and with the fast tier, the local commit; the
        durable copies' failures are logged, by design) and return its error, or one
        kept that no call raised yet. Not collective; blocking."""
        if self.tier is not None:
            try:
                self.tier.wait_local(raise_error=True)
            except BaseException as e:
                return e
            return None
        h, self._handle = self._handle, None
        if h is None:
            return None
        e = h.exception()
        if e is None:
            self._placed.wait()
            e, self._error = self._error, None
        return e

    def remove(self, path: str, is_rank0: bool) -> None:
        """Remove the checkpoint at ``path`` whole, on rank 0 (others: no-op). With a
        save in flight, after it commits. Not collective; blocking I/O. With the fast
        tier (every rank calls it, as Lightning does): this rank's part of the local
        copy too, in the copy thread after the copies queued before; not blocking."""
        if self.tier is not None:
            self.tier.remove(durable_name(path), (lambda: remove_whole(
                path, self.storage_options)) if is_rank0 else None)
            return
        if not is_rank0:
            return
        with self._lock:
            if self._handle is not None and not self._placed.is_set():
                self._pending.append(path)
                return
        remove_whole(path, self.storage_options)

    # ------------------------------------------------------------------ loading
    def resolve(self, path: str) -> "Source":
        """Where the checkpoint named ``path`` (rank 0's) is read from. Collective (a
        broadcast; with the fast tier an all-gather too). Waits for the saves in flight
        (copies included) first. Blocking I/O on rank 0 (a few stats; with the fast
        tier the name's manifest). Raises what they raise, on every rank alike."""
        comm = Comm()
        self._agree(comm)
        self.finish(drain=True)
        opts = self.storage_options
        # a link (save_last="link") stands for the name it points at, which may be
        # complete only in the fast tier
        path = link_target(str(path)) or str(path)

        def durable() -> list:
            found = kind(path, opts)
            return [found, durable_stamp(path, found, opts) if self.tier else None]

        found, dstamp = on_rank0(comm, durable, f"look up the checkpoint {path}")
        spath = _broadcast(comm, path if comm.rank == 0 else None)
        if self.tier is None:
            return Source(found, spath, opts)
        held = self.tier.held(_broadcast(comm, durable_name(spath) if comm.rank == 0
                                         else None), comm)
        if dstamp is not None and found == "dckpt":
            self.tier.seen[durable_name(spath)] = dstamp[0]
        # the node-local copy unless the name holds another commit saved since (a run
        # on other nodes; a stock checkpoint written after it): never an older step
        # resurrected over a newer one, nor a newer local commit hidden by an older
        # stock checkpoint of the same name (a run moving to this strategy)
        if held is not None and held.newer_than(dstamp):
            if comm.rank == 0:
                log.info("loading %s from the fast tier %s", spath, held.slot)
            durable_src = Source(found, spath, opts) if found == "dckpt" else None
            return Source("dckpt", held.slot, None, _view_name(comm.rank), durable_src)
        return Source(found, spath, opts)

    def resolve_last(self, candidates: list[str], dirs: list[str]) -> str | None:
        """The name ``ckpt_path="last"`` resumes (:func:`.last.resolve_last`).
        Collective."""
        from .last import resolve_last

        comm = Comm()
        self._agree(comm)
        self.finish(drain=True)
        return resolve_last(comm, self.tier, self.storage_options, candidates, dirs)

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
        lacks), StateMismatchError (parameters, shapes, dtypes), IntegrityError.
        ``path`` may be a :class:`Source` from :meth:`resolve`."""
        src = path if isinstance(path, Source) else self.resolve(path)
        try:
            return self._load(target, src, strict, modules, weights_only)
        except Exception as e:  # raised on every rank alike: every rank falls back
            if src.fallback is None or not fallback_worthy(e):
                raise
            if Comm().rank == 0:
                log.warning("the fast tier's copy of %s could not be loaded (%s): loading "
                            "its durable copy", src.fallback.path, failure_causes(e))
            return self._load(target, src.fallback, strict, modules, weights_only)

    def _load(self, target: dict, src: "Source", strict: bool, modules: list[str],
              weights_only: bool | None) -> tuple[Any, dict]:
        path = src.path
        found: dict[str, Any] = {}

        def extra(m) -> dict:
            for key in list(target):
                # the user's key may hold dots ("opt.main"): an entry is under it when
                # it is the key or starts with the key and a dot
                if not _has_entry(m, str(key)):
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
            load(target, path, storage_options=src.storage_options, strict=False,
                 allow_missing=not strict, extra=extra, manifest_name=src.manifest_name)
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


@dataclass(frozen=True)
class Source:
    """Where a load reads: ``kind`` as :func:`kind` says of the name ("dckpt",
    "other": a stock checkpoint, "none"), the path, its fsspec options, and the
    manifest each rank reads (None: ``manifest.json``; the fast tier: its own view), and
    for the fast tier the name's durable copy (None: none committed), read when the
    fast tier's cannot be (a file damaged or missing on some node, found at read time)."""

    kind: str
    path: str
    storage_options: dict | None = None
    manifest_name: str | None = None
    fallback: "Source | None" = None

    def manifest(self, rank: int) -> Any:
        """This source's manifest as ``rank`` reads it (parsed). Blocking I/O."""
        from ...format import manifest as mf
        from ...protocol.restore import read_manifest_bytes
        from ...storage.fsspec_storage import make_storage

        storage, root = make_storage(self.path, self.storage_options)
        name = self.manifest_name or mf.MANIFEST_NAME
        return mf.parse(read_manifest_bytes(storage, root, name), f"{self.path}/{name}")


def _has_entry(manifest: Any, key: str) -> bool:
    """Whether ``manifest`` holds an entry under the top-level ``key`` (which may
    contain dots). O(entries) once per key; no I/O."""
    head = key + "."
    return any(k == key or k.startswith(head) for k in (*manifest.tensors, *manifest.values))


def _world() -> Any:
    """The default process group (None without one), to notice a new one."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _view_name(rank: int) -> str:
    from ...tiers.local import view_name

    return view_name(rank)


def _broadcast(comm: Comm, obj: Any) -> Any:
    """Rank 0's small JSON-able ``obj`` on every rank (one broadcast)."""
    import json

    data = comm.broadcast_bytes(json.dumps(obj).encode() if comm.rank == 0 else None)
    return json.loads(data)


def _share_meta(comm: Comm, tree: dict) -> dict:
    """``tree`` with rank 0's ``__lightning__`` entry on every rank (one broadcast), for
    a fast-tier save: every rank then holds the metadata (ModelCheckpoint's score
    tensors, the pickled leftovers) in its own node's files, as a replica, and a load
    from the fast tier reads it there (with a local_root per node, rank 0's files are
    on rank 0's node only). The durable copy is unchanged: one copy, written by one
    rank. Raises rank 0's error on every rank alike."""
    if comm.size == 1:
        return tree
    data = rank0_bytes(comm, lambda: lightning_meta.to_bytes(tree.get(META_KEY)),
                       "share the Lightning metadata")
    if comm.rank == 0:
        return tree
    entry = lightning_meta.from_bytes(data)
    return tree if entry is None else {**tree, META_KEY: entry}


def meta_entry(meta: dict, modules: list[str], optimizers: list[str]) -> dict:
    """The ``__lightning__`` entry for ``meta`` (rank 0 saves it): the metadata and
    which keys hold modules and optimizers."""
    return lightning_meta.encode({"meta": meta, "modules": list(modules),
                                  "optimizers": list(optimizers)})
