"""What :class:`~dckpt.manager.core.CheckpointManager` saves and the asynchronous save
in flight: the saved tree (the state, each rank's RNG, the manager's epoch and
timeline values), staging buffers prepared ahead of the first async save, and the
joining of the save in flight (a mixin; it uses the manager's attributes)."""
from __future__ import annotations

import logging
from typing import Any

from ..engine import devstream
from ..engine.staging import live_view
from ..protocol.async_save import SaveHandle
from ..protocol.async_save import prepare_async_save as _prepare_async
from ..state import rng
from ..state.training import fence_targets
from . import history
from ..state.flatten import is_stateful

log = logging.getLogger("dckpt.manager.core")  # one logger for the manager's messages


def holds_stateful(state: Any) -> bool:
    """Whether ``state`` (nested dicts, lists, tuples) holds an object with
    ``state_dict``/``load_state_dict``. No I/O; O(containers)."""
    if is_stateful(state):
        return True
    if isinstance(state, dict):
        return any(holds_stateful(v) for v in state.values())
    if type(state) in (list, tuple):
        return any(holds_stateful(v) for v in state)
    return False


class InflightMixin:
    """The saved tree and the async save in flight of a CheckpointManager."""

    @staticmethod
    def _record_async(pending: history.PendingSave, h: SaveHandle) -> None:
        """Rank 0, when an async save is over: record it if it committed. Runs in the
        persist thread (or at once); only queues the write."""
        if h.exception() is None:
            info = h.result()
            pending.committed("durable", info.bytes_written, info.world_size, info.save_id)

    def _full(self, state: Any) -> dict[str, Any]:
        full: dict[str, Any] = {"state": state}
        if self.capture_rng:
            full["rng"] = {f"rank{self.comm.rank}": rng.capture()}
        manager: dict[str, Any] = {}
        if self._epoch is not None:  # read back by restore (restored_epoch)
            manager["epoch"] = self._epoch
        if self._parent is not None:  # the explicit timeline: tiers.chooser.timeline_of
            manager["parent"] = self._parent
        if self._after is not None:
            manager["after"] = self._after
        if manager:
            full["manager"] = manager
        return full

    def _prepare(self, state: Any, *, loaded: bool = True) -> None:
        """Async mode: allocate and touch the staging buffers now, so the first save
        blocks no longer than later ones. Collective (the async saver's group is made
        here on first use). Failures are only logged: the save will allocate then.

        ``loaded=False`` (a restore that found nothing): ``state`` must come out exactly
        as it went in, and a Stateful object's ``state_dict()`` may change it (a
        TrainingState's initialises a fresh optimizer with a zero-lr step: Adam's step
        count becomes 1 and every later bias correction is off by one). A state holding
        one is not prepared then; its first save allocates the buffers instead."""
        if not self.async_save:
            return
        if not loaded and holds_stateful(state):
            return
        try:
            full = self._full(state)
            if self.tier is not None and fence_targets(state):
                full, _, devices = live_view(full)  # resolved once, for the check and the buffers
                if devstream.live_devices_ok(devices):
                    # the tier is written from the live tensors (GPU ones through a
                    # small pinned bounce pair, pinned now): no buffers to hold
                    devstream.prepare(devices)
                    return
            if self.tier is not None:
                nbytes = self.tier.pool.prepare(full)
            else:  # the saver, its group and the buffers: what the first call would make
                nbytes = _prepare_async(full, process_group=self.group)
            log.debug("staging buffers ready: %.1f MiB", nbytes / 2**20)
        except Exception as e:
            log.warning("could not prepare staging buffers (the first save allocates "
                        "them): %s", e)

    def _finish_inflight(self, raise_error: bool) -> None:
        if self._inflight is not None:
            step, h = self._inflight
            self._inflight = None
            try:
                info = h.result()
            except Exception as e:
                self._base = None
                log.error("checkpoint of step %d failed: %s", step, e)
                self._error = e
            else:
                self._committed(step, info.save_id)
        if raise_error and self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait_snapshot(self) -> None:
        """Block until the in-flight async save's snapshot copy is complete (changing
        the saved state is safe after it). Not collective; no-op without one."""
        if self._inflight is not None:
            self._inflight[1].wait_snapshot()
        if self.tier is not None:
            self.tier.wait_snapshot()
