"""Snapshotting a state into reusable host buffers (pinned for CUDA tensors)."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..state.flatten import JSON_TYPES, is_bare_native, is_stateful
from ..state.tensors import DTensor, check_plain, is_sharded_tensor, restage_sharded
from . import devstream
from .buffers import aligned_empty

log = logging.getLogger(__name__)


_ROUND_CONF = "pinned_max_round_threshold_mb"
_warned_rounding = False


def pinned_waste(sizes: list[int]) -> int:
    """Host bytes torch's caching host allocator adds to pinned buffers of ``sizes``: it
    rounds each allocation up to a power of two (unless ``pinned_max_round_threshold_mb``
    in PYTORCH_CUDA_ALLOC_CONF says otherwise). Pure."""
    return sum((1 << (n - 1).bit_length()) - n for n in sizes if n > 0)


def _warn_rounding(sizes: list[int]) -> None:
    """Warn once per process when rounding costs over 10% of the pinned staging."""
    global _warned_rounding
    if _warned_rounding:
        return
    waste = pinned_waste(sizes)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if waste <= 0.1 * sum(sizes) or _ROUND_CONF in conf:
        return
    _warned_rounding = True
    log.warning(
        "pinned staging of %.1f MiB takes %.1f MiB more host memory: torch rounds each "
        "pinned allocation up to a power of two. Set PYTORCH_CUDA_ALLOC_CONF="
        "%s:16 (before CUDA starts) to pin large buffers at their size, or save into a "
        "fast tier with a fence (no staging buffers)", sum(sizes) / 2**20, waste / 2**20,
        _ROUND_CONF)


class StagingPool:
    """Host buffers reused from one snapshot to the next, keyed by state path.

    A buffer is reused when the tensor at the same key keeps its shape and dtype, so
    repeated snapshots of a training state allocate nothing after the first. CUDA
    tensors get pinned buffers (fast DMA); CPU tensors plain ones. ``budget_bytes``
    caps the pool: a snapshot that would exceed it raises CheckpointError before
    copying anything. Not thread-safe: one snapshot at a time (the caller waits for the
    previous save to finish before staging again).
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget = budget_bytes
        self.buffers: dict[str, torch.Tensor] = {}
        # key -> (buffer, layout, DTensor around it): rebuilding a DTensor costs ~0.1 ms
        # (an autograd Function and a spec), a fifth of a save's snapshot at 300 tensors
        self._wrapped: dict[str, tuple[torch.Tensor, tuple, Any]] = {}

    def release(self) -> None:
        """Free every buffer (and the DTensors wrapped around them, which hold them
        too). The next snapshot allocates afresh."""
        self.buffers.clear()
        self._wrapped.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        b = self.buffers.get(key)
        pinned = t.device.type == "cuda"
        if b is None or b.shape != t.shape or b.dtype != t.dtype or b.is_pinned() != pinned:
            b = aligned_empty(t.shape, t.dtype, pinned)
            self.buffers[key] = b
        return b

    def prepare(self, state: Any) -> int:
        """Allocate and touch the buffers a snapshot of ``state`` needs, copying nothing,
        so that the first snapshot costs what later ones do (page faults and pinning
        happen here, off the critical path: the manager calls it during ``restore``).
        Blocking CPU work of a memset of the state's size. Returns bytes prepared;
        raises what :meth:`snapshot` raises."""
        return self.snapshot(state, copy=False)[1]

    def snapshot(self, state: Any, copy: bool = True) -> tuple[Any, int]:
        """:meth:`plan` then :meth:`run` at once: returns (snapshot, bytes copied)."""
        snap, copies, total = self.plan(state)
        self.run(copies, copy)
        return snap, total

    def plan(self, state: Any) -> tuple[Any, list, int]:
        """A copy of ``state`` whose tensors live in this pool's buffers: same nesting,
        DTensors rebuilt around their staged local shards (no communication), Stateful
        objects replaced by their staged ``state_dict()``. Values dckpt cannot store are
        left as they are, so the save that follows reports them on every rank.

        Allocates the buffers and calls ``state_dict()`` of Stateful objects (in the
        caller's thread: it may run collectives), copies nothing: returns (snapshot,
        the (buffer, source) copies for :meth:`run`, their bytes)."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[str] = set()
        need = 0

        def leaf(key: str, obj: torch.Tensor) -> torch.Tensor:
            nonlocal need
            seen.add(key)
            nbytes = obj.numel() * obj.element_size()
            if self.budget is not None and nbytes > self.budget:
                raise CheckpointError(f"tensor {key!r} alone exceeds the staging budget "
                                      f"of {self.budget} bytes")
            need += nbytes
            if self.budget is not None and need > self.budget:
                # Checked before this buffer is allocated: host memory never goes
                # past the budget, even on the way to refusing.
                self.release()
                raise CheckpointError(
                    f"staging needs more than the budget of {self.budget} bytes of host "
                    f"memory ({need} by tensor {key!r}); raise staging_budget or save "
                    "synchronously")
            buf = self._buffer(key, obj)
            copies.append((buf, obj))
            return buf

        def wrap(key: str, obj: Any, local: torch.Tensor) -> Any:
            layout = (obj.device_mesh, tuple(obj.placements), tuple(obj.shape), obj.stride())
            hit = self._wrapped.get(key)
            if hit is not None and hit[0] is local and hit[1][0] is layout[0] \
                    and hit[1][1:] == layout[1:]:
                return hit[2]  # the same buffer, mesh and layout as the last snapshot
            d = rewrap(key, obj, local)
            self._wrapped[key] = (local, layout, d)
            return d

        snap = walk_state(state, leaf, wrap)
        for stale in set(self.buffers) - seen:  # keys gone from the state free their memory
            del self.buffers[stale]
            self._wrapped.pop(stale, None)
        if not _warned_rounding:
            pinned = [b.numel() * b.element_size() for b, src in copies
                      if src.device.type == "cuda"]
            if pinned:
                _warn_rounding(pinned)
        return snap, copies, sum(b.numel() * b.element_size() for b, _ in copies)

    @staticmethod
    def run(copies: list, copy: bool = True, after: dict | None = None) -> None:
        """Copy every source into its buffer (``copy=False``: touch the buffers only).
        Blocking until every copy has landed. CUDA sources are copied on a side stream
        of their own device that first waits for ``after[device]`` (a CUDA event
        recorded when the snapshot was asked for, see devstream.mark: the copies see
        every kernel queued before it), then one synchronisation per device (without an
        event: the side stream waits for the calling thread's current stream of that
        device). CPU copies release the GIL, so this may run in a background thread
        while training goes on."""
        with torch.no_grad():
            if not copy:
                for buf, _ in copies:
                    buf.zero_()  # touch every page now
                return
            by_device: dict[Any, list] = {}
            for buf, src in copies:
                by_device.setdefault(src.device, []).append((buf, src))
            streams = []
            try:
                for dev, pairs in by_device.items():
                    s = devstream.side_stream(dev, (after or {}).get(dev)) \
                        if dev.type == "cuda" else None
                    streams.append(s)
                    with devstream.on(s):
                        for buf, src in pairs:
                            buf.copy_(src.detach(), non_blocking=s is not None)
            finally:
                # the snapshot is complete before anyone moves on; after a failed
                # copy too, so that no copy still lands in a buffer being reused
                for s in streams:
                    if s is not None:
                        s.synchronize()



def rewrap(_key: str, obj: Any, local: torch.Tensor) -> Any:
    """DTensor ``obj``'s layout around ``local`` (no communication, no check)."""
    return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                              shape=obj.shape, stride=obj.stride())


def _local_of(d: Any) -> torch.Tensor:
    # The local shard itself: to_local() is an autograd Function call per tensor (about
    # as costly as rebuilding one), for the same tensor in a snapshot's no-grad copy.
    t = getattr(d, "_local_tensor", None)
    return t if isinstance(t, torch.Tensor) else d.to_local()


def walk_state(state: Any, leaf: Callable[[str, torch.Tensor], torch.Tensor],
               wrap: Callable[[str, Any, torch.Tensor], Any] = rewrap) -> Any:
    """``state`` rebuilt with every plain tensor replaced by ``leaf(key, tensor)``: same
    nesting; DTensors rebuilt by ``wrap(key, dtensor, new local tensor)`` and
    single-shard ShardedTensors around their new local
    tensor (no communication); Stateful objects (but modules and optimizers, which
    dckpt flattens itself) replaced by their ``state_dict()``, called here, in the
    caller's thread (it may run collectives). Values dckpt cannot store are left as
    they are, so the save that follows reports them on every rank. Raises what
    ``leaf`` raises, and CheckpointError for a tensor dckpt cannot store."""

    def walk(obj: Any, key: str) -> Any:
        if is_sharded_tensor(obj):
            shards = obj.local_shards()
            if len(shards) != 1:  # nothing to copy, or the save refuses it
                return obj
            return restage_sharded(obj, walk(shards[0].tensor, key))
        if isinstance(obj, DTensor):
            return wrap(key, obj, walk(_local_of(obj), key))
        if isinstance(obj, torch.Tensor):
            check_plain(key, obj)  # a clear error now, not a failed copy later
            return leaf(key, obj)
        if isinstance(obj, dict):
            return {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, f"{key}.{i}" if key else str(i)) for i, v in enumerate(obj))
        if isinstance(obj, JSON_TYPES):
            return obj
        if is_stateful(obj) and not is_bare_native(obj):
            return walk(obj.state_dict(), key)
        return obj

    return walk(state, "")


def live_view(state: Any, named: dict | None = None) -> tuple[Any, int, set]:
    """``state`` with Stateful objects resolved (their ``state_dict()`` called now, in
    the caller's thread) and every tensor kept as the live, detached tensor: what a
    save may write later, from another thread, as long as nothing changes those
    tensors first (a fence). Copies nothing. Returns (view, bytes of its tensors, the
    non-CPU devices its tensors are on). ``named``, when given, receives the view's
    tensors by key, a DTensor as itself (its own version counter is the one an
    in-place op on it bumps: :class:`dckpt.engine.fence.Versions`), in the same walk.
    Raises what :func:`walk_state` raises."""
    nbytes, devices = 0, set()

    def leaf(key: str, t: torch.Tensor) -> torch.Tensor:
        nonlocal nbytes
        nbytes += t.numel() * t.element_size()
        if t.device.type != "cpu":
            devices.add(t.device)
        t = t.detach()  # shares the version counter of the live tensor
        if named is not None:
            named[key] = t
        return t

    def wrap(key: str, d: Any, _local: torch.Tensor) -> Any:
        if named is not None:
            named[key] = d  # in place of its local shard, named by leaf just before
        return d  # kept as it is: its local shard is the live tensor already

    return walk_state(state, leaf, wrap), nbytes, devices
