"""Storage over any fsspec file system (memory://, s3://, gs://...).

Atomicity per backend (docs/GUARANTEES.md): object stores and the memory file system
store an object in one request, so the manifest is one ``pipe_file`` there (with
``mode="create"``, a conditional PUT, for an exclusive commit). Other backends (sftp,
hdfs, smb, webdav, cache wrappers...) may truncate and rewrite a file in place, so the
manifest goes to a temp name first and is then moved, and replacing an existing
manifest is refused (``atomic_replace`` False): there is no way to do it without a
moment where the old one is gone.
"""
from __future__ import annotations

import datetime as _dt
import logging
import uuid
from typing import Any

import fsspec

from .base import Entry, FileTooLargeError, NotRegularFileError, byte_views

log = logging.getLogger(__name__)

# Protocols whose single PUT of an object is atomic (readers see all of it or none).
ONE_PUT_PROTOCOLS = frozenset({"memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss",
                               "adl", "oss", "r2", "tos", "cos"})
# Protocols where a move within the file system is an atomic rename that replaces.
RENAME_PROTOCOLS = frozenset({"file", "local"})
# Listing keys that carry the modification time, by the backends that use them.
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "modified",
               "time_modified", "created", "creation_time")


def _timestamp(v: Any) -> float | None:
    """Seconds since the epoch from a listing's time value, or None if it is none."""
    if v is None or v == "":
        return None
    if isinstance(v, _dt.datetime):
        if v.tzinfo is None:
            v = v.replace(tzinfo=_dt.timezone.utc)
        return v.timestamp()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            return _timestamp(_dt.datetime.fromisoformat(v.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


def entry_mtime(info: dict) -> float | None:
    """The modification time in an fsspec ``info`` dict under whichever key its backend
    uses; None when it reports none (callers must then not treat the file as old)."""
    for k in _MTIME_KEYS:
        t = _timestamp(info.get(k))
        if t is not None:
            return t
    return None


class FsspecWriter:
    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self.f = fs.open(path, "wb")

    def write(self, data) -> None:
        self.f.write(memoryview(data).cast("B"))

    def pwrite(self, data, offset: int) -> None:
        raise NotImplementedError("fsspec writers are sequential")

    def commit(self) -> None:
        self.f.close()  # an object store completes its upload here

    def abort(self) -> None:
        # discard(): an object store's file aborts its multipart upload (parts already
        # sent are dropped, nothing becomes visible); close() would complete it.
        try:
            discard = getattr(self.f, "discard", None)
            if discard is not None:
                discard()
                self.f.closed = True  # else its finaliser would try to upload what is left
            else:
                self.f.close()
        except Exception:
            pass
        try:
            self.fs.rm(self.path)
        except Exception:
            pass


class FsspecReader:
    """Reads of one object: each ``readv`` is one ranged request whose bytes are
    scattered into the buffers (one round trip per region, not one per buffer)."""

    def __init__(self, storage: "FsspecStorage", path: str) -> None:
        self.storage, self.path = storage, path

    def readv(self, start: int, bufs: list) -> int:
        views = byte_views(bufs)
        data, n = self.storage.read(self.path, start, sum(len(v) for v in views)), 0
        for v in views:
            k = max(0, min(len(v), len(data) - n))
            v[:k] = data[n:n + k]
            n += k
        return n

    def close(self) -> None:
        pass

    def __enter__(self) -> "FsspecReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FsspecStorage:
    """Storage on an fsspec file system; ``put_atomic`` is a single ``pipe_file``, which
    object stores (one PUT) and the memory file system apply atomically."""

    random_write = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.one_put = any(p in ONE_PUT_PROTOCOLS for p in protos)
        self.renames = any(p in RENAME_PROTOCOLS for p in protos)
        self.atomic_replace = self.one_put or self.renames

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts[:-1]) + "/" + parts[-1] if len(parts) > 1 else parts[0]

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def is_dir(self, path: str) -> bool:
        # asked explicitly: fsspec lists a file as a one-entry directory of itself
        self.fs.invalidate_cache(path)
        return self.fs.isdir(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[Entry]:
        """Entries of ``path``, listed afresh (fsspec caches listings per process; other
        ranks' writes would not show). On an object store a prefix with no objects is
        an empty directory, not a missing one."""
        out = []
        self.fs.invalidate_cache(path)
        try:
            infos = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            if self.one_put:
                return []
            raise
        for info in infos:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            link = bool(info.get("islink"))
            out.append(Entry(name, int(info.get("size") or 0), entry_mtime(info),
                             info.get("type") == "directory" and not link, link))
        return out

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return int(self.fs.size(path))

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        end = None if length is None else start + length
        try:
            return self.fs.cat_file(path, start=start, end=end)
        except OSError as e:
            # An object store refuses a range that starts at or past the end (HTTP 416);
            # the protocol's answer there is a short (empty) read.
            if isinstance(e, FileNotFoundError) or start < self.size(path):
                raise
            return b""

    def read_file(self, path: str, cap: int) -> bytes:
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        if info.get("type") == "directory":
            raise IsADirectoryError(path)
        if info.get("type") not in (None, "file"):
            raise NotRegularFileError(f"{path} is a {info.get('type')}, not a file")
        size = int(info.get("size") or 0)
        if size > cap:
            raise FileTooLargeError(f"{path} holds {size} bytes, over the {cap}-byte cap")
        return self.fs.cat_file(path, start=0, end=size) if size else b""

    def open_read(self, path: str) -> "FsspecReader":
        return FsspecReader(self, path)

    def open_write(self, path: str) -> FsspecWriter:
        return FsspecWriter(self.fs, path)

    def put_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """One PUT where that is atomic (conditional with ``exclusive``); elsewhere a
        temp object moved into place, and an existing ``path`` is never replaced."""
        if self.one_put:
            # mode="create": If-None-Match on object stores, FileExistsError if present
            self.fs.pipe_file(path, data, mode="create" if exclusive else "overwrite")
            return
        if exclusive and self.fs.exists(path):
            raise FileExistsError(path)  # check-then-act: no exclusive primitive here
        if not self.renames and self.fs.exists(path):
            raise FileExistsError(
                f"{path} exists and {type(self.fs).__name__} has no atomic replace: dckpt "
                "never overwrites a manifest there (save to a new path instead)")
        tmp = f"{path.rsplit('/', 1)[0]}/.{path.rsplit('/', 1)[-1]}.tmp-{uuid.uuid4().hex[:12]}"
        self.fs.pipe_file(tmp, data)
        try:
            self.fs.mv(tmp, path)
        except BaseException:
            try:
                self.fs.rm(tmp)
            except Exception:
                pass
            raise

    def touch(self, path: str, data: bytes = b"") -> None:
        self.fs.pipe_file(path, data)  # a new PUT renews the modification time everywhere

    def remove(self, path: str) -> None:
        self.fs.rm(path)

    def remove_tree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)


def make_storage(path: str, storage_options: dict | None = None):
    """(Storage, normalised root path) for a local path or an fsspec URL. No I/O beyond
    creating the fsspec file system object."""
    from .local import LocalStorage
    import os

    opts = dict(storage_options or {})
    direct_io = bool(opts.pop("direct_io", True))  # local files only; see storage/direct.py
    if "://" not in path or path.startswith("file://"):
        local = path[len("file://"):] if path.startswith("file://") else path
        return LocalStorage(direct_io), os.path.abspath(local)
    fs, root = fsspec.core.url_to_fs(path, **opts)
    if getattr(fs, "protocol", None) in ("file", ("file", "local")):
        return LocalStorage(direct_io), root
    return FsspecStorage(fs), root.rstrip("/")
