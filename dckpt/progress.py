"""Progress lines for long operations (saves, loads, verification).

A save or load of a few GB is over in seconds and logs one line at the end; one of a TB
takes minutes, and a user watching a job wants to see it move. :class:`Progress` counts
bytes from any thread and logs ``what: 12.3/45.6 GiB (27%), 1.21 GB/s, about 27 s
left`` at most once every ``DCKPT_PROGRESS_SECONDS`` (default 10) seconds; an operation
shorter than that logs nothing extra.
"""
from __future__ import annotations

import logging
import os
import threading
import time

DEFAULT_EVERY = 10.0
UNITS = (("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40))


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit that ``nbytes`` reaches (B below 1 KiB): (name, bytes)."""
    name, div = UNITS[0]
    for n, d in UNITS:
        if nbytes >= d:
            name, div = n, d
    return name, div


def size_text(nbytes: float) -> str:
    """``nbytes`` for people: ``512 B``, ``1.5 MiB``, ``2.0 TiB``."""
    name, div = byte_unit(nbytes)
    return f"{nbytes:.0f} B" if div == 1 else f"{nbytes / div:.1f} {name}"


def _every() -> float:
    try:
        return max(0.0, float(os.environ.get("DCKPT_PROGRESS_SECONDS", DEFAULT_EVERY)))
    except ValueError:
        return DEFAULT_EVERY


class Progress:
    """Counts bytes done of ``total`` for ``what``; thread-safe. Cost per :meth:`add`: a
    lock and a clock read; a log record at most every ``every`` seconds."""

    def __init__(self, what: str, total: int, logger: logging.Logger,
                 every: float | None = None) -> None:
        self.what, self.total, self.log = what, max(0, int(total)), logger
        self.every = _every() if every is None else every
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """Count ``n`` more bytes done; log a line if ``every`` seconds have passed."""
        now = time.monotonic()
        with self._lock:
            self.done += n
            if now - self.last < self.every or not self.log.isEnabledFor(logging.INFO):
                return
            self.last = now
            done, elapsed = self.done, now - self.t0
        self.log.info("%s", self.line(done, elapsed))

    def line(self, done: int, elapsed: float) -> str:
        """The progress line for ``done`` bytes after ``elapsed`` seconds. Pure."""
        rate = done / elapsed if elapsed > 0 else 0.0
        unit, scale = byte_unit(max(self.total, 1 << 20))  # one unit, MiB at least
        out = f"{self.what}: {done / scale:.1f}/{self.total / scale:.1f} {unit}"
        if self.total:  # headers can take a save a little past its data total
            out += f" ({min(100.0, 100 * done / self.total):.0f}%)"
        out += f", {rate / 1e9:.2f} GB/s"
        if rate > 0 and self.total > done:
            out += f", about {(self.total - done) / rate:.0f} s left"
        return out


class CountingWriter:
    """A storage Writer that reports the bytes written through it to a Progress."""

    def __init__(self, writer, progress: Progress) -> None:
        self.inner, self.progress = writer, progress
        self.alignment = getattr(writer, "alignment", 8)

    def write(self, data) -> None:
        self.inner.write(data)
        self.progress.add(memoryview(data).nbytes)

    def pwrite(self, data, offset: int) -> None:
        self.inner.pwrite(data, offset)
        self.progress.add(memoryview(data).nbytes)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()
