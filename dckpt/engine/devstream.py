"""Writing CUDA tensors to a file through a small, reused pinned bounce buffer.

Why: written the plain way, a GPU tensor is first copied to the host whole
(:func:`dckpt.state.tensors.as_bytes`), so a fast-tier save of a GPU state held a full
host copy (pinned staging buffers) beside the tier's files: two host copies. A
:class:`DeviceSource` hands the shard writer its bytes a bounce block at a time
instead: two reused pinned buffers of ``BOUNCE`` bytes per device, filled on a side
stream, so the copy of block k+1 runs while block k is written and checksummed. Host
memory: 2 x BOUNCE per device and concurrent writer, whatever the state's size.

Ordering: the side stream first waits for ``after``, a CUDA event recorded on the
caller's stream when the save was asked for (see :func:`mark`; write_file records one
per GPU for a synchronous save): every kernel queued before it has run. Nothing here stops a kernel
queued later from changing a tensor before or while it is copied (blocks are copied as
the writer reaches them, possibly seconds later): the caller fences the optimizer (see
the ``fence`` of :func:`dckpt.async_save`) and releases it once the files are written.
What the fence does not hold back is caught, not prevented: each tensor's
:func:`fingerprint` before its first block and after its last must agree, else the
save fails naming it (the CPU path's equivalent is the fast tier's read-back). The event
covers the caller's current stream only: a tensor last written on another stream must
be synchronised into it first, as for any CUDA consumer.

``STREAM_CPU`` (tests only) sends CPU tensors through the same blocks, with plain
buffers and no stream, so the block logic runs on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from ..errors import CheckpointError
from ..state.tensors import byte_tensor
from .buffers import aligned_empty

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
    """Two host buffers of ``size`` bytes, pinned for a CUDA ``device``."""

    def __init__(self, device: torch.device, size: int) -> None:
        cuda = device.type == "cuda"
        # ``size`` is a power of two (BOUNCE) in use: pinned exactly, with no rounding
        self.bufs = [aligned_empty((size,), torch.uint8, cuda) for _ in range(2)]
        self.cuda = cuda


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


@contextlib.contextmanager
def on(stream: Any) -> Iterator[None]:
    """``stream`` as the current stream, on its own device (no-op for None: CPU work).
    The device is entered first: ``torch.cuda.stream`` alone restores, on exit, the
    stream of the thread's current device, which in a fresh thread is GPU 0, and so
    makes a CUDA context there on every rank."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def side_stream(device: torch.device, after: Any = None) -> Any:
    """A side stream of ``device`` that first waits for the event ``after`` or, without
    one, for everything queued so far on this thread's current stream of ``device``.
    Cheap, does not block."""
    s = torch.cuda.Stream(device)
    if after is not None:
        s.wait_event(after)
    else:
        s.wait_stream(torch.cuda.current_stream(device))  # read before entering ``s``
    return s


def fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """A wrapping int64 sum of the bytes of ``flat`` (uint8, 1-D) read as words: one
    reduction at memory speed on its own device, no copy, no sync. Any realistic
    change (an update, a partial overwrite) changes it; it is a detector of a tensor
    changed while it was written, not a checksum of the file (CRC32s are that)."""
    words = flat.numel() // 8
    head = None
    if words:
        try:  # a view needs an 8-byte aligned offset; else bytes, 8x more adds
            head = flat[:words * 8].view(torch.int64).sum()
        except RuntimeError:
            head = None
    if head is None:
        return flat.sum(dtype=torch.int64)
    return head + flat[words * 8:].sum(dtype=torch.int64)


class DeviceSource:
    """A tensor's bytes for :func:`dckpt.format.shards.write_shard`, produced block by
    block (see the module docstring). ``len()`` is its byte count; :meth:`blocks` may
    be iterated more than once (a streamed writer checksums first, then writes).

    Without ``after`` the copies wait for the current stream of the thread that
    iterates :meth:`blocks`. ``name`` names the tensor in errors."""

    def __init__(self, tensor: torch.Tensor, after: Any = None, name: str = "") -> None:
        self.tensor, self.after, self.name = tensor, after, name
        self._first: Any = None  # the first pass's fingerprint: every pass ends equal to it

    def __len__(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def blocks(self, multiple: int) -> Iterator[memoryview]:
        """The bytes in order, in views of a multiple of ``multiple`` bytes (but the
        last): about BOUNCE each. A view is valid until the next one is asked for.
        Blocking per block: waits for its device-to-host copy. After the last block,
        the tensor's :func:`fingerprint` is compared with the one taken before the
        first: a tensor changed while it was copied (by something no fence held back)
        raises CheckpointError naming it, instead of a torn tensor being saved. Raises
        what the copy raises (a CUDA error); the bounce pair is released on any exit."""
        n = len(self)
        if n == 0:
            return
        step = max(1, BOUNCE // multiple) * multiple
        spans = [(off, min(step, n - off)) for off in range(0, n, step)]
        dev = self.tensor.device
        with _bounce(dev, step) as b:
            s = side_stream(dev, self.after) if b.cuda else None
            try:
                yield from self._copies(b, s, spans)
            finally:
                if s is not None:
                    s.synchronize()  # a copy still landing must not hit the next user

    def _copies(self, b: _Bounce, s: Any, spans: list) -> Iterator[memoryview]:
        with on(s), torch.no_grad():
            # made on the side stream, after the event: a non-contiguous tensor's
            # packed copy lives in device memory, never on the host
            flat = byte_tensor(self.tensor)
            if self._first is None:
                self._first = fingerprint(flat)
            # a sequential writer reads twice (checksums, then data): both passes
            # must see the bytes the first one started from
            before = self._first
        landed: list[Any] = [None, None]

        def issue(i: int) -> None:
            off, k = spans[i]
            with on(s), torch.no_grad():
                b.bufs[i % 2][:k].copy_(flat[off:off + k], non_blocking=s is not None)
                landed[i % 2] = s.record_event() if s is not None else None

        issue(0)
        for i, (_, k) in enumerate(spans):
            if i + 1 < len(spans):
                issue(i + 1)  # into the other buffer, whose block was consumed
            if landed[i % 2] is not None:
                landed[i % 2].synchronize()
            yield memoryview(b.bufs[i % 2][:k].numpy())
        with on(s), torch.no_grad():
            after = fingerprint(byte_tensor(self.tensor))
            same = bool(torch.equal(before, after))  # syncs ``s``
        if not same:
            raise CheckpointError(
                f"tensor {self.name!r} ({self.tensor.device}) changed while it was written: something "
                "modified it before the fenced optimizer step or module forward; fence "
                "that too (save(..., fence=)) or call wait_snapshot() before changing "
                "it. The save is not committed")
