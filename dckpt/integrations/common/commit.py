"""A checkpoint's commit under its final name: planned under a hidden sibling, saved
(synchronously or in the background), placed by a rename once committed, then the
adapter's after-commit work (rotation) on rank 0. Local disks: the name appears only
complete; object stores: the manifest is the commit (no staging).

Call order (every rank): :meth:`Committer.plan` (collective), write anything extra
into ``plan.target`` (a framework's pre-hooks), :meth:`Committer.commit`
(collective); :meth:`Committer.finish` waits for an asynchronous one and raises its
error on every rank."""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ... import _faults
from ...errors import CheckpointError
from ...protocol.async_save import SaveHandle, async_save
from ...protocol.collectives import Comm, agree, on_rank0
from ...protocol.commit import save
from .exit import watch
from ...format.manifest import MANIFEST_NAME
from .place import PARTIAL, is_url, local_path, place, sweep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Where a save goes: ``final`` (the name), ``target`` (where dckpt writes: a
    hidden sibling when ``staged``, else ``final``), ``lease`` (the planning intent in
    ``target``, removed once committed; None on object stores)."""

    final: str
    target: str
    staged: bool
    lease: str | None = None


def _planning_lease(folder: str) -> str:
    """Mark the new staging ``folder`` in use from its creation: a save intent of this
    process (:mod:`dckpt.protocol.intent`'s format; no heartbeat), so another job's
    sweep of the same parent never removes it between the plan and the save's own
    intent (files written there before the save, e.g. trainer_state.json, would be lost
    silently). It expires with the lease, or at once once this process is gone.
    Returns its path. Local I/O: one small file."""
    import socket
    import time

    from ...protocol.intent import intent_name

    path = os.path.join(folder, intent_name(uuid.uuid4().hex[:16]))
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.time(), "planned": True}, f)
    return path


# a framework's own checkpoint in the folder at the name (Accelerate's, the Trainer's,
# DeepSpeed's): carried into a dckpt checkpoint, its stale pickles would be loaded by the
# stock class later, mixed with the new state. Refused instead (the user moves it away).
STOCK_MARKERS = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state.pth",
                 "random_states_0.pkl", "pytorch_model_fsdp_0", "optimizer_0", "latest")


def _check_replaceable(path: str) -> None:
    """A save's staged folder is renamed over what is at ``path``, and the files there
    that dckpt did not write move into it (:func:`.place.place` with ``adopt``): a
    subclass's or a callback's files written into the name before the save stay. So
    any folder is taken but one that holds a committed dckpt checkpoint below it (a
    parent of checkpoints: the new one would swallow them) or a framework's own
    checkpoint (:data:`STOCK_MARKERS`: its stale state would sit beside the new one);
    a file or a link at ``path`` is refused too. Never deletes. Local I/O: a stat, a
    listing, and a stat per entry two levels down. Raises CheckpointError naming ``path``."""
    if not os.path.lexists(path):
        return
    why = None
    if os.path.islink(path) or not os.path.isdir(path):
        why = "is not a folder"
    else:
        names = os.listdir(path)
        stock = sorted(set(names) & set(STOCK_MARKERS))
        nested = [n for n in names if os.path.isdir(os.path.join(path, n)) and (
            os.path.isfile(os.path.join(path, n, MANIFEST_NAME)) or any(
                os.path.isfile(os.path.join(path, n, m, MANIFEST_NAME))
                for m in _subdirs(os.path.join(path, n))))]
        ours = MANIFEST_NAME in names and _is_dckpt_manifest(path)
        if MANIFEST_NAME in names and not ours:
            why = (f"holds a {MANIFEST_NAME} that is not a dckpt manifest (a save would "
                   "replace it)")
        elif stock and not ours:
            why = f"holds a framework's own checkpoint ({', '.join(stock)})"
        elif nested:
            why = f"holds dckpt checkpoints ({', '.join(sorted(nested)[:3])})"
    if why is not None:
        raise CheckpointError(
            f"{path} exists and {why}: a save replaces that folder, so it would mix or "
            "swallow what is there. Save into a new folder (or an existing dckpt "
            "checkpoint, which is replaced atomically), or move that folder away")


def _is_dckpt_manifest(path: str) -> bool:
    """Whether ``path``'s manifest file parses as a dckpt manifest. Local I/O: one read
    (bounded by the manifest reader's cap)."""
    from .place import read_manifest

    try:
        read_manifest(path)
        return True
    except Exception:
        return False


def _subdirs(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


class Committer:
    """Commits trees under names, one save in flight at most. ``async_save``: a
    commit returns after the snapshot (the ``fence`` optimizers' next ``step()`` waits
    for the copy); the commit, placement and ``after`` run in the background and
    :meth:`finish` raises their error. ``markers``: names of files a framework puts
    in a folder before it calls the save, never kept in the placed checkpoint (every
    other file found at the name is: :func:`.place.place`). Raises CheckpointError on a bad option."""

    def __init__(self, storage_options: dict | None = None, async_save: bool = False,
                 compression: str | None = None, markers: tuple[str, ...] = ()) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise CheckpointError(f"storage_options must be a dict, got {storage_options!r}")
        if compression not in (None, "zstd", "lz4"):
            raise CheckpointError(f"compression must be None, 'zstd' or 'lz4', got {compression!r}")
        if not isinstance(async_save, bool):
            raise CheckpointError(f"async_save must be a bool, got {async_save!r}")
        self.storage_options, self.async_save = storage_options, async_save
        self.compression, self.markers = compression, tuple(markers)
        self._handle: SaveHandle | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        # the run's timeline (tiers.chooser.timeline_of): the newest time a commit of
        # this run had on it, and that commit's save id. A commit records them, so its
        # place follows what the run reached, whatever rank 0's clock says.
        self._newest: float | None = None
        self._parent: str | None = None

    def __getstate__(self) -> dict:
        # a copy (a pickled accelerator in a dataloader worker) has no save in flight
        d = dict(self.__dict__)
        d.update(_handle=None, _done=None, _error=None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._done = threading.Event()

    def saw(self, timeline: float, save_id: str) -> None:
        """A checkpoint of the run was loaded (its time on the timeline, its save id):
        the next commit continues it, ordered after it even when this host's clock is
        behind. No I/O."""
        self._newest = timeline if self._newest is None else max(self._newest, timeline)
        self._parent = save_id or self._parent

    def stamp(self, tree: dict, rank: int) -> dict:
        """``tree`` with the timeline values (``manager.after``: just past the newest
        commit this run has seen; ``manager.parent``) on rank 0. No I/O."""
        if rank != 0 or self._newest is None:
            return tree
        manager: dict = {"after": self._newest + 1e-3}
        if self._parent:
            manager["parent"] = self._parent
        return {**tree, "manager": manager}

    def _committed(self, save_id: str | None) -> None:
        # this commit's timeline time is at least "after" and at most now
        import time as _time

        now = _time.time()
        after = (self._newest + 1e-3) if self._newest is not None else now
        self._newest = max(now, after)
        self._parent = save_id or self._parent

    def plan(self, final: str) -> Plan:
        """Rank 0 decides where the save of ``final`` goes (and, locally, creates the
        hidden staging folder and sweeps what killed saves left beside it); every rank
        gets the same Plan. Waits for the save in flight first (:meth:`finish`).
        Collective (a broadcast); blocking I/O on rank 0. Raises rank 0's error on every
        rank."""
        comm = Comm()
        self.finish()  # one save at a time: the sweep never races a save in flight
        return Plan(*on_rank0(comm, lambda: self.decide(final), f"plan the checkpoint {final}"))

    def decide(self, final: str) -> list:
        """Rank 0's part of :meth:`plan`: [final, target, staged, lease]. Not
        collective; blocking I/O (local: a check of what is at ``final``, a sweep of
        its parent, the staging folder and its lease). Raises CheckpointError when
        ``final`` holds something a save may not replace, OSError."""
        if is_url(final):
            return [final.rstrip("/"), final.rstrip("/"), False]
        path = os.path.abspath(local_path(final))
        parent, name = os.path.split(path)
        _check_replaceable(path)
        os.makedirs(parent, exist_ok=True)
        sweep(parent, name)
        tmp = os.path.join(parent, f".{name}{PARTIAL}{uuid.uuid4().hex[:12]}")
        os.makedirs(tmp)
        return [path, tmp, True, _planning_lease(tmp)]

    def commit(self, tree: dict, plan: Plan, *, fence: list | None = None,
               after: Callable[[], None] | None = None, side: Any = None,
               prepare: Callable[[str], None] | None = None,
               placed: Callable[[str], None] | None = None) -> None:
        """Commit ``tree`` at ``plan.target``, place it at ``plan.final``, then run
        ``after()`` on rank 0 (its error is raised on every rank). ``side``: the save's
        :class:`dckpt.SideFile`; ``prepare(target)``: rank 0, once committed and before
        the placement (files derived from the commit, e.g. a model folder's index: the
        name appears with them); ``placed(save_id)``: every rank, once the commit
        succeeded (synchronous: after the placement; asynchronous: in the background,
        possibly before rank 0's placement: see the callee). Collective.
        Synchronous: all of it before returning; raises the commit's CheckpointError
        on every rank alike (nothing is placed then). Asynchronous: returns after the
        snapshot; :meth:`finish` raises. Blocking I/O: the writes (each rank its
        shards), one rename and ``after`` on rank 0."""
        comm = Comm()
        self.finish()
        kw = dict(storage_options=self.storage_options, compression=self.compression)
        if side is not None:
            kw["side"] = side
        tree = self.stamp(tree, comm.rank)
        if not self.async_save:
            info = save(tree, plan.target, **kw)
            self._committed(getattr(info, "save_id", None))
            err = None
            if comm.rank == 0:
                try:
                    self._place(plan, after, prepare)
                except Exception as e:
                    err = e
            agree(comm, err, f"place the checkpoint {plan.final}")
            if placed is not None:
                placed(getattr(info, "save_id", ""))
            return
        self._done.clear()
        self._error = None
        handle = async_save(tree, plan.target, fence=fence or None, **kw)
        self._handle = handle
        made = False
        if plan.staged and comm.rank == 0 and not os.path.lexists(plan.final):
            # the name a save returns exists at once, as stock's (a script writes into
            # it); the placement keeps what is written there (place's adoption)
            try:
                os.makedirs(plan.final)
                made = True
            except OSError as e:
                log.warning("cannot create %s before its placement: %s", plan.final, e)
        watch(self)  # a failed save nobody waits for fails the process at exit

        def done(h: SaveHandle) -> None:
            try:
                if h.exception() is None:
                    self._committed(getattr(h.result(), "save_id", None))
                if h.exception() is None and comm.rank == 0:
                    self._place(plan, after, prepare)
                if h.exception() is None and placed is not None:
                    placed(getattr(h.result(), "save_id", ""))
            except Exception as e:  # raised on every rank by the next finish()
                log.error("after the commit of %s: %s", plan.final, e)
                self._error = e
            finally:
                if made and h.exception() is not None:
                    try:  # the folder made for the script, if it wrote nothing there
                        os.rmdir(plan.final)
                    except OSError:
                        pass
                self._done.set()

        handle.add_done_callback(done)

    def _place(self, plan: Plan, after: Callable[[], None] | None,
               prepare: Callable[[str], None] | None = None) -> None:
        if plan.lease is not None:  # committed: the manifest protects the folder now
            try:
                os.remove(plan.lease)
            except FileNotFoundError:
                pass
        if prepare is not None:
            prepare(plan.target)
        if plan.staged:
            _faults.fault("place", 0)  # crash tests: committed, not yet renamed
            place(plan.target, plan.final, adopt=self.markers)
        if after is not None:
            after()

    def unfence(self) -> None:
        """Wait for the snapshot of the save in flight, then remove its fence's hooks
        from the models and optimizers (the training thread's call: before they are
        pickled, whose closures cannot be). Blocking: the snapshot copy at most. Never
        raises (a failed copy is the save's error, raised by :meth:`finish`)."""
        h = self._handle
        if h is None:
            return
        try:
            h.wait_snapshot()
        except Exception as e:  # pragma: no cover - wait_snapshot raises on timeout only
            log.debug("waiting for the snapshot of %s: %s", h.path, e)
        h._unfence()

    @property
    def pending(self) -> bool:
        """Whether an asynchronous save has not been waited for. No I/O."""
        return self._handle is not None

    def finish(self) -> None:
        """Wait for the asynchronous save in flight, its placement and ``after``, and
        raise their error on every rank alike. Collective when one was in flight (every
        rank has one then); else a no-op."""
        h, self._handle = self._handle, None
        if h is None:
            return
        h.result()  # the commit's error: the same on every rank
        self._done.wait()
        err, self._error = self._error, None
        agree(Comm(), err, f"finish the save to {h.path}")

    def unobserved_error(self) -> BaseException | None:
        """Wait for the save in flight nobody waited for and return its error (its
        commit's, its placement's or ``after``'s), None when it succeeded or none was
        in flight. Not collective; blocking. For the exit hook (:func:`.exit.watch`)."""
        h, self._handle = self._handle, None
        if h is None:
            return None
        e = h.exception()
        self._done.wait(60.0)  # its callback's cleanup too (the folder made for it)
        if e is None:
            e, self._error = self._error, None
        return e

    def abandon(self, timeout: float = 60.0) -> None:
        """After a failure of the training on this rank: wait up to ``timeout`` s for
        the save in flight without entering a collective on the training's group. Never
        raises (the training's error is the one to see); the save's fate is logged."""
        h, self._handle = self._handle, None
        if h is None:
            return
        try:
            h.result(timeout)
            self._done.wait(timeout)
        except Exception as e:
            log.error("the checkpoint save to %s in flight when the training failed: %s",
                      h.path, e)


def broadcast_json(comm: Comm, obj: Any) -> Any:
    """Rank 0's small JSON-able ``obj`` on every rank (one broadcast)."""
    data = comm.broadcast_bytes(json.dumps(obj).encode() if comm.rank == 0 else None)
    return json.loads(data)
