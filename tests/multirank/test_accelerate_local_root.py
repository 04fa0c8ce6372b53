"""DckptAccelerator with ``local_root`` (the fast tier) on gloo CPU ranks (torchrun),
FSDP2 through the CPU shim: a kill after a save's local commit, before its durable copy,
resumes that save from the fast tier; the run goes on, its copies land and rotate; a
restart at another world size reshards the newest durable copy. Single-process cases:
tests/integrations/test_accelerate_local_root.py."""
from __future__ import annotations

import os

import pytest

from .staterefs import ref
from .test_accelerate import ckpts, no_pickle, run, same, verify

pytest.importorskip("accelerate")


def test_kill_after_the_local_commit_resumes_it_then_copies_rotate_and_3_ranks_reshard(
        tmp_path):
    root, local = tmp_path / "r", str(tmp_path / "local")
    out = run(root, "dckpt", 2, "--steps", "6", "--every", "2", "--total-limit", "2",
              "--local-root", local, "--kill-at", "6", "--phase", "committed", ok=False)
    assert "SAVED 4" in out and "SAVED 6" not in out, out[-3000:]
    assert "checkpoint_2" not in ckpts(root)  # its durable copy never began
    out = run(root, "dckpt", 2, "--steps", "8", "--every", "2", "--total-limit", "2",
              "--local-root", local, "--resume")
    assert out.count("RESUMED step=6 iteration=3 counter=6") == 2, out[-3000:]
    for r in range(2):  # the state at the killed save, from every rank's node-local copy
        got = ref(root, f"resumed-2-r{r}")
        assert (got["step"], got["counter"]) == (6, 6)
        assert not same(got, ref(root, f"save-4-r{r}"))
    # checkpoint_2 lives in the fast tier only (the killed run's copy never ran) and
    # counts among the two names total_limit keeps: checkpoint_1 went, checkpoint_3 was
    # copied
    assert ckpts(root) == ["checkpoint_3"], ckpts(root)
    for n in ckpts(root):
        verify(os.path.join(root, "p", "checkpoints", n))
        no_pickle(os.path.join(root, "p", "checkpoints", n))
    out = run(root, "dckpt", 3, "--steps", "8", "--local-root", local, "--resume")
    assert out.count("RESUMED step=8 iteration=4 counter=8") == 3, out[-3000:]
    saved = ref(root, "save-8-r0")
    for r in range(3):
        assert same(ref(root, f"resumed-3-r{r}"), {**saved, "iteration": 4})
