"""The fast tier (``local_root``) of the framework adapters (today the Lightning/Fabric
strategies'): a save commits on every
node's own disk and returns; its copy to the name Lightning gave (a shared file system
or an object store) runs in the background and appears there whole, as a direct save
would (:mod:`dckpt.integrations.common.place`).

Layout: ``local_root/lightning-<12 hex>-<16 hex>/`` holds one checkpoint name's latest
local commit (the first hex: a hash of the directory the name lives in, the job's
identity; the second: a hash of the durable name, which every rank's view records as
its ``owner``, checked at load); each rank writes its own data file and its own view
``manifest-<rank>.json`` there (dckpt's node-local format, :mod:`dckpt.tiers.local`).

Ownership: a job is the checkpoint directory it saves into (ModelCheckpoint's
``dirpath``). Retention and the removal of dead slots look only at the slots of the
directories this process saved into, so two jobs on one ``local_root`` (own
directories; one after the other or at once) never trim or sweep each other's slots.
No lock is needed for that: the prefixes are disjoint. (Two jobs saving into the same
directory at once write the same names: that is a conflict on the durable side too,
as with the stock strategy.)

Threads and groups: a synchronous save commits locally in the training thread; an
asynchronous one copies the state into host buffers, then commits in the ``local``
thread (its own gloo group). Durable copies run one at a time in the ``copy`` thread
(another gloo group), in the order the saves committed, which every rank shares, so
their collectives pair up. Removals (``ModelCheckpoint``'s ``save_top_k``) run in the
copy thread too, after the copies queued before them.

What a slow or failing durable store costs: never the fast tier. A failed copy is
logged (its name stays local only: a load of that name reads it there); the next
copies go on. A new save of a name whose copy has not begun replaces that copy (its
files are about to be replaced); one whose copy is running waits for it. More than
``MAX_QUEUED`` copies waiting make the next save wait (logged): the local disk holds
what is queued, so the queue is bounded.

Local retention: after each copy, each rank removes its part of this job's slots
beyond the ``keep_last_local`` newest (never one being written or queued for a copy),
and of slots its own saves left without a view (killed mid-save). A slot beyond
``keep_last_local`` is removed only once its durable name is seen to hold the same
save (or a newer one): while the durable store is down, a checkpoint whose only copy
is local is kept (the number of such names is bounded by ModelCheckpoint's
``save_top_k``, whose removals take the local copy too).
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from ...errors import CheckpointError
from ...protocol.async_save import SaveHandle, _Unstageable, at_thread_exit
from ...protocol.collectives import Comm, OwnGroup, agree, on_rank0
from ...engine.staging import StagingPool
from ...storage.fsspec_storage import make_storage
from ...tiers import local as tlocal
from ...tiers import stager, stage_encoded
from . import slots as slots
from .exit import abandoned
from .place import place_agreed
from .slots import (PARENT_KEY, SLOT_PREFIX, Held,  # noqa: F401 (re-exported)
                              job_prefix)

log = logging.getLogger(__name__)
MAX_QUEUED = 2  # durable copies waiting (not running) before a save waits

# the tiers whose saves are drained at exit; weak: a dropped strategy (a sweep of trials
# in one process) frees its host buffers and threads
_LIVE: "weakref.WeakSet[LocalTier]" = weakref.WeakSet()


def _drain_at_exit() -> None:
    for tier in list(_LIVE):
        try:
            tier.drain(raise_error=False)
            for e in tier._errors:
                log.error("an asynchronous fast-tier save failed: %s", e)
        except Exception as e:  # never raised at exit
            log.error("dckpt fast tier %s at exit: %s", tier.root, e)


at_thread_exit(_drain_at_exit)


@dataclass(eq=False)
class CopyJob:
    """One durable copy: of the local commit of ``final``'s slot, to ``final``."""

    final: str
    commit: tlocal.LocalCommit
    storage_options: dict | None = None
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    superseded: bool = False


class LocalTier:
    """See the module docstring. Made in the strategy's constructor (no I/O); opened on
    the first save or load (collective: creates ``root`` on every rank, the two
    background groups). Raises CheckpointError for a ``root`` that is not a local path
    or a bad ``keep_last_local``."""

    def __init__(self, root: str, keep_last_local: int = 2,
                 storage_options: dict | None = None, compression: str | None = None) -> None:
        if not isinstance(root, (str, os.PathLike)) or (
                "://" in str(root) and not str(root).startswith("file://")):
            raise CheckpointError(f"local_root must be a node-local path (a local NVMe "
                                  f"directory, /dev/shm/job), not {root!r}")
        if isinstance(keep_last_local, bool) or not isinstance(keep_last_local, int) \
                or keep_last_local < 1:
            raise CheckpointError(f"keep_last_local must be an int >= 1, got {keep_last_local!r}")
        self.storage, self.root = make_storage(os.path.abspath(str(root).removeprefix("file://")))
        self.keep = keep_last_local
        self.storage_options, self.compression = storage_options, compression
        # what a copy's placement keeps of the folder it replaces (place's ``adopt``):
        # None, nothing (Lightning); the Hugging Face adapters set () (every file dckpt
        # did not write, as their direct saves)
        self.adopt: tuple[str, ...] | None = None
        # called on every rank in the copy thread once a durable copy is placed, with
        # its name: work that reads the durable folder (a sharded model's folder export)
        self.landed: Callable[[str], None] | None = None
        self.pool = StagingPool()
        self._lock = threading.Lock()
        self._jobs: list[CopyJob] = []  # queued or running, in order
        self._busy: set[str] = set()  # slots being written locally
        self._gen: dict[str, int] = {}  # saves of each name begun (a removal's reference)
        self._owned: set[str] = set()  # the slot prefixes of this job (see own())
        self._kept: set[str] = set()  # names kept beyond keep_last_local (logged once)
        # the durable save id of each name as this process last saw it (a load's look
        # up, or a copy it committed): the parent recorded in the next local commit
        self.seen: dict[str, str] = {}
        self._local_job: SaveHandle | None = None
        self._errors: list[BaseException] = []  # the asynchronous local saves'
        self._world: Any = None  # the default group the groups below were made for
        self._local_group = self._copy_group = None
        self._local_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-pl-local")
        self._copy_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-pl-copy")
        _LIVE.add(self)

    # ------------------------------------------------------------------ naming
    def slot(self, final: str) -> str:
        """The slot directory of the durable name ``final``: under its directory's
        prefix (:func:`job_prefix`). Pure."""
        h = hashlib.sha256(final.encode()).hexdigest()[:16]
        return self.storage.join(self.root, job_prefix(final) + h)

    def own(self, final: str) -> None:
        """Make the directory of ``final`` one of this job's (its slots are trimmed by
        this process's retention). Pure bookkeeping."""
        with self._lock:
            self._owned.add(job_prefix(final))

    def names_in(self, directory: str, rank: int,
                 accept: Callable[[Any], bool] | None = None) -> list[str]:
        """The durable names of ``directory`` whose slots this rank holds a view of
        (:func:`.slots.names_in`). Local I/O; never raises."""
        return slots.names_in(self.storage, self.root, self.slot, directory, rank, accept)

    def _open(self, comm: Comm) -> None:
        """Collective on first use (and after a new default group): ``root`` on every
        rank, the background groups. Raises CheckpointError on every rank alike."""
        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if self._world is not None and world is self._world:
            return
        err = None
        try:
            self.storage.makedirs(self.root)
        except OSError as e:
            err = CheckpointError(f"cannot create local_root {self.root}: {e}")
        agree(comm, err, f"create local_root {self.root}")
        if world is not None:
            timeout = float(os.environ.get("DCKPT_COLLECTIVE_TIMEOUT_S", "1800"))
            self._local_group = OwnGroup.create(None, timeout)
            self._copy_group = OwnGroup.create(None, timeout)
        self._world = world or object()

    # ------------------------------------------------------------------ saving
    def save(self, tree: dict, final: str, step: int, plan: Callable[[], tuple],
             *, async_: bool, storage_options: dict | None = None) -> None:
        """Commit ``tree`` in every rank's fast tier as the slot of ``final`` and queue
        its durable copy (``plan()``: rank 0's (final, target, staged), computed when
        the copy begins; ``storage_options``: the durable store's). Collective. Synchronous: returns after the local commit and
        raises its error on every rank alike. Asynchronous: returns after copying the
        state into host buffers; the local commit's error is raised by
        :meth:`wait_local` (the next save or load)."""
        comm = Comm()
        self._open(comm)
        self.wait_local(raise_error=True)
        slot = self.slot(final)
        self.own(final)
        self._make_room(final)
        with self._lock:
            self._busy.add(slot)
            self._gen[final] = self._gen.get(final, 0) + 1
        if not async_:
            try:
                self._commit(tree, final, step, slot, plan, comm, storage_options)
            finally:
                with self._lock:
                    self._busy.discard(slot)
            return
        t0 = time.perf_counter()
        try:
            snap, _ = self.pool.snapshot(tree)
        except Exception as e:  # join the collective save anyway: it fails everywhere
            snap = {"state": _Unstageable(e)}

        def run() -> None:
            try:
                self._commit(snap, final, step, slot, plan, Comm(self._local_group),
                             storage_options)
            finally:
                with self._lock:
                    self._busy.discard(slot)

        blocked = time.perf_counter() - t0
        self._local_job = SaveHandle(self._local_exec.submit(run), slot, blocked, blocked)

    def _make_room(self, final: str) -> None:
        """Before a local save of ``final``: a queued copy of its slot is dropped (the
        new save replaces its files), a running one awaited; then wait while more than
        MAX_QUEUED copies wait. Not collective; blocking while the durable store lags."""
        waits = []
        with self._lock:
            for job in self._jobs:
                if job.final == final and not job.done.is_set():
                    if job.started:
                        waits.append(job)
                    else:
                        job.superseded = True
        for job in waits:
            job.done.wait()
        t0, warned = time.monotonic(), False
        while True:
            with self._lock:
                waiting = [j for j in self._jobs if not j.started and not j.done.is_set()
                           and not j.superseded]
            if len(waiting) <= MAX_QUEUED:
                break
            if not warned:
                log.warning("%d durable copies are waiting (the durable store is slower "
                            "than the saves): this save waits for one", len(waiting))
                warned = True
            waiting[0].done.wait(1.0)
        if warned:
            log.warning("the save waited %.1f s for the durable store", time.monotonic() - t0)

    def _commit(self, tree: Any, final: str, step: int, slot: str, plan: Callable[[], tuple],
                comm: Comm, storage_options: dict | None) -> None:
        commit = tlocal.save_local(tree, step, slot, self.storage, comm, owner=final)
        if comm.rank == 0:
            log.info("%s committed in the fast tier %s in %.2f s", final, slot, commit.seconds)
        job = CopyJob(final, commit, storage_options)
        with self._lock:
            self._jobs.append(job)
        self._copy_exec.submit(self._copy, job, plan)

    def _copy(self, job: CopyJob, plan: Callable[[], tuple]) -> None:
        """The copy thread: stage ``job``'s commit to its durable name. Collective on
        the copy group (every rank runs its jobs in the same order). Never raises: a
        failure is logged and the name stays local only."""
        comm = Comm(self._copy_group)
        try:
            with self._lock:
                skip = job.superseded
                job.started = not skip
            if comm.any_of([skip])[0]:  # every rank skips, or none does
                log.info("durable copy of %s skipped: a newer save replaced it", job.final)
                return
            final, target, staged = on_rank0(comm, plan, f"plan the copy to {job.final}")
            if self.compression is not None:
                stage_encoded.stage(job.commit, self.storage, target, comm,
                                    job.storage_options, None, self.compression)
            else:
                stager.stage(job.commit, self.storage, target, comm, job.storage_options)
            place_agreed(comm, target, final, staged, adopt=self.adopt)
            self.seen[job.final] = job.commit.save_id
            if comm.rank == 0:
                log.info("%s copied to the durable tier (%.1f MiB)", final,
                         job.commit.total_bytes / 2**20)
            if self.landed is not None:
                self.landed(final)
        except Exception as e:
            log.error("rank %d: durable copy of %s failed (it stays in the fast tier %s; "
                      "training goes on): %s", comm.rank, job.final, job.commit.step_dir, e)
        finally:
            with self._lock:
                job.started = False
                job.done.set()
                self._jobs.remove(job)
            self._cleanup(comm.rank)

    # ------------------------------------------------------------------ removing
    def remove(self, final: str, remove_durable: Callable[[], None] | None) -> None:
        """Remove ``final``'s local slot (this rank's part) and, on rank 0
        (``remove_durable`` given), its durable copy: in the copy thread, after the
        copies queued before. A queued copy of ``final`` is dropped. A save of
        ``final`` begun after this call keeps its local commit (and its copy then
        recreates the name). Not collective; never raises (errors are logged)."""
        with self._lock:
            for job in self._jobs:
                if job.final == final and not job.started:
                    job.superseded = True
            gen = self._gen.get(final, 0)
        rank = Comm().rank if dist.is_available() and dist.is_initialized() else 0

        def run() -> None:
            try:
                if remove_durable is not None:
                    remove_durable()
            except Exception as e:  # the store down: the local slot goes all the same
                log.error("removing checkpoint %s from the durable store: %s", final, e)
            try:
                with self._lock:  # held: a new save of the name waits for the drop
                    if self._gen.get(final, 0) == gen:
                        tlocal.drop_step(self.storage, self.slot(final), rank)
            except Exception as e:
                log.error("removing checkpoint %s from the fast tier: %s", final, e)

        self._copy_exec.submit(run)

    def _cleanup(self, rank: int) -> None:
        """This rank's part of retention (:func:`.slots.cleanup`). Never
        raises."""
        slots.cleanup(self, rank)

    # ------------------------------------------------------------------ loading
    def held(self, final: str, comm: Comm) -> Held | None:
        """The local commit of ``final`` that every rank holds, or None (see
        :meth:`held_many`). Collective: one all-gather."""
        return self.held_many([final], comm)[0]

    def held_many(self, finals: list[str], comm: Comm) -> list[Held | None]:
        """For each durable name of ``finals`` (the same list on every rank), the local
        commit every rank holds (its view records the name, the same save and world
        size, its own files at their sizes), or None. Collective: one all-gather of a
        few bytes per name. Reads only this rank's files."""
        self._open(comm)
        mine = [slots.mine(self.storage, self.slot(final), final, comm)
                for final in finals]
        views = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
        out: list[Held | None] = []
        for i, final in enumerate(finals):
            got = [v[i] if isinstance(v, list) and i < len(v) else None for v in views]
            if any(v is None or v[0] != got[0][0] for v in got):
                out.append(None)
            else:
                out.append(Held(self.slot(final), *got[0]))
        return out

    # ------------------------------------------------------------------ waiting
    def wait_local(self, raise_error: bool = True) -> None:
        """Wait for the asynchronous local commit in flight and raise its error (the
        same on every rank) or one kept from before."""
        job, self._local_job = self._local_job, None
        if job is not None:
            e = job.exception()
            if e is not None:
                self._errors.append(e)
        if raise_error and self._errors:
            first, self._errors = self._errors[0], []
            raise first

    def abandon(self, timeout: float) -> None:
        """After the training failed on this rank: wait up to ``timeout`` seconds in all
        for the local commit in flight and the copies queued (they run on dckpt's own
        groups, never the training's), then stop waiting. Never raises (logged)."""
        end = time.monotonic() + timeout
        job, self._local_job = self._local_job, None
        try:
            if job is not None:
                e = job.exception(timeout)
                if e is not None:
                    log.error("the fast-tier save in flight when the training failed: %s", e)
            self._copy_exec.submit(lambda: None).result(max(0.0, end - time.monotonic()))
        except cf.TimeoutError:
            log.error("the fast tier's saves and copies in flight did not finish within "
                      "%.0f s of the training's failure: not waited for", timeout)
            pending = self._copy_exec.submit(lambda: None)
            abandoned(lambda: (job is not None and not job.done()) or not pending.done())
        except RuntimeError:  # shut down at exit
            pass

    def drain(self, raise_error: bool = True) -> None:
        """Wait for the local commit in flight and every copy and removal queued, then
        raise the local commit's error (as :meth:`wait_local`; a copy's failure is
        logged, never raised: that name stays local only). Collective in effect (the
        copies are); blocking."""
        try:
            self.wait_local(raise_error)
        finally:
            try:
                self._copy_exec.submit(lambda: None).result()  # the queue is FIFO
            except RuntimeError:  # shut down at exit
                pass
