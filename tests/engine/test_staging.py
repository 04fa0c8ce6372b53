"""StagingPool: snapshots into reused host buffers; pinned buffers for CUDA sources."""
from __future__ import annotations

import pytest
import torch

import dckpt
from dckpt.engine.staging import StagingPool


def test_snapshot_copies_and_reuses_buffers():
    pool = StagingPool()
    sd = {"a": torch.randn(64, 8), "n": {"b": torch.arange(5)}, "t": (1, "x"), "s": 3}
    snap, nbytes = pool.snapshot(sd)
    assert nbytes == 64 * 8 * 4 + 5 * 8
    assert torch.equal(snap["a"], sd["a"]) and snap["a"].data_ptr() != sd["a"].data_ptr()
    assert snap["t"] == (1, "x") and type(snap["t"]) is tuple and snap["s"] == 3
    ptr = snap["a"].data_ptr()
    sd["a"].add_(1)
    snap2, _ = pool.snapshot(sd)
    assert snap2["a"].data_ptr() == ptr, "the buffer is reused"
    assert torch.equal(snap2["a"], sd["a"])
    assert all(t.data_ptr() % 4096 == 0 for t in pool.buffers.values()), \
        "staged buffers are 4 KiB aligned, for zero-copy direct writes"
    del sd["n"]
    pool.snapshot(sd)
    assert "n.b" not in pool.buffers, "buffers of keys that left the state are freed"


def test_budget_refuses_before_copying():
    pool = StagingPool(budget_bytes=100)
    with pytest.raises(dckpt.CheckpointError, match="staging budget"):
        pool.snapshot({"a": torch.zeros(1000)})
    assert pool.buffers == {}


def test_budget_on_the_total_refuses_before_allocating_past_it():
    pool = StagingPool(budget_bytes=3000)
    pool.snapshot({"a": torch.zeros(500)})  # 2000 bytes: fits, and its buffer is kept
    allocated: list[str] = []
    orig = pool._buffer
    pool._buffer = lambda key, t: allocated.append(key) or orig(key, t)
    with pytest.raises(dckpt.CheckpointError, match="more than the budget of 3000.*'b'"):
        pool.snapshot({"a": torch.zeros(500), "b": torch.zeros(500)})  # 4000 in all
    assert allocated == ["a"] and pool.buffers == {}  # 'b' never got a buffer


def test_stateful_objects_are_snapshotted_by_value():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    snap, _ = StagingPool().snapshot({"sched": sched})
    opt.step()
    sched.step()
    assert snap["sched"]["last_epoch"] == 0 and sched.last_epoch == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_to_pinned_buffers():
    pool = StagingPool()
    src = torch.randn(1024, 1024, device="cuda")
    snap, _ = pool.snapshot({"w": src})
    assert snap["w"].device.type == "cpu" and snap["w"].is_pinned()
    assert torch.equal(snap["w"], src.cpu())
    src.add_(1)  # after return the snapshot no longer depends on the source
    assert not torch.equal(snap["w"], src.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_save_of_cuda_state(tmp_path):
    sd = {"w": torch.randn(256, 256, device="cuda"), "step": 1}
    want = sd["w"].cpu()
    h = dckpt.async_save(sd, str(tmp_path / "c"))
    sd["w"].zero_()
    h.result(timeout=60)
    t = {"w": torch.zeros(256, 256, device="cuda"), "step": 0}
    dckpt.load(t, str(tmp_path / "c"))
    assert torch.equal(t["w"].cpu(), want)


def test_pinned_rounding_waste_is_reported_once(caplog, monkeypatch):
    """torch rounds every pinned allocation up to a power of two: sizes just above one
    nearly double the staging's host memory. The pool says so once, with the setting
    that avoids it, and stays quiet when that setting is made or the waste is small."""
    import logging

    from dckpt.engine import staging

    assert staging.pinned_waste([1 << 24, 0]) == 0
    assert staging.pinned_waste([(1 << 24) + 4096]) == (1 << 24) - 4096
    monkeypatch.setattr(staging, "_warned_rounding", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with caplog.at_level(logging.WARNING, logger="dckpt.engine.staging"):
        staging._warn_rounding([1 << 24, 1 << 20])  # powers of two: no waste
        assert not caplog.records
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_max_round_threshold_mb:16")
        staging._warn_rounding([(1 << 24) + 1])
        assert not caplog.records
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        staging._warn_rounding([(1 << 24) + 1])
        staging._warn_rounding([(1 << 24) + 1])
    assert len(caplog.records) == 1
    assert "pinned_max_round_threshold_mb" in caplog.records[0].getMessage()
