"""Restore picks the right state (issue 25): a restore that finds nothing leaves the
state exactly as it was.

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
