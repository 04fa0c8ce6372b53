"""Elastic runs of launch/train.py under real torchrun: the checkpointed data sampler
resumes bitwise; a two-agent job (c10d rendezvous) that loses an agent carries on at the
smaller size; two agents whose restart counts differ still meet in one round. Process
handling is launch/elastic_demo.py's (shared with the demo)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from dckpt.catalog.verify import verify_checkpoint
from tests.multirank.test_launch import sha
from launch.elastic_demo import (BATCH, Agent, free_port, position_at, rdzv_args,
                                 saved_steps, standalone_args, wait_for)

pytestmark = pytest.mark.slow

COMMON = ["--every", "4", "--log-every", "1", "--dropout", "0.2", "--data", "sampler"]


def test_killed_and_restarted_run_with_sampler_is_bitwise_identical(tmp_path):
    with Agent("ref", standalone_args(2, 0),
               ["--steps", "12", "--ckpt-root", str(tmp_path / "a"), *COMMON]) as ref:
        assert ref.finish() == 0, ref.text[-3000:]
    with Agent("run", standalone_args(2, 1), ["--steps", "12", "--ckpt-root", str(tmp_path / "b"),
                                              "--step-sleep", "0.3", *COMMON]) as run:
        run.wait_for(r"saved \S+step-00000008")
        os.kill(run.worker_pids()[-1], signal.SIGKILL)  # torchrun restarts the workers
        assert run.finish() == 0, run.text[-3000:]
    assert "resumed from step 8" in run.text
    assert f"data position {8 * 2 * BATCH} " in run.text
    assert sha(run) == sha(ref)


def test_two_agents_lose_one_and_the_survivor_finishes_at_the_smaller_size(tmp_path):
    root = tmp_path / "ck"
    port, run_id = free_port(), f"test-{os.getpid()}"
    args = ["--steps", "16", "--ckpt-root", str(root), "--step-sleep", "0.25", *COMMON]
    # A hosts the c10d rendezvous store, B connects to it; B is the one killed: with A
    # gone the rendezvous would be gone too, and B could never form a new round.
    with Agent("A", rdzv_args(port, run_id, nproc=1, restarts=1, host=True), args) as a:
        with Agent("B", rdzv_args(port, run_id, nproc=1, restarts=1, host=False), args) as b:
            wait_for([a, b], r"world 2, cpu[\s\S]*saved \S+step-\d+")
            last = max(saved_steps(a.text) + saved_steps(b.text))
            b.kill()  # the agent and its worker, as a lost machine
        m = a.wait_for(r"world 1, cpu; resumed from step (\d+)[\s\S]*?data position (\d+) ")
        step = int(m.group(1))
        assert step >= last and step % 4 == 0, a.text[-3000:]
        # The sampler continues where the 2-rank job was at that step.
        assert int(m.group(2)) == position_at([a, b], 2, step)
        assert a.finish() == 0, a.text[-3000:]
    assert "final step 16" in a.text
    report = verify_checkpoint(str(root / "step-00000016"))
    assert report.ok, report.problems


def test_agents_whose_restart_counts_differ_still_meet(tmp_path):
    # B's worker dies while A's sleeps: B restarts and counts it; A restarts for the
    # membership change before its worker notices, which torchrun does not count. Ranks
    # that keyed the shared store by TORCHELASTIC_RESTART_COUNT then read the dead
    # round's gloo addresses ("connectFullMesh failed"), costing A a restart of its own
    # before the counts agreed again (or the job, with none left). train.py's store of
    # the round does not depend on the count: the first new round meets.
    port, run_id = free_port(), f"test-{os.getpid()}-w"
    args = ["--steps", "6", "--ckpt-root", str(tmp_path), "--step-sleep", "2", *COMMON,
            "--every", "2"]  # the last --every wins
    with Agent("A", rdzv_args(port, run_id, nproc=1, restarts=1, host=True), args) as a, \
            Agent("B", rdzv_args(port, run_id, nproc=1, restarts=1, host=False), args) as b:
        wait_for([a, b], r"world 2, cpu[\s\S]*step 2 loss")  # then a 2 s sleep begins
        time.sleep(0.3)  # into A's sleep: only makes the divergence likely, never a failure
        os.kill(b.worker_pids()[0], signal.SIGKILL)
        wait_for([a, b], r"world 2, cpu; resumed from step 2")
        assert a.finish() == 0 and b.finish() == 0, a.text[-2000:] + b.text[-2000:]
    assert "final step 6" in a.text + b.text
    assert "connectFullMesh" not in a.text + b.text
