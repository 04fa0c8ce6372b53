"""Soak: 200 saves in every mode keep host memory flat after the first ones (users
report async saves whose RSS grows without bound). One process, a small state."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import dckpt

SAVES = 200


def _rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g),
            "opt": {"m": torch.randn(512, 1024, generator=g)}, "step": 0}


def _save(mode: str, tmp_path, sd: dict, i: int, mgr) -> None:
    path = str(tmp_path / "c")
    if mode == "sync":
        dckpt.save(sd, path, overwrite=True)
    elif mode == "async":
        dckpt.async_save(sd, path, overwrite=True).result()
    else:
        mgr.save(i, sd, force=True)


@pytest.mark.parametrize("mode", ["sync", "async", "manager-async", "manager-tier",
                                  "manager-tier-fenced", "manager-incremental"])
def test_rss_is_flat_over_200_saves(tmp_path, mode):
    sd = _state()
    opt = None
    if mode == "manager-tier-fenced":  # written from the live tensors, fenced on opt
        model = torch.nn.Linear(1024, 512)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        sd["train"] = dckpt.TrainingState(model, opt)
    mgr = None
    if mode.startswith("manager"):
        kw = {"async_save": mode != "manager-incremental", "keep_last": 2, "capture_rng": False}
        if mode.startswith("manager-tier"):
            kw["local_root"] = str(tmp_path / "local")
        if mode == "manager-incremental":
            kw.update(incremental=True, full_every=5)
        mgr = dckpt.CheckpointManager(str(tmp_path / "root"), **kw)
    marks = {}
    for i in range(1, SAVES + 1):
        sd["step"] = i
        sd["b"].add_(1.0)
        _save(mode, tmp_path, sd, i, mgr)
        if opt is not None:  # waits for the files, then changes the saved weights
            sd["train"].model(torch.ones(2, 1024)).sum().backward()
            opt.step()
        if i in (20, SAVES):
            if mgr is not None:
                mgr.wait()
            marks[i] = _rss_mib()
    if mgr is not None:
        mgr.close()
    if opt is not None:  # every fence hook was removed once spent
        assert len(opt._optimizer_step_pre_hooks) <= 1
    grown = marks[SAVES] - marks[20]
    # 4 MiB of state: a leak of a staging copy per save would add 800 MiB.
    assert grown < 24, f"{mode}: RSS grew {grown:.1f} MiB from save 20 to save {SAVES} ({marks})"
