"""One conformance suite that every Storage backend runs unchanged (the contract in
dckpt/storage/base.py): local files with and without direct I/O, and fsspec's memory and
local file systems."""
from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pytest

from dckpt.storage.fsspec_storage import FsspecStorage
from dckpt.storage.local import LocalStorage


@pytest.fixture(params=["local-direct", "local-buffered", "fsspec-memory", "fsspec-file", "s3"])
def store(request, tmp_path):
    """(storage, a fresh root directory that exists). "s3" is a real S3-compatible
    server on loopback (tests/s3server.py)."""
    kind = request.param
    if kind.startswith("local"):
        s, root = LocalStorage(direct_io=kind == "local-direct"), str(tmp_path / "root")
    elif kind == "fsspec-memory":
        s, root = FsspecStorage(fsspec.filesystem("memory")), f"/conformance-{uuid.uuid4().hex}"
    elif kind == "s3":
        from dckpt.storage.fsspec_storage import make_storage

        server = request.getfixturevalue("s3")
        s, root = make_storage(server.url("conformance"), server.options)
    else:
        s, root = FsspecStorage(fsspec.filesystem("file")), str(tmp_path / "root")
    s.makedirs(root)
    yield s, root
    if kind in ("fsspec-memory", "s3") and s.exists(root):
        s.remove_tree(root)


def _has_directories(s) -> bool:
    """Object stores have no empty directories: a prefix exists while objects do."""
    return not (isinstance(s, FsspecStorage) and s.one_put and "memory" not in s.fs.protocol)


def _bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# Sizes around the 4 KiB direct-I/O alignment and the 8 MiB bounce buffers.
@pytest.mark.parametrize("pieces", [[0], [1], [4095, 1, 4096], [4097, 3], [9 << 20, 5],
                                    [100, 8 << 20, 4096, 7]])
def test_written_bytes_read_back(store, pieces):
    s, root = store
    path = s.join(root, "f.bin")
    data = [_bytes(n, i) for i, n in enumerate(pieces)]
    w = s.open_write(path)
    for d in data:
        w.write(memoryview(d))
    w.commit()
    whole = b"".join(data)
    assert s.exists(path) and s.size(path) == len(whole)
    assert s.read(path) == whole
    for lo, n in ((0, 1), (len(whole) // 3, 4099), (max(0, len(whole) - 2), 10)):
        assert s.read(path, lo, n) == whole[lo:lo + n]  # short at EOF, never padded
        buf = bytearray(n)
        with s.open_read(path) as f:
            got = f.readv(lo, [memoryview(buf)])
        assert got == len(whole[lo:lo + n]) and bytes(buf[:got]) == whole[lo:lo + n]
    if whole:  # many reads through one open file
        with s.open_read(path) as f:
            for lo in range(0, len(whole), max(1, len(whole) // 5)):
                buf = bytearray(min(3000, len(whole) - lo))
                assert f.readv(lo, [buf]) == len(buf) and bytes(buf) == whole[lo:lo + len(buf)]


def test_random_writes_where_supported(store):
    s, root = store
    path = s.join(root, "r.bin")
    w = s.open_write(path)
    if not s.random_write:
        with pytest.raises(NotImplementedError):
            w.pwrite(b"x", 0)
        w.abort()
        return
    a, b = _bytes(5000, 1), _bytes(4096, 2)
    w.pwrite(b, 8192)  # out of order, leaving a hole that is then filled
    w.pwrite(a, 0)
    w.pwrite(b"\x07" * 3192, 5000)
    w.commit()
    assert s.read(path) == a + b"\x07" * 3192 + b


def test_abort_leaves_nothing(store):
    s, root = store
    path = s.join(root, "partial.bin")
    w = s.open_write(path)
    w.write(_bytes(10_000))
    w.abort()
    assert not s.exists(path)
    assert [e.name for e in s.listdir(root)] == []


def test_put_atomic_replaces(store):
    s, root = store
    path = s.join(root, "manifest.json")
    s.put_atomic(path, b'{"v": 1}')
    s.put_atomic(path, b'{"v": 2}')
    assert s.read(path) == b'{"v": 2}'
    assert [e.name for e in s.listdir(root)] == ["manifest.json"]  # no temp files left


def test_listdir_remove_and_missing(store):
    s, root = store
    s.makedirs(s.join(root, "sub", "deeper"))
    s.put_atomic(s.join(root, "sub", "a"), b"abc")
    s.put_atomic(s.join(root, "top"), b"12345")
    entries = {e.name: e for e in s.listdir(root)}
    assert set(entries) == {"sub", "top"}
    assert entries["sub"].is_dir and not entries["top"].is_dir and entries["top"].size == 5
    names = {e.name for e in s.listdir(s.join(root, "sub"))}
    assert names == ({"a", "deeper"} if _has_directories(s) else {"a"})
    s.remove(s.join(root, "top"))
    assert not s.exists(s.join(root, "top"))
    s.remove_tree(s.join(root, "sub"))
    assert not s.exists(s.join(root, "sub")) and s.listdir(root) == []
    missing = s.join(root, "missing")
    for call in (lambda: s.read(missing), lambda: s.size(missing),
                 lambda: s.open_read(missing).readv(0, [bytearray(4)])):
        with pytest.raises(FileNotFoundError):
            call()


def test_open_write_in_missing_directory_fails(store):
    s, root = store
    if isinstance(s, FsspecStorage) and s.one_put:
        pytest.skip("object stores and the memory file system have no directories to be missing")
    with pytest.raises(OSError):
        w = s.open_write(s.join(root, "no", "such", "f"))
        w.write(b"x")
        w.commit()


@pytest.mark.parametrize("splits", [[5], [0, 7, 0, 3], [4096, 1, 9000], [1, 1, 1, 1, 1]])
@pytest.mark.parametrize("start", [0, 3, 12_000])
def test_scatter_reads(store, splits, start):
    """The reader's one-request scatter read (preadv locally, one range read on fsspec)
    fills consecutive buffers in order, and a read past the end is a short read."""
    from dckpt.errors import IntegrityError
    from dckpt.engine.reader import _Files

    s, root = store
    path = s.join(root, "s.bin")
    data = _bytes(20_000, 5)
    s.put_atomic(path, data)
    bufs = [bytearray(n) for n in splits]
    with _Files(s) as files:
        if start + sum(splits) > len(data):
            with pytest.raises(IntegrityError, match="tensor 't': short read"):
                files.read_exact(path, start, bufs, "tensor 't'")
            return
        files.read_exact(path, start, bufs, "tensor 't'")
    assert b"".join(bufs) == data[start:start + sum(splits)]
    with _Files(s) as files, pytest.raises(IntegrityError, match="missing"):
        files.read_exact(s.join(root, "gone"), 0, [bytearray(4)], "shard file gone")


def test_local_scatter_read_resumes_after_a_short_preadv(tmp_path, monkeypatch):
    """preadv may return fewer bytes than asked (signals, 2 GiB cap): the rest of the
    buffers are filled by further calls from the right offset."""
    import os

    from dckpt.storage import local

    p = tmp_path / "f"
    data = _bytes(10_000, 9)
    p.write_bytes(data)
    real = os.preadv
    monkeypatch.setattr(local.os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:777]], off))
    bufs = [bytearray(3000), bytearray(1), bytearray(5000)]
    with local.LocalReader(str(p)) as f:
        assert f.readv(100, bufs) == 8001
    assert b"".join(bufs) == data[100:8101]


def test_put_atomic_exclusive(store):
    """An exclusive put creates, or raises FileExistsError and changes nothing; it
    leaves no temp file either way."""
    s, root = store
    path = s.join(root, "manifest.json")
    s.put_atomic(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        s.put_atomic(path, b"second", exclusive=True)
    assert s.read(path) == b"first"
    assert [e.name for e in s.listdir(root)] == ["manifest.json"]


def test_put_atomic_exclusive_races(store):
    """Eight threads create one path exclusively at once: exactly one wins."""
    import threading

    s, root = store
    path = s.join(root, "manifest.json")
    go, wins, losses = threading.Barrier(8), [], []

    def one(i: int) -> None:
        go.wait()
        try:
            s.put_atomic(path, f"writer {i}".encode(), exclusive=True)
            wins.append(i)
        except FileExistsError:
            losses.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if isinstance(s, FsspecStorage) and not s.one_put:
        pytest.skip("fsspec's local file system has no exclusive create: check-then-act")
    assert len(wins) == 1 and len(losses) == 7
    assert s.read(path) == f"writer {wins[0]}".encode()


def test_read_file_bounds(store):
    """read_file returns a whole small file, refuses one over the cap without reading
    it, and reports a missing one."""
    from dckpt.storage.base import FileTooLargeError

    s, root = store
    path = s.join(root, "m")
    s.put_atomic(path, b"x" * 100)
    assert s.read_file(path, 100) == b"x" * 100
    with pytest.raises(FileTooLargeError):
        s.read_file(path, 99)
    with pytest.raises(FileNotFoundError):
        s.read_file(s.join(root, "nope"), 100)


def test_touch_renews_mtime(store):
    import time

    s, root = store
    path = s.join(root, "lease")
    s.touch(path, b"x")
    first = {e.name: e for e in s.listdir(root)}["lease"].mtime
    time.sleep(0.05 if _has_directories(s) else 1.1)  # object stores: 1 s resolution
    s.touch(path, b"x")
    second = {e.name: e for e in s.listdir(root)}["lease"].mtime
    assert first is not None and second is not None and second > first


def test_local_read_file_refuses_fifo_and_devices(tmp_path):
    """A FIFO named like a manifest must not block the read forever, and a link to
    /dev/zero must not be read at all."""
    import os

    from dckpt.storage.base import NotRegularFileError

    s = LocalStorage()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFileError):
        s.read_file(str(fifo), 1 << 30)
    with pytest.raises(NotRegularFileError):
        s.read(str(fifo), 0, 10)
    with pytest.raises(NotRegularFileError):
        s.open_read(str(fifo))
    os.symlink("/dev/zero", tmp_path / "zero")
    with pytest.raises(NotRegularFileError):
        s.read_file(str(tmp_path / "zero"), 1 << 30)


def test_local_listdir_does_not_follow_links(tmp_path):
    import os

    s = LocalStorage()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "root" / "dirlink")
    (tmp_path / "outside" / "f").write_bytes(b"1")
    os.symlink(tmp_path / "outside" / "f", tmp_path / "root" / "filelink")
    e = {x.name: x for x in s.listdir(str(tmp_path / "root"))}
    assert e["dirlink"].is_link and not e["dirlink"].is_dir
    assert e["filelink"].is_link and not e["filelink"].is_dir


def test_local_makedirs_fsyncs_each_new_parent(tmp_path, monkeypatch):
    """A new directory's entry in its parent is made durable: each parent of a created
    directory is fsynced after the mkdir."""
    import os

    from dckpt.storage import local

    synced = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda p: (synced.append(p), real(p)))
    LocalStorage().makedirs(str(tmp_path / "a" / "b" / "c"))
    assert synced == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    synced.clear()
    LocalStorage().makedirs(str(tmp_path / "a" / "b" / "c"))  # exists: nothing to sync
    assert synced == []
    assert os.path.isdir(tmp_path / "a" / "b" / "c")


def test_fsspec_replace_refused_without_an_atomic_primitive():
    """On a backend whose write is not one atomic request (sftp, webdav, smb...), an
    existing manifest is never rewritten in place."""
    fs = fsspec.filesystem("memory")
    s = FsspecStorage(fs)
    s.one_put = s.renames = s.atomic_replace = False  # as for sftp: no atomic primitive
    root = f"/noatomic-{uuid.uuid4().hex}"
    s.makedirs(root)
    path = s.join(root, "manifest.json")
    s.put_atomic(path, b"old")  # a new file: temp, then moved into place
    with pytest.raises(FileExistsError, match="no atomic replace"):
        s.put_atomic(path, b"new")
    assert s.read(path) == b"old"
    assert [e.name for e in s.listdir(root)] == ["manifest.json"]
    s.remove_tree(root)


def test_fsspec_mtime_from_each_backends_key():
    import datetime as dt

    from dckpt.storage.fsspec_storage import entry_mtime

    t = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert entry_mtime({"mtime": 5.0}) == 5.0
    assert entry_mtime({"LastModified": t}) == t.timestamp()
    assert entry_mtime({"last_modified": "2026-01-02T03:04:05Z"}) == t.timestamp()
    assert entry_mtime({"updated": "2026-01-02T03:04:05.000Z"}) == t.timestamp()
    assert entry_mtime({"created": t.timestamp()}) == t.timestamp()
    assert entry_mtime({"size": 3}) is None
