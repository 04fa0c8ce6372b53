"""Restore with a fast tier picks the right state (issue 25, defects 1.3, 1.4, 2.6):
commit order decides across tiers, a fast-tier step belongs to its own durable root,
and a restore that finds nothing leaves the state exactly as it was.

Single process (the manager needs no process group); real files under tmp_path."""
from __future__ import annotations

import logging
import os
import shutil

import torch

import dckpt


def _state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


def _manager(root, local_root, **kw) -> dckpt.CheckpointManager:
    kw.setdefault("capture_rng", False)
    kw.setdefault("every_steps", 10)
    return dckpt.CheckpointManager(str(root), local_root=str(local_root), **kw)


def _restore(root, local_root, **kw) -> tuple:
    mgr = _manager(root, local_root, **kw)
    st = _state(-1)
    step = mgr.restore(st)
    out = (step, mgr.restored_from, st["step"], float(st["w"][0]))
    mgr.close()
    return out


def _rewound(tmp_path) -> tuple:
    """Steps 10..100 (durable: 50 and 100), a rewind to 50, then 60..90 (local only)."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=50)
    for s in range(10, 101, 10):
        assert mgr.save(s, _state(s))
    mgr.close()
    assert mgr.steps() == [50, 100] and mgr.steps(tier="local") == [100]
    mgr = _manager(root, shm, durable_every_steps=50)
    st = _state(-1)
    assert mgr.restore(st, step=50) == 50 and st["step"] == 50
    for s in range(60, 91, 10):
        assert mgr.save(s, _state(s))
    mgr.close()
    return root, shm, mgr


def test_rewind_with_a_fast_tier_restores_the_live_timeline(tmp_path, caplog):
    root, shm, mgr = _rewound(tmp_path)
    # The local commit of 60 made durable 100 part of an abandoned timeline: removed.
    assert mgr.steps() == [50] and mgr.steps(tier="local") == [90]
    assert _restore(root, shm, durable_every_steps=50) == (90, "local", 90, 90.0)
    # The fast tier lost (a reboot): the newest step of the live timeline in durable.
    shutil.rmtree(shm)
    assert _restore(root, shm, durable_every_steps=50) == (50, "durable", 50, 50.0)


def test_abandoned_durable_step_is_never_restored_even_if_its_removal_failed(tmp_path, caplog):
    """The removal of durable 100 did not happen (a crash, a store error): the restore
    compares commit times across tiers, not step numbers, and still takes local 90."""
    root, shm = tmp_path / "run", tmp_path / "shm"
    mgr = _manager(root, shm, durable_every_steps=50)
    for s in range(10, 101, 10):
        assert mgr.save(s, _state(s))
    mgr.close()
    shutil.copytree(root / "step-00000100", tmp_path / "old100")
    mgr = _manager(root, shm, durable_every_steps=50)
    assert mgr.restore(_state(-1), step=50) == 50
    for s in range(60, 91, 10):
        assert mgr.save(s, _state(s))
    mgr.close()
    shutil.rmtree(root / "step-00000100", ignore_errors=True)
    shutil.copytree(tmp_path / "old100", root / "step-00000100")  # as if never removed
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        assert _restore(root, shm, durable_every_steps=50) == (90, "local", 90, 90.0)
    assert "abandoned timeline" in caplog.text and "100" in caplog.text


def test_fallback_follows_commit_order(tmp_path):
    """Local 90 is corrupt: the restore falls back to the next newest on the live
    timeline, durable 50, never to the abandoned durable 100."""
    root, shm, _ = _rewound(tmp_path)
    for f in os.listdir(shm / "step-00000090"):
        if f.startswith("data-"):
            with open(shm / "step-00000090" / f, "r+b") as fh:
                fh.seek(-4, os.SEEK_END)
                fh.write(b"\xff\xff\xff\xff")
    assert _restore(root, shm, durable_every_steps=50) == (50, "durable", 50, 50.0)


def test_a_new_run_does_not_restore_another_roots_fast_tier_step(tmp_path, caplog):
    shm = tmp_path / "shm"
    a = _manager(tmp_path / "runA", shm)
    assert a.save(5, _state(5), force=True)
    a.close()
    # Run B: an empty root, the same local_root. A's step is not B's.
    b = _manager(tmp_path / "runB", shm)
    st = _state(-1)
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        assert b.restore(st) is None
    assert st["step"] == -1 and float(st["w"][0]) == -1.0
    assert b.steps(tier="local") == []
    assert "another" in caplog.text and "step-00000005" in caplog.text
    b.close()
    # Skipped, not deleted: run A still restores it from its fast tier.
    assert (shm / "step-00000005" / "manifest-00000.json").exists()
    assert _restore(tmp_path / "runA", shm) == (5, "local", 5, 5.0)
    # Once run B commits in the shared local_root, its cleanup removes A's step.
    b = _manager(tmp_path / "runB", shm)
    assert b.save(7, _state(7), force=True)
    b.close()
    assert not (shm / "step-00000005" / "manifest-00000.json").exists()
    assert _restore(tmp_path / "runB", shm) == (7, "local", 7, 7.0)
    # The same root path, emptied and started over: a new run too.
    shutil.rmtree(tmp_path / "runA")
    assert _restore(tmp_path / "runA", shm) == (None, None, -1, -1.0)


def _adam_run(tmp_path, restore_first: bool, **kw) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if restore_first:
        mgr = dckpt.CheckpointManager(str(tmp_path / "empty"), async_save=True,
                                      capture_rng=False, **kw)
        assert mgr.restore({"train": dckpt.TrainingState(model, opt)}) is None
        assert len(opt.state) == 0, "restore() changed the optimizer's state"
        assert all(p.grad is None for p in model.parameters())
        mgr.close()
    x = torch.arange(8.0).reshape(2, 4)
    for _ in range(3):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]


def test_restore_finding_nothing_leaves_a_fresh_optimizer_alone(tmp_path):
    ref_params, ref_state = _adam_run(tmp_path / "ref", False)
    for kw in ({}, {"local_root": str(tmp_path / "shm")}):
        params, state = _adam_run(tmp_path / str(len(kw)), True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), kw
        assert all(float(state[i]["step"]) == float(ref_state[i]["step"]) == 3.0
                   for i in ref_state), kw


def test_live_timeline_orders_both_tiers_by_commit():
    from dckpt.tiers.chooser import Candidate as C, live_timeline

    # 10..100 durable at t=1..10; rewound to 50, then local 60' and 90' at t=11, 12.
    cands = [C(s, "durable", s / 10) for s in (50, 100)] + [
        C(60, "local", 11.0), C(90, "local", 12.0), C(100, "local", 10.0)]
    order, abandoned = live_timeline(cands)
    assert [(c.step, c.tier) for c in order] == [(90, "local"), (60, "local"), (50, "durable")]
    assert {(c.step, c.tier) for c in abandoned} == {(100, "durable"), (100, "local")}
    # One save in both tiers: local first, its durable copy next.
    order, abandoned = live_timeline([C(5, "durable", 1.0), C(5, "local", 1.0), C(3, "durable", 0.5)])
    assert [(c.step, c.tier) for c in order] == [(5, "local"), (5, "durable"), (3, "durable")]
    assert abandoned == []
    # A newer save of the same step supersedes the older one; unknown times are kept.
    order, abandoned = live_timeline([C(7, "durable", 1.0), C(7, "local", 2.0), C(9, "durable", None)])
    assert [(c.step, c.tier) for c in order] == [(9, "durable"), (7, "local")]
    assert [(c.step, c.tier) for c in abandoned] == [(7, "durable")]
