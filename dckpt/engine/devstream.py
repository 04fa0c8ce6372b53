"""Writing CUDA tensors to a file through a small, reused pinned bounce buffer.

Why: written the plain way, a GPU tensor is first copied to the host whole
(:func:`dckpt.state.tensors.as_bytes`), so a fast-tier save of a GPU state held a full
host copy (pinned staging buffers) beside the tier's files: two host copies. A
:class:`DeviceSource` hands the shard writer its bytes a bounce block at a time
instead: two reused pinned buffers of ``BOUNCE`` bytes per device, filled on a side
stream, so the copy of block k+1 runs while block k is written and checksummed. Host
memory: 2 x BOUNCE per device and concurrent writer, whatever the state's size.

Ordering: the side stream first waits for ``after``, a CUDA event recorded on the
caller's stream when the save was asked for (see :func:`mark`): the bytes are the
values at the call, never those of kernels queued after it. Without an event it waits
for the writing thread's current stream. Nothing here stops a kernel queued later from
changing a tensor before its copy is issued: the caller fences the optimizer (see
the ``fence`` of :func:`dckpt.async_save`) and releases it once the files are written.

``STREAM_CPU`` (tests only) sends CPU tensors through the same blocks, with plain
buffers and no stream, so the block logic runs on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from .staging import aligned_empty

BOUNCE = 16 << 20  # bytes per bounce buffer (two per writer): ~1 ms of a PCIe copy
STREAM_CPU = False  # tests: stream CPU tensors too


def streams(t: torch.Tensor) -> bool:
    """Whether ``t`` is written through a bounce buffer (a CUDA tensor) rather than
    viewed (CPU) or copied whole (another accelerator)."""
    return t.device.type == "cuda" or (STREAM_CPU and t.device.type == "cpu")


def live_devices_ok(devices: set) -> bool:
    """Whether a state on ``devices`` (the non-CPU ones) can be written straight from
    its live tensors: CUDA only (another accelerator has no event to order by)."""
    return all(d.type == "cuda" for d in devices)


def mark(devices: set) -> dict:
    """A CUDA event recorded now on the current stream of each of ``devices`` (the
    others are skipped): what a later :class:`DeviceSource` waits for. Cheap, does not
    block; call it in the thread that queued the state's kernels."""
    return {d: torch.cuda.current_stream(d).record_event() for d in devices if d.type == "cuda"}


class _Bounce:
    """Two host buffers of ``size`` bytes (pinned for CUDA) and a side stream."""

    def __init__(self, device: torch.device, size: int) -> None:
        cuda = device.type == "cuda"
        self.size = size
        self.bufs = [aligned_empty((size,), torch.uint8, cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if cuda else None


_FREE: dict[tuple[str, int], list[_Bounce]] = {}
_LOCK = threading.Lock()


@contextlib.contextmanager
def _bounce(device: torch.device, size: int) -> Iterator[_Bounce]:
    """A bounce pair for ``device``: the kept one when free (pinning costs ms), else a
    new one (a second writer at once). Kept again after use, one per device."""
    key = (str(device), size)
    with _LOCK:
        free = _FREE.get(key)
        b = free.pop() if free else None
    if b is None:
        b = _Bounce(device, size)
    try:
        yield b
    finally:
        if b.stream is not None:
            b.stream.synchronize()  # a copy still landing must not hit the next user
        with _LOCK:
            if not _FREE.get(key):
                _FREE[key] = [b]


def prepare(devices: set) -> None:
    """Allocate (and pin) the bounce buffers of ``devices`` now, off the first save's
    critical path. Blocking: a pinned allocation of 2 x BOUNCE per CUDA device."""
    for d in devices:
        if d.type == "cuda":
            with _bounce(d, BOUNCE):
                pass


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8)


class DeviceSource:
    """A tensor's bytes for :func:`dckpt.format.shards.write_shard`, produced block by
    block (see the module docstring). ``len()`` is its byte count; :meth:`blocks` may
    be iterated more than once (a streamed writer checksums first, then writes)."""

    def __init__(self, tensor: torch.Tensor, after: Any = None) -> None:
        self.tensor, self.after = tensor, after

    def __len__(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def blocks(self, multiple: int) -> Iterator[memoryview]:
        """The bytes in order, in views of a multiple of ``multiple`` bytes (but the
        last): about BOUNCE each. A view is valid until the next one is asked for.
        Blocking per block: waits for its device-to-host copy. Raises what the copy
        raises (a CUDA error); the bounce pair is released on any exit."""
        n = len(self)
        if n == 0:
            return
        step = max(1, BOUNCE // multiple) * multiple
        spans = [(off, min(step, n - off)) for off in range(0, n, step)]
        with _bounce(self.tensor.device, step) as b:
            s = b.stream

            def on() -> Any:  # the side stream as the current one (a fresh context each time)
                return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

            with on(), torch.no_grad():
                if s is not None:
                    if self.after is not None:
                        s.wait_event(self.after)
                    else:
                        s.wait_stream(torch.cuda.current_stream(self.tensor.device))
                # made on the side stream, after the event: a non-contiguous tensor's
                # packed copy lives in device memory, never on the host
                flat = _flat_bytes(self.tensor)
            landed: list[Any] = [None, None]

            def issue(i: int) -> None:
                off, k = spans[i]
                with on(), torch.no_grad():
                    b.bufs[i % 2][:k].copy_(flat[off:off + k], non_blocking=s is not None)
                    landed[i % 2] = s.record_event() if s is not None else None

            issue(0)
            for i, (_, k) in enumerate(spans):
                if i + 1 < len(spans):
                    issue(i + 1)  # into the other buffer, whose block was consumed
                if landed[i % 2] is not None:
                    landed[i % 2].synchronize()
                yield memoryview(b.bufs[i % 2][:k].numpy())
