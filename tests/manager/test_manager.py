"""CheckpointManager and its policies, in one process."""
from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

import dckpt
from dckpt.catalog.retention import RetentionPolicy
from dckpt.manager.policy import SavePolicy, young_daly_interval
from statekit import has_manifest


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
        SavePolicy(every_steps="auto", mtbf_hours=0)
    with pytest.raises(ValueError):
        SavePolicy(every_steps=0)


def test_failure_aware_interval_shortens_as_failures_come():
    from dckpt.manager.policy import estimate_mtbf_hours

    assert estimate_mtbf_hours(0, 0.0) == 24.0
    assert estimate_mtbf_hours(0, 48.0) == 72.0  # no failure yet: the estimate grows
    assert estimate_mtbf_hours(3, 6.0) == 7.5
    p = SavePolicy(every_steps="auto")
    calm = p.step_interval(20.0, 1.5)
    p.estimated_mtbf_hours = estimate_mtbf_hours(10, 2.0)
    assert p.step_interval(20.0, 1.5) < calm / 3
    with pytest.raises(ValueError):
        estimate_mtbf_hours(-1, 1.0)


def _state(step):
    return {"w": torch.full((4, 4), float(step)), "step": step}


def _steps_listed(root) -> list[str]:
    """The root's entries but the manager's own metadata (the save history)."""
    return sorted(n for n in os.listdir(root) if not n.startswith(".dckpt-"))


@pytest.mark.parametrize("use_async", [False, True])
def test_retention_keeps_exactly_what_the_policy_says(tmp_path, use_async):
    with dckpt.CheckpointManager(str(tmp_path), every_steps=3, keep_last=2, keep_every=9,
                                 async_save=use_async, capture_rng=False) as mgr:
        saved = [s for s in range(1, 31) if mgr.save(s, _state(s))]
        mgr.wait()
        assert saved == list(range(3, 31, 3))
        assert mgr.steps() == [9, 18, 27, 30]
        assert _steps_listed(tmp_path) == [f"step-{s:08d}" for s in (9, 18, 27, 30)]


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
    with caplog.at_level(logging.WARNING, logger="dckpt.manager.core"):
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


def test_retention_protected_steps_are_kept():
    # keep_last=1 alone would delete 5 and 7; protecting 5 (in flight / just committed)
    # must keep it, while 7 still goes.
    r = RetentionPolicy(keep_last=1)
    assert r.to_delete([5, 7, 9]) == [5, 7]
    assert r.to_delete([5, 7, 9], protected={5}) == [7]
    assert r.to_delete([5, 7, 9], protected={5, 7}) == []
    assert r.to_delete([9, 5, 7], protected={9}) == [5, 7]  # unsorted input, newest anyway
    assert RetentionPolicy().to_delete([5, 7, 9], protected={5}) == []


def test_manager_never_deletes_the_step_it_just_committed(tmp_path):
    # Roll back to a milestone and continue: the new checkpoint (5) is older than the
    # newest one (8); keep_last=1 alone would delete it right after it committed.
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1, keep_last=1, keep_every=4,
                                  capture_rng=False)
    assert mgr.save(4, _state(4)) and mgr.save(8, _state(8))
    assert mgr.steps() == [4, 8]
    assert mgr.restore(_state(0), step=4) == 4
    assert mgr.save(5, _state(5))
    assert 5 in mgr.steps()
    t = _state(0)
    assert mgr.restore(t, step=5) == 5 and t["step"] == 5


def test_async_failed_save_raises_from_wait_and_keeps_older_steps(tmp_path, monkeypatch):
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1, keep_last=2,
                                  async_save=True, capture_rng=False)
    assert mgr.save(1, _state(1)) and mgr.save(2, _state(2))
    mgr.wait()
    monkeypatch.setenv("DCKPT_FAULT", "write:0:raise")
    assert mgr.save(3, _state(3))  # returns after the snapshot: the write fails later
    with pytest.raises(dckpt.CheckpointError, match="injected fault at write") as ei:
        mgr.wait()
    monkeypatch.delenv("DCKPT_FAULT")
    assert isinstance(ei.value, dckpt.RankFailure) and 0 in ei.value.failures
    mgr.wait()  # the error is raised once
    assert mgr.steps() == [1, 2] and not has_manifest(tmp_path, 3)
    for s in (1, 2):
        t = _state(0)
        assert mgr.restore(t, step=s) == s and torch.equal(t["w"], _state(s)["w"])
    assert mgr.restore(_state(0)) == 2


def test_async_failed_save_raises_from_close_after_later_saves(tmp_path, monkeypatch):
    # The failure is noticed by the next save() (logged there) and raised by close().
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1, async_save=True,
                                  capture_rng=False)
    assert mgr.save(1, _state(1))
    mgr.wait()
    monkeypatch.setenv("DCKPT_FAULT", "write:0:raise")
    assert mgr.save(2, _state(2))
    # (private, test only) let the failing write happen while the fault is armed
    mgr._inflight[1].exception(timeout=30)
    monkeypatch.delenv("DCKPT_FAULT")
    assert mgr.save(3, _state(3))  # must not raise: the failed save is only logged here
    with pytest.raises(dckpt.CheckpointError, match="injected fault at write"):
        mgr.close()
    assert mgr.steps() == [1, 3]


def test_async_retention_deletes_only_after_newer_commit(tmp_path, monkeypatch):
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1, keep_last=1,
                                  async_save=True, capture_rng=False)
    assert mgr.save(1, _state(1))
    mgr.wait()
    assert mgr.save(2, _state(2))
    # Step 2 may still be in flight: step 1 is the only committed checkpoint.
    assert has_manifest(tmp_path, 1)
    mgr.wait()
    assert mgr.steps() == [2] and not (tmp_path / "step-00000001").exists()
    # A failed save deletes nothing: 2 stays, and it still loads.
    monkeypatch.setenv("DCKPT_FAULT", "write:0:raise")
    assert mgr.save(3, _state(3))
    assert has_manifest(tmp_path, 2)
    with pytest.raises(dckpt.CheckpointError):
        mgr.wait()
    monkeypatch.delenv("DCKPT_FAULT")
    assert mgr.steps() == [2] and (tmp_path / "step-00000003").is_dir()  # the failed save's leftover
    t = _state(0)
    assert mgr.restore(t) == 2 and torch.equal(t["w"], _state(2)["w"])
    # The next commit removes 2 (retention) and the uncommitted step 3 (older leftover).
    assert mgr.save(4, _state(4))
    assert has_manifest(tmp_path, 2)
    mgr.wait()
    assert _steps_listed(tmp_path) == ["step-00000004"]


@pytest.mark.parametrize("use_async", [False, True])
def test_partial_step_dirs_older_than_a_commit_are_removed(tmp_path, use_async):
    # No keep_last: leftovers of failed saves of *earlier* steps go after a commit;
    # an uncommitted directory of a later step, and committed steps, are kept.
    for s in (3, 9):
        d = tmp_path / f"step-{s:08d}"
        d.mkdir()
        (d / "data-0123456789abcdef-00000.safetensors").write_bytes(b"partial")
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1, async_save=use_async,
                                  capture_rng=False)
    assert mgr.save(2, _state(2))
    mgr.wait()
    assert (tmp_path / "step-00000003").is_dir()  # newer than the commit: kept
    assert mgr.save(5, _state(5))
    mgr.wait()
    assert _steps_listed(tmp_path) == [f"step-{s:08d}" for s in (2, 5, 9)]
    assert mgr.steps() == [2, 5]


@pytest.mark.parametrize("use_async", [False, True])
def test_auto_interval_leaves_warmup_after_a_measured_save(tmp_path, use_async):
    import time

    def run(root, mtbf_hours, last):
        mgr = dckpt.CheckpointManager(str(root), every_steps="auto", mtbf_hours=mtbf_hours,
                                      async_save=use_async, capture_rng=False)
        warm = mgr.policy.step_interval(mgr.save_seconds, mgr.step_seconds)
        saved = []
        for s in range(1, last + 1):
            time.sleep(0.002)
            if mgr.save(s, _state(s)):
                saved.append(s)
        mgr.close()
        return warm, mgr, saved

    # A tiny MTBF: Young/Daly says save every step once the save time is measured.
    warm, mgr, saved = run(tmp_path / "often", 1e-10, 110)
    assert warm == 100 and mgr.save_seconds and mgr.step_seconds
    assert mgr.policy.step_interval(mgr.save_seconds, mgr.step_seconds) == 1
    assert saved == list(range(100, 111))
    # A long MTBF: the interval grows far past the warm-up one (no save at step 200).
    warm, mgr, saved = run(tmp_path / "rarely", 100.0, 205)
    assert mgr.policy.step_interval(mgr.save_seconds, mgr.step_seconds) > 200
    assert saved == [100]


def _corrupt_data(path) -> None:
    f = next(p for p in path.iterdir() if p.name.endswith(".safetensors"))
    b = bytearray(f.read_bytes())
    b[-10] ^= 0xFF
    f.write_bytes(b)


def test_restore_raises_when_no_committed_checkpoint_loads(tmp_path):
    """Committed checkpoints exist but none loads: restore raises, listing each step it
    tried and why, instead of returning None (``mgr.restore(state) or 0`` would start
    from step 0 with the corrupt checkpoint's bytes in the state)."""
    mgr = dckpt.CheckpointManager(str(tmp_path), capture_rng=False)
    assert mgr.restore(_state(0)) is None  # nothing committed at all: None
    mgr.save(1, _state(1), force=True)
    mgr.save(2, _state(2), force=True)
    for s in (1, 2):
        _corrupt_data(tmp_path / f"step-{s:08d}")
    with pytest.raises(dckpt.CheckpointError) as info:
        mgr.restore(_state(0))
    msg = str(info.value)
    assert "step 2: IntegrityError" in msg and "step 1: IntegrityError" in msg, msg
    assert msg.index("step 2") < msg.index("step 1")  # newest first
    # One good older step: it is restored, and wins over the corrupt newer ones.
    mgr.save(0, _state(7), force=True)
    t = _state(0)
    assert mgr.restore(t) == 0 and torch.equal(t["w"], _state(7)["w"])


def test_restore_skips_malformed_manifests(tmp_path):
    """Valid JSON that is not a manifest (a number no float holds, deep nesting) is a
    ManifestError: restore skips it and takes the older step."""
    mgr = dckpt.CheckpointManager(str(tmp_path), capture_rng=False)
    mgr.save(1, _state(1), force=True)
    mgr.save(2, _state(2), force=True)
    mgr.save(3, _state(3), force=True)
    (tmp_path / "step-00000003" / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    import json

    from dckpt.format.manifest import seal

    m2 = tmp_path / "step-00000002" / "manifest.json"
    doc = json.loads(m2.read_bytes())
    doc["created"] = 10 ** 400  # resealed: the checksum holds, the value does not
    m2.write_bytes(seal(doc))
    t = _state(0)
    assert mgr.restore(t) == 1 and torch.equal(t["w"], _state(1)["w"])


def test_rng_restore_with_other_devices_than_saved(tmp_path, monkeypatch):
    """RNG state never fails a restore: a checkpoint saved with CUDA RNG states
    restores where none are visible, and one saved without them restores where this
    process would capture some (the job moved from CPU to GPUs)."""
    from dckpt.state import rng

    real = rng.capture
    fake_cuda = [torch.arange(16, dtype=torch.uint8) + i for i in range(4)]
    monkeypatch.setattr(rng, "capture", lambda: {**real(), "cuda": list(fake_cuda)})
    a = dckpt.CheckpointManager(str(tmp_path / "with_cuda"))
    a.save(1, _state(1), force=True)
    monkeypatch.setattr(rng, "capture", real)
    b = dckpt.CheckpointManager(str(tmp_path / "without_cuda"))
    random.seed(5)
    b.save(1, _state(1), force=True)  # no CUDA state in it
    want = random.random()
    # Saved with 4 CUDA states, restored with none visible.
    assert dckpt.CheckpointManager(str(tmp_path / "with_cuda")).restore(_state(0)) == 1
    # Saved without, restored by a process that would capture 4 CUDA states.
    monkeypatch.setattr(rng, "capture", lambda: {**real(), "cuda": list(fake_cuda)})
    random.seed(99)
    t = _state(0)
    assert dckpt.CheckpointManager(str(tmp_path / "without_cuda")).restore(t) == 1
    assert random.random() == want  # the saved Python RNG state came back
    assert torch.equal(t["w"], _state(1)["w"])


def test_rewind_abandons_the_newer_timeline(tmp_path, caplog):
    """restore(step=10) (rewinding past a loss spike) then a save of step 20: the step
    30 of the old timeline is removed after that commit, and even where its removal
    failed, restore() never picks it again."""
    import time

    mgr = dckpt.CheckpointManager(str(tmp_path), capture_rng=False)
    for s in (10, 20, 30):
        mgr.save(s, _state(s), force=True)
    t = _state(0)
    assert mgr.restore(t, step=10) == 10
    time.sleep(0.01)  # the new timeline's commits are later than the old one's
    with caplog.at_level(logging.WARNING, logger="dckpt.manager.core"):
        mgr.save(20, _state(2000), force=True)
    assert mgr.steps() == [10, 20]
    assert "abandoned timeline" in caplog.text and "30" in caplog.text
    t = _state(0)
    assert mgr.restore(t) == 20 and torch.equal(t["w"], _state(2000)["w"])

    # The crash window: step 30 committed long ago survives a failed removal.
    other = tmp_path / "other"
    m = dckpt.CheckpointManager(str(other), capture_rng=False)
    for s in (10, 20, 30):
        m.save(s, _state(s), force=True)
    m.restore(_state(0), step=10)
    time.sleep(0.01)
    denied = lambda path: (_ for _ in ()).throw(PermissionError(13, "denied"))  # noqa: E731
    m.storage.remove_tree = m.storage.remove = denied
    m.save(20, _state(2000), force=True)
    assert m.steps() == [10, 20, 30]  # could not be removed
    t = _state(0)
    assert m.restore(t) == 20 and torch.equal(t["w"], _state(2000)["w"])


def test_auto_interval_learns_from_restores_recorded_in_the_root(tmp_path):
    from dckpt.catalog.gc import collect_garbage
    from dckpt.catalog.listing import list_checkpoints
    from dckpt.manager.failures import HISTORY

    root = str(tmp_path / "run")
    st = {"w": torch.zeros(4)}
    first = dckpt.CheckpointManager(root, every_steps="auto", capture_rng=False)
    assert first.restore(st) is None and first.policy.estimated_mtbf_hours == pytest.approx(24, rel=1e-3)
    first.save(1, st, force=True)
    ests = []
    for _ in range(5):  # five restarts, each finding the checkpoint
        m = dckpt.CheckpointManager(root, every_steps="auto", capture_rng=False)
        assert m.restore(st) == 1
        ests.append(m.policy.estimated_mtbf_hours)
    assert ests == sorted(ests, reverse=True) and ests[-1] < 24 / 5
    # The history is dckpt's own small file: listing and gc leave it alone.
    assert [c.path for c in list_checkpoints(root)] == [os.path.join(root, "step-00000001")]
    collect_garbage(root, min_age_s=0)
    assert os.path.exists(os.path.join(root, HISTORY))
    # An unreadable history is started afresh, never an error.
    with open(os.path.join(root, HISTORY), "w") as f:
        f.write("{garbage")
    m = dckpt.CheckpointManager(root, every_steps="auto", capture_rng=False)
    assert m.restore(st) == 1 and m.policy.estimated_mtbf_hours <= 24
