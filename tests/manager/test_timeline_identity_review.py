"""Adversarial review of issue 34, section 1 (the explicit timeline, the run identity,
a durable outage, the local_root lease, settings agreement): each test proves a defect
found in review (it failed before its fix) or pins behaviour found sound."""
from __future__ import annotations

import os
import time

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import dckpt
from dckpt.tiers import identity


def _state(step: int, value: float | None = None) -> dict:
    return {"w": torch.full((16,), float(step if value is None else value)), "step": step}


def _mgr(root, shm, **kw) -> dckpt.CheckpointManager:
    kw.setdefault("capture_rng", False)
    kw.setdefault("every_steps", 10)
    return dckpt.CheckpointManager(str(root), local_root=str(shm), **kw)


class _DownMemory(MemoryFileSystem):
    """fsspec's in-memory store that raises ConnectionError (an OSError) on every call
    while ``down`` is set: a durable store that is unreachable."""

    protocol = ("downmem",)
    down = False
    store: dict = {}
    pseudo_dirs = [""]

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if (not name.startswith("_") or name in ("_open", "_rm", "_ls", "_info")) \
                and callable(attr) and type(self).down and name not in (
                    "protocol", "_strip_protocol", "unstrip_protocol", "sep", "root_marker"):
            def fail(*a, **k):
                raise ConnectionError(f"downmem: the store is unreachable ({name})")
            return fail
        return attr


fsspec.register_implementation("downmem", _DownMemory, clobber=True)


@pytest.fixture
def downmem():
    _DownMemory.down = False
    _DownMemory.store.clear()
    _DownMemory.pseudo_dirs[:] = [""]
    yield _DownMemory
    _DownMemory.down = False


def _check_restore(url, shm, **kw):
    m = _mgr(url, shm, **kw)
    st = _state(-1)
    step = m.restore(st)
    return m, step, st


# ------------------------------------------------------------- the durable outage
def test_durable_outage_mid_run_and_at_restart_is_survived(tmp_path, downmem):
    """Sound: the store down mid-run and at a restart (every call raising): saves go
    on locally, failures come back as CheckpointError, restore takes the fast tier,
    copies resume once it is back."""
    url, shm = "downmem://run", tmp_path / "shm"
    m = _mgr(url, shm, durable_every_steps=1)
    m.save(10, _state(10))
    m.wait()
    downmem.down = True
    assert m.save(20, _state(20)) and m.save(30, _state(30))
    with pytest.raises(dckpt.CheckpointError):
        m.wait()
    st = _state(-1)
    assert m.restore(st) == 30 and m.restored_from == "local"
    m.close()
    m, step, st = _check_restore(url, shm, durable_every_steps=1)
    assert step == 30 and m.restored_from == "local" and st["step"] == 30
    m.close()
    downmem.down = False


def test_retried_removal_after_an_outage_still_removes_the_whole_abandoned_timeline(
        tmp_path, downmem):
    """10, 20, 30 durable; restore(step=10); the store is down at the next local
    commit (20', local only), so the removal of the abandoned 20 and 30 fails; the
    store is back and a minute later 40' commits locally: the retry must remove 20 and
    30. It removes only the steps >= 40 (none), so after a reboot the restore takes
    the abandoned 30 (the values the run rewound away from)."""
    url, shm = "downmem://run", tmp_path / "shm"
    m = _mgr(url, shm, durable_every_steps=1000)
    for s in (10, 20, 30):
        assert m.save(s, _state(s), force=True)
    m.wait()
    assert m.steps() == [10, 20, 30]
    assert m.restore(_state(-1), step=10) == 10
    downmem.down = True
    assert m.save(20, _state(20, value=-20.0))  # local only: the removal fails
    downmem.down = False
    m._drop_retry_at = 0.0  # a minute later
    assert m.save(40, _state(40, value=-40.0))  # local only: the removal is retried
    m.close()
    assert m.steps() == [10], "the abandoned durable 20, 30 were not removed"
    import shutil
    shutil.rmtree(shm)  # a reboot
    m, step, st = _check_restore(url, shm, durable_every_steps=1000)
    m.close()
    assert (step, float(st["w"][0])) == (10, 10.0)


# ------------------------------------------------------------- the local_root lease
def test_two_live_managers_of_one_process_for_two_roots_on_one_local_root(tmp_path):
    """Two models trained in one process, each with its manager and its own root, the
    same local_root: the second must be refused as a second job (GUARANTEES.md:
    "two jobs on one local_root: refused"), or at least must not delete the first's
    step. Today it is accepted and its first commit removes A's only fast-tier step."""
    shm = tmp_path / "shm"
    a = _mgr(tmp_path / "a", shm, durable_every_steps=1000)
    assert a.save(10, _state(10))
    try:
        b = _mgr(tmp_path / "b", shm, durable_every_steps=1000)
    except dckpt.CheckpointError:
        a.close()
        return  # refused: the fix
    assert b.save(20, _state(20))
    b.close()
    assert os.path.isdir(shm / "step-00000010"), "job b deleted job a's only step"
    a.close()


def test_a_forked_child_does_not_keep_the_lease_after_close(tmp_path):
    """A manager, then a fork-started helper process (a DataLoader/multiprocessing
    worker) that outlives it; close(); a new manager on the same local_root (a
    restart in the same process, or a notebook re-run) must start. Today the child's
    inherited descriptor keeps the lock and the new manager is refused as "another
    job" whose holder is the child."""
    shm = tmp_path / "shm"
    m = _mgr(tmp_path / "run", shm)
    m.save(10, _state(10))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: waits until told to exit
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        m.close()
        os.environ["DCKPT_LEASE_WAIT_S"] = "0.5"
        try:
            m2 = _mgr(tmp_path / "run", shm)
        finally:
            del os.environ["DCKPT_LEASE_WAIT_S"]
        m2.close()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def test_a_stale_fast_tier_restored_during_an_outage_does_not_delete_newer_durable_steps(
        tmp_path, downmem):
    """Node A's fast tier holds step 10; the job moves to node B and goes on to 50
    (every step durable); the store goes down and the job is rescheduled on node A.
    The restore (durable unknown) takes A's step 10 and training repeats 20 locally.
    The store comes back, 30 commits locally: its removal of the "abandoned timeline"
    deletes durable 40 and 50, newer commits than anything this run restored or saw.
    Durable 50 must survive (and a restore with A's tier gone must not fall back to 10)."""
    url, shm_a, shm_b = "downmem://run", tmp_path / "nodeA", tmp_path / "nodeB"
    m = _mgr(url, shm_a, durable_every_steps=1)
    m.save(10, _state(10))
    m.close()
    m = _mgr(url, shm_b, durable_every_steps=1)
    assert m.restore(_state(-1)) == 10
    for s in (20, 30, 40, 50):
        m.save(s, _state(s))
        # each copied before the next save: on a loaded machine the tier skips a copy
        # while a newer step is queued (its backpressure), and this test needs them all
        m.wait()
    m.close()
    assert m.steps() == [10, 20, 30, 40, 50]
    downmem.down = True
    m, step, st = _check_restore(url, shm_a, durable_every_steps=1000)
    assert step == 10 and m.restored_from == "local"  # the stale step, with a warning
    m.save(20, _state(20, value=-20.0))
    downmem.down = False
    m._drop_retry_at = 0.0  # a minute later
    m.save(30, _state(30, value=-30.0))
    m.close()
    assert 50 in m.steps(), f"durable 50 deleted: {m.steps()}"
