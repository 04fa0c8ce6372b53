"""async_save: the snapshot is what gets saved, errors reach every handle, memory stays
flat over many saves, and the background persist never deadlocks with training."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _state(scale: float = 1.0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(11)
    full = torch.randn(256, 64, generator=g) * scale
    return {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "b": torch.arange(32, dtype=torch.float32) * scale, "step": 7}


def _mutate_after_return(path: str) -> float:
    import dckpt

    sd = _state()
    want = {k: (v.to_local().clone() if hasattr(v, "to_local") else v.clone())
            for k, v in sd.items() if isinstance(v, torch.Tensor)}
    h = dckpt.async_save(sd, path)
    with torch.no_grad():  # the training step right after the call
        sd["w"].to_local().add_(100.0)
        sd["b"].mul_(-1)
    sd["step"] = 8
    info = h.result(timeout=60)
    assert h.done() and h.exception() is None and info.world_size == dist.get_world_size()
    t = _state(0.0)
    t["step"] = 0
    dckpt.load(t, path)
    assert torch.equal(t["w"].to_local(), want["w"]) and torch.equal(t["b"], want["b"])
    assert t["step"] == 7
    return h.staging_seconds


def test_values_after_return_are_not_saved(ranks, tmp_path):
    assert all(s >= 0 for s in ranks(2).run(_mutate_after_return, str(tmp_path / "a")))


def _fault_reaches_every_handle(path: str) -> str:
    import dckpt

    h = dckpt.async_save(_state(), path)
    err = h.exception(timeout=60)
    assert isinstance(err, dckpt.RankFailure), err
    with pytest.raises(dckpt.RankFailure):
        h.result()
    assert not os.path.exists(os.path.join(path, "manifest.json"))
    return str(err)


def _save_ok(path: str) -> int:
    import dckpt

    return dckpt.async_save(_state(), path).result(timeout=60).num_files


def test_failure_on_one_rank_reaches_every_handle(ranks, tmp_path):
    pool = ranks(2)
    msgs = pool.run(_fault_reaches_every_handle, str(tmp_path / "f"),
                    env={"DCKPT_FAULT": "write:1:raise"})
    assert all("failed on rank 1:" in m and "injected fault at write" in m for m in msgs)
    assert len(set(msgs)) == 1, msgs
    # The next save works: the in-flight slot and the staging buffers recovered.
    assert pool.run(_save_ok, str(tmp_path / "f")) == [2, 2]


def _bad_leaf_on_rank0(path: str) -> str:
    import dckpt

    sd = _state()
    if dist.get_rank() == 0:
        sd["fn"] = print
    else:
        sd["fn"] = "print"
    err = dckpt.async_save(sd, path).exception(timeout=60)
    assert isinstance(err, dckpt.UnsupportedValueError), err
    return str(err)


def test_refused_leaf_fails_every_handle(ranks, tmp_path):
    msgs = ranks(2).run(_bad_leaf_on_rank0, str(tmp_path / "u"))
    assert all("rank 0" in m and "'fn'" in m for m in msgs)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def _twenty_saves(path: str) -> tuple[int, int, int]:
    import dckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {f"p{i}": distribute_tensor(torch.randn(512, 256), mesh, [Shard(0)], src_data_rank=None)
          for i in range(8)}  # 4 MiB per rank
    rss = []
    for i in range(20):
        with torch.no_grad():
            for v in sd.values():
                v.to_local().add_(1.0)
        dckpt.async_save(sd, path, overwrite=True)
        rss.append(_rss_kib())
    from dckpt.protocol.async_save import _saver
    _saver(None).inflight.result(timeout=60)
    files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
    return rss[4], rss[-1], files


def test_twenty_saves_keep_memory_flat(ranks, tmp_path):
    for early, late, files in ranks(2).run(_twenty_saves, str(tmp_path / "m")):
        assert late - early < 8 * 1024, (early, late)  # < 8 MiB growth over 15 saves
        assert files == 2


def _interleave(path: str) -> int:
    import dckpt

    sd = _state()
    x = torch.ones(1000)
    for i in range(6):
        h = dckpt.async_save(sd, os.path.join(path, f"s{i}"))
        for _ in range(20):  # the training's own collectives while the persist runs
            dist.all_reduce(x)
            x.div_(dist.get_world_size())
            dist.barrier()
        h.result(timeout=60)
    return int(x[0].item())


def test_interleaving_with_training_collectives_does_not_hang(ranks, tmp_path):
    assert ranks(2).run(_interleave, str(tmp_path), timeout=120) == [1, 1]


def _load(path: str) -> dict:
    import dckpt

    t = _state(0.0)
    t["step"] = 0
    dckpt.load(t, path)
    return t


def _second_save_waits(root: str) -> float:
    import dckpt

    first, second = _state(1.0), _state(-3.0)
    second["step"] = 8
    want1 = (first["w"].to_local().clone(), first["b"].clone())
    want2 = (second["w"].to_local().clone(), second["b"].clone())
    p1, p2 = os.path.join(root, "one"), os.path.join(root, "two")
    # DCKPT_FAULT=plan:*:sleep holds the first persist before it writes a byte: a second
    # snapshot taken without waiting would land in the very buffers it is about to write.
    h1 = dckpt.async_save(first, p1)
    h2 = dckpt.async_save(second, p2)  # no result() in between
    assert h1.done(), "the second async_save returned while the first save was in flight"
    assert h2.blocking_seconds >= 1.0, h2.blocking_seconds
    h1.result(timeout=60)
    h2.result(timeout=60)
    t1, t2 = _load(p1), _load(p2)
    assert torch.equal(t1["w"].to_local(), want1[0]) and torch.equal(t1["b"], want1[1])
    assert t1["step"] == 7
    assert torch.equal(t2["w"].to_local(), want2[0]) and torch.equal(t2["b"], want2[1])
    assert t2["step"] == 8
    return h2.blocking_seconds


def test_second_async_save_waits_for_the_first(ranks, tmp_path):
    waited = ranks(2).run(_second_save_waits, str(tmp_path),
                          env={"DCKPT_FAULT": "plan:*:sleep=1.5"}, timeout=60)
    assert all(w >= 1.0 for w in waited), waited


def _staging_fails_on_rank0(path: str) -> str:
    import dckpt

    budget = 64 if dist.get_rank() == 0 else None  # rank 0 cannot stage a 32 KiB shard
    h = dckpt.async_save(_state(), path, staging_budget=budget)
    err = h.exception(timeout=10)  # TimeoutError here = a rank left waiting
    assert isinstance(err, dckpt.CheckpointError), repr(err)
    assert set(err.failures) == {0}, err.failures
    with pytest.raises(dckpt.CheckpointError, match="rank 0"):
        h.result(timeout=1)
    assert not os.path.exists(os.path.join(path, "manifest.json"))
    with pytest.raises(dckpt.NotCommittedError):
        _load(path)
    return str(err)


def test_snapshot_failure_on_one_rank_fails_every_handle(ranks, tmp_path):
    pool = ranks(2)
    msgs = pool.run(_staging_fails_on_rank0, str(tmp_path / "s"), timeout=60)
    assert all("rank 0" in m and "staging budget" in m for m in msgs), msgs
    assert msgs[0] == msgs[1]
    # The staging pool and the in-flight slot recovered: the next save commits.
    assert pool.run(_save_ok, str(tmp_path / "s")) == [2, 2]


def _wrappers_follow_the_layout(root: str) -> list:
    """The staging pool reuses a DTensor wrapper around a reused buffer only while the
    layout is the same: a key that changes placements (same local shape) gets a new one,
    and every snapshot saves the values at its call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import dckpt
    from dckpt.engine.staging import StagingPool

    w = dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    local = torch.arange(12, dtype=torch.float32).reshape(3, 4) + dist.get_rank()
    pool = StagingPool()
    out = []
    for i, placement in enumerate([Shard(0), Shard(0), Replicate()]):
        if placement == Replicate():
            local = torch.full((3, 4), 7.0)  # the same on every rank, as Replicate says
        d = DTensor.from_local(local, mesh, [placement], run_check=False)
        snap, _ = pool.snapshot({"x": d})
        out.append((snap["x"].placements[0] == placement, snap["x"].shape == d.shape,
                    id(snap["x"])))
        dckpt.save(snap, f"{root}/c{i}")
        local.add_(100)  # after the snapshot: not saved
        full = torch.zeros(tuple(d.shape))
        dckpt.load({"x": full}, f"{root}/c{i}")
        want = torch.full((3, 4), 7.0) if placement == Replicate() else \
            torch.cat([torch.arange(12, dtype=torch.float32).reshape(3, 4) + r + 100 * i
                       for r in range(w)])
        out.append(torch.equal(full, want))
    return out


def test_staging_reuses_dtensor_wrappers_only_for_the_same_layout(ranks, tmp_path):
    for out in ranks(2).run(_wrappers_follow_the_layout, str(tmp_path)):
        (ok0, s0, id0), v0, (ok1, s1, id1), v1, (ok2, s2, id2), v2 = out
        assert ok0 and ok1 and ok2 and s0 and s1 and s2 and v0 and v1 and v2
        assert id0 == id1 and id2 != id1  # reused, then rebuilt for the new placement
