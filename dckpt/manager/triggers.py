"""When :class:`~dckpt.manager.core.CheckpointManager` saves: the policy's decision
(taken on rank 0 and broadcast when it depends on clocks), a SIGTERM noted for a final
save, and saves requested from any thread (a mixin; it uses the manager's ``comm``,
``policy`` and bookkeeping attributes)."""
from __future__ import annotations

import time


class TriggerMixin:
    """The save decision of :meth:`CheckpointManager.save`. Collective where noted."""

    def _decide(self, step: int, force: bool, epoch: int | None = None) -> bool:
        now = time.monotonic()
        if self._calls is not None and step > self._calls[0]:
            dt = (now - self._calls[1]) / (step - self._calls[0])
            self.step_seconds = dt if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * dt
        self._calls = (step, now)
        due = force or self.policy.due(step, self._last_step, now - self._last_time,
                                       self.save_seconds, self.step_seconds,
                                       epoch=epoch, last_epoch=self._epoch)
        if self.policy.every_seconds is None and not force and self.policy.every_steps != "auto":
            # A pure function of the step and epoch: the same on every rank, no collective.
            return due
        # Clocks and measured times differ per rank: rank 0 decides for everyone.
        return self.comm.broadcast_bytes(b"1" if due else b"0") == b"1"

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def request_save(self) -> None:
        """Ask for a save at the next :meth:`save` call (a preemption notice, a node
        health check). Not collective: call it on any rank, from any thread (a signal
        handler too); the next :meth:`save` on every rank agrees on it (one all-reduce
        of two ints per call) and saves that step, in every tier."""
        self._requested = True

    def _votes(self) -> tuple[bool, bool]:
        """(preempted, save requested), agreed by every rank: one all-reduce of two ints
        per :meth:`save` call, O(1) in the number of ranks."""
        mine = [self._sigterm and self.save_on_sigterm, self._requested]
        self._requested = False
        preempted, requested = self.comm.any_of(mine)
        return preempted, requested
