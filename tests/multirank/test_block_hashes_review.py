"""Review of issue 38 (block hashes only when asked for) at 4 gloo ranks: ranks that
disagree on ``base`` must fail the save on every rank with the same CheckpointError,
naming the disagreement, and keep the old checkpoint, as ranks that disagree on
``compression`` or ``block_hashes`` do. Before the fix a base passed on some ranks but
not on rank 0 (or a different base than rank 0's) was silently ignored and the save
committed, and a base passed on rank 0 only failed the others with a raw TypeError."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .test_block_hashes import _same, _zeros


def _state(seed: int = 0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {f"w{i}": distribute_tensor(torch.randn(64, 256, generator=g), mesh, [Shard(0)],
                                     src_data_rank=None) for i in range(2)}
    sd["step"] = seed
    return sd


def _bases_differ(root: str, what: str, use_async: bool) -> tuple:
    import dckpt

    old = _state()
    dckpt.save(old, f"{root}/x")
    dckpt.save(old, f"{root}/y", block_hashes=True)
    dckpt.save(old, f"{root}/ck")  # the checkpoint that must survive
    rank = dist.get_rank()
    base = {"not_on_rank0": f"{root}/x" if rank == 2 else None,
            "only_on_rank0": f"{root}/x" if rank == 0 else None,
            "another_base": f"{root}/y" if rank == 2 else f"{root}/x"}[what]
    new = _state(seed=1)
    try:
        if use_async:
            dckpt.async_save(new, f"{root}/ck", overwrite=True, base=base).result()
        else:
            dckpt.save(new, f"{root}/ck", overwrite=True, base=base)
        got = None
    except dckpt.CheckpointError as e:
        got = str(e)
    except Exception as e:  # noqa: BLE001 - a raw exception is a finding too
        got = f"RAW {type(e).__name__}: {e}"
    dist.barrier()
    return got, _same(old, dckpt.load(_zeros(old), f"{root}/ck"))


@pytest.mark.parametrize("what", ["not_on_rank0", "only_on_rank0", "another_base"])
@pytest.mark.parametrize("use_async", [False, True])
def test_ranks_that_disagree_on_the_base_fail_alike_and_keep_the_old(ranks, tmp_path, what,
                                                                     use_async):
    out = ranks(4).run(_bases_differ, str(tmp_path), what, use_async, timeout=120)
    assert all(o == out[0] for o in out), out
    got, kept = out[0]
    assert got is not None, f"a save whose ranks disagree on base ({what}) was committed"
    assert not got.startswith("RAW") and "TypeError" not in got, got
    assert "base" in got, got
    assert kept
