"""CheckpointManager housekeeping in one process: close() gives the staging buffers back."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dckpt


def _state(step: int) -> dict:
    return {"w": torch.full((256, 256), float(step)), "b": torch.arange(64.0) + step,
            "step": step}


def _storages(pool) -> list:
    return [weakref.ref(b.untyped_storage()) for b in pool.buffers.values()]


@pytest.mark.parametrize("tier", [False, True])
def test_close_releases_the_staging_buffers(tmp_path, tier):
    """An async manager (a plain dict: snapshot into host buffers) holds a full host copy
    of the state between saves; after close() it holds none, and the buffers' memory is
    freed (before: the pool kept them as long as the process lived)."""
    from dckpt.engine.async_save import _saver

    kw = dict(local_root=str(tmp_path / "shm")) if tier else {}
    mgr = dckpt.CheckpointManager(str(tmp_path / "ckpt"), every_steps=1, async_save=True,
                                  capture_rng=False, **kw)
    for s in (1, 2):
        assert mgr.save(s, _state(s))
    pool = mgr.tier.pool if tier else _saver(None).pool
    assert pool.nbytes >= 256 * 256 * 4  # a whole copy, while the manager lives
    alive = _storages(pool)
    mgr.close()
    gc.collect()
    assert pool.nbytes == 0 and pool.buffers == {} and pool._wrapped == {}
    assert all(ref() is None for ref in alive), "a staging buffer is still referenced"
    st = _state(0)  # what was saved is still there
    assert dckpt.CheckpointManager(str(tmp_path / "ckpt"), capture_rng=False, **kw).restore(st) == 2
    assert torch.equal(st["w"], _state(2)["w"])
