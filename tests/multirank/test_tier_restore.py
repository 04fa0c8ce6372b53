"""Restore with a fast tier across ranks (issue 25, 1.3 and 1.4): after a rewind every
rank restores the live timeline's newest step, from its own node when every rank holds
it, from the durable tier when one node lost its fast tier; a fast-tier step saved for
another root is never restored."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist


def _state(step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + step
    return {"x": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((8,), float(step)), "step": step}


def _manager(base: str, root: str = "durable", **kw):
    import dckpt

    kw.setdefault("capture_rng", False)
    return dckpt.CheckpointManager(os.path.join(base, root), every_steps=10,
                                   local_root=os.path.join(base, f"node{dist.get_rank()}"), **kw)


def _rewind(base: str) -> tuple:
    mgr = _manager(base, durable_every_steps=50)
    for s in range(10, 101, 10):
        assert mgr.save(s, _state(s))
    mgr.close()
    before = mgr.steps()
    mgr = _manager(base, durable_every_steps=50)
    assert mgr.restore(_state(-1), step=50) == 50
    for s in range(60, 91, 10):
        assert mgr.save(s, _state(s))
    mgr.close()
    return before, mgr.steps(), mgr.steps(tier="local")


def _restore(base: str, root: str = "durable", wipe: bool = False) -> tuple:
    if wipe and dist.get_rank() == 1:  # a lost node: its fast tier is empty
        shutil.rmtree(os.path.join(base, "node1"))
    dist.barrier()
    mgr = _manager(base, root)
    st = _state(-1)
    step = mgr.restore(st)
    ok = step is not None and torch.equal(st["x"].to_local(), _state(step)["x"].to_local())
    mgr.close()
    return step, mgr.restored_from, st["step"], ok


def test_rewind_restores_the_live_timeline_on_every_rank(ranks, tmp_path):
    base = str(tmp_path)
    assert ranks(2).run(_rewind, base) == [([50, 100], [50], [90])] * 2
    assert ranks(2).run(_restore, base) == [(90, "local", 90, True)] * 2
    assert ranks(2).run(_restore, base, "durable", True) == [(50, "durable", 50, True)] * 2


def _save_one(base: str, root: str, step: int) -> None:
    mgr = _manager(base, root)
    assert mgr.save(step, _state(step), force=True)
    mgr.close()


def test_another_roots_fast_tier_step_is_not_restored(ranks, tmp_path):
    base = str(tmp_path)
    ranks(2).run(_save_one, base, "runA", 5)
    assert ranks(2).run(_restore, base, "runB") == [(None, None, -1, False)] * 2
    assert ranks(2).run(_restore, base, "runA") == [(5, "local", 5, True)] * 2
