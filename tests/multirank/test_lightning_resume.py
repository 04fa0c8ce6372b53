"""Where a killed or failed Lightning job resumes (dckpt's strategy, real Trainer fits on
CPU/gloo, real SIGKILLs, under deadlines): always its newest complete checkpoint, in
whichever tier holds it, and nothing but the user's retention deletes one. One-process
tests at the end drive the strategies' Committer (what the strategies call) where the
defect is in dckpt's own bookkeeping: two jobs on one local_root, a durable store
that is down."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("pytorch_lightning")

from dckpt.catalog.verify import verify_checkpoint  # noqa: E402

from .test_lightning import _tiny_load, _tiny_save, ckpts, equal, ref, run  # noqa: E402

pytestmark = pytest.mark.slow


def test_first_save_committed_only_in_the_fast_tier_resumes_from_it(tmp_path):
    """The job's first saves (step 2: step=2.ckpt and last.ckpt) commit in the fast
    tier and the job is SIGKILLed before their durable copies: no durable name exists.
    ``ckpt_path="last"`` at the same device count resumes step 2 from the fast tier
    (Lightning's own lookup finds no last.ckpt and would start from step 0)."""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    run(root, "dckpt", 2, "--max-steps", "8", "--every", "2", "--local-root", local,
        "--kill-before-copy", "2", killed=True)
    assert not os.path.exists(os.path.join(root, "ckpts", "last.ckpt"))
    out = run(root, "dckpt", 2, "--max-steps", "4", "--ckpt-path", "last",
              "--local-root", local)
    assert "TRAIN START global_step=2" in out and "from the fast tier" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-2"))
    for name in ckpts(root):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok


def test_fast_tier_commit_wins_over_an_older_stock_checkpoint(tmp_path):
    """A run moves from the stock ModelParallelStrategy (its last.ckpt at step 2) to
    dckpt's with ``local_root``: it resumes step 2 from the stock folder, commits step 4
    in the fast tier and is killed before the copy. The restart resumes step 4 (the
    newer commit), not the stock step 2 still at the name."""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    run(root, "stock", 2, "--max-steps", "2", "--every", "2")
    out = run(root, "dckpt", 2, "--max-steps", "8", "--every", "2", "--ckpt-path", "last",
              "--local-root", local, "--kill-before-copy", "4", killed=True)
    assert "TRAIN START global_step=2" in out
    assert os.path.exists(os.path.join(root, "ckpts", "last.ckpt", "meta.pt"))  # stock
    out = run(root, "dckpt", 2, "--max-steps", "5", "--ckpt-path", "last",
              "--local-root", local)
    assert "TRAIN START global_step=4" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-4"))


def test_last_link_to_a_save_killed_in_its_commit_resumes_the_newest_complete(tmp_path):
    """``save_last="link"`` with ``async_save``: Lightning links last.ckpt to
    step=4.ckpt as soon as the save call returns; the job is killed while step 4
    commits, so the link dangles. ``ckpt_path="last"`` resumes step 2 (the newest
    complete checkpoint), not step 0."""
    root = str(tmp_path / "run")
    run(root, "dckpt", 2, "--max-steps", "8", "--every", "2", "--save-last", "link",
        "--async-save", "--stall-commit-at", "4", killed=True)
    last = os.path.join(root, "ckpts", "last.ckpt")
    assert os.path.islink(last) and not os.path.exists(last)  # dangling
    out = run(root, "dckpt", 2, "--max-steps", "4", "--ckpt-path", "last",
              "--save-last", "link")
    assert "TRAIN START global_step=2" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-2"))
    assert os.path.exists(last)  # the restart's own saves linked it again


@pytest.mark.parametrize("tier", ["direct", "local_root"])
def test_failed_last_async_save_fails_the_fit(tmp_path, tier):
    """``async_save=True``: the fit's final save (last.ckpt at step 4, after
    step=4.ckpt committed) fails on every rank. The fit raises that error (the script
    fails, as with a synchronous save) instead of returning normally; last.ckpt still
    holds step 2 whole, and ``ckpt_path="last"`` resumes the newest complete
    checkpoint, step=4.ckpt."""
    root = str(tmp_path / "run")
    extra = ["--local-root", str(tmp_path / "local")] if tier == "local_root" else []
    out = run(root, "dckpt", 2, "--max-steps", "4", "--every", "2", "--async-save",
              "--fail-last-save-at", "4", *extra, failed=True)
    assert "injected fault at vote" in out and "FIT DONE" not in out
    last = os.path.join(root, "ckpts", "last.ckpt")
    assert verify_checkpoint(last).ok
    out = run(root, "dckpt", 2, "--max-steps", "5", "--ckpt-path", "last")
    assert "TRAIN START global_step=4" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-4"))


def test_a_rank_that_raises_with_an_async_save_in_flight_reports_its_error(tmp_path):
    """``async_save=True`` and a slow store (every vote sleeps 3 s); rank 1 raises in
    training_step at step 3 while step 2's save commits. Its teardown enters no
    collective on the training's group: the job fails with rank 1's own error (not a
    gloo collective mismatch), within the deadline."""
    root = str(tmp_path / "run")
    out = run(root, "dckpt", 2, "--max-steps", "8", "--every", "2", "--async-save",
              "--slow-vote", "3", "--raise-at", "3", "--raise-rank", "1", failed=True,
              timeout=180)
    assert "RuntimeError: boom at step 3 on rank 1" in out
    assert "mismatch" not in out.lower()


# ---------------------------------------------------------------- one process, no launcher
def test_two_jobs_on_one_local_root_never_trim_each_others_slots(tmp_path, monkeypatch):
    """Job B (its own directory) commits step 4 of last.ckpt only locally (its copy
    fails); job A, another directory on the same local_root, then saves more names than
    keep_last_local. A's retention leaves B's slots alone: B's restart loads step 4."""
    from torch import nn

    from dckpt.integrations.lightning import committer as lio

    local = str(tmp_path / "local")
    model = nn.Linear(3, 2)
    b_last = str(tmp_path / "b" / "last.ckpt")
    job_b = lio.Committer(local_root=local)
    _tiny_save(job_b, model, b_last, 2)
    job_b.finish(drain=True)
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")  # B's copy of step 4 fails
    _tiny_save(job_b, model, b_last, 4)
    job_b.finish(drain=True)
    monkeypatch.delenv("DCKPT_FAULT")
    job_a = lio.Committer(local_root=local, keep_last_local=1)
    for i in range(4):
        _tiny_save(job_a, model, str(tmp_path / "a" / f"step={i}.ckpt"), 10 + i)
    job_a.finish(drain=True)
    assert _tiny_load(lio.Committer(local_root=local), b_last) == (4, 4.0)


def test_store_down_never_trims_a_checkpoint_whose_only_copy_is_local(tmp_path, monkeypatch):
    """Every durable copy fails (the store is down); ModelCheckpoint keeps
    step=4.ckpt and step=6.ckpt, keep_last_local=2, more saves follow. step=4's local
    commit is its only copy: it is kept beyond keep_last_local and loads; once the
    store is back, the next copies let retention trim the fast tier again."""
    from torch import nn

    from dckpt.integrations.lightning import committer as lio

    local = str(tmp_path / "local")
    ck = tmp_path / "ckpts"
    model = nn.Linear(3, 2)
    io = lio.Committer(local_root=local, keep_last_local=2)
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")
    for step in (4, 6, 8):
        _tiny_save(io, model, str(ck / f"step={step}.ckpt"), step)
        _tiny_save(io, model, str(ck / "last.ckpt"), step)
    io.finish(drain=True)
    monkeypatch.delenv("DCKPT_FAULT")
    assert lio.kind(str(ck / "step=4.ckpt")) == "none"  # never copied
    assert _tiny_load(io, str(ck / "step=4.ckpt")) == (4, 4.0)
    assert _tiny_load(io, str(ck / "step=6.ckpt")) == (6, 6.0)
    io.remove(str(ck / "step=4.ckpt"), is_rank0=True)  # ModelCheckpoint's own removal
    for step in (10, 12):
        _tiny_save(io, model, str(ck / f"step={step}.ckpt"), step)
        _tiny_save(io, model, str(ck / "last.ckpt"), step)
    io.finish(drain=True)
    slots = sorted(e for e in os.listdir(local) if e.startswith("lightning-"))
    # the 2 newest (last, step=12) and step=6, step=8 (no durable copy); step=10 went
    assert slots == sorted(os.path.basename(io.tier.slot(str(ck / n))) for n in
                           ("last.ckpt", "step=12.ckpt", "step=6.ckpt", "step=8.ckpt"))
    assert _tiny_load(io, str(ck / "step=8.ckpt")) == (8, 8.0)


def test_job_prefix_is_per_directory():
    """Slots of names in one directory share a prefix no other directory's has."""
    from dckpt.integrations.common.tier import job_prefix

    assert job_prefix("/r/a/last.ckpt") == job_prefix("/r/a/step=2.ckpt")
    assert job_prefix("/r/a/last.ckpt") != job_prefix("/r/b/last.ckpt")
    assert job_prefix("s3://bkt/a/last.ckpt") != job_prefix("s3://bkt/b/last.ckpt")
    assert not job_prefix("/r/a/x").startswith(job_prefix("/r/b/x"))
