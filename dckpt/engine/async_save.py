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
import logging
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from ..protocol.collectives import OwnGroup, drop_dead
from ..protocol.commit import CheckpointInfo, save
from .staging import StagingPool

log = logging.getLogger(__name__)


class SaveHandle:
    """The outcome of one :func:`async_save`. Every rank's handle resolves to the same
    CheckpointInfo or raises the same error."""

    def __init__(self, future: cf.Future, path: str, blocked_s: float, staged_s: float) -> None:
        self._future, self.path = future, path
        self.blocking_seconds = blocked_s  # the whole call, waiting for a previous save included
        self.staging_seconds = staged_s  # the snapshot copy alone

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit (blocking, up to ``timeout`` s) and return its info;
        raises the save's error, or TimeoutError."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)


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


def _saver(group: Any) -> _Saver:
    # Keyed on the live group object: after destroy_process_group() and a new init, the
    # default group is a new object and gets a new saver (and checkpoint group).
    initialized = dist.is_available() and dist.is_initialized()
    key = group if group is not None else (dist.group.WORLD if initialized else None)
    with _LOCK:
        for stale in drop_dead(_SAVERS, key):  # their groups were destroyed
            stale.executor.shutdown(wait=False)
        if key not in _SAVERS:
            _SAVERS[key] = _Saver(group)
        return _SAVERS[key]


def async_save(state_dict: Any, path: str, *, process_group: Any = None,
               storage_options: dict | None = None, overwrite: bool = False,
               staging_budget: int | None = None, base: str | None = None,
               compression: str | None = None) -> SaveHandle:
    """Snapshot ``state_dict`` and persist it to ``path`` in the background.

    Collective (every rank calls it, in the same order). Blocks until the previous
    async save of this group has finished (at most one in flight), then until the
    snapshot is complete: CPU tensors copied into reusable host buffers, CUDA tensors
    into pinned ones with non-blocking copies and one synchronisation. The caller may
    change its tensors as soon as this returns. The commit has every guarantee of
    :func:`dckpt.save`; its outcome, or any rank's error, is on every rank's handle.
    ``staging_budget`` caps the host memory of the staging buffers (bytes). ``base``
    and ``compression`` are :func:`dckpt.save`'s (incremental and compressed saves):
    the hashing, comparing and compressing run in the background, not in the call."""
    t0 = time.perf_counter()
    saver = _saver(process_group)
    if saver.inflight is not None:
        try:
            saver.inflight.result()
        except Exception as e:  # already reported through its own handle
            log.debug("previous async save failed: %s", e)
    saver.pool.budget = staging_budget
    t1 = time.perf_counter()
    try:
        snap, nbytes = saver.pool.snapshot(state_dict)
    except Exception as e:
        # Still join the collective save, so no other rank waits forever: it fails
        # everywhere with this rank's error.
        snap, nbytes = {"state": _Unstageable(e)}, 0
    blocked = time.perf_counter() - t0
    fut = saver.executor.submit(save, snap, path, process_group=saver.group,
                                storage_options=storage_options, overwrite=overwrite,
                                base=base, compression=compression)
    handle = SaveHandle(fut, path, blocked, time.perf_counter() - t1)
    saver.inflight = handle
    log.debug("async save to %s: staged %.1f MiB in %.3f s", path, nbytes / 2**20, blocked)
    return handle


class _Unstageable:
    """Stands in for a state that could not be staged; flattening it reports why."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def state_dict(self):
        raise self.error

    def load_state_dict(self, sd) -> None:  # pragma: no cover - never loaded
        raise self.error
