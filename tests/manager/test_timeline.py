"""Issue 34, section 1: the explicit timeline, the run identity, a durable outage, a
mismatching fast-tier step and a second job on one local_root (defects 1.1-1.4, 1.10).

Single process (the manager needs no process group); real files under tmp_path, a
real S3 server (moto's, on loopback) for the outage, a real second process holding a
local_root for the lease, killed with SIGKILL."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dckpt
from dckpt.tiers import chooser
from dckpt.tiers.chooser import Candidate
from tests.tiers.test_tier_restore import _manager, _restore


def _state(step: int, value: float | None = None) -> dict:
    return {"w": torch.full((16,), float(step if value is None else value)), "step": step}


# ---------------------------------------------------------------- 1.1 the timeline
def test_resave_of_the_same_step_after_a_rewind_abandons_its_durable_copy(tmp_path):
    """The issue's setup: 10 and 20 durable, restore(step=10), 20 saved again with new
    values (local only), the fast tier wiped: the old durable 20 (the values the user
    rewound away from) must not come back. Before: step 20 with the old values."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=1000)
    assert mgr.save(10, _state(10), force=True) and mgr.save(20, _state(20), force=True)
    mgr.close()
    assert mgr.steps() == [10, 20]
    mgr = _manager(root, shm, durable_every_steps=1000)
    assert mgr.restore(_state(-1), step=10) == 10
    assert mgr.save(20, _state(20, value=-20.0))  # the new timeline's 20, local only
    mgr.close()
    assert mgr.steps() == [10]  # the abandoned copy of 20 is removed at once
    assert _restore(root, shm, durable_every_steps=1000) == (20, "local", 20, -20.0)
    shutil.rmtree(shm)  # a reboot
    assert _restore(root, shm, durable_every_steps=1000) == (10, "durable", 10, 10.0)


def _damage(step_dir) -> None:
    for name in os.listdir(step_dir):
        if name.startswith("data-"):
            with open(os.path.join(step_dir, name), "r+b") as f:
                f.seek(-4, os.SEEK_END)
                f.write(b"\xde\xad\xbe\xef")


def test_a_deletion_that_did_not_happen_cannot_resurrect_an_abandoned_step(tmp_path):
    """10, 20 durable; rewind to 10; 30 saved durable on the new timeline; the removal
    of the abandoned 20 did not happen (restored behind the manager's back); the fast
    tier is gone and 30 is damaged. The fallback is 10 (30's ancestor), never 20,
    which nothing of a lower step outlived. Before: step 20."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=1000)
    mgr.save(10, _state(10), force=True)
    mgr.save(20, _state(20), force=True)
    mgr.close()
    shutil.copytree(root / "step-00000020", tmp_path / "old20")
    mgr = _manager(root, shm, durable_every_steps=1000)
    assert mgr.restore(_state(-1), step=10) == 10
    assert mgr.save(30, _state(30, value=-30.0), force=True)
    mgr.close()
    shutil.rmtree(root / "step-00000020", ignore_errors=True)
    shutil.copytree(tmp_path / "old20", root / "step-00000020")  # as if never removed
    shutil.rmtree(shm)
    _damage(root / "step-00000030")
    assert _restore(root, shm, durable_every_steps=1000) == (10, "durable", 10, 10.0)


def test_a_restart_on_a_host_whose_clock_is_behind_keeps_its_timeline(tmp_path, monkeypatch):
    """Run 1 saves 10, 20, 30 (durable); run 2, on a host whose clock is a day behind,
    rewinds to 10 and saves 20 (durable); the removal of 30 did not happen. The
    restore takes run 2's 20: its commits order after everything it saw at its
    restore, whatever its clock said. Before: step 30 (its commit time was 'later')."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=1)
    for s in (10, 20, 30):
        mgr.save(s, _state(s))
    mgr.close()
    shutil.copytree(root / "step-00000030", tmp_path / "old30")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400.0)
    mgr = _manager(root, shm, durable_every_steps=1)
    assert mgr.restore(_state(-1), step=10) == 10
    mgr.save(20, _state(20, value=-20.0))
    mgr.close()
    monkeypatch.setattr(time, "time", real)
    shutil.rmtree(root / "step-00000030", ignore_errors=True)
    shutil.copytree(tmp_path / "old30", root / "step-00000030")
    shutil.rmtree(shm)
    assert _restore(root, shm, durable_every_steps=1) == (20, "durable", 20, -20.0)


def test_live_timeline_follows_the_tips_ancestry():
    """Pure: the tip's ancestors by save id (in any tier) stay; a commit after the
    oldest known ancestor on another branch is abandoned; older commits and ones of
    unknown lineage keep the commit-order rule."""
    c = [Candidate(5, "durable", 0.5, "e", None),  # before the known lineage
         Candidate(10, "durable", 1.0, "a", "e"),
         Candidate(20, "durable", 2.0, "b", "a"),   # the abandoned branch
         Candidate(30, "local", 3.0, "c", "a"),
         Candidate(30, "durable", 3.0, "c", "a"),   # the same save in both tiers
         Candidate(40, "local", 4.0, "d", "c")]
    order, abandoned = chooser.live_timeline(c)
    assert [(x.step, x.tier) for x in order] == [(40, "local"), (30, "local"),
                                                  (30, "durable"), (10, "durable"),
                                                  (5, "durable")]
    assert [(x.step, x.save_id) for x in abandoned] == [(20, "b")]
    # a tip whose parent is unknown (deleted, or a fresh start): commit order alone
    order, abandoned = chooser.live_timeline([Candidate(10, "durable", 1.0, "a"),
                                              Candidate(20, "durable", 2.0, "b", "gone")])
    assert [x.step for x in order] == [20, 10] and abandoned == []


# ---------------------------------------------------------------- 1.2 the run id
def test_an_unreadable_run_id_file_is_an_error_and_nothing_is_deleted(tmp_path, monkeypatch):
    """One read of root/.dckpt-run-id fails with EIO at the restart: the manager raises
    an error naming the file, and the fast tier's steps are still there and restore
    once the read works. Before: a new run id, restore() None, and the next local
    commit deleted the fast tier's steps."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=1000)
    mgr.save(10, _state(10))
    mgr.save(20, _state(20))
    mgr.close()
    from dckpt.storage.local import LocalStorage

    real = LocalStorage.read_file

    def flaky(self, path, cap):
        if path.endswith(".dckpt-run-id"):
            raise OSError(errno.EIO, "Input/output error", path)
        return real(self, path, cap)

    monkeypatch.setattr(LocalStorage, "read_file", flaky)
    with pytest.raises(dckpt.CheckpointError, match=r"\.dckpt-run-id.*cannot be read"):
        _manager(root, shm, durable_every_steps=1000)
    monkeypatch.setattr(LocalStorage, "read_file", real)
    assert sorted(os.listdir(shm / "step-00000020"))  # nothing deleted
    assert _restore(root, shm, durable_every_steps=1000) == (20, "local", 20, 20.0)


def test_a_damaged_run_id_file_is_an_error_and_is_left_alone(tmp_path):
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm)
    mgr.save(10, _state(10))
    mgr.close()
    (root / ".dckpt-run-id").write_text("not a run id\n")
    with pytest.raises(dckpt.CheckpointError, match="does not hold a run id"):
        _manager(root, shm)
    assert (root / ".dckpt-run-id").read_text() == "not a run id\n"


# ---------------------------------------------------------------- 1.4 a mismatch
def test_a_fast_tier_step_that_does_not_match_the_state_is_an_error(tmp_path):
    """1000 durable with an 8x4 embedding, 1010 local with 9x4, the restart's state
    8x4: StateMismatchError, as without a fast tier. Before: step 1000, a warning."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=1000)
    mgr.save(1000, {"emb": torch.ones(8, 4)})
    mgr.save(1010, {"emb": torch.ones(9, 4)})
    mgr.close()
    assert mgr.steps() == [1000] and mgr.steps(tier="local") == [1010]
    mgr = _manager(root, shm, durable_every_steps=1000)
    with pytest.raises(dckpt.errors.StateMismatchError, match="emb"):
        mgr.restore({"emb": torch.zeros(8, 4)})
    mgr.close()


# ---------------------------------------------------------------- 1.3 a durable outage
def test_a_durable_store_down_at_restart_does_not_block_the_fast_tier(tmp_path):
    """A tiered job on S3 (moto's real server) saves to the fast tier; the store goes
    down; the job restarts while it is down: the manager is made, restores the fast
    tier's newest step, goes on saving locally, and its durable copies resume once the
    store is back. Before: CheckpointManager(...) raised on every rank."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3server import S3Server

    server = S3Server().start()
    url = server.url("outage")
    opts = {**server.options, "config_kwargs": {"retries": {"max_attempts": 1},
                                                "connect_timeout": 2, "read_timeout": 2}}
    shm = tmp_path / "shm"
    mgr = _manager(url, shm, durable_every_steps=1000, storage_options=opts)
    mgr.save(10, _state(10), force=True)
    mgr.save(20, _state(20))
    mgr.close()
    server.stop()
    _clear_s3fs_cache()
    mgr = _manager(url, shm, durable_every_steps=1000, storage_options=opts)
    st = _state(-1)
    assert mgr.restore(st) == 20 and mgr.restored_from == "local" and st["step"] == 20
    assert mgr.save(30, _state(30))
    with pytest.raises(dckpt.CheckpointError):  # the durable copy of 40 fails, reported
        mgr.save(40, _state(40), force=True)
        mgr.wait()
    assert mgr.steps(tier="local") == [40]
    mgr.close()
    # The store is back (a new server on another port; moto keeps its data in the
    # process, so the bucket holds step 10 and the run id again): copies resume.
    server = S3Server().start()
    try:
        opts2 = {**server.options}
        mgr = _manager(url, shm, durable_every_steps=1000, storage_options=opts2)
        st = _state(-1)
        assert mgr.restore(st) == 40 and mgr.restored_from == "local"
        assert mgr.save(50, _state(50), force=True)
        mgr.close()
        assert mgr.steps() == [10, 50]
    finally:
        server.stop()


def _clear_s3fs_cache() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def test_a_durable_root_down_with_no_cached_identity_is_a_clear_error(tmp_path):
    """A first start while the durable root cannot be reached and the fast tier holds
    nothing of it: an error naming both, not a new run."""
    shm = tmp_path / "shm"
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the root's parent directory should be
    with pytest.raises(dckpt.CheckpointError, match="holds no cached identity"):
        _manager(blocked / "run", shm)


# ---------------------------------------------------------------- 1.10 one job per local_root
_HOLDER = textwrap.dedent("""
    import sys, time, torch, dckpt
    m = dckpt.CheckpointManager(sys.argv[1], local_root=sys.argv[2], capture_rng=False,
                                every_steps=1)
    m.save(1, {"w": torch.ones(4)})
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_second_job_on_a_local_root_is_refused_while_the_first_lives(tmp_path):
    """Job A holds local_root; job B (another root) is refused with an error naming the
    lock, and A's step is untouched; once A is killed (SIGKILL), B starts. Before: B's
    first commit deleted A's only step."""
    shm = tmp_path / "shm"
    a = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "a"), str(shm)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert a.stdout.readline().strip() == "ready"
        os.environ["DCKPT_LEASE_WAIT_S"] = "0.5"
        try:
            with pytest.raises(dckpt.CheckpointError,
                               match=rf"another job is using this local_root: its processes "
                                     rf"\(pid {a.pid}\)"):
                _manager(tmp_path / "b", shm)
        finally:
            del os.environ["DCKPT_LEASE_WAIT_S"]
        assert os.path.isdir(shm / "step-00000001")
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(30)
    mgr = _manager(tmp_path / "b", shm)  # A is gone: its lease is stale
    mgr.save(10, _state(10))
    mgr.close()


def test_a_plain_load_of_a_manager_checkpoint_ignores_the_timeline_values(tmp_path):
    """The timeline's bookkeeping (manager.parent, manager.after) is not state: a plain
    strict dckpt.load of a manager's checkpoint into {"state": ...} does not report it
    as keys the state_dict lacks (it did: the first CI run of this change failed
    test_crash's incremental generations)."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=1)
    mgr.save(10, _state(10))
    mgr.save(20, _state(20))
    mgr.close()
    st = _state(-1)
    dckpt.load({"state": st}, str(root / "step-00000020"))
    assert st["step"] == 20
    with dckpt.open(str(root / "step-00000020")) as ck:
        assert isinstance(ck.to_state_dict()["manager"]["parent"], str)
