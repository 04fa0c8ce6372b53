"""The replicated fast tier (issue 28) across real gloo ranks on simulated nodes
(node = rank // k, one local_root per node shared by its ranks): replication after each
local commit, a lost node restored from its peers' memory at the same world size and by
the survivors alone, two adjacent nodes lost (durable), damaged replicas never used,
disagreeing settings refused on every rank."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from statekit import flip_byte

DEADLINE = 120.0


def _state(step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5) + step
    return {"x": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((6,), float(step)), "step": step}


def _check(state: dict, step: int) -> None:
    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5) + step
    assert torch.equal(state["x"].full_tensor(), full)
    assert torch.equal(state["rep"], torch.full((6,), float(step)))
    assert state["step"] == step


def _manager(base: str, per_node: int, **kw):
    import dckpt

    kw.setdefault("capture_rng", False)
    kw.setdefault("replicas", 1)
    node = dist.get_rank() // per_node
    return dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=10,
                                   durable_every_steps=1000, node=node,
                                   local_root=os.path.join(base, f"node{node}"), **kw)


def _save(base: str, per_node: int, steps: list, forced: int | None = None) -> list:
    mgr = _manager(base, per_node)
    for s in steps:
        assert mgr.save(s, _state(s), force=s == forced)
    mgr.close()
    return mgr.steps()


def _restore(base: str, per_node: int) -> tuple:
    mgr = _manager(base, per_node)
    st = _state(-1)
    got = mgr.restore(st)
    _check(st, got)
    mgr.close()
    return got, mgr.restored_from


def _restore_and_look(base: str, per_node: int, lost_root: str) -> tuple:
    mgr = _manager(base, per_node)
    st = _state(-1)
    got = mgr.restore(st)
    _check(st, got)
    held = _peer_parts(lost_root, got)  # right after restore(), before close()
    mgr.close()
    return got, mgr.restored_from, held


def _peer_parts(root: str, step: int) -> list[int]:
    d = os.path.join(root, "peers", f"step-{step:08d}")
    if not os.path.isdir(d):
        return []
    return sorted(int(n[9:14]) for n in os.listdir(d) if n.startswith("manifest-"))


def test_lose_each_node_in_turn_and_restore_from_peers(ranks, tmp_path):
    pool = ranks(4)
    pool.run(_save, str(tmp_path), 2, [10, 20], 10, timeout=DEADLINE)
    # node0 holds node1's parts (2, 3) as replicas and vice versa; keep_last_local=1
    assert _peer_parts(str(tmp_path / "node0"), 20) == [2, 3]
    assert _peer_parts(str(tmp_path / "node1"), 20) == [0, 1]
    assert _peer_parts(str(tmp_path / "node0"), 10) == []
    for lost in ("node1", "node0"):
        shutil.rmtree(tmp_path / lost)  # the replacement node starts empty
        out = pool.run(_restore_and_look, str(tmp_path), 2, str(tmp_path / lost),
                       timeout=DEADLINE)
        # the replacement holds its own parts again, and the replicas it held for others
        # are back when restore() returns (before any close() or wait())
        want = [2, 3] if lost == "node0" else [0, 1]
        assert out == [(20, "peer", want)] * 4, out
    out = pool.run(_restore, str(tmp_path), 2, timeout=DEADLINE)
    assert out == [(20, "local")] * 4


def _data_file(root: str, step: int, part: int, peers: bool = True) -> str:
    d = os.path.join(root, "peers", f"step-{step:08d}") if peers else \
        os.path.join(root, f"step-{step:08d}")
    names = [n for n in os.listdir(d) if n.startswith("data-") and n.endswith(f"-{part:05d}.safetensors")]
    assert len(names) == 1, os.listdir(d)
    return os.path.join(d, names[0])


def _flip_last(path: str) -> None:
    flip_byte(path, os.path.getsize(path) - 3)  # in the last tensor's data


def test_a_damaged_replica_is_never_used(ranks, tmp_path):
    pool = ranks(4)
    pool.run(_save, str(tmp_path), 2, [10, 20], 10, timeout=DEADLINE)
    _flip_last(_data_file(str(tmp_path / "node0"), 20, 2))  # in node1's replica of part 2
    shutil.rmtree(tmp_path / "node1")
    # part 2 of step 20 is held nowhere else: the durable step 10, never the damaged bytes
    assert pool.run(_restore, str(tmp_path), 2, timeout=DEADLINE) == [(10, "durable")] * 4


def test_two_adjacent_nodes_lost_with_one_replica_restore_durable(ranks, tmp_path):
    pool = ranks(8)
    pool.run(_save, str(tmp_path), 2, [10, 20], 10, timeout=DEADLINE)
    for n in range(4):  # ring: node n's parts on node n+1
        nxt = (n + 1) % 4
        assert _peer_parts(str(tmp_path / f"node{nxt}"), 20) == [2 * n, 2 * n + 1]
    shutil.rmtree(tmp_path / "node1")
    shutil.rmtree(tmp_path / "node2")  # node1's replicas were there
    assert pool.run(_restore, str(tmp_path), 2, timeout=DEADLINE) == [(10, "durable")] * 8


def test_eight_ranks_on_four_nodes_lose_each_node_in_turn(ranks, tmp_path):
    pool = ranks(8)
    pool.run(_save, str(tmp_path), 2, [10, 20], 10, timeout=DEADLINE)
    for n in range(4):
        shutil.rmtree(tmp_path / f"node{n}")
        assert pool.run(_restore, str(tmp_path), 2, timeout=DEADLINE) == [(20, "peer")] * 8
        assert _peer_parts(str(tmp_path / f"node{n}"), 20) == [2 * ((n - 1) % 4), 2 * ((n - 1) % 4) + 1]
        assert _peer_parts(str(tmp_path / f"node{(n + 1) % 4}"), 20) == [2 * n, 2 * n + 1]


def test_a_damaged_replica_is_skipped_for_another_holder(ranks, tmp_path):
    pool = ranks(6)
    pool.run(_save_r2, str(tmp_path), [10, 20], timeout=DEADLINE)
    for n in range(3):
        others = [p for p in range(6) if p // 2 != n]
        assert _peer_parts(str(tmp_path / f"node{n}"), 20) == others
    _flip_last(_data_file(str(tmp_path / "node0"), 20, 4))  # node0's copy of part 4
    shutil.rmtree(tmp_path / "node2")  # parts 4, 5: node0 (damaged 4) and node1 hold them
    assert pool.run(_restore_r2, str(tmp_path), timeout=DEADLINE) == [(20, "peer")] * 6


def _save_r2(base: str, steps: list) -> list:
    mgr = _manager(base, 2, replicas=2)
    for s in steps:
        assert mgr.save(s, _state(s), force=s == 10)
    mgr.close()
    return mgr.steps()


def _restore_r2(base: str) -> tuple:
    mgr = _manager(base, 2, replicas=2)
    st = _state(-1)
    got = mgr.restore(st)
    _check(st, got)
    mgr.close()
    return got, mgr.restored_from


def _disagree(base: str) -> str:
    try:
        _manager(base, 2, replicas=1 if dist.get_rank() != 3 else 2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_ranks_disagreeing_on_replicas_fail_alike_without_a_hang(ranks, tmp_path):
    out = ranks(4).run(_disagree, str(tmp_path), timeout=30)
    assert len(set(out)) == 1, out
    assert out[0].startswith("CheckpointError") and "replicas=1 on ranks 0, 1, 2" in out[0] \
        and "replicas=2 on rank 3" in out[0], out[0]


def test_survivors_alone_restore_at_a_smaller_world_size(ranks, tmp_path):
    ranks(4).run(_save, str(tmp_path), 2, [10, 20], 10, timeout=DEADLINE)
    shutil.rmtree(tmp_path / "node1")
    # node0's two ranks go on alone: node0 holds its own parts and node1's replicas
    assert ranks(2).run(_restore, str(tmp_path), 2, timeout=DEADLINE) == [(20, "peer")] * 2


def _restore_counting(base: str, per_node: int) -> tuple:
    mgr = _manager(base, per_node)
    st = _state(-1)
    got = mgr.restore(st)
    _check(st, got)
    fetched = mgr.tier.peers.fetched
    left = [n for n in os.listdir(mgr.tier.root) if n.startswith(".restore-")]
    mgr.close()
    return got, mgr.restored_from, fetched, left


def test_other_world_size_fetches_byte_ranges_from_peers(ranks, tmp_path):
    ranks(8).run(_save, str(tmp_path), 2, [10, 20], 10, timeout=DEADLINE)
    shutil.rmtree(tmp_path / "node3")
    # 6 survivors on 3 nodes: node3's parts (6, 7) are on node0 only; each rank reads
    # the rows it needs from whichever node holds them
    out = ranks(6).run(_restore_counting, str(tmp_path), 2, timeout=DEADLINE)
    assert [o[:2] for o in out] == [(20, "peer")] * 6
    assert all(o[3] == [] for o in out)  # the sparse copies are gone after the load
    # new rank r reads rows 4r..4r+3, saved by old parts r*4//3 ..: rank 2 (node1) reads
    # parts 2 and 3, both on node1, and fetches nothing; rank 1 (node0) reads parts 1
    # and 2 and fetches part 2's rows; rank 5 (node2) reads parts 6 and 7 (node3's,
    # on node0 only). Each fetched its ranges, less than the parts' whole files.
    fetched = [o[2] for o in out]
    assert fetched[2] == 0 and fetched[1] > 0 and fetched[5] > 0, fetched
    part_files = sum(os.path.getsize(os.path.join(tmp_path / "node1", f"step-{20:08d}", n))
                     for n in os.listdir(tmp_path / "node1" / f"step-{20:08d}")
                     if n.startswith(("data-", "replica-")))
    assert all(f < part_files for f in fetched), (fetched, part_files)


def _leftovers(root: str) -> list[str]:
    out = []
    for base, dirs, files in os.walk(root):
        out += [os.path.join(base, n) for n in files + dirs
                if ".peer-" in n or n == ".incoming" and os.listdir(os.path.join(base, n))
                or n.startswith(".restore-")]
    return out


def test_a_kill_during_replication_leaves_no_usable_partial_replica(ranks, tmp_path):
    from harness import RankFailed

    pool = ranks(4)
    pool.run(_save, str(tmp_path), 2, [10], 10, timeout=DEADLINE)
    # rank 3 (node1) is SIGKILLed with node0's part 1 of step 20 half received
    with pytest.raises(RankFailed):
        pool.run(_save, str(tmp_path), 2, [20], None, timeout=DEADLINE,
                 env={"DCKPT_FAULT": "replicate:3:kill", "DCKPT_COLLECTIVE_TIMEOUT_S": "10"})
    assert _leftovers(str(tmp_path / "node1"))  # the transfer was cut short there
    shutil.rmtree(tmp_path / "node0")
    # step 20's part 1 is held nowhere whole; step 10's replicas were kept, and so was
    # node1's own step 10 (nothing newer was replicated): step 10 from the peer
    assert ranks(4).run(_restore, str(tmp_path), 2, timeout=DEADLINE) == [(10, "peer")] * 4
    assert _leftovers(str(tmp_path / "node1")) == []


def _save_while_replication_fails(base: str) -> tuple:
    mgr = _manager(base, 2)
    trained = [mgr.save(s, _state(s)) for s in (10, 20)]  # training never sees it
    try:
        mgr.close()
    except Exception as e:
        return trained, f"{type(e).__name__}: {e}"
    return trained, "no error"


def test_a_failed_replication_never_fails_training_and_is_raised_by_close(ranks, tmp_path):
    out = ranks(4).run(_save_while_replication_fails, str(tmp_path), timeout=DEADLINE,
                       env={"DCKPT_FAULT": "replicate:2:raise"})
    for trained, err in out:
        assert trained == [True, True]
        assert err.startswith("CheckpointError") and "replication of step" in err \
            and "rank 2" in err, err
    # the fast tier itself is whole: every rank restores its own files
    assert ranks(4).run(_restore, str(tmp_path), 2, timeout=DEADLINE) == [(20, "local")] * 4


def _save_keep(base: str, keep: int) -> None:
    mgr = _manager(base, 2, keep_last_local=keep)
    for s in (10, 20, 30, 40):
        mgr.save(s, _state(s))
        mgr.wait()  # each step replicated (a step saved meanwhile would supersede it)
    mgr.close()


def test_keep_last_local_applies_to_replicas(ranks, tmp_path):
    ranks(4).run(_save_keep, str(tmp_path), 2, timeout=DEADLINE)
    for n in ("node0", "node1"):
        assert sorted(os.listdir(tmp_path / n / "peers")) == ["step-00000030", "step-00000040"]
        assert sorted(x for x in os.listdir(tmp_path / n) if x.startswith("step-")) == \
            ["step-00000030", "step-00000040"]


def _send_a_part_whose_data_file_is_gone(base: str) -> tuple:
    """Rank 0 sends node0's part 0 of step 10, whose view is there but whose data file
    is gone (so it is not held: a Missing stand-in); rank 1 receives it."""
    import time

    from dckpt.format import manifest as mf
    from dckpt.protocol.collectives import OwnGroup
    from dckpt.storage.local import LocalStorage
    from dckpt.tiers.peers import part as peerpart

    where = os.path.join(base, "node0", f"step-{10:08d}")
    view = mf.parse(open(os.path.join(where, "manifest-00000.json"), "rb").read(), "view")
    group, storage, t0 = OwnGroup([0, 1], 30.0), LocalStorage(), time.monotonic()
    try:
        if dist.get_rank() == 0:
            held = peerpart.find(peerpart.scan(storage, os.path.join(base, "node0"),
                                               view.meta["owner"]), 10, view.save_id, 0)
            assert held is None  # not held: its data file is gone
            peerpart.send_part(group, storage, peerpart.Missing(10, 0, where, None), 1)
        else:
            peerpart.recv_part(group, storage, os.path.join(base, "dst"), 0, 0,
                               view.save_id, view.meta["owner"])
        return "ok", "", time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        group.shutdown()


def test_sending_a_part_that_is_not_held_fails_on_both_sides_at_once(ranks, tmp_path):
    pool = ranks(2)
    pool.run(_save, str(tmp_path), 1, [10], 10, timeout=DEADLINE)
    os.remove(_data_file(str(tmp_path / "node0"), 10, 0, peers=False))
    out = pool.run(_send_a_part_whose_data_file_is_gone, str(tmp_path), timeout=DEADLINE)
    for kind, msg, seconds in out:
        assert kind == "CheckpointError" and "part 0" in msg and "step 10" in msg, out
        assert seconds < 10, out  # neither side waited out the group's timeout
    assert not os.path.exists(tmp_path / "dst" / "manifest-00000.json")
