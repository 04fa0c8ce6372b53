"""CheckpointManager across ranks: time decisions agreed, RNG per rank, resharding."""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from statekit import has_manifest


def _time_based(root: str) -> list[int]:
    import dckpt

    mgr = dckpt.CheckpointManager(root, every_seconds=0.15, capture_rng=False)
    saved = []
    for step in range(1, 25):
        # Ranks run at different speeds: their clocks would disagree on their own.
        time.sleep(0.02 if dist.get_rank() == 0 else 0.035)
        if mgr.save(step, {"x": torch.full((2,), float(step))}):
            saved.append(step)
    mgr.close()
    assert mgr.steps() == saved
    return saved


def test_time_based_saves_agree_across_ranks(ranks, tmp_path):
    out = ranks(2).run(_time_based, str(tmp_path))
    assert out[0] == out[1] and len(out[0]) >= 2


def _draws() -> tuple:
    import numpy as np

    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _save_rng(root: str) -> tuple:
    import numpy as np

    import dckpt

    r = dist.get_rank()
    random.seed(100 + r), np.random.seed(200 + r), torch.manual_seed(300 + r)
    mgr = dckpt.CheckpointManager(root, every_steps=1)
    mgr.save(1, {"x": torch.zeros(2)})
    return _draws()


def _restore_rng(root: str) -> tuple:
    import dckpt

    random.seed(0)
    torch.manual_seed(0)
    mgr = dckpt.CheckpointManager(root, every_steps=1)
    assert mgr.restore({"x": torch.zeros(2)}) == 1
    return _draws()


def test_rng_per_rank_same_and_other_world_size(ranks, tmp_path):
    root = str(tmp_path)
    want = ranks(2).run(_save_rng, root)
    assert want[0] != want[1]
    assert ranks(2).run(_restore_rng, root) == want  # each rank gets its own back
    got = ranks(3).run(_restore_rng, root)  # grown: documented mapping
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2] not in want, "the new rank gets a stream of its own"
    assert ranks(3).run(_restore_rng, root)[2] == got[2], "deterministic"


def _async_failure_and_retention(root: str) -> str:
    import os

    import dckpt

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def st(s):  # every rank writes a shard (a plain tensor is written by one rank only)
        full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) + s
        return {"x": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None), "s": s}

    mgr = dckpt.CheckpointManager(root, every_steps=1, keep_last=1, async_save=True,
                                  capture_rng=False)
    assert mgr.save(1, st(1))
    mgr.wait()
    assert mgr.save(2, st(2))
    assert has_manifest(root, 1), "deleted before the newer checkpoint committed"
    mgr.wait()
    assert mgr.steps() == [2]
    os.environ["DCKPT_FAULT"] = "write:1:raise"  # rank 1's write of step 3 fails
    try:
        assert mgr.save(3, st(3))
        with pytest.raises(dckpt.CheckpointError) as ei:
            mgr.wait()
    finally:
        del os.environ["DCKPT_FAULT"]
    err = ei.value
    assert isinstance(err, dckpt.RankFailure) and set(err.failures) == {1}, err
    assert mgr.steps() == [2] and has_manifest(root, 2)
    t = st(0)
    assert mgr.restore(t) == 2 and t["s"] == 2
    assert torch.equal(t["x"].to_local(), st(2)["x"].to_local())
    assert mgr.save(4, st(4))
    mgr.close()
    dist.barrier()
    assert sorted(n for n in os.listdir(root) if not n.startswith(".dckpt-")) == [
        "step-00000004"]  # 2 by retention, 3 a leftover; .dckpt-*: the save history
    return str(err)


def test_async_failure_on_one_rank_raises_everywhere_and_keeps_older(ranks, tmp_path):
    msgs = ranks(2).run(_async_failure_and_retention, str(tmp_path), timeout=60)
    assert all("rank 1" in m and "injected fault at write" in m for m in msgs)


class _SkewedClock:
    """``time`` for dckpt.manager.core and .triggers whose monotonic clock runs ``scale`` times as fast."""

    def __init__(self, scale: float) -> None:
        self.scale, self.t0 = scale, time.monotonic()

    def monotonic(self) -> float:
        return (time.monotonic() - self.t0) * self.scale

    perf_counter = staticmethod(time.perf_counter)


def _auto_interval(root: str) -> tuple:
    import dckpt
    import dckpt.manager.core as manager
    import dckpt.manager.triggers as triggers

    # Rank 1 measures its steps 10^6 times shorter: on its own it would compute an
    # interval far above rank 0's, so only rank 0 deciding keeps the saves together.
    if dist.get_rank() == 1:
        manager.time = triggers.time = _SkewedClock(1e-6)
    try:
        mgr = dckpt.CheckpointManager(root, every_steps="auto", mtbf_hours=1e-9,
                                      capture_rng=False)
        saved = []
        for step in range(1, 111):
            time.sleep(0.002)
            if mgr.save(step, {"x": torch.full((2,), float(step))}):
                saved.append(step)
        mgr.close()
        assert mgr.steps() == saved
        return saved, mgr.policy.step_interval(mgr.save_seconds, mgr.step_seconds)
    finally:
        manager.time = triggers.time = time


def test_auto_interval_agreed_across_ranks(ranks, tmp_path):
    (s0, n0), (s1, n1) = ranks(2).run(_auto_interval, str(tmp_path), timeout=60)
    assert s0 == s1 == list(range(100, 111)), (s0, s1)  # warm-up 100, then every step
    assert n0 == 1 and n1 > 100, (n0, n1)  # the ranks' own estimates do disagree
