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


@pytest.fixture(params=["local-direct", "local-buffered", "fsspec-memory", "fsspec-file"])
def store(request, tmp_path):
    """(storage, a fresh root directory that exists)."""
    kind = request.param
    if kind.startswith("local"):
        s, root = LocalStorage(direct_io=kind == "local-direct"), str(tmp_path / "root")
    elif kind == "fsspec-memory":
        s, root = FsspecStorage(fsspec.filesystem("memory")), f"/conformance-{uuid.uuid4().hex}"
    else:
        s, root = FsspecStorage(fsspec.filesystem("file")), str(tmp_path / "root")
    s.makedirs(root)
    yield s, root
    if kind == "fsspec-memory":
        s.remove_tree(root)


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
    assert {e.name for e in s.listdir(s.join(root, "sub"))} == {"a", "deeper"}
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
    if isinstance(s, FsspecStorage) and "memory" in s.fs.protocol:
        pytest.skip("the memory file system has no directories to be missing")
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
    from dckpt.reader import _Files

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
