"""A script that ends with a save still in flight: the save commits before the
process exits (it used to fail with "cannot schedule new futures after interpreter
shutdown": its writer could no longer start threads). Real subprocesses."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import dckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120)


def test_async_save_in_flight_at_exit_commits(tmp_path):
    p = _run(f"""
        import torch, dckpt
        sd = {{"w": torch.arange(1 << 20, dtype=torch.float32)}}
        dckpt.async_save(sd, {str(tmp_path / "c")!r})  # never waited for
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    got = dckpt.load({"w": torch.zeros(1 << 20)}, str(tmp_path / "c"))
    assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_fast_tier_saves_in_flight_at_exit_commit_in_both_tiers(tmp_path):
    p = _run(f"""
        import os, torch, dckpt
        os.environ["DCKPT_FAULT"] = "write:*:sleep=0.3"  # still writing when main ends
        sd = {{"w": torch.arange(1 << 20, dtype=torch.float32)}}
        mgr = dckpt.CheckpointManager({str(tmp_path / "r")!r}, async_save=True,
                                      capture_rng=False, local_root={str(tmp_path / "n")!r})
        mgr.save(1, sd, force=True)  # never waited for, never closed
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    with dckpt.CheckpointManager(str(tmp_path / "r"), capture_rng=False,
                                 local_root=str(tmp_path / "n")) as mgr:
        assert mgr.steps() == [1] and mgr.steps(tier="local") == [1]
        st = {"w": torch.zeros(1 << 20)}
        assert mgr.restore(st) == 1
    assert torch.equal(st["w"], torch.arange(1 << 20, dtype=torch.float32))
