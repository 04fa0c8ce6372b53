"""Storage over any fsspec file system (memory://, s3://, gs://...)."""
from __future__ import annotations

from typing import Any

import fsspec

from .base import Entry, byte_views


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
        try:
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

    def join(self, *parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts[:-1]) + "/" + parts[-1] if len(parts) > 1 else parts[0]

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[Entry]:
        out = []
        for info in self.fs.ls(path, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            out.append(Entry(name, int(info.get("size") or 0), float(mtime),
                             info.get("type") == "directory"))
        return out

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else start + length
        return self.fs.cat_file(path, start=start, end=end)

    def open_read(self, path: str) -> "FsspecReader":
        return FsspecReader(self, path)

    def open_write(self, path: str) -> FsspecWriter:
        return FsspecWriter(self.fs, path)

    def put_atomic(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

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
