"""The replicated fast tier's retention (issue 34, defects 1.5-1.7) across real gloo ranks
on simulated nodes (node = rank // 2, one local_root per node): which step counts as
replicated after a restart, replicas dropped while a receiver keeps failing, and replicas
reclaimed once replication stops (replicas=0, a shrink onto one node)."""
from __future__ import annotations

import os
import shutil

from .test_peer_restore import DEADLINE, _check, _manager, _save, _state

FAIL_NODE0 = {"DCKPT_FAULT": "replicate:0:raise"}  # rank 0 (node0) receives part 2


def _saves_whose_replication_fails(base: str, steps: list) -> list[str]:
    """Save each step and wait for its replication (so none is superseded); the errors
    wait()/close() raise are returned, never let out: training goes on."""
    from dckpt import CheckpointError

    mgr = _manager(base, 2)
    errs = []
    for s in steps:
        assert mgr.save(s, _state(s))
        try:
            mgr.wait()
        except CheckpointError as e:
            errs.append(str(e))
    try:
        mgr.close()
    except CheckpointError as e:
        errs.append(str(e))
    return errs


def _restore_then_save(base: str, step: int) -> tuple:
    from dckpt import CheckpointError

    mgr = _manager(base, 2)
    st = _state(-1)
    got = mgr.restore(st)
    _check(st, got)
    mgr.save(step, _state(step))
    try:
        mgr.close()
    except CheckpointError:
        pass  # the replication of ``step`` may fail (a fault): training went on
    return got, mgr.restored_from


def _restore_or_none(base: str, replicas: int = 1) -> tuple:
    mgr = _manager(base, 2, replicas=replicas)
    st = _state(-1)
    got = mgr.restore(st)
    if got is not None:
        _check(st, got)
    mgr.close()
    return got, mgr.restored_from


def _peer_steps(root) -> list[str]:
    d = os.path.join(root, "peers")
    return sorted(n for n in os.listdir(d) if n.startswith("step-")) if os.path.isdir(d) else []


def _incoming(root) -> list[str]:
    return sorted(os.path.relpath(b, root) for b, ds, fs in os.walk(root)
                  if os.path.basename(b) == ".incoming" and fs)


def test_a_restart_keeps_the_own_files_of_the_step_really_replicated(ranks, tmp_path):
    pool = ranks(4)
    pool.run(_save, str(tmp_path), 2, [10], None, timeout=DEADLINE)  # replicated everywhere
    # node0's receiver fails from here on: step 20 is committed but not replicated
    errs = pool.run(_saves_whose_replication_fails, str(tmp_path), [20], env=FAIL_NODE0,
                    timeout=DEADLINE)
    assert all(e and "replication of step 20" in e[0] for e in errs), errs
    # a restart: 20 from the own files; 30 saved, its replication fails too
    out = pool.run(_restore_then_save, str(tmp_path), 30, env=FAIL_NODE0, timeout=DEADLINE)
    assert out == [(20, "local")] * 4
    # step 10 is still the newest step held whole on both nodes: node0 kept its own
    # files of it (the restart did not take step 20 for replicated) and its replicas
    shutil.rmtree(tmp_path / "node1")
    assert pool.run(_restore_or_none, str(tmp_path), timeout=DEADLINE) == [(10, "peer")] * 4


def test_a_receiver_that_keeps_failing_leaves_peers_bounded(ranks, tmp_path):
    pool = ranks(4)
    pool.run(_save, str(tmp_path), 2, [10], None, timeout=DEADLINE)
    steps = [20, 30, 40, 50, 60, 70]
    errs = pool.run(_saves_whose_replication_fails, str(tmp_path), steps, env=FAIL_NODE0,
                    timeout=DEADLINE)
    assert all(len(e) == len(steps) for e in errs), errs
    for n in ("node0", "node1"):
        # keep_last_local=1: the replicas of step 10 (the newest replicated everywhere)
        # and of the newest step tried (70), whatever its copy's outcome; nothing between
        assert _peer_steps(tmp_path / n) == ["step-00000010", "step-00000070"], n
        assert _incoming(tmp_path / n) in ([], ["peers/step-00000070/.incoming"]), n
    # node1 received node0's parts of 70 whole: losing node0 restores 70 from node1
    shutil.rmtree(tmp_path / "node0")
    assert pool.run(_restore_or_none, str(tmp_path), timeout=DEADLINE) == [(70, "peer")] * 4


def test_a_restart_without_replicas_reclaims_them(ranks, tmp_path):
    pool = ranks(4)
    pool.run(_save, str(tmp_path), 2, [10, 20], None, timeout=DEADLINE)
    assert _peer_steps(tmp_path / "node0") == ["step-00000020"]
    out = pool.run(_restore_or_none, str(tmp_path), 0, timeout=DEADLINE)
    assert out == [(20, "local")] * 4
    for n in ("node0", "node1"):
        assert _peer_steps(tmp_path / n) == [], n


def test_a_shrink_onto_one_node_reclaims_the_lost_nodes_replicas(ranks, tmp_path):
    ranks(4).run(_save, str(tmp_path), 2, [10, 20], None, timeout=DEADLINE)
    shutil.rmtree(tmp_path / "node1")
    # node0 goes on alone: its replicas of node1's parts serve the restore, then the
    # first step replicated on the new ring (no other node) makes them unneeded
    out = ranks(2).run(_restore_then_save, str(tmp_path), 30, timeout=DEADLINE)
    assert out == [(20, "peer")] * 2
    assert _peer_steps(tmp_path / "node0") == []
