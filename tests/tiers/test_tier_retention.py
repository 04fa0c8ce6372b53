"""CheckpointManager housekeeping in one process: close() gives the staging buffers back,
and a durable store slower than the saves keeps the fast tier bounded."""
from __future__ import annotations

import gc
import logging
import os
import time
import weakref

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

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
    from dckpt.protocol.async_save import _saver

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


class _SlowMemory(MemoryFileSystem):
    """fsspec's in-memory store, each file opened for writing after a delay: a durable
    store slower than the save interval (a real store, only slower)."""

    protocol = ("slowmem",)
    delay = 0.4

    def _open(self, path, mode="rb", **kw):
        if "w" in mode or "a" in mode:
            time.sleep(self.delay)
        return super()._open(path, mode, **kw)


fsspec.register_implementation("slowmem", _SlowMemory, clobber=True)


def _slow_run(tmp_path, name: str, steps: int, forced: int) -> tuple:
    """``steps`` quick saves (``forced`` with force=True) into a fast tier staged to a
    slow store; returns the most steps the local_root held after a save, the durable
    steps, and the local_root's steps at the end."""
    local = str(tmp_path / name)
    mgr = dckpt.CheckpointManager(f"slowmem://{tmp_path.name}/{name}", every_steps=1,
                                  capture_rng=False, local_root=local, keep_last_local=1,
                                  keep_last=100)
    most = 0
    for s in range(1, steps + 1):
        assert mgr.save(s, _state(s), force=s == forced)
        most = max(most, len([n for n in os.listdir(local) if n.startswith("step-")]))
    mgr.close()
    return most, mgr.steps(), sorted(n for n in os.listdir(local) if n.startswith("step-"))


def test_slow_durable_store_skips_copies_that_cannot_keep_up(tmp_path, caplog):
    """keep_last_local=1 and uploads slower than saves: the fast tier never holds more
    than two steps after a save (the newest, and the one being uploaded), the copies that
    cannot keep up are skipped with a log line naming them, and the newest step (the
    run's final save, forced) ends durable. Before: every queued copy kept its step."""
    with caplog.at_level(logging.INFO, logger="dckpt"):
        most, durable, left = _slow_run(tmp_path, "a", 15, forced=15)
    assert most <= 2, most
    assert durable[-1] == 15 and len(durable) < 15, durable
    for s in set(range(1, 16)) - set(durable):
        assert f"durable copy of step {s} skipped" in caplog.text, (s, caplog.text)
    assert left == ["step-00000015"]
    st = _state(0)
    mgr = dckpt.CheckpointManager(f"slowmem://{tmp_path.name}/a", capture_rng=False)
    assert mgr.restore(st) == 15 and torch.equal(st["w"], _state(15)["w"])


def test_slow_durable_store_never_skips_a_forced_copy(tmp_path):
    """A forced save's durable copy (force=True, request_save, SIGTERM's final save) is
    never skipped: while it waits behind an upload it is kept locally too (one step over
    the bound), then copied; the last step ends durable."""
    most, durable, left = _slow_run(tmp_path, "b", 12, forced=3)
    assert 3 in durable and durable[-1] == 12 and len(durable) < 12, durable
    assert most <= 3, most
    assert left == ["step-00000012"]
