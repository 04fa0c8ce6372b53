"""Writing tensors through the bounded bounce buffer (dckpt.engine.devstream): the path
CUDA tensors take into the fast tier, so that a GPU state has one host copy (the
tier's files). Without a GPU, ``STREAM_CPU`` sends CPU tensors through the same block
logic; the CUDA cases at the end run where a device is present."""
from __future__ import annotations

import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dckpt
from dckpt.engine import devstream
from dckpt.format import shards
from dckpt.state.tensors import as_bytes
from dckpt.storage.fsspec_storage import make_storage

from .test_fence import (_model, _same, _snapshot, _step, _tier_manager,
                         unfenced_change_fails)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def streamed(monkeypatch):
    """CPU tensors streamed, through small bounce buffers (several blocks per tensor)."""
    monkeypatch.setattr(devstream, "STREAM_CPU", True)
    monkeypatch.setattr(devstream, "BOUNCE", 4096)
    monkeypatch.setattr(devstream, "_FREE", {})


def _tensors(sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(sizes) + len(sizes))
    out = []
    for i, n in enumerate(sizes):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        if i % 3 == 1 and n % 4 == 0:
            t = t.view(torch.float32)
        out.append(t)
    return out


def _write(storage, path: str, tensors: list[torch.Tensor], block: int) -> bytes:
    entries = [(f"t{i}", "U8" if t.dtype == torch.uint8 else "F32", tuple(t.shape),
                t.numel() * t.element_size()) for i, t in enumerate(tensors)]
    bufs = [devstream.DeviceSource(t) if devstream.streams(t) else as_bytes(t) for t in tensors]
    w = storage.open_write(path)
    shards.write_shard(w, entries, bufs, storage.random_write, block)
    w.commit()
    return storage.read(path, 0, storage.size(path))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 7, 1000, 1024, 4096, 4097, 3 * 4096 + 17, 9 * 4096]),
                min_size=1, max_size=5),
       st.sampled_from([512, 1024, 4096, 8192]), st.booleans())
def test_streamed_shard_is_byte_identical(sizes, block, memory):
    """Whatever the sizes against the bounce and checksum blocks, and for a random-
    access (local) or a sequential (memory://) writer: the file is byte for byte the
    one written from whole host buffers, checksums included."""
    import tempfile

    tensors = _tensors(sizes)
    with tempfile.TemporaryDirectory() as d:
        storage, root = make_storage(f"memory://ds-{uuid.uuid4().hex}" if memory else d)
        plain = _write(storage, storage.join(root, "plain"), tensors, block)
        saved = devstream.STREAM_CPU, devstream.BOUNCE, devstream._FREE
        devstream.STREAM_CPU, devstream.BOUNCE, devstream._FREE = True, 4096, {}
        try:
            got = _write(storage, storage.join(root, "streamed"), tensors, block)
        finally:
            devstream.STREAM_CPU, devstream.BOUNCE, devstream._FREE = saved
    assert got == plain


def test_change_between_a_sequential_writers_two_passes_fails(streamed):
    """A sequential writer (memory://, an object store) reads a streamed tensor twice:
    checksums first, then the data. A change between the passes would commit
    checksums that do not match the data: the second pass compares against the first
    pass's fingerprint, and the write fails naming the tensor."""
    storage, root = make_storage(f"memory://ds-{uuid.uuid4().hex}")
    assert not storage.random_write
    t = torch.randn(8192)

    class Changing:
        def __init__(self, w) -> None:
            self.w, self.first = w, True

        def write(self, data) -> None:
            if self.first:  # the header: checksums are done, the data pass is next
                self.first = False
                t.add_(1.0)
            self.w.write(data)

    w = storage.open_write(storage.join(root, "f"))
    with pytest.raises(dckpt.CheckpointError, match="'t' .*changed while it was written"):
        shards.write_shard(Changing(w), [("t", "F32", (8192,), 8192 * 4)],
                           [devstream.DeviceSource(t, name="t")], False, 1024)
    w.abort()


def test_blocks_of_a_non_contiguous_tensor(streamed):
    """A transposed tensor streams its packed bytes, in views that are whole
    multiples of the asked size but the last."""
    t = torch.arange(64 * 48, dtype=torch.float32).view(64, 48).t()
    views = [bytes(v) for v in devstream.DeviceSource(t).blocks(1024)]
    assert all(len(v) == 4096 for v in views[:-1]) and 0 < len(views[-1]) <= 4096
    assert b"".join(views) == bytes(as_bytes(t))


def test_a_failed_write_releases_the_bounce(streamed, tmp_path):
    """A writer failing in mid-tensor: the error goes up, the bounce pair is back in
    the pool (one kept per device), and the next write is whole."""

    class Failing:
        random_write = True

        def __init__(self) -> None:
            self.calls = 0

        def pwrite(self, data, pos) -> None:
            self.calls += 1
            if self.calls == 2:
                raise OSError("disk full")

    t = torch.randn(4096)  # 16 KiB: four bounce blocks
    entries = [("t", "F32", (4096,), t.numel() * 4)]
    with pytest.raises(OSError, match="disk full"):
        shards.write_shard(Failing(), entries, [devstream.DeviceSource(t)], True, 1024)
    assert [len(v) for v in devstream._FREE.values()] == [1]
    storage, root = make_storage(str(tmp_path))
    assert _write(storage, storage.join(root, "f"), [t], 1024) == \
        _write_plain(storage, storage.join(root, "g"), [t])


def _write_plain(storage, path, tensors):
    devstream.STREAM_CPU = False
    try:
        return _write(storage, path, tensors, 1024)
    finally:
        devstream.STREAM_CPU = True


def test_fast_tier_written_through_the_bounce(streamed, tmp_path, monkeypatch):
    """The fenced fast-tier path GPU states take, run on CPU: no staging buffers, the
    call returns before the (slowed) write, the optimizer's next step waits for it,
    and both tiers hold the values at the call."""
    # The write sleeps 1 s: long enough that a call returning before it is not a race
    # with a loaded CI machine (0.3 s failed there once).
    monkeypatch.setenv("DCKPT_FAULT", "write:*:sleep=1.0")
    m, opt = _model(128)
    _step(m, opt)
    want = _snapshot(m, opt)
    with _tier_manager(tmp_path) as mgr:
        t0 = time.perf_counter()
        mgr.save(1, {"train": dckpt.TrainingState(m, opt)}, force=True)
        assert time.perf_counter() - t0 < 1.0
        assert mgr.tier.pool.nbytes == 0
        _step(m, opt)  # waits for the files
        assert devstream._FREE  # the files went through a bounce pair
        assert mgr.tier._local_job.blocking_seconds >= 0.9
    monkeypatch.delenv("DCKPT_FAULT")
    m2, o2 = _model(128)
    with _tier_manager(tmp_path) as mgr:
        assert mgr.restore({"train": dckpt.TrainingState(m2, o2)}) == 1
        assert mgr.restored_from == "local"
    _same(want, _snapshot(m2, o2))
    m3, o3 = _model(128)
    _step(m3, o3)
    dckpt.load({"state": {"train": dckpt.TrainingState(m3, o3)}}, mgr.path(1), strict=False)
    _same(want, _snapshot(m3, o3))


def test_durable_save_streams_and_its_hashes_serve_an_incremental_save(streamed, tmp_path):
    """A plain dckpt.save streams too (GPU tensors never copied to the host whole), and
    with ``block_hashes=True`` the hashes it reports, computed as the blocks pass, are
    the ones an incremental save compares with (no read back of the base): an unchanged
    tensor is referenced, not written; a changed block is written; both load bitwise;
    and verify passes."""
    from dckpt.engine.reader import ChunkReader
    from dckpt.format import manifest as mf
    from dckpt.catalog.verify import verify_checkpoint

    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(3, 1 << 18, generator=g).t(),
          "step": 1}
    full = dckpt.save(sd, str(tmp_path / "s0"), block_hashes=True)
    assert devstream._FREE
    sd["a"][:1000] += 1.0  # the first 1 MiB hash block only
    real, read = ChunkReader.stored_bytes, []
    ChunkReader.stored_bytes = lambda self, *a: read.append(a[1]) or real(self, *a)
    try:
        inc = dckpt.save(sd, str(tmp_path / "s1"), base=str(tmp_path / "s0"))  # not streamed
    finally:
        ChunkReader.stored_bytes = real
    assert "b" not in read  # compared by the hashes recorded while streaming
    assert inc.bytes_written < 0.4 * full.bytes_written, (inc.bytes_written, full.bytes_written)
    m = mf.parse(open(tmp_path / "s1" / "manifest.json", "rb").read())
    assert m.files[int(m.tensors["b"].chunks.file[0])].dir == "s0"  # referenced, not rewritten
    for d in ("s0", "s1"):
        assert verify_checkpoint(str(tmp_path / d)).ok
    got = dckpt.load({"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 18, 3), "step": 0},
                     str(tmp_path / "s1"))
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["b"], sd["b"]) and got["step"] == 1


def test_fingerprint_sees_changes_and_odd_offsets():
    """The device-side detector: equal for equal bytes, different after an update or
    a one-byte overwrite, and works on views whose offset is not 8-byte aligned (the
    byte-sum fallback)."""
    t = torch.randn(1001)
    fp = devstream.fingerprint
    flat = t.view(torch.uint8)
    assert torch.equal(fp(flat), fp(t.clone().view(torch.uint8)))
    u = t.clone()
    u[500] += 1e-3
    assert not torch.equal(fp(flat), fp(u.view(torch.uint8)))
    odd = flat[3:3 + 4000]  # offset 3: no int64 view
    changed = odd.clone()
    changed[-1] ^= 1
    assert not torch.equal(fp(odd), fp(changed))
    assert fp(flat[:0]).item() == 0


def test_unfenced_change_during_a_streamed_write_fails_the_save(streamed, tmp_path, monkeypatch):
    """The GPU path has no read-back (its checksums come from the bytes copied): a
    tensor changed between its first and last block, by something no fence held
    back, is caught by its fingerprint, and the save fails, naming it; the previous
    step stays."""
    unfenced_change_fails(tmp_path, monkeypatch, "changed while it was written")


# ----------------------------------------------------------------------------- CUDA

def _cuda_model(width: int = 512):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width)).cuda()
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _cuda_step(m, opt) -> None:
    opt.zero_grad()
    m(torch.randn(8, m[0].in_features, device="cuda")).sum().backward()
    opt.step()


@cuda
def test_cuda_fenced_tier_save_holds_one_host_copy(tmp_path, monkeypatch):
    """A GPU TrainingState into the fast tier: no pinned staging copy, the optimizer
    steps right away (waiting for the files), both tiers hold the values at the
    call, and the restore puts them back on the GPU."""
    monkeypatch.setenv("DCKPT_FAULT", "write:*:sleep=0.2")
    m, opt = _cuda_model()
    _cuda_step(m, opt)
    want = _snapshot(m, opt)
    with _tier_manager(tmp_path) as mgr:
        mgr.save(1, {"train": dckpt.TrainingState(m, opt)}, force=True)
        assert mgr.tier.pool.nbytes == 0
        _cuda_step(m, opt)
        assert mgr.tier._local_job.blocking_seconds >= 0.15
    monkeypatch.delenv("DCKPT_FAULT")
    m2, o2 = _cuda_model()
    with _tier_manager(tmp_path) as mgr:
        assert mgr.restore({"train": dckpt.TrainingState(m2, o2)}) == 1
    _same(want, _snapshot(m2, o2))
    assert next(m2.parameters()).is_cuda


@cuda
def test_cuda_copy_sees_kernels_queued_before_the_call(tmp_path):
    """Kernels queued before the save (still running when it returns) are in the
    checkpoint; the fenced step queued after it is not: the side stream waits for
    the event recorded at the call."""
    x = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
    opt = torch.optim.SGD([x], lr=1.0)
    x.grad = torch.ones_like(x)
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time ahead of the add
        x.add_(2.0)
    with _tier_manager(tmp_path) as mgr:
        mgr.save(1, {"x": x}, force=True, fence=opt)
        assert not torch.cuda.current_stream().query()  # the add has not run yet
        opt.step()  # x -> 1.0, once the files are written
    got = dckpt.load({"state": {"x": torch.zeros(1 << 20)}}, mgr.path(1))["state"]["x"]
    assert torch.equal(got, torch.full((1 << 20,), 2.0))
    assert torch.equal(x.detach().cpu(), torch.full((1 << 20,), 1.0))


@cuda
def test_cuda_sync_tier_save_streams(tmp_path):
    """A synchronous tier save of GPU tensors streams them too (waiting for the
    caller's stream) and restores bitwise."""
    sd = {"w": torch.randn(300, 700, device="cuda"), "h": torch.randn(64, device="cuda").half()}
    want = {k: v.cpu() for k, v in sd.items()}
    with dckpt.CheckpointManager(str(tmp_path / "r"), capture_rng=False,
                                 local_root=str(tmp_path / "node")) as mgr:
        mgr.save(1, sd, force=True)
    t = {k: torch.zeros_like(v) for k, v in sd.items()}
    with dckpt.CheckpointManager(str(tmp_path / "r"), capture_rng=False,
                                 local_root=str(tmp_path / "node")) as mgr:
        assert mgr.restore(t) == 1 and mgr.restored_from == "local"
    for k in want:
        assert torch.equal(t[k].cpu(), want[k]), k


@cuda
def test_cuda_sync_save_waits_for_queued_kernels(tmp_path):
    """A plain synchronous dckpt.save right after kernels were queued (no .cpu() or
    synchronize() in between) writes their results: the bytes are streamed after an
    event recorded in the caller's thread."""
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    x.add_(3.0)
    assert not torch.cuda.current_stream().query()
    dckpt.save({"x": x}, str(tmp_path / "c"))
    got = dckpt.load({"x": torch.zeros(1 << 20)}, str(tmp_path / "c"))["x"]
    assert torch.equal(got, torch.full((1 << 20,), 3.0))


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device_streams_without_touching_the_first(tmp_path):
    """A rank on cuda:1 streams from cuda:1 (a background thread's current device is 0:
    entering only the stream would make a CUDA context there); where no context on
    cuda:0 existed before, none exists after."""
    fresh = not torch._C._cuda_hasPrimaryContext(0)
    t = torch.randn(1 << 20, device="cuda:1")
    with dckpt.CheckpointManager(str(tmp_path / "r"), capture_rng=False,
                                 local_root=str(tmp_path / "node")) as mgr:
        mgr.save(1, {"t": t}, force=True)
    got = dckpt.load({"state": {"t": torch.zeros(1 << 20)}}, mgr.path(1))["state"]["t"]
    assert torch.equal(got, t.cpu())
    if fresh:
        assert not torch._C._cuda_hasPrimaryContext(0)
