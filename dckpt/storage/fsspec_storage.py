"""Storage over any fsspec file system (memory://, s3://, gs://...).

Atomicity per backend (docs/GUARANTEES.md): object stores and the memory file system
store an object in one request, so the manifest is one ``pipe_file`` there (with
``mode="create"``, a conditional PUT, for an exclusive commit). Other backends (sftp,
hdfs, smb, webdav, cache wrappers...) may truncate and rewrite a file in place, so the
manifest goes to a temp name first and is then moved, and replacing an existing
manifest is refused (``atomic_replace`` False): there is no way to do it without a
moment where the old one is gone.

S3 (s3fs) gets bounded network behaviour by default (:func:`s3_options`): botocore's
connect/read timeouts and its own "standard" retries, s3fs's nested retry loops off, and
a deadline on every request, so a dead or frozen endpoint fails a call in minutes, never
hangs it. Every failure other than a missing/existing file is a :class:`StorageIOError`
naming the object (``s3://bucket/key``) and the operation.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

from .base import Entry, FileTooLargeError, NotRegularFileError, byte_views
from .s3client import s3_options

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


class StorageIOError(OSError):
    """An fsspec/object-store call failed (after the client's own retries) for a reason
    other than a missing or already existing file: the message names the operation and
    the object (``s3://bucket/key``) and carries the client's error."""


# Raised as they are: callers act on them (a missing file, an exclusive create that
# lost, a size cap), and their messages already name the path.
_PASS_THROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                 NotRegularFileError, FileTooLargeError, StorageIOError)


def _url(fs: Any, path: str) -> str:
    try:
        return fs.unstrip_protocol(path)
    except Exception:
        return path


@contextlib.contextmanager
def _named(fs: Any, op: str, path: str):
    """Re-raise a failure of ``op`` on ``path`` as StorageIOError naming the object."""
    try:
        yield
    except _PASS_THROUGH:
        raise
    except Exception as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise StorageIOError(f"{op} {_url(fs, path)} failed: {type(e).__name__}: {msg}") from e


ONE_PUT_MAX = 256 << 20  # files up to this size are uploaded in one request


def _is_object_store(fs: Any) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ONE_PUT_PROTOCOLS and p != "memory" for p in protos)


class FsspecWriter:
    """A sequential upload. On an object store a file over the block size is a
    multipart upload: ``commit`` completes it, ``abort`` aborts it (its parts are
    dropped, nothing becomes visible). A writer dropped without either (a bug, an
    interpreter exit) is marked closed without any I/O: fsspec's finaliser would
    otherwise complete the upload of a partial file, and at interpreter exit wait
    forever on fsspec's I/O thread, which is gone by then. Its multipart upload, if any,
    stays incomplete until ``dckpt gc`` aborts it."""

    def __init__(self, fs: Any, path: str, size_hint: int | None = None) -> None:
        self.fs, self.path, self.done = fs, path, False
        kw = {}
        chosen = getattr(fs, "default_block_size", None) != getattr(type(fs), "default_block_size", None)
        if size_hint is not None and size_hint <= ONE_PUT_MAX and _is_object_store(fs) \
                and not chosen:  # a block size the user chose (storage_options) is kept
            # A file that fits goes up as one PUT at commit (s3fs sends a file smaller
            # than its block size in one request), not as sequential multipart parts:
            # measured against the tests' server, 0.7-0.95 s instead of 1.3-1.8 s for
            # 64 MiB. Costs a buffer of the file's size, hence the bound.
            kw["block_size"] = max(int(size_hint) + 1, 5 << 20)
        with _named(fs, "open for writing", path):
            self.f = fs.open(path, "wb", **kw)

    def write(self, data) -> None:
        with _named(self.fs, "upload to", self.path):
            self.f.write(memoryview(data).cast("B"))

    def pwrite(self, data, offset: int) -> None:
        raise NotImplementedError("fsspec writers are sequential")

    def commit(self) -> None:
        with _named(self.fs, "upload to", self.path):
            self.f.close()  # an object store completes its upload here
        self.done = True

    def abort(self) -> None:
        # discard(): an object store's file aborts its multipart upload (parts already
        # sent are dropped, nothing becomes visible); close() would complete it.
        self.done = True
        try:
            discard = getattr(self.f, "discard", None)
            if discard is not None:
                discard()
            else:
                self.f.close()
        except Exception as e:
            log.debug("aborting the upload of %s: %s", self.path, e)
        finally:
            if isinstance(self.f, AbstractBufferedFile):
                self.f.closed = True  # else its finaliser would upload what is left
        try:
            self.fs.rm(self.path)
        except Exception:
            pass

    def __del__(self) -> None:
        f = getattr(self, "f", None)
        if not getattr(self, "done", True) and isinstance(f, AbstractBufferedFile):
            f.closed = True  # no I/O here: see the class docstring


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

    def _named(self, op: str, path: str):
        return _named(self.fs, op, path)

    def exists(self, path: str) -> bool:
        with self._named("check", path):
            self.fs.invalidate_cache(path)
            return self.fs.exists(path)

    def is_dir(self, path: str) -> bool:
        # asked explicitly: fsspec lists a file as a one-entry directory of itself
        with self._named("check", path):
            self.fs.invalidate_cache(path)
            return self.fs.isdir(path)

    def makedirs(self, path: str) -> None:
        with self._named("create directory", path):
            self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[Entry]:
        """Entries of ``path``, listed afresh (fsspec caches listings per process; other
        ranks' writes would not show). On an object store a prefix with no objects is
        an empty directory, not a missing one."""
        out = []
        with self._named("list", path):
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
        with self._named("stat", path):
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        end = None if length is None else start + length
        with self._named(f"read of bytes {start}..{'' if end is None else end} of", path):
            try:
                return self.fs.cat_file(path, start=start, end=end)
            except OSError as e:
                # An object store refuses a range that starts at or past the end (HTTP
                # 416); the protocol's answer there is a short (empty) read.
                if isinstance(e, FileNotFoundError):
                    raise
                try:
                    past_end = start >= int(self.fs.size(path))
                except Exception:
                    raise e from None  # the read's error, not the size check's
                if not past_end:
                    raise
                return b""

    def read_file(self, path: str, cap: int) -> bytes:
        with self._named("read", path):
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

    def open_write(self, path: str, size_hint: int | None = None) -> FsspecWriter:
        """A sequential upload of ``path``; ``size_hint`` (about the bytes that will be
        written, or more) lets a file that fits go up as one request."""
        return FsspecWriter(self.fs, path, size_hint)

    def put_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """One PUT where that is atomic (conditional with ``exclusive``); elsewhere a
        temp object moved into place, and an existing ``path`` is never replaced."""
        with self._named("write", path):
            self._put_atomic(path, data, exclusive)

    def _put_atomic(self, path: str, data: bytes, exclusive: bool) -> None:
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
        with self._named("write", path):
            self.fs.pipe_file(path, data)  # a new PUT renews the modification time everywhere

    def remove(self, path: str) -> None:
        with self._named("remove", path):
            self.fs.rm(path)

    def remove_tree(self, path: str) -> None:
        with self._named("remove", path):
            self.fs.rm(path, recursive=True)

    # -- incomplete multipart uploads (S3 only; every other backend has none) ----------
    def incomplete_uploads(self, path: str) -> list["Upload"]:
        """The multipart uploads begun and never completed nor aborted under the
        directory ``path`` (its whole subtree), each with the size of the parts it
        holds. Empty on every backend but S3. Blocking I/O: one listing per 1000
        uploads and one per upload for its parts. Raises StorageIOError."""
        if not _is_s3fs(self.fs):
            return []
        out = []
        with self._named("list the incomplete uploads under", path):
            bucket, key, _ = self.fs.split_path(path)
            prefix = key.rstrip("/") + "/" if key else ""
            marker: dict = {}
            while True:
                page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                       Prefix=prefix, **marker)
                for u in page.get("Uploads") or []:
                    out.append(Upload(f"{bucket}/{u['Key']}", u["UploadId"],
                                      _timestamp(u.get("Initiated")),
                                      self._parts_size(bucket, u["Key"], u["UploadId"])))
                if not page.get("IsTruncated"):
                    return out
                marker = {"KeyMarker": page.get("NextKeyMarker", ""),
                          "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    def _parts_size(self, bucket: str, key: str, upload_id: str) -> int:
        total, marker = 0, {}
        while True:
            try:
                page = self.fs.call_s3("list_parts", Bucket=bucket, Key=key,
                                       UploadId=upload_id, **marker)
            except FileNotFoundError:
                return total  # completed or aborted since the listing
            total += sum(int(p.get("Size") or 0) for p in page.get("Parts") or [])
            if not page.get("IsTruncated"):
                return total
            marker = {"PartNumberMarker": page.get("NextPartNumberMarker", 0)}

    def abort_upload(self, upload: "Upload") -> None:
        """Abort an incomplete multipart upload: its parts are deleted and no object
        appears (an object already at that key is not touched). Already gone: done."""
        if not _is_s3fs(self.fs):
            return
        with self._named(f"abort the incomplete upload {upload.upload_id[:16]}... of",
                         upload.path):
            bucket, key, _ = self.fs.split_path(upload.path)
            try:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                                UploadId=upload.upload_id)
            except FileNotFoundError:
                pass  # NoSuchUpload: completed or aborted meanwhile


@dataclass(frozen=True)
class Upload:
    """An incomplete multipart upload: ``path`` is its key as a storage path
    (``bucket/key``), ``initiated`` the server's start time (None if not reported),
    ``size`` the bytes of the parts it holds."""

    path: str
    upload_id: str
    initiated: float | None
    size: int = 0


def _is_s3fs(fs: Any) -> bool:
    protos = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("s3", "s3a") for p in protos) and callable(getattr(fs, "call_s3", None))


def make_storage(path: str, storage_options: dict | None = None):
    """(Storage, normalised root path) for a local path or an fsspec URL. No I/O beyond
    creating the fsspec file system object. ``s3://`` URLs get :func:`s3_options`."""
    from .local import LocalStorage
    import os

    opts = dict(storage_options or {})
    direct_io = bool(opts.pop("direct_io", True))  # local files only; see storage/direct.py
    if "://" not in path or path.startswith("file://"):
        local = path[len("file://"):] if path.startswith("file://") else path
        return LocalStorage(direct_io), os.path.abspath(local)
    if path.split("://", 1)[0] in ("s3", "s3a"):
        opts = s3_options(opts)
    fs, root = fsspec.core.url_to_fs(path, **opts)
    if getattr(fs, "protocol", None) in ("file", ("file", "local")):
        return LocalStorage(direct_io), root
    if _is_s3fs(fs):
        # s3fs wraps each call in retry loops of its own (nested: up to 25 tries of
        # botocore's tries); botocore's retries (above) are the only ones dckpt wants.
        fs.retries = 1
    return FsspecStorage(fs), root.rstrip("/")
