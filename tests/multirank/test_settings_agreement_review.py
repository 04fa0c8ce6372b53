"""Adversarial review of issue 34, section 1, multi-rank: settings agreement. Each
test proves a defect found in review (it failed before its fix)."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

DEADLINE = 60


def _make(base: str, kw_by_rank: dict) -> str:
    import dckpt

    kw = kw_by_rank.get(dist.get_rank(), kw_by_rank.get("*", {}))
    try:
        mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), capture_rng=False,
                                      local_root=os.path.join(base, "shm"), **kw)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    mgr.close()
    return "no error"


def test_equal_int_and_float_settings_agree(ranks, tmp_path):
    out = ranks(2).run(_make, str(tmp_path), {0: {"every_seconds": 10},
                                              1: {"every_seconds": 10.0}}, timeout=DEADLINE)
    assert out == ["no error", "no error"], out
