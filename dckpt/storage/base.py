"""The Storage protocol: the few operations a checkpoint needs from a file system.

Two implementations: :class:`~dckpt.storage.local.LocalStorage` (os calls, pwrite/pread,
fsync of files and directories, atomic rename) and
:class:`~dckpt.storage.fsspec_storage.FsspecStorage` (any fsspec URL; the manifest is
one ``pipe`` call, which object stores apply atomically).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Entry:
    """One listing entry. ``is_dir`` never follows a symbolic link: a link (to a file or
    a directory) has ``is_link`` set and ``is_dir`` False, so nothing walks out of a
    root through one. ``mtime`` is None where the backend reports no modification time
    (then nothing may treat the entry as old)."""

    name: str
    size: int
    mtime: float | None
    is_dir: bool
    is_link: bool = False


class NotRegularFileError(OSError):
    """The path is a FIFO, a device, a socket or a directory, where a regular file was
    required (reading it could block forever or never end)."""


class FileTooLargeError(OSError):
    """The file is larger than the caller's cap; nothing was read."""


def byte_views(bufs: list) -> list[memoryview]:
    """Flat byte views of the non-empty buffers in ``bufs``, in order (what a Reader's
    ``readv`` fills). Cheap: no copy."""
    return [memoryview(b).cast("B") for b in bufs if len(b)]


class Reader(Protocol):
    """An open file for many reads; also a context manager that closes it."""

    def readv(self, start: int, bufs: list) -> int:
        """Fill ``bufs`` in order from the consecutive bytes at ``start``, in one request
        where the backend can; returns the bytes read (short at EOF). Blocking I/O."""
    def close(self) -> None: ...


class Writer(Protocol):
    """A file being written. ``pwrite`` exists only where ``Storage.random_write``."""

    def write(self, data) -> None: ...
    def pwrite(self, data, offset: int) -> None: ...
    def commit(self) -> None:
        """Flush, fsync where the backend can, close. Blocking I/O."""
    def abort(self) -> None:
        """Close and remove the partial file; never raises."""


class Storage(Protocol):
    """Operations on paths under one root. All calls block on I/O; raise OSError (or
    FileNotFoundError) on failure."""

    random_write: bool

    def join(self, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory (on an object store: a prefix holding objects)."""
    def makedirs(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[Entry]: ...
    def size(self, path: str) -> int: ...
    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[start, start+length)`` (to the end when length is None). Short at EOF."""
    def read_file(self, path: str, cap: int) -> bytes:
        """The whole of the regular file ``path`` when it holds at most ``cap`` bytes.
        Never blocks on a FIFO and never allocates more than its size. Raises
        FileNotFoundError, NotRegularFileError, FileTooLargeError, OSError."""
    def open_read(self, path: str) -> Reader:
        """A handle for many reads of ``path``; may raise FileNotFoundError here or at
        the first read."""
    def open_write(self, path: str, size_hint: int | None = None) -> Writer:
        """A new file at ``path``. ``size_hint``: about how many bytes will be written
        (at least that many), when known; a backend may use it (one request instead of
        a multipart upload)."""
    atomic_replace: bool
    """Whether ``put_atomic(..., exclusive=False)`` replaces an existing file in one step."""

    def put_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Make ``path`` hold ``data`` in one step: readers see the old content or the
        new, never a part. Durable on return. With ``exclusive`` the file is created
        only if nothing is at ``path`` (checked and created as one step where the
        backend allows: link(2) on POSIX, a conditional PUT on object stores), else
        FileExistsError and nothing changes. Without it, on a backend that has no
        atomic replace (``atomic_replace`` False), an existing ``path`` raises
        FileExistsError rather than risk a half-written file."""
    def touch(self, path: str, data: bytes = b"") -> None:
        """Create ``path`` or renew its modification time (a lease heartbeat)."""
    def remove(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
