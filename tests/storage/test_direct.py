"""The O_DIRECT writer against a byte model: whatever the write pattern, the file holds
exactly what was written, and shard files written direct load and verify."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dckpt
from dckpt.storage import direct
from dckpt.catalog.verify import verify_checkpoint
from dckpt.storage.local import LocalStorage, LocalWriter

pytestmark = pytest.mark.skipif(not direct.supported(), reason="no O_DIRECT on this OS")
A = direct.ALIGN


def aligned(n: int, misalign: int = 0) -> memoryview:
    """n bytes of pattern whose address is ALIGN-aligned plus ``misalign``."""
    raw = np.empty(n + 2 * A, np.uint8)
    start = (-raw.ctypes.data) % A + misalign
    mv = raw[start:start + n]
    mv[:] = np.random.default_rng(n + misalign).integers(0, 256, n, dtype=np.uint8)
    return memoryview(mv)


def check(path, model: bytearray) -> None:
    with open(path, "rb") as f:
        assert f.read() == bytes(model)


@settings(max_examples=40, deadline=None)
@given(start_blocks=st.integers(0, 3),
       pieces=st.lists(st.tuples(st.integers(0, 3 * A + 17), st.integers(0, 7)), max_size=8),
       header=st.booleans(),
       stray=st.one_of(st.none(), st.tuples(st.integers(0, 5 * A), st.integers(1, 3000))))
def test_any_pattern_writes_exactly_the_bytes(tmp_path_factory, start_blocks, pieces, header, stray):
    # the shape of write_shard's pattern: data streamed from an aligned offset (sources
    # aligned or not), a header at 0 last; then maybe a stray unaligned write.
    path = str(tmp_path_factory.mktemp("d") / "f")
    w = direct.DirectWriter.open(path)
    model = bytearray()

    def put(mv, off):
        w.pwrite(mv, off)
        if len(model) < off + len(mv):
            model.extend(bytes(off + len(mv) - len(model)))
        model[off:off + len(mv)] = bytes(mv)

    pos = start_blocks * A
    for n, mis in pieces:
        put(aligned(n, mis), pos)
        pos += n
    if header and start_blocks:
        put(aligned(start_blocks * A, 3), 0)
    if stray:
        put(aligned(stray[1], 1), stray[0])
    w.commit()
    check(path, model)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4 * A + 5), st.integers(0, 3 * A + 9),
                          st.sampled_from([0, 1])), min_size=1, max_size=6))
def test_arbitrary_writes_obey_the_writer_contract(tmp_path_factory, writes):
    """Any sequence of pwrites (offsets, sizes, memory alignment), later writes winning:
    the file is the byte model, whatever streams, lone writes and padding happen inside."""
    path = str(tmp_path_factory.mktemp("d") / "f")
    w = direct.DirectWriter.open(path)
    model = bytearray()
    for off, n, mis in writes:
        mv = aligned(n, mis)
        w.pwrite(mv, off)
        if len(model) < off + n:
            model.extend(bytes(off + n - len(model)))
        model[off:off + n] = bytes(mv)
    w.commit()
    check(path, model)


def test_padding_never_covers_earlier_writes(tmp_path):
    """Found in review: a stream's zero-padded tail block used to overwrite bytes an
    earlier write had put in that block."""
    for name, ops in (("restart", [(0, aligned(2 * A)), (0, aligned(100, 1))]),
                      ("around", [(0, aligned(100, 1)), (A, aligned(A)), (100, aligned(5000, 1))])):
        path, model = str(tmp_path / name), bytearray()
        w = direct.DirectWriter.open(path)
        for off, mv in ops:
            w.pwrite(mv, off)
            model.extend(bytes(max(0, off + len(mv) - len(model))))
            model[off:off + len(mv)] = bytes(mv)
        w.commit()
        check(path, model)


def test_large_streams_cross_bounce_buffers(tmp_path):
    path = str(tmp_path / "f")
    w = direct.DirectWriter.open(path)
    parts = [aligned(5 << 20, 0), aligned(3 * (1 << 20) + 5, 0), aligned(11 << 20, 8), aligned(123, 0)]
    w.write(b"x" * 10)  # unaligned start: the stream begins at 0
    for p in parts:
        w.write(p)
    w.commit()
    check(path, bytearray(b"x" * 10 + b"".join(bytes(p) for p in parts)))


def test_abort_removes_the_file(tmp_path):
    w = direct.DirectWriter.open(str(tmp_path / "f"))
    w.write(aligned(3 * A + 1))
    w.abort()
    assert not os.path.exists(tmp_path / "f")


def test_file_system_refusing_o_direct_falls_back(tmp_path, monkeypatch):
    def refuse(path):
        raise OSError(errno.EINVAL, "Invalid argument", path)
    monkeypatch.setattr(direct.DirectWriter, "open", staticmethod(refuse))
    storage = LocalStorage()
    assert isinstance(storage.open_write(str(tmp_path / "f")), LocalWriter)
    assert storage.direct_io is False  # asked once per storage, not per file
    w = storage.open_write(str(tmp_path / "g"))
    w.write(b"abc")
    w.commit()
    assert open(tmp_path / "g", "rb").read() == b"abc"


def test_other_open_errors_are_raised(tmp_path):
    with pytest.raises(FileNotFoundError):
        LocalStorage().open_write(str(tmp_path / "no" / "such" / "dir" / "f"))


@pytest.mark.parametrize("direct_io", [True, False, None])  # None: the default
def test_shard_files_round_trip_either_way(tmp_path, direct_io, monkeypatch):
    # uneven sizes, several dtypes: data offsets cross 4 KiB boundaries in every way
    state = {"a": torch.randn(1000, 3), "b": torch.arange(4097, dtype=torch.int16),
             "c": torch.randn(64, 64).to(torch.bfloat16), "d": torch.tensor(True), "n": 7}
    opts = None if direct_io is None else {"direct_io": direct_io}
    opened: list[str] = []  # direct I/O is really used by default, and only then
    orig = direct.DirectWriter.open
    monkeypatch.setattr(direct.DirectWriter, "open",
                        staticmethod(lambda path: opened.append(path) or orig(path)))
    dckpt.save(state, str(tmp_path / "ck"), storage_options=opts)
    assert len(opened) == (0 if direct_io is False else 1), opened
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()}
    dckpt.load(out, str(tmp_path / "ck"), storage_options=opts)
    for k in state:
        assert (torch.equal(out[k], state[k]) if isinstance(state[k], torch.Tensor)
                else out[k] == state[k])
    assert verify_checkpoint(str(tmp_path / "ck")).ok
    from safetensors.torch import load_file  # still plain safetensors
    for f in os.listdir(tmp_path / "ck"):
        if f.endswith(".safetensors"):
            assert set(load_file(str(tmp_path / "ck" / f))) <= {"a", "b", "c", "d"}


def _enospc_on(monkeypatch, when):
    """Make os.pwrite fail with ENOSPC (a full disk) for calls where ``when(buf, offset)``."""
    real = os.pwrite

    def pwrite(fd, buf, offset):
        if when(buf, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, offset)
    monkeypatch.setattr(direct.os, "pwrite", pwrite)


def test_full_disk_at_the_unaligned_header_is_reported_as_enospc(tmp_path, monkeypatch):
    """Found in review: the temporary copy of an unaligned header could not be closed while
    the failed write's memoryview was still alive, so BufferError replaced the ENOSPC."""
    path = str(tmp_path / "f")
    w = direct.DirectWriter.open(path)
    w.pwrite(aligned(3 * A + 5), A)  # the data stream, after a header block
    _enospc_on(monkeypatch, lambda buf, off: off == 0)
    with pytest.raises(OSError) as e:
        w.pwrite(aligned(A, 1), 0)  # aligned size and offset, unaligned memory: the copy path
    assert e.value.errno == errno.ENOSPC and path in str(e.value)
    assert not isinstance(e.value, BufferError)
    w.abort()
    assert not os.path.exists(path)


@pytest.mark.parametrize("where", ["direct", "bounce", "tail", "buffered"])
def test_full_disk_on_every_write_path_is_reported_as_enospc(tmp_path, monkeypatch, where):
    path = str(tmp_path / "f")
    w = direct.DirectWriter.open(path)
    if where == "buffered":
        w.pwrite(aligned(100, 1), 7)  # not a stream start: the rest goes buffered
    _enospc_on(monkeypatch, lambda buf, off: True)
    with pytest.raises(OSError) as e:
        if where == "direct":
            w.pwrite(aligned(2 * A), 0)  # aligned in memory and file: written straight
        elif where == "bounce":
            w.pwrite(aligned(2 * direct._BOUNCE + 3, 1), 0)
            w.commit()
        else:
            w.pwrite(aligned(100, 1), 0 if where == "tail" else 500)
            w.commit()
    assert e.value.errno == errno.ENOSPC and path in str(e.value), e.value
    w.abort()
    assert not os.path.exists(path)
