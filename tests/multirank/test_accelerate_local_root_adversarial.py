"""Adversarial review of DckptAccelerator(local_root=...) on gloo CPU ranks (torchrun,
FSDP2 through the CPU shim; job: tests/multirank/jobs/accelerate_job.py), every run
under a deadline. Each test pins a defect the review proved on f277e0b (it failed there),
fixed since."""
from __future__ import annotations

import os

import pytest

from .test_accelerate import ckpts, run

pytest.importorskip("accelerate")


def slot_views(local: str) -> dict[str, list[str]]:
    """Each fast-tier slot's per-rank views."""
    return {s: sorted(n for n in os.listdir(os.path.join(local, s)) if n.startswith("manifest-"))
            for s in os.listdir(local)}


def test_a_restart_at_another_world_size_never_overwrites_the_newer_fast_tier_commit(tmp_path):
    root, local = tmp_path / "r", str(tmp_path / "local")
    # checkpoint_0 (step 2) and checkpoint_1 (step 4): committed and copied
    run(root, "dckpt", 2, "--steps", "4", "--every", "2", "--local-root", local)
    assert ckpts(root) == ["checkpoint_0", "checkpoint_1"]
    # checkpoint_2 (step 6): committed on every node, killed before its durable copy
    out = run(root, "dckpt", 2, "--steps", "6", "--every", "2", "--local-root", local,
              "--resume", "--kill-at", "6", "--phase", "committed", ok=False)
    assert "SAVED 6" not in out and "checkpoint_2" not in ckpts(root), out[-3000:]
    # 1 rank: the 2-rank fast-tier commit cannot be read there (documented), so the
    # durable checkpoint_1 is resumed with a warning ...
    out = run(None, "dckpt", None, "--roots", str(root), "--steps", "6", "--every", "2",
              "--local-root", local, "--resume")
    assert "RESUMED step=4 iteration=3 counter=4" in out, out[-3000:]  # past checkpoint_2
    # ... but the next save must not take the name checkpoint_2: the fast tier holds a
    # newer save of it (its only copy, resumable by a 2-rank restart); stock Accelerate
    # (and dckpt without local_root) name the next save past every name present
    saved = [ln for ln in out.splitlines() if ln.startswith("SAVED 6")]
    assert saved and not saved[0].rstrip("/").endswith("checkpoint_2"), (saved, out[-3000:])
