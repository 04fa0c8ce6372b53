"""dckpt.diff compares values, not layouts: the same tensors saved by 1, 2 and 3 gloo
ranks (DTensor Shard(0), Shard(1), Replicate, plain, JSON values) compare equal, with
slabs that cut across every chunk boundary; a tensor changed in the 3-rank save reports
its exact numbers whatever the world size on the other side."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dckpt
from dckpt.cli.main import main


def _full(bump: bool = False) -> dict[str, torch.Tensor]:
    """The global tensors, the same in every process (the ranks and the test)."""
    g = torch.Generator().manual_seed(11)
    out = {"rows": torch.randn(30, 17, generator=g),  # Shard(0): 15/15 or 10/10/10 rows
           "cols": torch.randn(6, 20, generator=g).to(torch.bfloat16),  # Shard(1)
           "odd": torch.randn(7, 5, 3, generator=g, dtype=torch.float64),  # 4/3 or 3/3/1
           "rep": torch.randint(0, 50, (4, 4), generator=g)}
    if bump:
        out["rows"][11, 4] += 0.5  # on rank 1's chunk at 3 ranks, rank 0's at 2
        out["rows"][29, 16] = -100.0
    return out


def _save(path: str, bump: bool = False) -> None:
    """Runs on every rank (or in the test's process, world 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = _full(bump)
    if not dist.is_initialized():
        sd = {"model": dict(full), "plain": torch.arange(9.0), "step": 5, "cfg": {"lr": 0.1}}
        dckpt.save(sd, path)
        return
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    d = lambda k, p: distribute_tensor(full[k], mesh, [p], src_data_rank=None)  # noqa: E731
    sd = {"model": {"rows": d("rows", Shard(0)), "cols": d("cols", Shard(1)),
                    "odd": d("odd", Shard(0)), "rep": d("rep", Replicate())},
          "plain": torch.arange(9.0), "step": 5, "cfg": {"lr": 0.1}}
    dckpt.save(sd, path)


def test_the_same_values_saved_by_2_and_3_ranks_are_equal(ranks, tmp_path, capsys):
    two, three, one = (str(tmp_path / n) for n in ("two", "three", "one"))
    ranks(2).run(_save, two)
    ranks(3).run(_save, three)
    _save(one)
    with dckpt.open(two) as c2, dckpt.open(three) as c3:  # the layouts do differ
        assert c2.info("model.rows").sharding == "2 chunks along dim 0"
        assert c3.info("model.rows").sharding == "3 chunks along dim 0"
        assert c3.info("model.cols").sharding == "3 chunks along dim 1"
    for slab in (12, 70, 1000, 64 << 20):  # parts of a row, a few rows, whole tensors
        r = dckpt.diff(two, three, slab_bytes=slab)
        assert r.equal, [k for k in r.keys if k.status != "equal"]
        assert len(r.keys) == 7 and all(k.n_diff in (0, None) for k in r.keys)
    assert dckpt.diff(one, three).equal and dckpt.diff(three, one).equal
    assert main(["diff", two, three]) == 0
    assert capsys.readouterr().out.strip().endswith("7 keys: 7 equal (exact): equal")


@pytest.mark.parametrize("other_world", [1, 2])
def test_a_change_reports_exact_numbers_across_world_sizes(ranks, tmp_path, other_world):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    if other_world == 1:
        _save(old)
    else:
        ranks(other_world).run(_save, old)
    ranks(3).run(_save, new, True)
    a, b = _full()["rows"], _full(True)["rows"]
    d = (a.double() - b.double()).abs()
    for slab in (20, 4096):
        r = dckpt.diff(old, new, slab_bytes=slab)
        k = {x.key: x for x in r.keys}
        assert [x.key for x in r.keys if x.status != "equal"] == ["model.rows"]
        rows = k["model.rows"]
        assert (rows.status, rows.n_diff, rows.numel) == ("changed", 2, 30 * 17)
        assert rows.max_abs_diff == float(d.max())
        assert rows.rel_l2 == pytest.approx(float(d.norm() / b.double().norm()), rel=1e-12)
    assert dckpt.diff(old, new, keys="model.rows", atol=float(d.max())).equal
