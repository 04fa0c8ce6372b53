"""Multi-rank round trips: plain tensors, DTensors (Shard/Replicate, uneven, 2-D mesh),
every dtype, at 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from statekit import ALL_DTYPES, plain_state, rand, same, zeros_like_state


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("a", "b")[: len(shape)]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _dstate(world: int, seed: int = 0) -> tuple[dict, dict]:
    """A state of DTensors on 1-D and (for 4 ranks) 2-D meshes, and the full tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    m1 = _mesh((world,))
    full: dict = {}
    sd: dict = {}

    def put(key, t, mesh, placements):
        full[key] = t
        sd[key] = distribute_tensor(t, mesh, placements, src_data_rank=None)

    put("s0", rand((11, 6), torch.float32, g), m1, [Shard(0)])
    put("s1", rand((5, 9), torch.bfloat16, g), m1, [Shard(1)])
    put("rep", rand((4, 4), torch.int64, g), m1, [Replicate()])
    put("tiny", rand((world - 1, 3), torch.float16, g), m1, [Shard(0)])  # a rank holds nothing
    put("vec", rand((3 * world + 1,), torch.bool, g), m1, [Shard(0)])
    for dt in ALL_DTYPES:
        put(f"dt.{str(dt).split('.')[-1]}", rand((world + 2, 3), dt, g), m1, [Shard(0)])
    if world == 4:
        m2 = _mesh((2, 2))
        put("m2.s0s1", rand((7, 5), torch.float32, g), m2, [Shard(0), Shard(1)])
        put("m2.rs0", rand((9, 3), torch.float64, g), m2, [Replicate(), Shard(0)])
        put("m2.s0r", rand((6, 2), torch.int32, g), m2, [Shard(0), Replicate()])
        put("m2.s0s0", rand((10, 3), torch.float32, g), m2, [Shard(0), Shard(0)])
        put("m2.s1s0", rand((5, 7, 2), torch.float32, g), m2, [Shard(1), Shard(0)])
    sd["plain"] = plain_state(seed)
    return sd, full


def _roundtrip(path: str) -> dict:
    import dckpt
    from dckpt.protocol.restore import read_manifest
    from dckpt.storage.local import LocalStorage

    world = dist.get_world_size()
    sd, full = _dstate(world)
    info = dckpt.save(sd, path)
    target = zeros_like_state(sd)
    dckpt.load(target, path)
    assert same(sd, target)
    for k, t in full.items():
        if not k.startswith("dt."):  # gloo cannot all-gather every dtype
            assert same(t, target[k].full_tensor()), k
    m, _ = read_manifest(LocalStorage(), path)
    stored = sum(t.nbytes for t in m.tensors.values())
    return {"info": info, "stored": stored, "headers": sum(8 + f.header_len for f in m.files)}


@pytest.mark.parametrize("world", [2, 4])
def test_roundtrip(ranks, tmp_path, world):
    out = ranks(world).run(_roundtrip, str(tmp_path / "c"))
    info = out[0]["info"]
    assert all(o["info"] == info for o in out), "every rank returns the same info"
    assert info.world_size == world
    assert info.num_files == world  # every rank wrote a share
    # Replicated tensors are written exactly once: file bytes = tensor bytes + headers.
    assert info.bytes_written == out[0]["stored"] + out[0]["headers"]


def _replicated_spread(path: str) -> list[int]:
    import dckpt

    sd = {f"p{i}": torch.full((256,), float(i)) for i in range(8)}
    dckpt.save(sd, path)
    import os

    return sorted(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                  if f.endswith(".safetensors"))


def test_replicated_plain_tensors_spread_over_ranks(ranks, tmp_path):
    sizes = ranks(4).run(_replicated_spread, str(tmp_path / "r"))[0]
    assert len(sizes) == 4 and max(sizes) - min(sizes) < 200, sizes  # 2 tensors per rank


def _reshard_layouts(path: str) -> None:
    """Same world size, different layout: Shard(0) saved, Shard(1)/Replicate/plain loaded."""
    import dckpt
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = _mesh((world,))
    full = torch.arange(70, dtype=torch.float32).reshape(7, 10)
    dckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, path)
    for placements in ([Shard(1)], [Replicate()], [Shard(0)]):
        t = {"w": distribute_tensor(torch.zeros(7, 10), mesh, placements)}
        dckpt.load(t, path)
        assert torch.equal(t["w"].full_tensor(), full), placements
    plain = {"w": torch.zeros(7, 10)}
    dckpt.load(plain, path)
    assert torch.equal(plain["w"], full)


def test_load_into_other_layouts(ranks, tmp_path):
    ranks(2).run(_reshard_layouts, str(tmp_path / "l"))


def _subgroups(root: str) -> list:
    """Two independent saves at once, each over its own 2-rank subgroup of 4 ranks."""
    import os

    import dckpt

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    path = os.path.join(root, f"pair{rank // 2}")
    sd = {"x": torch.full((4,), float(rank // 2)), "who": rank // 2}
    info = dckpt.save(sd, path, process_group=mine)
    t = {"x": torch.zeros(4), "who": -1}
    dckpt.load(t, path, process_group=mine)
    assert t["who"] == rank // 2 and torch.equal(t["x"], sd["x"])
    return info.world_size, info.num_files


def test_given_process_group(ranks, tmp_path):
    assert ranks(4).run(_subgroups, str(tmp_path)) == [(2, 1)] * 4


def _save_three(path: str) -> None:
    import dckpt

    dckpt.save({"a": torch.full((3,), 1.0), "b": torch.full((2,), 2.0), "c": 5}, path)


def _load_split(path: str) -> list:
    """Each rank asks for part of the checkpoint, as pipeline stages do."""
    import dckpt

    rank = dist.get_rank()
    mine = {"a": torch.zeros(3)} if rank == 0 else {"b": torch.zeros(2), "c": 0}
    try:
        dckpt.load(mine, path, strict=True)
    except dckpt.StateMismatchError as e:
        return ["error", str(e)]
    return ["ok", {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in mine.items()}]


def test_strict_load_with_keys_split_over_ranks(ranks, tmp_path):
    """A checkpoint key is unexpected only if no rank asked for it: ranks that each take
    part of the state load under strict=True, and a key nobody wants is still refused."""
    pool = ranks(2)
    path = str(tmp_path / "split")
    pool.run(_save_three, path)
    assert pool.run(_load_split, path) == [["ok", {"a": [1.0, 1.0, 1.0]}],
                                                  ["ok", {"b": [2.0, 2.0], "c": 5}]]
    pool.run(_save_extra, str(tmp_path / "extra"))
    out = pool.run(_load_split, str(tmp_path / "extra"))
    assert [o[0] for o in out] == ["error", "error"] and out[0][1] == out[1][1]
    assert "'d'" in out[0][1] and "'a'" not in out[0][1], out[0][1]


def _save_extra(path: str) -> None:
    import dckpt

    dckpt.save({"a": torch.ones(3), "b": torch.ones(2), "c": 5, "d": torch.ones(1)}, path)


def _torch_save_style(path: str) -> None:
    """Every rank holds the same plain model and optimizer (DDP style): the torch.save
    style dict with int optimizer keys saves once and loads on every rank into a fresh
    optimizer."""
    import dckpt

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    model, opt = make(0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=g)).sum().backward()
        opt.step()
    dckpt.save({"epoch": 7, "model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    model2, opt2 = make(dist.get_rank() + 10)
    ck = {"epoch": 0, "model": model2.state_dict(), "optimizer": opt2.state_dict()}
    dckpt.load(ck, path)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    a, b = opt.state_dict(), opt2.state_dict()
    assert ck["epoch"] == 7 and a["param_groups"] == b["param_groups"]
    assert sorted(b["state"]) == [0, 1, 2, 3]
    for k in a["state"]:
        for n in a["state"][k]:
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)
    for v, v2 in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(v, v2)


def test_torch_save_style_dict_with_int_keys(ranks, tmp_path):
    ranks(2).run(_torch_save_style, str(tmp_path / "t"))


def _cast_dtensor(path: str) -> None:
    """fp32 saved as Shard(0), loaded into a bf16 DTensor laid out Shard(1): resharded
    and converted."""
    import dckpt
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh((dist.get_world_size(),))
    full = torch.randn(9, 12, generator=torch.Generator().manual_seed(3))
    dckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)}, path)
    t = {"w": distribute_tensor(torch.zeros(9, 12, dtype=torch.bfloat16), mesh, [Shard(1)])}
    dckpt.load(t, path, cast=True)
    assert torch.equal(t["w"].full_tensor(), full.to(torch.bfloat16))


def test_cast_into_another_layout(ranks, tmp_path):
    ranks(2).run(_cast_dtensor, str(tmp_path / "c"))
