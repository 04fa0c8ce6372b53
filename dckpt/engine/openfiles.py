"""The files one reader thread holds open while it reads verified chunks (used by
:mod:`dckpt.engine.reader`, the encoder's base reads and ``dckpt verify``)."""
from __future__ import annotations

from ..errors import IntegrityError


class OpenFiles:
    """The files one reader thread has open, by path; all closed on exit. A
    ``prefetched`` span (path, offset, bytes) serves the reads that lie inside it."""

    def __init__(self, storage) -> None:
        self.storage, self.open = storage, {}
        self.prefetched: tuple[str, int, memoryview] | None = None

    def read_exact(self, path: str, start: int, bufs: list, what: str) -> None:
        """Fill ``bufs``, in order, from the consecutive bytes at ``start`` of ``path``,
        in one request (one ``preadv`` locally, one range read on an object store).
        Blocking I/O. Raises IntegrityError (``what`` names the file and tensor) on a
        short read or a vanished file."""
        want = sum(memoryview(b).nbytes for b in bufs)
        if not want:
            return
        p = self.prefetched
        if p is not None and p[0] == path and p[1] <= start and start + want <= p[1] + len(p[2]):
            pos = start - p[1]
            for b in bufs:
                v = memoryview(b).cast("B")
                v[:] = p[2][pos:pos + len(v)]
                pos += len(v)
            return
        try:
            f = self.open.get(path)
            if f is None:
                f = self.open[path] = self.storage.open_read(path)
            n = f.readv(start, bufs)
        except FileNotFoundError:
            raise IntegrityError(f"{what}: the file is missing") from None
        except OSError as e:  # EIO and friends: a damaged medium is a damaged checkpoint
            raise IntegrityError(f"{what}: read failed ({e})") from None
        if n != want:
            raise IntegrityError(f"{what}: short read (truncated file)")

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc) -> None:
        for f in self.open.values():
            f.close()
        self.open.clear()
