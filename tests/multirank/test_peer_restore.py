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
        out = pool.run(_restore, str(tmp_path), 2, timeout=DEADLINE)
        assert out == [(20, "peer")] * 4, out
        # the replacement holds its own parts again and the replicas it held for others
        assert _peer_parts(str(tmp_path / lost), 20) == ([2, 3] if lost == "node0" else [0, 1])
    out = pool.run(_restore, str(tmp_path), 2, timeout=DEADLINE)
    assert out == [(20, "local")] * 4
