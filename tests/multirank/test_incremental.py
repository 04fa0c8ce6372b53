"""Incremental and compressed checkpoints across ranks: saved by 2, loaded by 3 and 1."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _full(step: int) -> dict:
    g = torch.Generator().manual_seed(7)
    emb = torch.randn(4096, 64, generator=g)  # 1 MiB: rows cut across ranks
    frozen = torch.randn(1024, 512, generator=g)  # 2 MiB
    if step:
        emb[::37] += step  # a few rows touched per step
    return {"emb": emb, "frozen": frozen, "head": torch.full((300,), float(step))}


def _dstate(step: int, zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for k, v in _full(step).items():
        place = [Replicate()] if k == "head" else [Shard(0)]
        out[k] = distribute_tensor(torch.zeros_like(v) if zero else v, mesh, place,
                                   src_data_rank=None)
    return out


def _save_chain(root: str) -> list[int]:
    import dckpt

    written = []
    base = None
    for step in range(3):
        path = os.path.join(root, f"step-{step}")
        info = dckpt.save(_dstate(step, False), path, base=base,
                          compression="zstd" if step == 2 else None)
        written.append(info.bytes_written)
        base = path
    return written


def _load(root: str, step: int) -> bool:
    import dckpt

    st = _dstate(step, True)
    dckpt.load(st, os.path.join(root, f"step-{step}"))
    want = _dstate(step, False)
    return all(torch.equal(st[k].full_tensor(), want[k].full_tensor()) for k in st)


def test_incremental_saved_by_2_loads_into_3_and_1(ranks, tmp_path):
    root = str(tmp_path)
    written = ranks(2).run(_save_chain, root)[0]
    assert written[1] <= 0.15 * written[0] and written[2] <= 0.15 * written[0], written
    for step in range(3):
        assert all(ranks(3).run(_load, root, step)), step
        assert all(ranks(1).run(_load, root, step)), step
    from dckpt.catalog.verify import verify_checkpoint

    assert verify_checkpoint(os.path.join(root, "step-2")).ok
