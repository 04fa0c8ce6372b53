"""FastTier: the manager's fast tier and its background staging, wired together.

One object per CheckpointManager with ``local_root``. It owns the node-local storage,
two background threads with a gloo group each (one for asynchronous local saves, one
for staging to the durable tier, so a slow or failing durable store never holds up a
local save) and the set of steps being staged (never deleted locally). Every
collective of a background job runs on that job's own group, in the same order on
every rank: jobs are queued in save order, which every rank shares.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import torch.distributed as dist

from ..errors import CheckpointError
from ..catalog.retention import RetentionPolicy
from ..protocol.collectives import Comm, OwnGroup, agree
from ..protocol.async_save import SaveHandle, _Unstageable, at_thread_exit
from ..engine import devstream
from ..engine.fence import Versions, releaser
from ..engine.staging import StagingPool, live_view
from ..storage.fsspec_storage import make_storage
from . import chooser, identity, local, stage_encoded, stager
from .peers import restore as peerrestore, replication

log = logging.getLogger(__name__)
# on_commit(tier, commit, info): "local" (info None) or "durable" (the staged CheckpointInfo)
OnCommit = Callable[[str, "local.LocalCommit", Any], None]


_LIVE: "weakref.WeakSet[FastTier]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    """At exit, let every tier's saves in flight commit in every tier (see
    :func:`dckpt.protocol.async_save.at_thread_exit`); errors are logged."""
    for tier in list(_LIVE):
        try:
            tier.wait(raise_error=False)
        except Exception as e:
            log.error("fast tier %s at exit: %s", tier.root, e)


at_thread_exit(_finish_at_exit)


class FastTier:
    """See the module docstring. Construct on every rank together (collective: makes
    the background groups, creates each rank's ``local_root``). Raises CheckpointError
    when ``local_root`` is not a local path or cannot be created on some rank."""

    # Set by the manager for incremental or compressed durable copies; None: byte copies
    chain: "stage_encoded.Chain | None" = None

    def __init__(self, local_root: str, *, keep_last_local: int, durable_every: int | None,
                 group: Any, comm: Comm, durable_path: Callable[[int], str],
                 storage_options: dict | None, on_durable: Callable[[int], None],
                 owner: str | None = None, replicas: int = 0, node: Any = None) -> None:
        if "://" in local_root and not local_root.startswith("file://"):
            raise CheckpointError(f"local_root must be a node-local path (e.g. /dev/shm/job "
                                  f"or a local NVMe directory), not the URL {local_root!r}")
        if durable_every is not None and (not isinstance(durable_every, int) or durable_every < 1):
            raise CheckpointError(f"durable_every_steps must be a positive int, got {durable_every!r}")
        self.storage, self.root = make_storage(local_root)
        self.retention = RetentionPolicy(keep_last_local)
        self.durable_every = durable_every
        self.comm, self.durable_path, self.on_durable = comm, durable_path, on_durable
        self.storage_options = storage_options
        # the durable root's identity, recorded in every view: only its steps restore
        self.owner = owner
        self.last_durable: int | None = None  # the last step queued for the durable tier
        self.pool = StagingPool()
        self.queue = stager.StageQueue()  # the durable copies queued (bounded by coalescing)
        self._local_job: SaveHandle | None = None
        self._stage_jobs: list[cf.Future] = []
        self._errors: list[BaseException] = []
        self._last_local: int | None = None  # the newest step committed locally
        self.last_commit: local.LocalCommit | None = None  # this tier's newest commit
        err = None
        # One job per local_root: every process holds the job's lease (identity.Lease)
        job = comm.broadcast_bytes(uuid.uuid4().hex.encode() if comm.rank == 0 else None)
        self._lease = identity.Lease(self.root, job.decode(), owner)
        try:
            self.storage.makedirs(self.root)
            self._lease.acquire()
            if owner is not None:  # for a restart while the durable root is down
                identity.cache_identity(self.root, owner)
        except OSError as e:
            err = CheckpointError(f"cannot create local_root {self.root}: {e}")
        except CheckpointError as e:
            err = CheckpointError(f"{self.root}: {e}")
        if err is not None:
            self._lease.release()
        agree(comm, err, f"create local_root {local_root}")
        self._sharers = identity.sharers(comm, self.root)
        # Every rank's replication settings, checked together: a disagreement raises on
        # every rank here, before any save (never a hang in the replication thread).
        agreed = replication.agree_settings(comm, replicas, node)
        _LIVE.add(self)
        self._local_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-local")
        self._stage_exec = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-stage")
        self._local_group = self._stage_group = None
        if dist.is_available() and dist.is_initialized():
            # Made now, on every rank together, so the first save pays nothing for them.
            timeout = float(os.environ.get("DCKPT_COLLECTIVE_TIMEOUT_S", "1800"))
            self._local_group = OwnGroup.create(group, timeout)
            self._stage_group = OwnGroup.create(group, timeout)
        self.peers: replication.Replicator | None = None
        if agreed.replicas > 0 and self._local_group is None:
            # One process, one node: nothing to replicate to; never an error (the job goes on)
            log.warning("replicas=%d: this job is a single process (no process group), so "
                        "there is no other node to replicate to", agreed.replicas)
        elif agreed.replicas > 0:
            low = min(self._sharers) if self._sharers else comm.rank
            lows = [int(b) for b in comm.all_gather_bytes(str(low).encode())]
            place_of = replication.places(agreed.nodes, lows)
            self.peers = replication.Replicator(
                self.storage, self.root, comm, OwnGroup.create(group, timeout), agreed,
                place_of, owner, keep_last_local)
        if self.peers is None:  # no replicas kept in this job: free those left here
            replication.reclaim(self.root, self._sharers, comm.rank)

    # ------------------------------------------------------------------ saving
    def step_dir(self, step: int) -> str:
        return self.storage.join(self.root, local.step_name(step))

    def durable_due(self, step: int, force: bool) -> bool:
        """Whether the local save of ``step`` also goes durable: every save when
        ``durable_every_steps`` is None; else forced saves, multiples of it, and any step
        at least that many steps after the last durable one. Pure, the same on every
        rank."""
        d = self.durable_every
        due = (d is None or force or step % d == 0
               or step - (self.last_durable or 0) >= d)
        if due:
            self.last_durable = step
        return due

    def save(self, step: int, state: Any, *, durable: bool, async_: bool,
             on_commit: OnCommit | None = None,
             fence: list | None = None, forced: bool = False) -> SaveHandle | None:
        """Commit ``state`` as ``step`` in every rank's fast tier, then queue its staging
        when ``durable`` (a copy that cannot keep up with the saves is skipped for a
        newer one unless ``forced``: see :class:`stager.StageQueue`). Collective.
        Synchronous: returns after the local commit (and
        raises its error). Asynchronous: returns after the snapshot; the local commit
        runs in the background, its error is raised by :meth:`wait`. Waits for the
        previous local save first (one local save at a time).

        Asynchronous with ``fence`` (optimizers or modules, see :func:`dckpt.async_save`)
        and CPU or CUDA tensors: no snapshot at all. The call resolves the state (its
        Stateful objects' ``state_dict()``), records a CUDA event per GPU, and returns;
        the background save writes the tier's files straight from the live tensors
        (CUDA ones through a small pinned bounce pair on a side stream, after the
        event: dckpt.engine.devstream), and the fenced optimizers' steps (and the forwards
        of the fenced modules that can write saved tensors) wait until this rank's files are written; an in-place
        write the fence does not hold back fails the save (dckpt.engine.fence). The fast
        tier's files are then the one host copy of the state: no staging buffers are
        held. No fence (or another accelerator): the state is copied into reused host
        buffers first (pinned for GPU tensors), and written from them.

        ``on_commit(tier, commit, info)`` is called on this rank after the local commit
        (``"local"``, info None) and after the durable one (``"durable"``, the staged
        CheckpointInfo), in the thread that saw it (the save history); its errors are
        logged, never raised. Returns the asynchronous save's handle (its
        ``blocking_seconds`` grows by a fence's wait), None for a synchronous one."""
        self.wait_local()
        if not async_:
            self._save_local(step, state, self.comm, durable, on_commit, forced=forced)
            return None
        t0 = time.perf_counter()
        copied: threading.Event | None = None
        after: dict | None = None
        release: Callable[[], None] | None = None
        try:
            named: dict = {}  # the live tensors by key, gathered in the same walk
            view = live_view(state, named) if fence else None
            if view is not None and devstream.live_devices_ok(view[2]):
                snap, copied = view[0], threading.Event()
                after = devstream.mark(view[2])  # the values at the call, on every GPU
                # a write the fence does not hold back fails the save (engine.fence)
                release = releaser(copied, Versions(named),
                                   "the fast tier was written from it", self.comm.rank)
                self.pool.release()  # the tier's files are the one host copy
            else:  # the state resolved once: state_dict() is not called twice
                snap, _ = self.pool.snapshot(state if view is None else view[0])
        except Exception as e:  # join the collective save anyway: it fails everywhere
            snap, copied, release = {"state": _Unstageable(e)}, None, None
        job = self._local_exec.submit(self._save_local, step, snap, Comm(self._local_group),
                                      durable, on_commit, release, after, forced)
        blocked = time.perf_counter() - t0
        self._local_job = SaveHandle(job, self.step_dir(step), blocked, blocked, copied)
        if copied is not None:
            self._local_job._fence(fence)
        return self._local_job

    def wait_snapshot(self) -> None:
        """Block until the local save in flight no longer reads the live state (its
        snapshot copied, or its files written). Not collective; no-op without one."""
        if self._local_job is not None:
            self._local_job.wait_snapshot()

    def _save_local(self, step: int, state: Any, comm: Comm, durable: bool,
                    on_commit: OnCommit | None = None,
                    written: Callable[[], None] | None = None,
                    after: dict | None = None, forced: bool = False) -> local.LocalCommit:
        commit = local.save_local(state, step, self.step_dir(step), self.storage, comm,
                                  written, after,
                                  self.owner)
        if comm.rank == 0:
            log.info("step %d committed in the fast tier %s in %.2f s", step, self.root,
                     commit.seconds)
        self._last_local = step
        self.last_commit = commit
        _notify(on_commit, "local", commit, None)
        if durable:
            job = self.queue.add(step, forced)  # older copies not begun are skipped
            self._stage_jobs.append(self._stage_exec.submit(self._stage, commit, job,
                                                            on_commit))
        if self.peers is not None:  # in the background, off the training thread
            self.peers.submit(commit, self._replicated)
        self.cleanup(step)
        return commit

    def _stage(self, commit: local.LocalCommit, job: stager.StageJob,
               on_commit: OnCommit | None = None) -> None:
        comm = Comm(self._stage_group)
        try:
            # Every rank skips, or none does (the staging is collective): one all-reduce.
            if comm.any_of([self.queue.claim(job)])[0]:
                if comm.rank == 0:
                    newer = self.queue.newest()  # another rank may have queued it first
                    log.warning(
                        "durable copy of step %d skipped: %s is queued for the durable "
                        "tier, which is slower than the saves (the fast tier keeps "
                        "keep_last_local steps plus the one being uploaded, not a backlog)",
                        commit.step, f"step {newer}" if newer and newer > commit.step
                        else "a newer step")
                return
            # incremental/compressed copies (stage_encoded.Chain), else byte for byte
            info = (self.chain.stage if self.chain is not None else stager.stage)(
                commit, self.storage, self.durable_path(commit.step), comm,
                self.storage_options)
            _notify(on_commit, "durable", commit, info)
            self.on_durable(commit.step)
        except Exception as e:
            # Training goes on with the fast tier; the next durable save tries again.
            log.error("rank %d: durable copy of step %d failed (training goes on; the next "
                      "durable save tries again): %s", comm.rank, commit.step, e)
            raise
        finally:
            self.queue.finish(job)

    def _replicated(self, step: int) -> None:
        """The replication thread, after ``step`` was replicated everywhere: the own
        step it kept for the replicas' sake may go now (in the local saves' thread: see
        :meth:`wait`). Never raises."""
        try:
            # Only retention, up to ``step``: a synchronous save may be committing a
            # newer step in the training thread right now, which the abandoned-timeline
            # rule (steps above the one given) would take for a rewind's leftover.
            self._local_exec.submit(self.cleanup, step, False)
        except RuntimeError:  # closed
            pass

    def cleanup(self, step: int, after_commit: bool = True) -> None:
        """This rank, after ``step`` committed locally: remove its part of the local
        steps retention drops (never ``step``, one being staged, nor one queued for the
        durable tier and not superseded), of steps newer than ``step`` (an abandoned
        timeline) and of older failed saves (``after_commit=False``: retention only, for
        a cleanup that may run beside a save). Own files only, except on the lowest rank
        of those sharing this ``local_root``: it also removes, in those steps, the
        files of ranks that do not use this directory in this job (the job shrank, or
        they moved), which nobody else would ever remove. No collective; never raises."""
        try:
            held, partial = [], []
            for e in self.storage.listdir(self.root):
                m = local.STEP_DIR.match(e.name)
                if not (m and e.is_dir):
                    continue
                s = int(m.group(1))
                view = self.storage.join(self.root, e.name, local.view_name(self.comm.rank))
                (held if self.storage.exists(view) else partial).append(s)
            protected = {step} | self.queue.protected()
            if self.peers is not None:  # being replicated, or the newest replicated
                protected |= self.peers.protected()
            doomed = [s for s in held if s > step] + [s for s in partial if s < step] \
                if after_commit else []
            doomed += self.retention.to_delete([s for s in held if s <= step], protected)
        except Exception as e:
            log.warning("fast-tier cleanup after step %d skipped: %s", step, e)
            return
        sharers = self._sharers if self._sharers and min(self._sharers) == self.comm.rank \
            else None
        for s in doomed:
            if s not in protected:
                local.drop_step(self.storage, self.step_dir(s), self.comm.rank, sharers)

    # ------------------------------------------------------------------ waiting
    def wait_local(self) -> None:
        """Wait for the local save in flight; its error is kept for :meth:`wait`."""
        job, self._local_job = self._local_job, None
        if job is not None:
            e = job.exception()
            job._unfence()  # in the training thread: its fence hooks are spent
            if e is not None:
                log.error("local checkpoint failed: %s", e)
                self._errors.append(e)

    def wait(self, raise_error: bool = True) -> None:
        """Block until every save so far is committed in every tier it is meant for (or
        its durable copy skipped for a newer one: :class:`stager.StageQueue`); raise the
        first error (then forget them all). Then apply the local retention
        once more: a step that was being staged when a newer one committed was kept
        (never deleted while uploading), and is dropped now if retention says so."""
        self.wait_local()
        jobs, self._stage_jobs = self._stage_jobs, []
        for job in jobs:
            e = job.exception()
            if e is not None:
                self._errors.append(e)
        if self.peers is not None:
            self._errors += self.peers.wait()
        if (jobs or self.peers is not None) and self._last_local is not None:
            # In the local saves' own thread: a cleanup beside a local save could take
            # the step it is committing for an abandoned timeline (wait() also runs
            # from the exit hook, while a training thread may still be saving).
            try:
                self._local_exec.submit(self.cleanup, self._last_local).result()
            except RuntimeError as e:  # closed: the next tier's save cleans up
                log.debug("fast-tier cleanup skipped: %s", e)
        if raise_error and self._errors:
            first, self._errors = self._errors[0], []
            raise first

    def close(self) -> None:
        """:meth:`wait`, then stop the background threads and free the staging buffers
        (an unfenced async save's host copy of the state). Collective as :meth:`wait`."""
        try:
            self.wait()
        finally:
            self._local_exec.shutdown(wait=False)
            self._stage_exec.shutdown(wait=False)
            if self.peers is not None:
                self.peers.close()
            if self._local_job is None:  # none in flight (wait() joined it) reads them
                self.pool.release()
            self._lease.release()

    # ------------------------------------------------------------------ restoring
    def common_steps(self) -> list[int]:
        """Steps every rank holds in its fast tier from one save, ascending.
        Collective (one all-gather); reads only this rank's own directory."""
        return list(self.held_steps())

    def held_steps(self) -> dict[int, "chooser.Held"]:
        """:meth:`common_steps` with their save ids, times and parents, ascending.
        Steps saved for another durable root (``owner``) are left out."""
        mine = local.own_steps(self.storage, self.root, self.comm.rank, self.comm.size,
                               self.owner)
        return chooser.agree_local_steps(self.comm, mine)

    def peer_options(self) -> list:
        """With replicas: every step the job can restore from the nodes' fast tiers
        (own parts and replicas), newest first (:func:`peerrestore.options`).
        Collective: one all-gather."""
        return peerrestore.options(self.peers)

    def peer_restore(self, opt, loader: Callable[[str, str, int], None],
                     needs: Callable) -> str:
        """Restore ``opt`` (one of :meth:`peer_options`) through ``loader`` as
        :meth:`load` does, fetching from peers what this rank lacks; returns
        ``"local"`` or ``"peer"``. Returns once the replicas the lost node held are
        re-created too (they are copied in the replication thread, after the load: the
        job survives another node loss from the moment this returns; their failure is
        logged, never raised). Collective; raises as :func:`peerrestore.restore`."""
        n = self.read_workers()
        used = peerrestore.restore(self.peers, opt, self.step_dir,
                                   lambda path, name: loader(path, name, n), needs)
        for e in self.peers.wait():  # the re-replication (errors: already logged)
            log.debug("re-replication after the restore: %s", e)
        return used

    def load(self, step: int, loader: Callable[[str, str, int], None]) -> None:
        """Load ``step`` from the fast tier through ``loader(path, manifest_name,
        read_workers)`` (the manager's load, RNG handling included). Collective; raises
        what the load raises."""
        loader(self.step_dir(step), local.view_name(self.comm.rank), self.read_workers())

    def read_workers(self) -> int:
        """Reader threads per rank for a local load. Reading node-local files (host
        memory, a local disk's page cache) is CPU work: more threads than the cores a
        rank has only contend, so each rank gets its share of the node's cores (ranks
        per node from torchrun's LOCAL_WORLD_SIZE, else all ranks), between 1 and 4."""
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or self.comm.size
        return max(1, min(4, cpus // max(1, per_node)))


def _notify(on_commit: OnCommit | None, tier: str, commit: local.LocalCommit, info: Any) -> None:
    """``on_commit(tier, commit, info)``, if given; its errors are logged: a hook (the
    save history) never fails a save that committed."""
    if on_commit is None:
        return
    try:
        on_commit(tier, commit, info)
    except Exception as e:
        log.warning("after the %s commit of step %d: %s", tier, commit.step, e)
