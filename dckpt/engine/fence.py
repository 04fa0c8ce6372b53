"""Fences: hold back what changes a snapshot's live tensors until the snapshot is taken.

A fenced save returns before its snapshot is taken (the copy into host buffers runs in
the background, or the fast tier's files are written straight from the live tensors).
Until it is taken, a :class:`Fence` makes each target wait where it would change them:

- an optimizer at every ``step()`` (a step pre-hook, first in line);
- a module at the forward of each of its modules that can write a saved tensor in
  place (forward pre-hooks, first in line), chosen without a list of classes
  (:mod:`dckpt.engine.writers`): a module with persistent buffers of its own
  (BatchNorm's running stats, spectral norm's ``u``/``v``, a custom buffer), or one
  seen writing its own parameters or buffers during a forward (the rows
  ``Embedding(max_norm=)`` renormalises). At the first fenced save of a model, before
  anything is learned, every forward waits. The other forwards (plain ``Linear``
  layers, attention) run at once, so the copy or the fast tier's write overlaps the
  next forward and backward passes, and only the optimizer's step (and the writers)
  wait, as in CheckFreq or torchtitan.

Each hook waits on the snapshot's event by itself, so two targets fired from two threads
both wait, and a wait interrupted (a KeyboardInterrupt) leaves that hook and every other
one armed. A fence is disarmed only once the snapshot is taken: a module's hooks remove
themselves after its first call that ends after that, once the outermost call returns
(torch iterates over a copy of a module's hooks, so this is safe), so later forwards
pay nothing; an optimizer's hook
(torch iterates over the live dict) stays, a check of one event per step, until
:meth:`Fence.disarm`. Arming costs O(modules + tensors) per save, no per-element work
(about 40 ms for 4,500 modules on a CPU, and about 40 ms more for each forward under
the hooks, only while the snapshot is taken: :mod:`dckpt.engine.writers`).

What a fence does not hold back (a ``p.add_()`` outside the optimizer, an EMA update
before the next forward, a forward that writes a saved tensor for the first time) is
caught, not prevented: :class:`Versions` reads each saved tensor's version counter
(torch bumps it at every in-place write through the tensor or a view of it) at the
call and again when the snapshot is taken, and the save fails naming the tensor; a
module whose forward wrote is learned then, and waits from the next save on. A write
through ``.data`` or numpy does not bump the counter: the fast tier's read-back and the
GPU fingerprint (dckpt.engine.devstream) still catch such a change while the files are
written, not one made before.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from .writers import ModuleHooks, eager_modules, remove

__all__ = ["Fence", "Versions", "eager_modules", "releaser", "targets_of"]


class Fence:
    """The hooks of one fenced save. ``done`` is set once the snapshot is taken (also
    when it failed); ``on_wait(seconds)`` is told the time training lost waiting
    (waits that overlap, from several threads, are counted once)."""

    def __init__(self, done: threading.Event,
                 on_wait: Callable[[float], None] | None = None) -> None:
        self.done, self._on_wait = done, on_wait
        self._lock = threading.Lock()
        self._first_wait: float | None = None  # the start of the earliest wait
        self._counted = False
        self.hooks: list = []  # every handle, removed by disarm()

    def wait(self) -> None:
        """Block until the snapshot is taken; returns at once after. Interruptible
        (KeyboardInterrupt): nothing is disarmed then."""
        if self.done.is_set():
            return
        t0 = time.perf_counter()
        with self._lock:
            if self._first_wait is None or t0 < self._first_wait:
                self._first_wait = t0
        self.done.wait()
        t1 = time.perf_counter()
        with self._lock:
            # every wait ends when the event is set: their union runs from the
            # earliest start to now, counted by the first to get here
            lost, self._counted = (None if self._counted else t1 - self._first_wait), True
        if lost is not None and self._on_wait is not None:
            self._on_wait(lost)

    def arm(self, targets: list) -> None:
        """Register the hooks on ``targets`` (optimizers and modules, checked by
        :func:`targets_of`): a step pre-hook per optimizer, the forward hooks of
        :class:`~dckpt.engine.writers.ModuleHooks` on each module's eager submodules.
        Call it from the thread that owns the targets, once per save;
        O(targets + their modules and tensors), no wait."""
        modules = None
        for t in targets:
            if isinstance(t, torch.optim.Optimizer):
                self._hook_step(t)
            else:
                if modules is None:
                    modules = ModuleHooks(self.wait, self.done, self.hooks)
                modules.arm(t)

    def _hook_step(self, opt: torch.optim.Optimizer) -> None:
        def hook(*_args, **_kwargs) -> None:
            self.wait()

        h = opt.register_step_pre_hook(hook)
        # First in line: a pre-hook registered earlier may change state too (a
        # load-balancing bias updated before each step). torch's global optimizer
        # pre-hooks still run before it.
        hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
        if hooks is not None and h.id in hooks:
            hooks.move_to_end(h.id, last=False)
        self.hooks.append(h)

    def disarm(self) -> None:
        """Remove every hook. Call it from the training thread (an optimizer's hook
        must not be removed while its step runs), once the save is over."""
        hooks, self.hooks = self.hooks, []
        for h in hooks:
            remove(h)


def targets_of(fence: Any) -> list:
    """The optimizers and modules of ``fence`` (one, or a list or tuple of them).
    Raises CheckpointError for anything else (before any copy)."""
    if fence is None:
        return []
    items = list(fence) if isinstance(fence, (list, tuple)) else [fence]
    for f in items:
        if not isinstance(f, (torch.optim.Optimizer, torch.nn.Module)):
            raise CheckpointError(f"fence must be an optimizer or module (or a list of them), "
                                  f"not {type(f).__name__}")
    return items


class Versions:
    """The version counters of a snapshot's live tensors, read at the call (in the
    training thread), to find a write the fence did not hold back. O(tensors), no I/O.
    ``named``: the live tensors by key, as :func:`dckpt.engine.staging.live_view`
    gathers them in the walk that resolves the state (a DTensor's own counter is read,
    not its local shard's: an in-place op on a DTensor bumps only the former)."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self._keys = list(named)
        self._tensors = [named[k] for k in self._keys]
        self._at_call = [t._version for t in self._tensors]

    def changed(self) -> str | None:
        """The name of the first tensor written in place since the call, or None."""
        for i, (t, v) in enumerate(zip(self._tensors, self._at_call)):
            if t._version != v:
                return self._keys[i]
        return None

    def error(self, where: str, rank: int | None = None) -> CheckpointError | None:
        """A CheckpointError naming the tensor written since the call (and ``rank``),
        or None."""
        name = self.changed()
        if name is None:
            return None
        who = "" if rank is None else f"rank {rank}: "
        return CheckpointError(
            f"{who}tensor {name!r} changed while {where}: it was written in place after the "
            "save was called, by something the fence does not hold back (the fenced "
            "optimizers' step() waits, and the forwards of the fenced modules known to "
            "write saved tensors; a manual p.add_(), an EMA update or a load do not, "
            "nor a forward seen writing for the first time: that one waits from the "
            "next save on). Fence that too (save(..., fence=)) or call wait_snapshot() "
            "before changing it. The save is not committed")


def releaser(done: threading.Event, versions: Versions, where: str,
             rank: int | None = None) -> Callable[[], None]:
    """The callable a writer of live tensors calls once it no longer reads them (the
    ``written`` of :func:`dckpt.tiers.local.save_local`): the first call checks
    ``versions`` and raises the error naming a tensor written since the call, so that
    the save fails instead of committing it, unless an exception is already on its
    way (that one is the save's error); every call then sets ``done``, the fence's
    event. Idempotent once the check ran."""
    checked = [False]

    def release() -> None:
        err = None
        try:
            if not checked[0]:
                checked[0] = True
                if sys.exc_info()[1] is None:
                    err = versions.error(where, rank)
        finally:
            done.set()  # after the check: a fenced writer bumps nothing before it
        if err is not None:
            raise err

    return release
