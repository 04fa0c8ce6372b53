"""The replicated fast tier (issue 28) under real torchrun: two agents on one host, each
one node (``--node-id A`` / ``B``) with its own ``--local-root``, a shared durable root
that no fast-tier step reaches (--durable-every 1000). Agent B is SIGKILLed with its
worker once fast-tier steps are replicated, and its local_root is wiped, as a lost
machine; agent A's worker fails on the dead peer and A exits. Both agents come back (a
fixed --nnodes=2:2: the restart needs both) and resume from the newest replicated step,
which exists nowhere but in A's local_root (A's own part and B's replica): "(peer
tier)". Process handling and the job's settings are launch/elastic_demo.py's (its phase 4
narrates the same run)."""
from __future__ import annotations

import os
import re
import shutil

import pytest

from dckpt.catalog.verify import verify_checkpoint
from launch.elastic_demo import (REPLICATED, Agent, DemoError, durable_steps, peer_agents,
                                 standalone_args, wait_for)
from tests.multirank.test_launch import sha

pytestmark = pytest.mark.slow

STEPS = 24


def test_lost_agent_resumes_from_its_peers_replica(tmp_path):
    base = str(tmp_path)
    a, b = peer_agents(base, "run1", STEPS, nproc=1, restarts=0, step_sleep=0.25)
    with a, b:
        # Two replicated steps, so that retention has run on the replicas too.
        m = wait_for([a, b], rf"{REPLICATED}[\s\S]*{REPLICATED}", timeout=90)
        seen = int(m.group(2))
        assert os.listdir(tmp_path / "A" / "peers"), "A holds no replica of B's steps"
        b.kill()  # agent and worker, as a lost machine
        shutil.rmtree(tmp_path / "B")  # its memory is gone with it
        # A's worker fails on the dead peer, and A (no restarts left) exits.
        try:
            rc_a = a.finish(timeout=60)
        except DemoError as e:
            pytest.fail(f"agent A did not exit after its peer died: {e}")
        assert rc_a != 0
    text1 = a.text + b.text
    replicated = {int(s) for s in re.findall(REPLICATED, text1)}
    durable = durable_steps(str(tmp_path / "durable"))
    # The fast-tier steps never went durable (--durable-every 1000; whether the first
    # save does is the policy's business): the newest replicated one is not there.
    assert max(replicated) not in durable, (durable, text1[-3000:])
    assert not (tmp_path / "B").exists()

    a, b = peer_agents(base, "run2", STEPS, nproc=1, restarts=0, step_sleep=0.0)
    with a, b:
        rc = (a.finish(timeout=120), b.finish(timeout=30))
    text2 = a.text + b.text
    assert rc == (0, 0), text2[-4000:]
    m = re.search(r"resumed from step (\d+) \((\w+) tier\)", text2)
    assert m is not None, text2[-4000:]
    step, tier = int(m.group(1)), m.group(2)
    # The newest step replicated before the loss, from A's replica of B's part (B's
    # local_root was empty): a step the durable root never held.
    assert tier == "peer", text2[-4000:]
    assert step >= max(seen, *replicated), (step, replicated)
    assert step not in durable
    assert f"final step {STEPS}" in text2
    # Node B's fast tier, empty at the restart, is in use again.
    assert (tmp_path / "B").is_dir() and os.listdir(tmp_path / "B")
    # The bytes that came from the peer are the state that was saved: the resumed run
    # ends bitwise where an uninterrupted one does (train.py checkpoints the RNGs).
    with Agent("ref", standalone_args(2, 0),
               ["--steps", str(STEPS), "--every", "2", "--width", "32", "--depth", "1",
                "--ckpt-root", str(tmp_path / "ref")]) as ref:
        assert ref.finish(timeout=90) == 0, ref.text[-3000:]
    assert sha(a if "params sha256" in a.text else b) == sha(ref)
    report = verify_checkpoint(str(tmp_path / "durable" / f"step-{STEPS:08d}"))
    assert report.ok, report.problems
