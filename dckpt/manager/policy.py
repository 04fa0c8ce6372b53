"""When to save and what to keep: small, pure policy objects used by CheckpointManager."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young/Daly's optimal time between checkpoints, ``sqrt(2 * C * MTBF)``, for a
    save that stalls training ``C`` seconds and a mean time between failures MTBF.

    Worked example: a save blocks training 20 s and the job fails on average every
    24 h (86,400 s): sqrt(2 * 20 * 86400) = 1,859 s, so checkpoint about every 31 min;
    at 1.5 s per step that is every 1,239 steps. The expected loss per failure is then
    half an interval of work plus the save costs, the minimum of their sum."""
    if save_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("save_seconds and mtbf_seconds must be positive")
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def estimate_mtbf_hours(failures: int, hours_observed: float, prior_hours: float = 24.0) -> float:
    """The mean time between failures, estimated from ``failures`` seen over
    ``hours_observed`` hours of the job, with a prior of one failure per ``prior_hours``
    (counted as one failure and ``prior_hours`` of observation): ``(hours + prior) /
    (failures + 1)``. With no failure it starts at the prior and grows as the job runs
    without one; failures coming quickly pull it down, so the interval shortens. Pure.

    Worked example: 3 restarts in the first 6 h of a job: (6 + 24) / 4 = 7.5 h, against
    24 h before any. Raises ValueError for negative inputs."""
    if failures < 0 or hours_observed < 0 or prior_hours <= 0:
        raise ValueError("failures and hours_observed must be >= 0, prior_hours > 0")
    return (hours_observed + prior_hours) / (failures + 1)


def check_epoch(epoch: object) -> int | None:
    """``epoch`` as an int (None stays None). Pure. Raises ValueError unless it is an
    integer >= 0 (a bool is refused: ``epoch=True`` is a bug, not epoch 1)."""
    if epoch is None:
        return None
    try:
        if isinstance(epoch, bool):
            raise TypeError
        e = operator.index(epoch)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        raise ValueError(f"epoch must be an int >= 0 (the epoch that just ended, counting "
                         f"from 0), got {epoch!r}") from None
    if e < 0:
        raise ValueError(f"epoch must be >= 0 (the epoch that just ended, counting from 0), "
                         f"got {e}")
    return e


@dataclass
class SavePolicy:
    """Save every ``every_steps`` steps and/or every ``every_seconds`` seconds and/or at
    the end of every ``every_epochs``-th epoch; a step is saved when any of them is due.
    ``every_steps="auto"`` derives the step interval from :func:`young_daly_interval`
    with the save blocking time and step time measured as the job runs (until both
    are known, it saves every ``auto_warmup_steps``). With ``"auto"`` and no
    ``mtbf_hours``, the owner (CheckpointManager) estimates it from the failures it
    observes (:func:`estimate_mtbf_hours`) and sets ``estimated_mtbf_hours``.

    Epochs count from 0, as ``for epoch in range(num_epochs)`` does: the save call made
    at the end of epoch ``e`` passes ``epoch=e``, and ``every_epochs=N`` saves after
    epochs N-1, 2N-1, ... (the N-th, 2N-th, ... epoch), as Lightning's
    ``every_n_epochs`` does. See :meth:`epoch_due`."""

    every_steps: int | str | None = None
    every_seconds: float | None = None
    mtbf_hours: float | None = None
    auto_warmup_steps: int = 100
    estimated_mtbf_hours: float = 24.0  # used when mtbf_hours is None
    every_epochs: int | None = None

    def __post_init__(self) -> None:
        if self.every_steps == "auto":
            if self.mtbf_hours is not None and self.mtbf_hours <= 0:
                raise ValueError('every_steps="auto" needs mtbf_hours > 0 (or None: estimated '
                                 'from the restarts observed)')
        elif self.every_steps is not None and (not isinstance(self.every_steps, int)
                                               or self.every_steps < 1):
            raise ValueError(f"every_steps must be a positive int or 'auto', got {self.every_steps!r}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError("every_seconds must be positive")
        if self.every_epochs is not None and (isinstance(self.every_epochs, bool)
                                              or not isinstance(self.every_epochs, int)
                                              or self.every_epochs < 1):
            raise ValueError(f"every_epochs must be a positive int, got {self.every_epochs!r}")

    def step_interval(self, save_seconds: float | None, step_seconds: float | None) -> int | None:
        """The current step interval (None when not step based)."""
        if self.every_steps != "auto":
            return self.every_steps  # type: ignore[return-value]
        if not save_seconds or not step_seconds:
            return self.auto_warmup_steps
        seconds = young_daly_interval(save_seconds, (self.mtbf_hours or self.estimated_mtbf_hours)
                                      * 3600.0)
        return max(1, round(seconds / step_seconds))

    def epoch_due(self, step: int, last_step: int | None, epoch: int | None,
                  last_epoch: int | None) -> bool:
        """Whether the save call of ``step``, made at the end of epoch ``epoch`` (None:
        not at the end of an epoch), is due under ``every_epochs``. Pure, so every rank
        that passes the same epoch decides the same without a collective.

        Due when ``(epoch + 1) % every_epochs == 0``, unless that epoch was already
        seen (``epoch <= last_epoch``: the last epoch passed to a save call, or the
        epoch recorded with the checkpoint a restore loaded), or ``step`` is the step
        saved (or restored) last: after a restart, replaying the end of an epoch that
        is already in the checkpoint does not save it again."""
        n = self.every_epochs
        if n is None or epoch is None or (epoch + 1) % n:
            return False
        if last_epoch is not None and epoch <= last_epoch:
            return False
        return step != last_step

    def due(self, step: int, last_step: int | None, elapsed_s: float | None,
            save_seconds: float | None = None, step_seconds: float | None = None,
            epoch: int | None = None, last_epoch: int | None = None) -> bool:
        """Whether ``step`` should be saved, given the last saved step and the seconds
        since the last save (or since the start), and for ``every_epochs`` the epoch
        that ends with this call (None: none) and the last epoch seen (see
        :meth:`epoch_due`). Any policy that is due saves."""
        if self.epoch_due(step, last_step, epoch, last_epoch):
            return True
        n = self.step_interval(save_seconds, step_seconds)
        if n is not None and (step - (last_step or 0)) >= n:
            return True
        return bool(self.every_seconds is not None and elapsed_s is not None
                    and elapsed_s >= self.every_seconds)
