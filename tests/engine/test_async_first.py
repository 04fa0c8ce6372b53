"""The first async_save blocks about as long as later ones once prepared (issue 34,
section 3). The first call's extra time was the first touch of its fresh staging
buffers (a page fault per 4 KiB: 5-12x a later call's copy on a 2-core VM);
dckpt.protocol.async_save.prepare_async_save takes those faults (and the saver's set-up)
before the first call. Counted, not timed: the process's minor page faults during the
call (RUSAGE_SELF: torch's copy faults from its intra-op threads too), so the test
holds on a loaded machine."""
from __future__ import annotations

import resource

import torch

import dckpt
from dckpt.protocol.async_save import _saver, async_save, prepare_async_save, release_buffers

PAGES = (64 << 20) // 4096  # a 64 MiB state


def _state() -> dict:
    return {"w": torch.rand(16, 1 << 20), "step": 3}  # one 64 MiB tensor: always mmap'd


def _faults(fn):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = fn()
    return out, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_the_first_call_touches_fresh_buffers_unless_prepared(tmp_path):
    sd = _state()
    release_buffers()  # this process's saver may hold buffers from other tests
    h, faults = _faults(lambda: async_save(sd, str(tmp_path / "cold")))
    h.result(timeout=60)
    assert faults > 0.8 * PAGES  # the cause: every page of the buffers faults in the call

    release_buffers()
    nbytes, prep_faults = _faults(lambda: prepare_async_save(sd))
    assert nbytes == 64 << 20 and prep_faults > 0.8 * PAGES  # ... now, in prepare
    buffers = dict(_saver(None).pool.buffers)
    want = sd["w"].clone()
    h, faults = _faults(lambda: async_save(sd, str(tmp_path / "warm")))
    sd["w"].zero_()  # after the call: not in the checkpoint
    h.result(timeout=60)
    assert faults < 0.1 * PAGES, faults
    assert all(_saver(None).pool.buffers[k] is b for k, b in buffers.items())  # reused
    back = dckpt.load({"w": torch.empty(16, 1 << 20), "step": 0}, str(tmp_path / "warm"))
    assert torch.equal(back["w"], want) and back["step"] == 3
    release_buffers()


def test_prepare_respects_the_staging_budget(tmp_path):
    import pytest

    from dckpt.errors import CheckpointError

    release_buffers()
    with pytest.raises(CheckpointError, match="budget"):
        prepare_async_save(_state(), staging_budget=1 << 20)
    assert _saver(None).pool.nbytes == 0  # nothing allocated past the budget
