"""CheckpointManager and its policies, in one process."""
from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

import dckpt
from dckpt.policy import RetentionPolicy, SavePolicy, young_daly_interval


def test_retention_policy():
    r = RetentionPolicy(keep_last=2, keep_every=10)
    assert r.to_delete([5, 10, 15, 20, 25, 30]) == [5, 15]
    assert r.to_delete([5, 7], protected={5}) == []
    assert RetentionPolicy(keep_last=1).to_delete([1, 2, 3]) == [1, 2]
    assert RetentionPolicy().to_delete([1, 2, 3]) == []
    with pytest.raises(ValueError):
        RetentionPolicy(keep_last=0)


def test_save_policy_and_young_daly():
    p = SavePolicy(every_steps=5)
    assert [s for s in range(1, 21) if p.due(s, 5 * ((s - 1) // 5) or None, 0.0)] == [5, 10, 15, 20]
    t = SavePolicy(every_seconds=10)
    assert not t.due(3, None, 9.9) and t.due(3, None, 10.0)
    assert young_daly_interval(20, 86400) == pytest.approx(1859.0, abs=1)
    a = SavePolicy(every_steps="auto", mtbf_hours=24)
    assert a.step_interval(None, None) == 100  # warm-up until times are measured
    assert a.step_interval(20.0, 1.5) == round(1859.03 / 1.5)
    with pytest.raises(ValueError):
        SavePolicy(every_steps="auto")
    with pytest.raises(ValueError):
        SavePolicy(every_steps=0)


def _state(step):
    return {"w": torch.full((4, 4), float(step)), "step": step}


@pytest.mark.parametrize("use_async", [False, True])
def test_retention_keeps_exactly_what_the_policy_says(tmp_path, use_async):
    with dckpt.CheckpointManager(str(tmp_path), every_steps=3, keep_last=2, keep_every=9,
                                 async_save=use_async, capture_rng=False) as mgr:
        saved = [s for s in range(1, 31) if mgr.save(s, _state(s))]
        mgr.wait()
        assert saved == list(range(3, 31, 3))
        assert mgr.steps() == [9, 18, 27, 30]
        assert sorted(os.listdir(tmp_path)) == [f"step-{s:08d}" for s in (9, 18, 27, 30)]


def test_force_and_path(tmp_path):
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=100, capture_rng=False)
    assert not mgr.save(1, _state(1))
    assert mgr.save(2, _state(2), force=True)
    assert mgr.path(2) == os.path.join(str(tmp_path), "step-00000002")
    assert mgr.steps() == [2]


def test_restore_newest_ignores_uncommitted_and_falls_back_past_corruption(tmp_path, caplog):
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1, capture_rng=False)
    for s in (1, 2, 3):
        mgr.save(s, _state(s))
    (tmp_path / "step-00000009").mkdir()  # a save that never committed
    t = _state(0)
    assert mgr.restore(t) == 3 and t["step"] == 3 and torch.equal(t["w"], _state(3)["w"])
    # Corrupt the newest: restore warns and falls back to step 2.
    d = tmp_path / "step-00000003"
    f = next(p for p in d.iterdir() if p.suffix == ".safetensors")
    b = bytearray(f.read_bytes())
    b[-1] ^= 0x01
    f.write_bytes(b)
    t = _state(0)
    with caplog.at_level(logging.WARNING, logger="dckpt.manager"):
        assert mgr.restore(t) == 2
    assert t["step"] == 2 and torch.equal(t["w"], _state(2)["w"])
    assert any("step 3" in r.message and "checksum" in r.message for r in caplog.records)
    with pytest.raises(dckpt.IntegrityError):
        mgr.restore(_state(0), step=3)  # an explicit step does not fall back
    (d / "manifest.json").write_text("garbage")
    assert mgr.restore(_state(0)) == 2


def test_restore_with_nothing_saved(tmp_path):
    assert dckpt.CheckpointManager(str(tmp_path / "new")).restore(_state(0)) is None


def test_rng_captured_and_restored(tmp_path):
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    mgr.save(1, _state(1))
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert mgr.restore(_state(0)) == 1
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


def test_user_keys_stay_strict(tmp_path):
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1)
    mgr.save(1, {"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(dckpt.StateMismatchError, match="'state.b'"):
        mgr.restore({"a": torch.zeros(1)})
