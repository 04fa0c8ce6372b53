"""Real crashes: torchrun jobs whose ranks are SIGKILLed in the middle of saves.

After every kill the checkpoint path must hold one whole generation (never a mix of
two), pass full verification, and the leftovers must be removable by ``dckpt gc``.
"""
from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import dckpt
from dckpt.catalog.gc import collect_garbage
from dckpt.catalog.verify import verify_checkpoint

JOB = os.path.join(os.path.dirname(__file__), "jobs", "save_job.py")
pytestmark = pytest.mark.slow


class Job:
    """``torchrun --nproc-per-node=2 SCRIPT PATH RUNDIR ARGS...`` in its own session,
    its output collected line by line; ``env`` is added to the environment."""

    def __init__(self, path: str, rundir: str, *args: str, script: str = JOB,
                 env: dict | None = None) -> None:
        env = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("DCKPT_FAULT", None)
        self.rundir = rundir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "--max-restarts=0", script, path, rundir, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        end = time.time() + timeout
        while time.time() < end:
            try:
                if text in self.lines.get(timeout=1):
                    return
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
        raise AssertionError(f"job never printed {text!r}:\n{''.join(self.output)[-3000:]}")

    def pid(self, rank: int) -> int:
        return int(open(os.path.join(self.rundir, f"pid.{rank}")).read())

    def kill_all(self) -> None:
        """The node is lost: the agent and every worker at once (SIGKILL)."""
        for pid in (self.pid(0), self.pid(1), self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self, timeout: float = 120) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError("job did not exit after a rank was killed")
        # Workers live in their own sessions: make sure none outlives the agent, or it
        # would go on saving while the test inspects the checkpoint.
        for rank in (0, 1):
            try:
                pid = self.pid(rank)
            except (OSError, ValueError):
                continue
            end = time.time() + 30
            while _alive(pid) and time.time() < end:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"rank {rank} outlived its torchrun agent")
        return rc


    def last_saved(self) -> int:
        gens = [int(x.split()[1]) for x in self.output if x.startswith("saved ")]
        return max(gens, default=0)


def expected(gen: int) -> dict:
    rows = 1 << 12
    full = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024) + gen * 1e7
    return {"w": full, "m": full[:, :512] * 2, "r": torch.full((256, 256), float(gen)),
            "b": torch.full((1 << 16,), float(gen)), "gen": gen}


def gc_after_lease(root: str, **kw):
    """gc as it runs once the killed save's lease has run out: its intent file (which
    the dead rank 0 can no longer renew) is aged past the lease first."""
    from dckpt.protocol.intent import INTENT_FILE, LEASE_S

    old = time.time() - LEASE_S - 60
    for d, _, files in os.walk(root):
        for f in files:
            if INTENT_FILE.match(f):
                os.utime(os.path.join(d, f), (old, old))
    return collect_garbage(root, min_age_s=0, **kw)


def loaded_generation(path: str) -> int:
    """Load the checkpoint into plain tensors in this one process; check it is exactly
    one generation and verifies."""
    t = {"w": torch.zeros(4096, 1024), "m": torch.zeros(4096, 512), "r": torch.zeros(256, 256),
         "b": torch.zeros(1 << 16), "gen": -1}
    dckpt.load(t, path)
    want = expected(t["gen"])
    for k in ("w", "m", "r", "b"):
        assert torch.equal(t[k], want[k]), f"{k} is not generation {t['gen']}: a mix"
    rep = verify_checkpoint(path)
    assert rep.ok, rep.problems
    return t["gen"]


@pytest.mark.parametrize("victim, seed", [(1, 0), (0, 1), (1, 2), ("all", 3)])
def test_sigkill_at_random_moment(tmp_path, victim, seed):
    path, run = str(tmp_path / "ckpt"), str(tmp_path)
    job = Job(path, run)
    job.wait_for("saved 1")
    time.sleep(random.Random(seed).uniform(0.0, 0.4))
    if victim == "all":  # the whole node goes: agent and workers at once
        for pid in (job.pid(0), job.pid(1), job.proc.pid):
            os.kill(pid, signal.SIGKILL)
    else:
        os.kill(job.pid(victim), signal.SIGKILL)
    assert job.finish() != 0
    gen = loaded_generation(path)
    assert job.last_saved() <= gen <= job.last_saved() + 1, (gen, job.last_saved())
    gc_after_lease(str(tmp_path))
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == sorted(
        f.name for f in dckpt.protocol.restore.read_manifest(
            dckpt.storage.local.LocalStorage(), path)[0].files)
    assert loaded_generation(path) == gen


@pytest.mark.parametrize("fault, committed", [
    ("plan:0:kill", False), ("write:1:kill", False), ("vote:0:kill", False),
    ("commit:0:kill", False), ("committed:0:kill", True)])
def test_kill_at_each_phase_of_an_overwrite(tmp_path, fault, committed):
    path, run = str(tmp_path / "ckpt"), str(tmp_path)
    job = Job(path, run, "--gens", "2", "--fault-gen", "2", "--fault", fault)
    assert job.finish() != 0, "".join(job.output)
    assert job.last_saved() == 1
    assert loaded_generation(path) == (2 if committed else 1)
    # A half-written file of the failed save may be left (rank 0 rolls the save back
    # when it sees the collective break, unless torchrun kills it first): gc's job.
    gc_after_lease(str(tmp_path))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 2
    assert loaded_generation(path) == (2 if committed else 1)


def test_kill_during_first_save_leaves_no_checkpoint(tmp_path):
    path, run = str(tmp_path / "ckpt"), str(tmp_path)
    job = Job(path, run, "--gens", "1", "--fault-gen", "1", "--fault", "commit:0:kill")
    assert job.finish() != 0
    with pytest.raises(dckpt.NotCommittedError):
        loaded_generation(path)
    # While its lease lasts, the dead save's files are left alone (it might be alive).
    assert collect_garbage(str(tmp_path), min_age_s=0, dry_run=True) == []
    assert gc_after_lease(str(tmp_path), dry_run=True)
    gc_after_lease(str(tmp_path))
    assert [f for f in os.listdir(path) if f.endswith(".safetensors")] == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_during_async_persist(tmp_path):
    """The snapshot is taken and training goes on; the rank dies while the background
    persist is in flight: the previous checkpoint stays, the new one never appears."""
    path, run = str(tmp_path / "ckpt"), str(tmp_path)
    job = Job(path, run, "--async-save", "--gens", "2", "--fault-gen", "2",
              "--fault", "vote:0:sleep=60")
    job.wait_for("staged 2")
    time.sleep(0.5)
    os.kill(job.pid(0), signal.SIGKILL)
    assert job.finish() != 0
    assert job.last_saved() == 1
    assert loaded_generation(path) == 1
    gc_after_lease(str(tmp_path))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 2


def _incremental_generation(root: str, step: int) -> None:
    """Step ``step`` under ``root`` loads in this process as generation ``step`` (with
    the frozen "w" of generation 0) and verifies, references included."""
    want = expected(step)
    want["w"] = expected(0)["w"]
    t = {k: (torch.zeros_like(v) if torch.is_tensor(v) else -1) for k, v in want.items()}
    dckpt.load({"state": t}, os.path.join(root, f"step-{step:08d}"))
    for k in ("w", "m", "r", "b"):
        assert torch.equal(t[k], want[k]), f"step {step}: {k} is not generation {step}"
    assert t["gen"] == step
    rep = verify_checkpoint(os.path.join(root, f"step-{step:08d}"))
    assert rep.ok, rep.problems


def _committed_steps(root: str) -> list[int]:
    return sorted(int(d[5:]) for d in os.listdir(root)
                  if os.path.exists(os.path.join(root, d, "manifest.json")))


@pytest.mark.parametrize("how", ["random", "write:1:kill", "commit:0:kill"])
def test_kill_mid_incremental_save(tmp_path, how):
    """A manager saving incrementally (full_every=3, keep_last=2) is killed in the middle
    of a save: every committed step (a full one and the deltas that reference it) still
    loads bitwise and verifies, the manager restores the newest, and gc after the lease
    keeps every referenced file."""
    root, run = str(tmp_path / "ckpt"), str(tmp_path)
    if how == "random":
        job = Job(root, run, "--incremental")
        job.wait_for("saved 4")  # into the second chain: a delta of step 4
        time.sleep(random.Random(7).uniform(0.0, 0.3))
        job.kill_all()
    else:  # step 5 is an incremental save on 4 (4 is full: saves 1, 4, 7 are)
        job = Job(root, run, "--incremental", "--gens", "5", "--fault-gen", "5",
                  "--fault", how)
    assert job.finish() != 0
    last = job.last_saved()
    if how != "random":
        assert last == 4
    steps = _committed_steps(root)
    assert steps and last <= steps[-1] <= last + 1, (steps, last)
    for s in steps:
        _incremental_generation(root, s)
    gc_after_lease(run)
    assert _committed_steps(root) == steps
    for s in steps:
        _incremental_generation(root, s)
    want = expected(steps[-1])
    t = {k: (torch.zeros_like(v) if torch.is_tensor(v) else -1) for k, v in want.items()}
    assert dckpt.CheckpointManager(root, capture_rng=False).restore(t) == steps[-1]


@pytest.mark.parametrize("how", ["random", "history:0:kill"])
def test_history_survives_a_killed_save(tmp_path, how):
    """A manager saving one step per epoch (every_epochs=1) on 2 ranks is SIGKILLed: at
    a random moment, or half-way through writing the history line of step 4, after its
    commit. The history still parses, holds the record of every step whose save()
    returned, and loses nothing but the line being written; the next restore adds the
    record the kill prevented (rebuilt from the manifest), after the torn line."""
    from dckpt.manager.history import read_history
    from dckpt.storage.local import LocalStorage

    root, run = str(tmp_path / "ckpt"), str(tmp_path)
    if how == "random":
        job = Job(root, run, "--manager")
        job.wait_for("saved 3")
        time.sleep(random.Random(11).uniform(0.0, 0.3))
        job.kill_all()
    else:  # killed during the save of step 4, after its commit
        job = Job(root, run, "--manager", "--gens", "4", "--fault-gen", "4", "--fault", how)
    assert job.finish() != 0
    last = job.last_saved()
    steps = _committed_steps(root)
    assert steps and last <= steps[-1] <= last + 1, (steps, last)
    if how != "random":
        assert last == 3 and steps[-1] == 4

    recs, bad = read_history(LocalStorage(), root)
    assert bad == (1 if how == "history:0:kill" else bad) and bad <= 1
    by_step = {r.step: r for r in recs}
    assert set(range(1, last + 1)) <= set(by_step) <= set(range(1, last + 2))
    for s in range(1, last + 1):
        r = by_step[s]
        assert (r.tier, r.mode, r.world_size, r.epoch) == ("durable", "sync", 2, s - 1)
        assert r.bytes > 20 << 20 and 0 < r.blocking_s <= r.total_s
    if how != "random":
        assert 4 not in by_step  # the kill came before its record was whole

    mgr = dckpt.CheckpointManager(root, capture_rng=False)
    t = {k: (torch.zeros_like(v) if torch.is_tensor(v) else -1)
         for k, v in expected(steps[-1]).items()}
    assert mgr.restore(t) == steps[-1] and mgr.restored_epoch == steps[-1] - 1
    mgr.close()
    after, bad_after = read_history(LocalStorage(), root)
    assert bad_after == bad  # the torn line stays on its own, skipped
    assert after[:len(recs)] == recs  # nothing written before the kill was lost
    assert {r.step for r in after} == set(range(1, steps[-1] + 1))
    for r in after[len(recs):]:  # only what the kill prevented, rebuilt from its manifest
        assert (r.step, r.mode, r.world_size, r.epoch) == (steps[-1], "recovered", 2,
                                                           steps[-1] - 1)
