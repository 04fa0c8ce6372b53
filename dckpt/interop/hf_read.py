"""The reads of :func:`dckpt.load_hf` (see :mod:`dckpt.interop.hf_load`): which bytes of a
safetensors tensor a rank reads for one box of it (:class:`Runs`, pure), and the
threads that read them into place (:func:`read_all`).

A tensor is stored C-contiguous, so the elements of a box lie in *runs*: the innermost
dim the box does not cover whole, and every dim after it, are one contiguous byte range
per index of the dims before it (a row-sharded box is one run; a column slice of a
matrix is one run per row). Runs are read one request each, except that consecutive
runs of the same *line* (consecutive indices of the dim just outside the run) are read
as one request when the gap between two of them is at most ``join_gap`` bytes and the
box still has that many bytes of its ``waste`` allowance left (at most
:data:`MAX_RUNS` runs a request: one scatter read, each run straight into its place,
each gap into a scratch buffer). So a box costs its own bytes plus at most ``waste``
bytes, whatever its shape: on a local file system ``waste`` is :data:`WASTE` (64 KiB)
per box (a small column-sliced tensor is one read, a large one a read per row
segment); on an object store, where a request costs a round trip, gaps up to 1 MiB are
joined with no allowance.

Large boxes are first cut along their outermost dims (:func:`dckpt.layout.reshard.
split_item`) so that no read exceeds ``chunk`` bytes (or one innermost row): the
temporaries of a cast or a device copy stay bounded, and the reads spread over threads.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import CheckpointError
from ..format.dtypes import ITEMSIZE, to_torch
from ..layout.chunks import Box
from ..layout.reshard import ReadItem, byte_span, split_item, strides
from ..progress import Progress
from ..state.tensors import LocalPiece

log = logging.getLogger("dckpt.interop.hf_load")  # progress lines under the API's logger

WASTE = 64 << 10  # bytes a box may read beyond its own on random-access storage
JOIN_GAP_OBJECT_STORE = 1 << 20  # as dckpt.engine.reader.COALESCE_GAP
MAX_RUNS = 512  # runs per request: 2 * 512 - 1 buffers stay under Linux's IOV_MAX (1024)


def box_item(shape: tuple[int, ...], box: Box) -> ReadItem | None:
    """The read of ``box`` from a stored tensor of ``shape`` (one chunk holding it
    whole), in the coordinates :mod:`dckpt.layout.reshard` uses: ``src`` in the
    tensor, ``dst`` in the box; None when the box is empty."""
    if box.numel == 0:
        return None
    src = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
    dst = tuple(slice(0, n) for n in box.sizes)
    return ReadItem(0, 0, src, dst, tuple(box.sizes) == tuple(shape), True)


def cut(shape: tuple[int, ...], item: ReadItem, itemsize: int, chunk: int) -> list[ReadItem]:
    """``item`` cut so that each part's byte span fits ``chunk`` (or is one innermost
    row): see :func:`dckpt.layout.reshard.split_item`."""
    return split_item(item, list(shape), itemsize, chunk)


def span_of(shape: tuple[int, ...], item: ReadItem, itemsize: int) -> tuple[int, int]:
    """Bytes ``[a, b)`` of the stored tensor from the first element of ``item`` to just
    past its last."""
    return byte_span(list(shape), item.src, itemsize)


class Runs:
    """The requests that read ``item`` (a part of a box of a stored tensor of ``shape``,
    C order) into a local tensor with element strides ``local_strides`` (``item.dst``
    in its coordinates). Iterating yields ``(start, nbytes, m, dst)``: bytes ``[start,
    start + nbytes)`` of the stored tensor hold ``m`` runs of one line, each of
    ``run_bytes`` bytes, ``gap_bytes`` apart, whose destination starts at element
    ``dst`` of the local tensor (the next run's ``dst_strides[0]`` further). The
    elements of the ``m`` runs, in the read and in the local tensor, are the views of
    shape ``(m, *run_shape)`` with element strides ``src_strides`` and ``dst_strides``.
    ``extra``: bytes read beyond the box so far (at most ``waste``). Iteration is
    O(runs) time and O(1) memory; it happens once."""

    def __init__(self, shape: tuple[int, ...], item: ReadItem, itemsize: int,
                 local_strides: tuple[int, ...], join_gap: int, waste: int,
                 max_runs: int = MAX_RUNS) -> None:
        self.shape, self.item, self.isz = tuple(shape), item, itemsize
        self.join_gap, self.waste, self.max_runs = join_gap, waste, max(1, max_runs)
        self.extra = 0
        src, dst, nd = item.src, item.dst, len(shape)
        ls = tuple(local_strides)
        if nd == 0:
            self.k, self.run_shape, self.src_strides, self.dst_strides = 0, (), (0,), (0,)
            self.run_bytes, self.gap_bytes = itemsize, 0
            return
        st = strides(shape)
        self.st = st
        # k: the innermost dim the part does not cover whole (0 when it covers it all)
        k = next((d for d in range(nd - 1, -1, -1) if src[d].stop - src[d].start != shape[d]), 0)
        self.k = k
        self.run_shape = (src[k].stop - src[k].start, *shape[k + 1:])
        run = self.run_shape[0] * st[k]  # elements per run
        step = st[k - 1] if k else 0  # elements from one run of a line to the next
        self.run_bytes = run * itemsize
        self.gap_bytes = (step - run) * itemsize if k else 0
        self.src_strides = (step, *st[k:])
        self.dst_strides = (ls[k - 1] if k else 0, *ls[k:])
        # the element (in the part's first run) where each run starts, tensor and local
        self.base = src[k].start * st[k]
        self.dbase = sum(d.start * s for d, s in zip(dst[k:], ls[k:]))
        self.ls = ls

    def dst_contiguous(self) -> bool:
        """Whether each run's destination is contiguous in the local tensor (then a
        read can land in place)."""
        if not self.run_shape:
            return True
        want = strides(self.run_shape)
        return all(n == 1 or a == b for n, a, b in zip(self.run_shape, self.dst_strides[1:], want))

    def __iter__(self) -> Iterator[tuple[int, int, int, int]]:
        isz, src, dst = self.isz, self.item.src, self.item.dst
        if not self.run_shape:  # 0-d
            yield 0, isz, 1, 0
            return
        k = self.k
        if k == 0:
            yield self.base * isz, self.run_bytes, 1, self.dbase
            return
        line, st, ls = k - 1, self.st, self.ls
        step, dstep = st[line], ls[line]
        gap, run = self.gap_bytes, self.run_bytes
        lo, hi = src[line].start, src[line].stop
        joinable = gap <= self.join_gap
        for idx in itertools.product(*(range(s.start, s.stop) for s in src[:line])):
            base = self.base + sum(i * s for i, s in zip(idx, st))
            dbase = self.dbase + sum((d.start + i - s.start) * t
                                     for i, s, d, t in zip(idx, src, dst, ls))
            dbase += (dst[line].start - lo) * dstep
            i0 = lo
            while i0 < hi:
                m = 1
                if joinable:
                    m = min(hi - i0, self.max_runs,
                            1 + (self.waste - self.extra) // gap if gap else hi - i0)
                    self.extra += (m - 1) * gap
                yield (base + i0 * step) * isz, (m - 1) * step * isz + run, m, dbase + i0 * dstep
                i0 += m


# ------------------------------------------------------------------ the reads

@dataclass(frozen=True)
class _Task:
    piece: LocalPiece
    st: Any  # hf_load's _Tensor: file, dtype, shape, start, nbytes
    key: str
    item: Any  # a ReadItem: part of the piece's box (src in the tensor, dst in the box)
    waste: int  # bytes this part may read beyond its own
    lo: int  # its byte span in the stored tensor: [lo, hi)
    hi: int


def _tasks(pieces: list, coalesce: bool, chunk: int) -> list[_Task]:
    """Every piece cut into parts of at most ``chunk`` bytes of span, each with its
    share of the piece's waste allowance, in file order. Pure."""
    out = []
    for piece, st, key in pieces:
        isz = ITEMSIZE[st.dtype]
        item = box_item(st.shape, piece.box)
        if item is None:
            continue
        parts = cut(st.shape, item, isz, chunk)
        waste = _UNBOUNDED if coalesce else WASTE // len(parts)
        out += [_Task(piece, st, key, p, waste, *span_of(st.shape, p, isz))
                for p in parts]
    out.sort(key=lambda t: (t.st.file, t.st.start + t.lo))
    return out


_UNBOUNDED = 1 << 62


def _batches(tasks: list[_Task], n: int) -> list[list[_Task]]:
    """``tasks`` (in file order) cut into at most ``n`` consecutive batches of about equal
    bytes. Pure."""
    total = sum(t.hi - t.lo for t in tasks)
    per, out, acc = max(1, -(-total // n)), [[]], 0
    for t in tasks:
        if acc >= per * len(out) and len(out) < n:
            out.append([])
        out[-1].append(t)
        acc += t.hi - t.lo
    return [b for b in out if b]


def read_all(storage, files: list[str], pieces: list, workers: int, budget: int,
             what: str) -> int:
    """Read every piece's boxes into place on ``workers`` threads (each its own batch of
    consecutive parts, in file order, through its own open files). Returns the bytes
    read. Blocking I/O; raises CheckpointError naming the file and key."""
    coalesce = getattr(storage, "coalesce_reads", not storage.random_write)
    if coalesce:  # a request costs a round trip: read through gaps up to 1 MiB
        join_gap, max_runs = JOIN_GAP_OBJECT_STORE, _UNBOUNDED
    else:
        join_gap, max_runs = WASTE, MAX_RUNS
    tasks = _tasks(pieces, coalesce, max(1 << 20, budget // workers))
    batches = _batches(tasks, workers)
    progress = Progress(what, sum(t.hi - t.lo for t in tasks), log)
    stop = threading.Event()

    def run(tasks: list[_Task]) -> int:
        done, opened = 0, {}
        scratch = bytearray(join_gap)  # the gaps of joined runs land here
        try:
            for t in tasks:
                if stop.is_set():
                    break
                try:
                    n = _read_task(storage, files, opened, t, join_gap, max_runs, scratch)
                except BaseException:
                    stop.set()
                    raise
                done += n
                progress.add(t.hi - t.lo)
        finally:
            for f in opened.values():
                f.close()
        return done

    if len(batches) <= 1:
        return sum(run(b) for b in batches)
    with ThreadPoolExecutor(len(batches), thread_name_prefix="dckpt-hf-read") as pool:
        return sum(pool.map(run, batches))


def _read_task(storage, files: list[str], opened: dict, t: _Task, join_gap: int,
               max_runs: int, scratch: bytearray) -> int:
    """Read one part of a box. Each request is one scatter read: every run straight
    into its place, every gap of joined runs into ``scratch``. The place is the local
    tensor itself when each run's destination there is contiguous CPU memory of the
    stored dtype; otherwise (a cast, a device tensor, a strided destination) a
    contiguous temporary of the part, copied into the local tensor once read (at most
    the part's bytes: about ``read_budget / read_workers``). Returns bytes read.
    Blocking I/O; raises CheckpointError naming the file and key."""
    path = files[t.st.file]
    isz = ITEMSIZE[t.st.dtype]
    dtype = to_torch(t.st.dtype)
    local = t.piece.local.detach()  # a parameter's local tensor requires grad
    runs = Runs(t.st.shape, t.item, isz, local.stride(), join_gap, t.waste, max_runs)
    into = local
    if not (local.device.type == "cpu" and local.dtype == dtype and not local.is_conj()
            and not local.is_neg() and runs.dst_contiguous()):
        into = torch.empty([s.stop - s.start for s in t.item.dst], dtype=dtype)
        part = dataclasses.replace(t.item, dst=tuple(slice(0, n) for n in into.shape))
        runs = Runs(t.st.shape, part, isz, into.stride(), join_gap, t.waste, max_runs)
    extent = 1 + sum((n - 1) * s for n, s in zip(into.shape, into.stride()))
    flat = torch.as_strided(into, (extent,), (1,), into.storage_offset())
    mem = memoryview(flat.view(torch.uint8).numpy())
    gap = memoryview(scratch)[:runs.gap_bytes]  # runs are joined only when it fits
    rb, dstep, base = runs.run_bytes, runs.dst_strides[0] * isz, t.st.start
    try:
        f = opened.get(path)
        if f is None:
            f = opened[path] = storage.open_read(path)
        total = 0
        for start, nbytes, m, dst in runs:
            o = dst * isz
            if m == 1:
                bufs = [mem[o:o + rb]]
            else:
                bufs = []
                for j in range(m):
                    bufs += (mem[o + j * dstep:o + j * dstep + rb], gap)
                bufs.pop()
            n = f.readv(base + start, bufs)
            if n != nbytes:
                raise CheckpointError(f"{path}: short read of tensor {t.key!r} (the file "
                                      "shrank while being loaded)")
            total += n
    except FileNotFoundError:
        raise CheckpointError(f"{path}: the file is missing (tensor {t.key!r})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: reading tensor {t.key!r} failed ({e})") from None
    if into is not local:
        with torch.no_grad():
            local[t.item.dst].copy_(into)  # the cast, the device copy
    return total
