"""Adversarial review of issue 38 at 4 gloo ranks: plans by rule against layouts the
rule's authors did not test (a mesh built from a permuted rank list, a DTensor on a
mesh of part of the group, _StridedShard, empty and 0-d tensors, slices of a named
mesh), settings that differ between ranks, and hostile votes at rank 0."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from .test_plan_rules import _entries, _fresh, _save_gathered  # _entries: the manifest's tensors as plain data


def _state(layout: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6)
    sd: dict = {"step": 3, "plain": torch.full((4,), 2.0)}
    if layout == "permuted":
        mesh = DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]))
        sd["a"] = distribute_tensor(full, mesh, [Shard(0), Shard(1)], src_data_rank=None)
        sd["b"] = distribute_tensor(full, mesh, [Replicate(), Shard(0)], src_data_rank=None)
        sd["c"] = distribute_tensor(full, mesh, [Shard(1), Replicate()], src_data_rank=None)
    elif layout == "submesh":
        mesh = DeviceMesh("cpu", [3, 1])
        sd["a"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        sd["b"] = distribute_tensor(full[:1].clone(), mesh, [Shard(0)], src_data_rank=None)
    elif layout == "strided":
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh("cpu", (2, 2))
        sd["a"] = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2), Shard(0)],
                                    src_data_rank=None)
        sd["b"] = distribute_tensor(full[:8].clone(), mesh, [_StridedShard(0, split_factor=2),
                                                            Shard(0)], src_data_rank=None)
    elif layout == "empty":
        mesh = init_device_mesh("cpu", (4,))
        sd["a"] = distribute_tensor(torch.zeros(0, 6), mesh, [Shard(0)], src_data_rank=None)
        sd["b"] = distribute_tensor(torch.zeros(5, 0), mesh, [Shard(0)], src_data_rank=None)
        sd["c"] = distribute_tensor(torch.tensor(7.0), mesh, [Replicate()], src_data_rank=None)
        sd["d"] = torch.tensor(5.0)
        sd["e"] = distribute_tensor(full[:2].clone(), mesh, [Shard(0)], src_data_rank=None)
    elif layout == "even":  # every rank's file has the same size
        mesh = init_device_mesh("cpu", (4,))
        sd = {"step": 3, "a": distribute_tensor(full[:12], mesh, [Shard(0)], src_data_rank=None)}
    elif layout == "slices":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sd["a"] = distribute_tensor(full, mesh["dp"], [Shard(0)], src_data_rank=None)
        sd["b"] = distribute_tensor(full, mesh["tp"], [Shard(1)], src_data_rank=None)
        sd["c"] = distribute_tensor(full, mesh, [Shard(1), Shard(0)], src_data_rank=None)
    return sd


def _full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _rule_vs_gathered(root: str, layout: str) -> tuple:
    import dckpt
    from dckpt.protocol import coordinator

    derived: list = []
    real = coordinator._Coordinator._derive
    coordinator._Coordinator._derive = lambda self, o: derived.append(real(self, o)) or derived[-1]
    try:
        _fresh()
        dckpt.save(_state(layout), f"{root}/rule")
    finally:
        coordinator._Coordinator._derive = real
    _save_gathered(_state(layout), f"{root}/gathered")
    ok = []
    for name in ("rule", "gathered"):
        target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                  for k, v in _state(layout).items()}
        dckpt.load(target, f"{root}/{name}")
        ok.append(all(torch.equal(_full(v), _full(target[k]))
                      for k, v in _state(layout).items() if isinstance(v, torch.Tensor)))
    return ([d is not None for d in derived], ok,
            (_entries(f"{root}/rule"), _entries(f"{root}/gathered")) if dist.get_rank() == 0 else None)


@pytest.mark.parametrize("layout", ["permuted", "submesh", "strided", "empty", "slices"])
def test_derived_equals_gathered_on_unusual_meshes(ranks, tmp_path, layout):
    out = ranks(4).run(_rule_vs_gathered, str(tmp_path), layout)
    derived, ok, manifests = zip(*out)
    assert all(all(o) for o in ok), ok
    rule, gathered = manifests[0]
    assert rule == gathered
    assert derived[0] == [True]  # the rule path planned it


def _one_rank_without_rules(root: str) -> tuple:
    import dckpt
    from dckpt.protocol import plancache

    _fresh()
    if dist.get_rank() == 2:  # DCKPT_PLAN_RULES=0 in one rank's environment only
        plancache.RULES = False
    try:
        first = dckpt.save(_state("permuted"), f"{root}/a")
        again = dckpt.save(_state("permuted"), f"{root}/b")
    finally:
        plancache.RULES = True
    return first.plan_cached, again.plan_cached, \
        _entries(f"{root}/a") if dist.get_rank() == 0 else None


def test_plan_rules_off_on_one_rank_only(ranks, tmp_path):
    out = ranks(4).run(_one_rank_without_rules, str(tmp_path), timeout=60)
    assert [o[:2] for o in out] == [(False, True)] * 4
    gathered = ranks(4).run(_rule_vs_gathered, str(tmp_path / "ref"), "permuted")[0][2][1]
    assert out[0][2] == gathered


def _hostile_vote(root: str, how: str) -> tuple:
    import json

    import dckpt
    from dckpt.format.filenames import data_name
    from dckpt.protocol import commit, votes

    dckpt.save(_state("permuted"), root)  # a committed checkpoint to overwrite
    real = commit.vote_bytes

    def hostile(vote, save_id, rank):
        good = real(vote, save_id, rank)
        if rank != 1:
            return good
        if how == "other_rank_file":  # rank 1 claims rank 0's file (the same size)
            return json.dumps({**vote, "file": data_name(save_id, 0)}).encode()
        if how == "manifest_name":  # rank 1 claims the committed manifest as its file
            size = os.path.getsize(os.path.join(root, "manifest.json"))
            return json.dumps({**vote, "file": "manifest.json", "size": size, "hlen": 8}).encode()
        if how == "no_file":  # rank 1 wrote its file but reports none
            return votes._NO_FILE
        if how == "bad_magic":
            return b"\x00\x00\x00\x00" + good[4:]
        if how == "short":
            return good[:19]
        if how == "wrong_size":
            return votes._STRUCT.pack(votes.MAGIC, vote["size"] + 1, vote["hlen"], vote["crc"])
        raise AssertionError(how)

    commit.vote_bytes = hostile
    try:
        dckpt.save(_state("even"), root, overwrite=True)
        got = None
    except dckpt.CheckpointError as e:
        got = (type(e).__name__, sorted(e.failures), str(e))
    finally:
        commit.vote_bytes = real
    dist.barrier()
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
              for k, v in _state("permuted").items()}
    dckpt.load(target, root)  # the old checkpoint is intact
    same = all(torch.equal(_full(v), _full(target[k]))
               for k, v in _state("permuted").items() if isinstance(v, torch.Tensor))
    return got, same


@pytest.mark.parametrize("how", ["other_rank_file", "manifest_name", "no_file", "bad_magic",
                                 "short", "wrong_size"])
def test_a_hostile_vote_fails_everywhere_and_keeps_the_old_checkpoint(ranks, tmp_path, how):
    out = ranks(4).run(_hostile_vote, str(tmp_path / "ck"), how, timeout=60)
    assert all(o == out[0] for o in out), out
    got, same = out[0]
    assert got is not None, "a hostile vote was committed"
    assert same, "the old checkpoint was damaged"
    if how not in ("wrong_size", "no_file"):  # caught at the vote: its rank is named
        assert got[1] == [1] and "rank 1" in got[2], got
    else:  # caught by the commit's file check, naming the file's rank
        assert "rank 1" in got[2], got


def _subgroup(root: str) -> tuple:
    import dckpt
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dckpt.protocol import coordinator

    group = dist.new_group([3, 1])  # a save over part of the world, ranks out of order
    if dist.get_rank() not in (1, 3):
        return None
    mesh = DeviceMesh("cpu", [3, 1])
    full = torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6)
    sd = {"a": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None), "p": full[0]}
    derived: list = []
    real = coordinator._Coordinator._derive
    coordinator._Coordinator._derive = lambda self, o: derived.append(real(self, o)) or derived[-1]
    try:
        _fresh()
        dckpt.save(sd, f"{root}/rule", process_group=group)
    finally:
        coordinator._Coordinator._derive = real
    _save_gathered(sd, f"{root}/gathered", process_group=group)
    got = {"a": torch.zeros_like(sd["a"]), "p": torch.zeros(6)}
    dckpt.load(got, f"{root}/rule", process_group=group)
    # local shards (full_tensor() on a mesh listed out of group order is torch's own
    # business: its gather order follows the group, not the mesh)
    ok = torch.equal(got["a"].to_local(), sd["a"].to_local()) and torch.equal(got["p"], full[0])
    return [d is not None for d in derived], ok, \
        (_entries(f"{root}/rule"), _entries(f"{root}/gathered")) if derived else None


def test_derived_equals_gathered_on_a_subgroup_in_another_order(ranks, tmp_path):
    out = ranks(4).run(_subgroup, str(tmp_path), timeout=60)
    assert out[0] is None and out[2] is None
    coord = next(o for o in out if o is not None and o[0])
    assert coord[0] == [True]  # the rule path planned it
    assert coord[1] and all(o[1] for o in out if o is not None)
    rule, gathered = coord[2]
    assert rule == gathered
