"""Asynchronous save: a fast snapshot into host memory, then persist in the background.

The persist runs the ordinary two-phase commit (:func:`dckpt.save`) from one background
thread per process, over a gloo group of its own, created once per training group. The
training's own group is never used from that thread, so the training loop's collectives
(all_reduce, barrier, FSDP's all-gathers) cannot interleave with the checkpoint's.

That group is dckpt's own (:class:`~dckpt.protocol.collectives.OwnGroup`, not registered
with torch.distributed): a ``destroy_process_group()`` while a save is in flight does not
break it, so the save still commits (or fails) identically on every rank and
``result()`` returns its outcome. ``DCKPT_COLLECTIVE_TIMEOUT_S`` (default 1800) bounds
each of its collectives.
"""
from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours)
import logging
import os
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from .collectives import OwnGroup, drop_dead
from .commit import CheckpointInfo, save
from ..engine import devstream
from ..engine.fence import Fence, Versions, targets_of
from ..engine.staging import StagingPool, live_view

log = logging.getLogger(__name__)


class SaveHandle:
    """The outcome of one :func:`async_save`. Every rank's handle resolves to the same
    CheckpointInfo or raises the same error."""

    def __init__(self, future: cf.Future, path: str, blocked_s: float, staged_s: float,
                 copied: threading.Event | None = None) -> None:
        self._future, self.path = future, path
        # the time the caller lost: the whole call (waiting for a previous save
        # included) plus any fence's wait for the snapshot
        self.blocking_seconds = blocked_s
        self.staging_seconds = staged_s  # the snapshot copy alone (in the call)
        self._copied = copied
        self._fence_obj: Fence | None = None  # its hooks are removed by result()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the snapshot copy is complete; after it, changing the saved
        tensors is safe. Returns at once for a save without a fence (its copy ended
        in the call). Raises TimeoutError. A failed copy does not raise here: the
        save fails, and :meth:`result` raises why."""
        if self._copied is not None and not self._copied.wait(timeout):
            raise TimeoutError(f"the snapshot of {self.path} did not finish in {timeout} s")

    def _fence(self, targets: list) -> None:
        """Make every step of each fenced optimizer, and the forwards of the fenced
        modules that can write saved tensors, wait for the snapshot (each by itself:
        see :mod:`dckpt.engine.fence`), adding the wait to blocking_seconds."""
        if self._copied is None:
            return
        if self._fence_obj is None:
            self._fence_obj = Fence(self._copied, self._lost)
        self._fence_obj.arm(targets)

    def _lost(self, seconds: float) -> None:
        self.blocking_seconds += seconds

    @property
    def _hooks(self) -> list:
        """The fence's hooks still registered (none once disarmed)."""
        return self._fence_obj.hooks if self._fence_obj is not None else []

    def _unfence(self) -> None:
        """Remove the fence's hooks (from the training thread, once the save is over:
        an optimizer's hook must not be removed while its step runs)."""
        if self._fence_obj is not None:
            self._fence_obj.disarm()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit (blocking, up to ``timeout`` s) and return its info;
        raises the save's error, or TimeoutError. Call it from the training thread
        (it also removes a fence's hooks)."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                self._unfence()

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[["SaveHandle"], None]) -> None:
        """Call ``fn(handle)`` once the save has committed or failed: in the background
        thread that ran it, or at once in this thread when it is already over. ``fn``
        should be quick (the next save's background work waits for it); an exception
        it raises is logged by ``concurrent.futures`` and otherwise ignored."""
        self._future.add_done_callback(lambda _f: fn(self))


class _Saver:
    """Per (process, training group): the staging pool, the background thread, the
    checkpoint group and the save in flight."""

    def __init__(self, group: Any) -> None:
        self.pool = StagingPool()
        self.executor = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-persist")
        self.inflight: SaveHandle | None = None
        self.group = None
        if dist.is_available() and dist.is_initialized():
            # Collective, once: every rank makes its first async_save together.
            self.group = OwnGroup.create(group, float(os.environ.get(
                "DCKPT_COLLECTIVE_TIMEOUT_S", "1800")))


_SAVERS: dict[Any, _Saver] = {}
_LOCK = threading.Lock()


def _finish_at_exit() -> None:
    """At interpreter exit, let the saves still in flight commit (or fail) while
    background threads can still start work: once concurrent.futures has begun its own
    exit, a save in flight could no longer start the threads its writer uses and would
    fail. Blocking, up to each save's own duration; errors are logged, not raised."""
    with _LOCK:
        inflight = [s.inflight for s in _SAVERS.values() if s.inflight is not None]
    for h in inflight:
        if not h.done():
            log.info("waiting for the async save to %s before the process exits", h.path)
        try:
            h._future.result()
        except Exception as e:  # already reported through its handle, if anyone looked
            log.error("async save to %s failed: %s", h.path, e)


def at_thread_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit before concurrent.futures stops its executors
    (threading's exit hooks run in reverse order of registration, before atexit's;
    concurrent.futures.thread registered its own when it was imported, above)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:  # private since 3.9; without it, saves in flight may fail
        register(fn)


at_thread_exit(_finish_at_exit)


def _saver_key(group: Any) -> Any:
    # Keyed on the live group object: after destroy_process_group() and a new init, the
    # default group is a new object and gets a new saver (and checkpoint group).
    initialized = dist.is_available() and dist.is_initialized()
    return group if group is not None else (dist.group.WORLD if initialized else None)


def _saver(group: Any) -> _Saver:
    key = _saver_key(group)
    with _LOCK:
        for stale in drop_dead(_SAVERS, key):  # their groups were destroyed
            stale.executor.shutdown(wait=False)
        if key not in _SAVERS:
            _SAVERS[key] = _Saver(group)
        return _SAVERS[key]


def release_buffers(group: Any = None) -> None:
    """Free the staging buffers of ``group``'s async saver, if one was made (the next
    :func:`async_save` on that group allocates afresh). Local, not collective; makes
    no saver. Call it once no save of the group is in flight: a save in flight keeps
    the buffers it copies into alive until it ends, so it stays correct, but they are
    then freed only when it is over."""
    with _LOCK:
        saver = _SAVERS.get(_saver_key(group))
    if saver is not None:
        saver.pool.release()


def _wait_inflight(saver: _Saver) -> None:
    """Wait for the group's save in flight, if any (its error is its own handle's)."""
    if saver.inflight is not None:
        try:
            saver.inflight.result()
        except Exception as e:  # already reported through its own handle
            log.debug("previous async save failed: %s", e)


def prepare_async_save(state_dict: Any, *, process_group: Any = None,
                       staging_budget: int | None = None) -> int:
    """Do now what the first :func:`async_save` of ``state_dict`` would do in its call
    beyond the copy, so that call blocks about as long as later ones (issue 34: the
    first call blocked 5-12x a later one, nearly all of it the first touch of its
    fresh staging buffers).

    Creates this group's async saver (its background thread and its own checkpoint
    group), and allocates and touches the staging buffers a snapshot of
    ``state_dict`` needs, DTensor wrappers included, copying nothing: the page faults
    of the first snapshot happen here. Call it once the state exists (after building
    it, or after a restore), before the first save; again if its shapes change (a
    save re-allocates what no longer fits). Later saves reuse the buffers.

    Collective the first time on a group (every rank calls it together: the
    checkpoint group is made here). Blocking: about a memset of this rank's state
    (0.2 s for 365 MiB on a 2-core VM), after waiting for a save of the group in
    flight. Host memory: the staging buffers, which the first save would allocate
    anyway (:func:`release_buffers` frees them). Calls the ``state_dict()`` of
    Stateful values, as a save does: a :class:`dckpt.TrainingState` whose optimizer
    has not stepped yet initialises its state there, so prepare after the first step
    or after a restore (:class:`dckpt.CheckpointManager` prepares in ``restore()``).
    Values dckpt cannot store are left for the save to report. Returns the bytes
    prepared. Raises CheckpointError when they exceed ``staging_budget`` (nothing is
    allocated past it) or for a tensor dckpt cannot store (naming its key), and what
    a ``state_dict()`` raises; a rank that raises has still made the checkpoint
    group, so the ranks stay in step."""
    saver = _saver(process_group)
    _wait_inflight(saver)
    saver.pool.budget = staging_budget
    nbytes = saver.pool.prepare(state_dict)
    log.debug("async save staging buffers ready: %.1f MiB", nbytes / 2**20)
    return nbytes


def async_save(state_dict: Any, path: str, *, process_group: Any = None,
               storage_options: dict | None = None, overwrite: bool = False,
               staging_budget: int | None = None, base: str | None = None,
               compression: str | None = None, fence: Any = None,
               block_hashes: bool = False, side: Any = None) -> SaveHandle:
    """Snapshot ``state_dict`` and persist it to ``path`` in the background.

    Collective (every rank calls it, in the same order). Blocks until the previous
    async save of this group has finished (at most one in flight), then until the
    snapshot is complete: CPU tensors copied into reusable host buffers, CUDA tensors
    into pinned ones with non-blocking copies and one synchronisation. The caller may
    change its tensors as soon as this returns. The commit has every guarantee of
    :func:`dckpt.save`; its outcome, or any rank's error, is on every rank's handle.
    The first call of a group also allocates the staging buffers (their page faults:
    several times a later call's copy) unless :func:`prepare_async_save` did.
    ``staging_budget`` caps the host memory of the staging buffers (bytes). ``base``,
    ``compression``, ``block_hashes`` and ``side`` are :func:`dckpt.save`'s (incremental and
    compressed saves): the hashing, comparing and compressing run in the background,
    not in the call.

    ``fence`` (an optimizer or module, or a list of them): the call returns as soon as
    the buffers are ready, and the copy runs in the background, overlapped with what
    the caller does next; until it is complete every ``step()`` of each fenced
    optimizer, and the forward of each module of a fenced module that can write a
    saved tensor in place (BatchNorm's running stats, ``Embedding(max_norm=)`` rows,
    spectral norm's ``u``/``v``: found by its buffers or learned, every forward at a
    model's first fenced save), waits for it first, each by itself (from any thread;
    an interrupted wait leaves the fence armed): see :mod:`dckpt.engine.fence`. So
    the checkpoint holds the values at the call.
    Anything else that changes the saved tensors before that must call
    :meth:`SaveHandle.wait_snapshot` first; an in-place write it does not hold back
    (one that bumps the tensor's version counter) fails the save, naming the tensor.
    Fencing only the optimizer keeps the copy overlapped with the next forward and
    backward passes, for models whose forward writes nothing it saves.
    ``blocking_seconds`` then counts the call and the fence's wait."""
    t0 = time.perf_counter()
    targets = _fence_targets(fence)
    saver = _saver(process_group)
    _wait_inflight(saver)
    saver.pool.budget = staging_budget
    t1 = time.perf_counter()
    copies: list = []
    versions: Versions | None = None
    try:
        if targets:
            # resolved once (Stateful objects' state_dict() called now): the version
            # counters and the copies see the same live tensors
            named: dict = {}
            state_dict = live_view(state_dict, named)[0]
            versions = Versions(named)
        snap, copies, nbytes = saver.pool.plan(state_dict)
        if not targets:
            saver.pool.run(copies)
    except Exception as e:
        # Still join the collective save, so no other rank waits forever: it fails
        # everywhere with this rank's error.
        snap, nbytes, copies = {"state": _Unstageable(e)}, 0, []
    kw = dict(process_group=saver.group, storage_options=storage_options,
              overwrite=overwrite, base=base, compression=compression,
              block_hashes=block_hashes, side=side)
    if targets:
        copied = threading.Event()
        after = devstream.mark({src.device for _, src in copies})  # now, at the call
        fut = saver.executor.submit(_copy_then_save, saver.pool, copies, after, copied,
                                    snap, path, kw, versions)
    else:
        copied = None
        fut = saver.executor.submit(save, snap, path, **kw)
    blocked = time.perf_counter() - t0
    handle = SaveHandle(fut, path, blocked, time.perf_counter() - t1, copied)
    if targets:
        handle._fence(targets)
    saver.inflight = handle
    log.debug("async save to %s: staged %.1f MiB in %.3f s", path, nbytes / 2**20, blocked)
    return handle


def _fence_targets(fence: Any) -> list:
    """The optimizers and modules to fence on. Raises CheckpointError for anything
    else (before any copy)."""
    return targets_of(fence)


def _copy_then_save(pool: StagingPool, copies: list, after, copied: threading.Event,
                    snap: Any, path: str, kw: dict,
                    versions: Versions | None) -> CheckpointInfo:
    """The background half of a fenced save: the copy, then the commit. A failed copy,
    or a source written in place between the call and the copy's end (by something
    the fence did not hold back: the copy may hold the new values, or a mix), still
    joins the collective save, which then fails on every rank."""
    try:
        pool.run(copies, after=after)
        # before the fence opens: a fenced writer cannot have bumped a counter yet
        err = versions.error("its snapshot was taken") if versions is not None else None
        if err is not None:
            raise err
    except Exception as e:
        snap = {"state": _Unstageable(e)}
    finally:
        copied.set()
    return save(snap, path, **kw)


class _Unstageable:
    """Stands in for a state that could not be staged; flattening it reports why."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def state_dict(self):
        raise self.error

    def load_state_dict(self, sd) -> None:  # pragma: no cover - never loaded
        raise self.error
