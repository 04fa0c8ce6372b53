"""PyTorch Lightning's Trainer on dckpt (issue 37), each scenario run through Lightning's
stock ModelParallelStrategy too: real multi-process CPU fits (Lightning's launcher
re-executes tests/multirank/jobs/lightning_job.py once per extra device), under
deadlines; a killed job is reaped with its whole process group.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from dckpt.catalog.verify import verify_checkpoint  # noqa: E402

from .lightning_run import run_job  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "jobs", "lightning_job.py")
pytestmark = pytest.mark.slow


def run(root: str, strategy: str, devices: int, *args: str, timeout: float = 240,
        killed: bool = False, failed: bool = False) -> str:
    """Run the job; return its output. ``killed``: it must end by SIGKILL; ``failed``:
    with an error status."""
    return run_job(JOB, root, strategy, devices, *args, timeout=timeout, killed=killed,
                   failed=failed)


def ref(root: str, name: str) -> dict:
    return torch.load(os.path.join(root, "refs", f"{name}.pt"))


def equal(a: dict, b: dict) -> bool:
    """Model, optimizer state and step of two gathered states are identical."""
    if a["model"].keys() != b["model"].keys() or a["step"] != b["step"]:
        return False
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    return (all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and sa.keys() == sb.keys()
            and all(torch.equal(torch.as_tensor(sa[k][s]), torch.as_tensor(sb[k][s]))
                    for k in sa for s in sa[k])
            and a["sched"] == b["sched"])


def ckpts(root: str) -> list[str]:
    return sorted(os.listdir(os.path.join(root, "ckpts")))


@pytest.mark.parametrize("strategy", ["dckpt", "stock"])
def test_fit_top_k_and_resume_last_at_1_and_3(tmp_path, strategy):
    """A fit at 2 devices saving every 2 steps (save_top_k=2, save_last): two top-k
    checkpoints and last.ckpt remain; ``ckpt_path="last"`` resumes at 3 and 1 devices at
    global step 6 with the model, optimizer and scheduler state saved at step 6. dckpt's:
    no leftovers (no partial folder), every folder passes ``dckpt verify``, and a
    resume at 2 from an explicit top-k path (``fit(ckpt_path=path)``) too."""
    root = str(tmp_path / "run")
    run(root, strategy, 2, "--max-steps", "6", "--every", "2", "--top-k", "2")
    assert ckpts(root) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]  # top 2 + last
    saved6 = ref(root, "save-6")
    for n in ([3, 1] if strategy == "dckpt" else [3]):
        copy = str(tmp_path / f"resume{n}")
        shutil.copytree(root, copy)
        out = run(copy, strategy, n, "--max-steps", "8", "--ckpt-path", "last")
        assert "TRAIN START global_step=6" in out
        assert equal(ref(copy, f"resumed-{n}"), saved6), f"resume at {n} devices"
    if strategy != "dckpt":
        return
    for name in ckpts(root):
        report = verify_checkpoint(os.path.join(root, "ckpts", name))
        assert report.ok, report.problems
    copy = str(tmp_path / "explicit")
    shutil.copytree(root, copy)
    out = run(copy, strategy, 2, "--max-steps", "6", "--ckpt-path",
              os.path.join(copy, "ckpts", "step=4.ckpt"))
    assert "TRAIN START global_step=4" in out
    assert equal(ref(copy, "resumed-2"), ref(root, "save-4"))


@pytest.mark.parametrize("strategy", ["dckpt", "stock"])
def test_save_of_last_killed_resumes_from_previous(tmp_path, strategy):
    """The save of last.ckpt at step 4 is SIGKILLed on every rank after the shard files
    are written, before the commit; the restart with ``ckpt_path="last"``:

    - dckpt: last.ckpt still holds step 2 whole and step=4.ckpt (saved just before)
      is complete: ``ckpt_path="last"`` resumes the newest complete checkpoint, step 4,
      with exactly step 4's state; the folders verify.
    - stock: DCP has rewritten the shard files in place and the kill came before
      .metadata and meta.pt, so last.ckpt is found and loaded without any error at
      global step 2 (meta.pt) with weights that are not step 2's: a silent mix.
    """
    root = str(tmp_path / "run")
    run(root, strategy, 2, "--max-steps", "6", "--every", "2", "--kill-last-at", "4",
        killed=True)
    out = run(root, strategy, 2, "--max-steps", "6", "--ckpt-path", "last")
    resumed, saved2 = ref(root, "resumed-2"), ref(root, "save-2")
    if strategy == "dckpt":
        assert "TRAIN START global_step=4" in out
        assert equal(resumed, ref(root, "save-4"))
        assert verify_checkpoint(os.path.join(root, "ckpts", "last.ckpt")).ok
        assert verify_checkpoint(os.path.join(root, "ckpts", "step=4.ckpt")).ok
    else:
        assert "TRAIN START global_step=2" in out
        assert not equal(resumed, saved2)
        assert not any(torch.equal(resumed["model"][k], saved2["model"][k])
                       for k in saved2["model"])


def test_async_save_commits_and_resumes(tmp_path):
    """``async_save=True``: saves return after the snapshot and commit in the
    background; the checkpoints (renamed into place and top-k removals after the
    commit) are the same set, they verify, and a resume at 2 gets step 6's state."""
    root = str(tmp_path / "run")
    run(root, "dckpt", 2, "--max-steps", "6", "--every", "2", "--async-save")
    assert ckpts(root) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    for name in ckpts(root):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok
    out = run(root, "dckpt", 2, "--max-steps", "7", "--ckpt-path", "last", "--async-save")
    assert "TRAIN START global_step=6" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-6"))


# ---------------------------------------------------------------- one process, no launcher
def test_metadata_codec_json_tensors_and_pickled_leftovers():
    """Lightning's metadata: JSON-able values in the tree (int keys, tuples, NaN/inf
    kept), tensors as dckpt tensors, no pickle unless some value needs it."""
    import argparse
    import math

    from dckpt.errors import ManifestError
    from dckpt.integrations.lightning import meta as lm

    plain = {"epoch": 1, "loops": {"fit": {3: (1, "a")}}, "lr": [0.5, math.inf, math.nan],
             "best": torch.tensor(2.5), "none": None}
    enc = lm.encode(plain)
    assert "pickle" not in enc and len(enc["tensors"]) == 1
    back = lm.decode(enc, "x")
    assert back["loops"] == {"fit": {3: (1, "a")}} and back["lr"][1] == math.inf
    assert math.isnan(back["lr"][2]) and torch.equal(back["best"], torch.tensor(2.5))
    enc = lm.encode({"hparams": argparse.Namespace(a=1)})
    assert "pickle" in enc
    assert lm.decode(enc, "x", weights_only=False)["hparams"].a == 1
    with pytest.raises(Exception):  # torch's weights_only refuses a Namespace
        lm.decode(enc, "x", weights_only=True)
    with pytest.raises(ManifestError, match="ck1"):
        lm.decode({"format": 1, "tree": '{"bogus": 1}', "tensors": []}, "ck1")
    with pytest.raises(ManifestError, match="ck2"):
        lm.decode({"format": 9, "tree": "{}", "tensors": []}, "ck2")


def test_committer_places_overwrites_removes_and_checks_strictness(tmp_path):
    """In one process: a new name appears only complete (no partial left), a second
    save overwrites it in place, a strict load refuses a model with other parameters
    (StateMismatchError) and a missing entry (MissingKeyError, a KeyError), a removal
    takes the folder whole; bad options are CheckpointErrors."""
    from torch import nn

    from dckpt.errors import CheckpointError, StateMismatchError
    from dckpt.integrations.lightning import committer as lio

    with pytest.raises(CheckpointError, match="compression"):
        lio.Committer(compression="gzip")
    with pytest.raises(CheckpointError, match="storage_options"):
        lio.Committer(storage_options="s3")
    io = lio.Committer()
    model = nn.Linear(3, 2)
    path = str(tmp_path / "ckpts" / "last.ckpt")
    for step in (1, 2):
        io.save({"state_dict": model.state_dict(),
                 lio.META_KEY: lio.meta_entry({"global_step": step}, ["state_dict"], [])}, path)
        assert os.listdir(tmp_path / "ckpts") == ["last.ckpt"]
        assert lio.kind(path) == "dckpt" and verify_checkpoint(path).ok
    fresh = nn.Linear(3, 2)
    meta, _ = io.load({"state_dict": lio.ModelState(fresh)}, path, strict=True,
                      modules=["state_dict"])
    assert meta == {"global_step": 2} and torch.equal(fresh.weight, model.weight)
    with pytest.raises(StateMismatchError):
        io.load({"state_dict": lio.ModelState(nn.Linear(3, 2, bias=False))}, path,
                strict=True, modules=["state_dict"])
    with pytest.raises(KeyError, match="optimizer_0"):
        io.load({"state_dict": lio.ModelState(fresh),
                 "optimizer_0": lio.OptimizerState(fresh, torch.optim.SGD(fresh.parameters()))},
                path, strict=True, modules=["state_dict"])
    io.remove(path, is_rank0=True)
    assert os.listdir(tmp_path / "ckpts") == [] and lio.kind(path) == "none"


# ---------------------------------------------------------------- the fast tier (local_root)
def slots(local: str) -> list[str]:
    return sorted(e for e in os.listdir(local) if e.startswith("lightning-"))


def test_local_root_saves_copies_trims_and_resumes_from_the_fast_tier(tmp_path):
    """``local_root``: saves commit node-locally and are copied to their names in the
    background; after the fit the names are the stock set (top 2 + last), whole and
    verified, and the fast tier keeps at most keep_last_local (2) checkpoints. A resume
    at 2 reads last.ckpt from the fast tier (its log says so), one of a copy of the
    folder at 3 from the durable name: both at step 6 with step 6's state. (A resume at
    another device count of the same names: test_local_root_killed_before_the_copy.)"""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    run(root, "dckpt", 2, "--max-steps", "6", "--every", "2", "--local-root", local)
    assert ckpts(root) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    for name in ckpts(root):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok
    assert 1 <= len(slots(local)) <= 2, slots(local)
    copy = str(tmp_path / "resume3")  # another folder: its names are not in the fast tier
    shutil.copytree(root, copy)
    out = run(copy, "dckpt", 3, "--max-steps", "7", "--ckpt-path", "last", "--local-root", local)
    assert "TRAIN START global_step=6" in out and "from the fast tier" not in out
    assert equal(ref(copy, "resumed-3"), ref(root, "save-6"))
    out = run(root, "dckpt", 2, "--max-steps", "7", "--ckpt-path", "last", "--local-root", local)
    assert "TRAIN START global_step=6" in out and "from the fast tier" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-6"))


@pytest.mark.parametrize("devices", [2, 3])
def test_local_root_killed_before_the_copy(tmp_path, devices):
    """Every rank is SIGKILLed after the saves of step 4 committed in the fast tier and
    before their durable copies: last.ckpt's durable copy is step 2's. The restart
    with ``ckpt_path="last"`` at the same 2 devices resumes step 4 from the fast tier;
    at 3 devices (no rank layout to read it with) step 2 from the durable name. No
    partial folder of the killed copies remains after the restart's first save."""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    run(root, "dckpt", 2, "--max-steps", "8", "--every", "2", "--local-root", local,
        "--kill-before-copy", "4", killed=True)
    assert verify_checkpoint(os.path.join(root, "ckpts", "last.ckpt")).ok
    out = run(root, "dckpt", devices, "--max-steps", "6", "--ckpt-path", "last",
              "--local-root", local)
    step = 4 if devices == 2 else 2
    assert f"TRAIN START global_step={step}" in out
    assert equal(ref(root, f"resumed-{devices}"), ref(root, f"save-{step}"))
    assert not [e for e in os.listdir(os.path.join(root, "ckpts")) if e.startswith(".")]
    for name in ckpts(root):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok


def test_local_root_async(tmp_path):
    """``local_root`` with ``async_save``: the same checkpoints, verified; resume."""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    run(root, "dckpt", 2, "--max-steps", "6", "--every", "2", "--local-root", local,
        "--async-save")
    assert ckpts(root) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    for name in ckpts(root):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok
    out = run(root, "dckpt", 2, "--max-steps", "7", "--ckpt-path", "last",
              "--local-root", local, "--async-save")
    assert "TRAIN START global_step=6" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-6"))


def _tiny_save(io, model, path: str, step: int) -> None:
    from dckpt.integrations.lightning import committer as lio

    with torch.no_grad():
        model.weight.fill_(float(step))
    io.save({"state_dict": model.state_dict(),
             lio.META_KEY: lio.meta_entry({"global_step": step}, ["state_dict"], [])},
            path, step=step)


def _tiny_load(io, path: str):
    from torch import nn

    from dckpt.integrations.lightning import committer as lio

    fresh = nn.Linear(3, 2)
    meta, _ = io.load({"state_dict": lio.ModelState(fresh)}, path, strict=True,
                      modules=["state_dict"])
    return meta["global_step"], float(fresh.weight[0, 0].detach())


def test_fast_tier_one_process(tmp_path, monkeypatch, caplog):
    """The fast tier in one process: bad options are CheckpointErrors; a failed copy
    leaves the name in the fast tier only, and a load reads it there; a newer commit of
    the name by someone else (another run, no fast tier) wins over the older local one
    (never an older step resurrected); a save of a name whose copy has not begun drops
    that copy; too many copies waiting make a save wait (logged); keep_last_local
    bounds the fast tier; a removal takes the name and its local copy."""
    import logging

    from torch import nn

    from dckpt.errors import CheckpointError
    from dckpt.integrations.lightning import committer as lio

    with pytest.raises(CheckpointError, match="local_root"):
        lio.Committer(local_root="s3://bucket/x")
    with pytest.raises(CheckpointError, match="keep_last_local"):
        lio.Committer(local_root=str(tmp_path / "l"), keep_last_local=0)
    caplog.set_level(logging.INFO, logger="dckpt")
    local = str(tmp_path / "local")
    io = lio.Committer(local_root=local, keep_last_local=2)
    model = nn.Linear(3, 2)
    ck = tmp_path / "ckpts"
    last = str(ck / "last.ckpt")
    _tiny_save(io, model, last, 1)
    io.finish(drain=True)
    assert lio.kind(last) == "dckpt" and verify_checkpoint(last).ok

    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")  # the durable store fails
    _tiny_save(io, model, last, 2)
    io.finish(drain=True)
    monkeypatch.delenv("DCKPT_FAULT")
    assert "durable copy of" in caplog.text and "failed" in caplog.text
    assert _tiny_load(io, last) == (2, 2.0)  # the fast tier's, newer than the name's
    assert _tiny_load(lio.Committer(), last) == (1, 1.0)  # the name still holds step 1

    with torch.no_grad():
        model.weight.fill_(7.0)
    lio.Committer().save(  # another run (no fast tier) saves the name
{"state_dict": model.state_dict(), lio.META_KEY: lio.meta_entry(
        {"global_step": 7}, ["state_dict"], [])}, last)
    assert _tiny_load(io, last) == (7, 7.0)

    caplog.clear()
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:sleep=0.5")  # a slow durable store
    for i, name in enumerate(["a", "b", "b", "c", "d", "e", "f"]):
        _tiny_save(io, model, str(ck / f"{name}.ckpt"), 10 + i)
    io.finish(drain=True)
    monkeypatch.delenv("DCKPT_FAULT")
    assert "skipped: a newer save replaced it" in caplog.text
    assert "durable copies are waiting" in caplog.text
    assert _tiny_load(lio.Committer(), str(ck / "b.ckpt")) == (12, 12.0)  # the second save
    slots_left = [e for e in os.listdir(local) if e.startswith("lightning-")]
    assert len(slots_left) == 2, slots_left
    for name in "abcdef":
        assert verify_checkpoint(str(ck / f"{name}.ckpt")).ok

    io.remove(str(ck / "f.ckpt"), is_rank0=True)
    io.finish(drain=True)
    assert lio.kind(str(ck / "f.ckpt")) == "none"
    assert len([e for e in os.listdir(local) if e.startswith("lightning-")]) == 1


def test_fsdp_tp_2x2_resume_as_fsdp_at_2(tmp_path):
    """FSDP2 + tensor parallelism (dp 2 x tp 2, colwise then rowwise Linear) at 4
    devices; ``ckpt_path="last"`` at 2 devices with FSDP2 alone (tp 1) resumes step 4
    with the model, optimizer and scheduler state saved (resharded across layouts);
    the folders verify. (The stock strategy passes the same run: not repeated here,
    4 processes on CI's 2 cores cost a minute.)"""
    strategy = "dckpt"
    root = str(tmp_path / "run")
    run(root, strategy, 4, "--max-steps", "4", "--every", "2", "--tp", "2", timeout=300)
    out = run(root, strategy, 2, "--max-steps", "5", "--ckpt-path", "last", timeout=300)
    assert "TRAIN START global_step=4" in out
    assert equal(ref(root, "resumed-2"), ref(root, "save-4"))
    for name in ckpts(root):
        assert verify_checkpoint(os.path.join(root, "ckpts", name)).ok


def test_fast_tier_never_resurrects_over_a_later_save_whatever_the_clocks(tmp_path, monkeypatch):
    """A run's local commit of last.ckpt (step 2) whose copy failed, then another run
    (other nodes, no fast tier) saves last.ckpt (step 7) on a host whose clock is an
    hour behind. A restart of the first run on its nodes loads step 7: the local commit
    records the durable save it was made over (step 1's), which is no longer there, so
    the name was saved since; commit times from two hosts are not compared."""
    import time as _time

    from torch import nn

    from dckpt.integrations.lightning import committer as lio

    local = str(tmp_path / "local")
    last = str(tmp_path / "ckpts" / "last.ckpt")
    model = nn.Linear(3, 2)
    io = lio.Committer(local_root=local)
    _tiny_save(io, model, last, 1)
    io.finish(drain=True)
    monkeypatch.setenv("DCKPT_FAULT", "stage:*:raise")
    _tiny_save(io, model, last, 2)
    io.finish(drain=True)
    monkeypatch.delenv("DCKPT_FAULT")
    real = _time.time
    monkeypatch.setattr(_time, "time", lambda: real() - 3600)  # the other host's clock
    _tiny_save(lio.Committer(), model, last, 7)
    monkeypatch.setattr(_time, "time", real)
    assert _tiny_load(lio.Committer(local_root=local), last) == (7, 7.0)
