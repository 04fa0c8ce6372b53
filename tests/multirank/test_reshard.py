"""Resharding restore: a checkpoint saved by N ranks loads into M ranks, any layout."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

SHAPES = {"a": (13, 6), "b": (5, 11), "c": (7, 4, 3), "r": (6, 6), "tiny": (2, 5), "e": (0, 4)}


def _full(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=g)


def _layouts(world: int, variant: int) -> dict:
    """key -> (mesh shape, placements) for a given world size; variant picks another."""
    from torch.distributed.tensor import Replicate, Shard

    S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
    one = (world,)
    if variant == 0:
        out = {"a": (one, [S0]), "b": (one, [S1]), "c": (one, [S2]), "r": (one, [R]),
               "tiny": (one, [S0]), "e": (one, [S0])}
        if world == 4:
            out.update(a=((2, 2), [S0, S1]), c=((2, 2), [R, S0]), r=((2, 2), [S1, R]))
        return out
    out = {"a": (one, [S1]), "b": (one, [R]), "c": (one, [S0]), "r": (one, [S0]),
           "tiny": (one, [S1]), "e": (one, [S1])}
    if world == 4:
        out.update(b=((2, 2), [S0, S0]), tiny=((2, 2), [S1, S0]))
    return out


def _state(world: int, variant: int, zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes: dict = {}
    sd = {}
    for key, (mshape, placements) in _layouts(world, variant).items():
        if mshape not in meshes:
            meshes[mshape] = init_device_mesh("cpu", mshape)
        t = torch.zeros(SHAPES[key]) if zero else _full(key)
        sd[key] = distribute_tensor(t, meshes[mshape], placements, src_data_rank=None)
    sd["meta"] = {"world": world}
    return sd


def _save(path: str) -> None:
    import dckpt

    dckpt.save(_state(dist.get_world_size(), 0, zero=False), path)


def _load(path: str, budget: int) -> int:
    import dckpt

    world = dist.get_world_size()
    target = _state(world, 1, zero=True)
    dckpt.load(target, path, read_budget=budget)
    want = _state(world, 1, zero=False)
    for key in SHAPES:
        got, exp = target[key].to_local(), want[key].to_local()
        assert torch.equal(got, exp), (key, dist.get_rank())
    return target["meta"]["world"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_n_to_m(ranks, tmp_path, n, m):
    path = str(tmp_path / "ckpt")
    ranks(n).run(_save, path)
    budget = 1 << 20 if (n + m) % 2 else 256 << 20
    assert ranks(m).run(_load, path, budget) == [n] * m


def test_sharded_into_plain_tensors_in_one_process(ranks, tmp_path):
    """Export/eval: one process without a process group reads full tensors."""
    import dckpt

    path = str(tmp_path / "ckpt")
    ranks(4).run(_save, path)
    target = {k: torch.zeros(s) for k, s in SHAPES.items()}
    target["meta"] = {"world": 0}
    dckpt.load(target, path)
    for key in SHAPES:
        assert torch.equal(target[key], _full(key)), key
    assert target["meta"]["world"] == 4


def _partial(path: str) -> str:
    import dckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dt = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        dckpt.save({"p": dt}, path)
    except dckpt.UnsupportedValueError as e:
        return str(e)
    raise AssertionError("a Partial DTensor was saved")


def test_partial_placement_refused(ranks, tmp_path):
    msgs = ranks(2).run(_partial, str(tmp_path / "p"))
    assert all("Partial" in m and "'p'" in m and "Replicate" in m for m in msgs)
    assert not (tmp_path / "p" / "manifest.json").exists()
