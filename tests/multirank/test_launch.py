"""launch/train.py under real torchrun: restarts, resharding resumes, preemption, and a
killed-and-resumed run that ends bitwise identical to an uninterrupted one."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from launch.elastic_demo import Agent, standalone_args

pytestmark = pytest.mark.slow


def Run(nproc: int, *args: str, restarts: int = 0, env: dict | None = None) -> Agent:
    """A single-agent torchrun job of launch/train.py (process handling shared with the
    elastic demo: output collected, every worker killed at the end)."""
    return Agent("job", standalone_args(nproc, restarts), list(args), env=env)


def sha(run: Agent) -> str:
    m = re.search(r"params sha256 ([0-9a-f]{64})", run.text)
    assert m, run.text[-3000:]
    return m.group(1)


COMMON = ["--every", "4", "--log-every", "1", "--dropout", "0.2"]


def test_killed_and_restarted_run_is_bitwise_identical(tmp_path):
    ref = Run(2, "--steps", "12", "--ckpt-root", str(tmp_path / "a"), *COMMON)
    assert ref.finish() == 0, ref.text[-3000:]
    run = Run(2, "--steps", "12", "--ckpt-root", str(tmp_path / "b"), "--step-sleep", "0.3",
              *COMMON, restarts=1)
    run.wait_for(r"saved \S+step-00000008")
    os.kill(run.worker_pids()[-1], signal.SIGKILL)  # torchrun restarts the workers
    assert run.finish() == 0, run.text[-3000:]
    assert "resumed from step 8" in run.text
    assert sha(run) == sha(ref)


def test_worker_killed_mid_save_resumes_from_previous_checkpoint(tmp_path):
    # Every save stalls 4 s on rank 1 after writing its shard, before its vote: a window
    # to kill that rank mid-save.
    run = Run(2, "--steps", "10", "--ckpt-root", str(tmp_path), *COMMON, restarts=1,
              env={"DCKPT_FAULT": "vote:1:sleep=4"})
    run.wait_for(r"saved \S+step-00000004")
    run.wait_for(r"step 7 loss")
    time.sleep(1.5)  # inside the save of step 8
    os.kill(max(run.worker_pids()), signal.SIGKILL)  # local rank 1 was started last
    assert run.finish() == 0, run.text[-3000:]
    assert "resumed from step 4" in run.text
    # The killed save of step 8 never committed: no "saved" of it before the restart.
    assert not re.search(r"saved \S+step-00000008", run.text.split("resumed from step 4")[0])


def test_restart_with_other_world_size_reshards(tmp_path):
    a = Run(2, "--steps", "8", "--ckpt-root", str(tmp_path), *COMMON)
    assert a.finish() == 0, a.text[-3000:]
    b = Run(3, "--steps", "12", "--ckpt-root", str(tmp_path), *COMMON)
    assert b.finish() == 0, b.text[-3000:]
    assert "world 3" in b.text and "resumed from step 8" in b.text
    c = Run(1, "--steps", "14", "--ckpt-root", str(tmp_path), *COMMON)
    assert c.finish() == 0 and "resumed from step 12" in c.text, c.text[-3000:]


def test_sigterm_writes_a_final_checkpoint(tmp_path):
    run = Run(2, "--steps", "1000", "--ckpt-root", str(tmp_path), "--every", "100",
              "--log-every", "1", "--step-sleep", "0.1", "--save-on-sigterm")
    run.wait_for(r"step 5 loss")
    os.kill(run.proc.pid, signal.SIGTERM)  # the agent forwards it to every worker
    run.finish()  # the agent itself, SIGTERMed, exits non-zero; the workers exit 0
    m = re.search(r"final checkpoint of step (\d+)", run.text)
    assert m, run.text[-3000:]
    step = int(m.group(1))
    assert os.path.exists(tmp_path / f"step-{step:08d}" / "manifest.json")
    again = Run(2, "--steps", str(step + 2), "--ckpt-root", str(tmp_path), "--every", "100")
    assert again.finish() == 0 and f"resumed from step {step}" in again.text, again.text[-3000:]


def test_fast_tier_restart_resumes_from_local_and_is_bitwise_identical(tmp_path):
    """Two ranks share one node-local tier (as on a real node); the run is killed after
    step 8 reached only the fast tier (durable every 12 steps) and resumes from it."""
    ref = Run(2, "--steps", "12", "--ckpt-root", str(tmp_path / "a"), *COMMON)
    assert ref.finish() == 0, ref.text[-3000:]
    run = Run(2, "--steps", "12", "--ckpt-root", str(tmp_path / "b"), "--step-sleep", "0.3",
              "--local-root", str(tmp_path / "shm"), "--durable-every", "12", *COMMON,
              restarts=1)
    run.wait_for(r"step 8 committed in the fast tier")
    os.kill(run.worker_pids()[-1], signal.SIGKILL)  # torchrun restarts the workers
    assert run.finish() == 0, run.text[-3000:]
    assert "resumed from step 8 (local tier)" in run.text, run.text[-3000:]
    assert sha(run) == sha(ref)
    assert sorted(n for n in os.listdir(tmp_path / "b") if not n.startswith(".dckpt-")) == [
        "step-00000012"]  # .dckpt-*: the save history


def test_demo_model_does_not_trip_fsdp2_view_warning(tmp_path):
    """The demo's FSDP2-wrapped modules return fresh tensors, not views: torch warns that
    an in-place op on a view output "can cause backward to fail or produce wrong
    gradients", which a user's first run must not print (issue 27, 7)."""
    run = Run(2, "--steps", "2", "--every", "2", "--ckpt-root", str(tmp_path))
    assert run.finish() == 0, run.text[-3000:]
    assert "final step 2 params sha256" in run.text, run.text[-3000:]
    assert "returned a view tensor" not in run.text, run.text[-3000:]
    assert "Warning" not in run.text, run.text[-3000:]
    _readme_export_works(tmp_path / "step-00000002", tmp_path / "hf")


def _readme_export_works(ckpt, out) -> None:
    """The README's `dckpt export` line, run on a checkpoint of launch/train.py (its
    path and output swapped for ours): its --prefix matches the model's keys (issue 27,
    6), and the export holds the model's weights under their module names."""
    import shlex
    import subprocess
    import sys

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    line = next(ln for ln in readme.splitlines() if ln.startswith("dckpt export "))
    argv = shlex.split(line.split("#")[0])
    argv[2:4] = [str(ckpt), str(out)]
    p = subprocess.run([sys.executable, "-m", "dckpt", *argv[1:]], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, (line, p.stdout, p.stderr)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"emb.weight", "head.weight", "blocks.0.1.weight"} <= names, names


def _durable_steps(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-")
                  and os.path.exists(os.path.join(root, n, "manifest.json")))


def test_fast_tier_run_makes_its_final_step_durable_by_default(tmp_path):
    """With a fast tier, the run's last save is forced durable (--final-durable, on by
    default): without it, steps below --durable-every apart stay node-local only, and a
    lost node would lose the run's end (issue 27, 8)."""
    tier = ["--every", "4", "--durable-every", "100", "--log-every", "4"]
    run = Run(2, "--steps", "8", "--ckpt-root", str(tmp_path / "a"),
              "--local-root", str(tmp_path / "shm-a"), *tier)
    assert run.finish() == 0, run.text[-3000:]
    assert _durable_steps(tmp_path / "a") == ["step-00000008"], run.text[-3000:]
    off = Run(2, "--steps", "8", "--ckpt-root", str(tmp_path / "b"),
              "--local-root", str(tmp_path / "shm-b"), "--no-final-durable", *tier)
    assert off.finish() == 0, off.text[-3000:]
    assert _durable_steps(tmp_path / "b") == [], off.text[-3000:]  # local only
    assert "step 8 committed in the fast tier" in off.text
