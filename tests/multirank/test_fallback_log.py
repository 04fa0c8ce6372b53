"""The manager's fallback warnings (issue 27, 5): a fast-tier step that fails on one rank,
or a durable step that fails its checks, is reported once, by rank 0, naming every
failing rank and its cause; the other ranks log it at debug level only."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from .test_tiers import _data_files, _flip, _manager, _same, _save_steps, _state


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.got: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.got.append((record.levelname, record.getMessage()))


def _restore_logged(base: str, corrupt: dict[str, list[int]]) -> tuple:
    """Corrupt step 3 on the given tiers ("local": those ranks' fast-tier files;
    "durable": its durable files, by rank 0), restore, and return what this rank's
    ``dckpt`` loggers recorded at debug level and above."""
    r = dist.get_rank()
    if r in corrupt.get("local", []):
        for f in _data_files(os.path.join(base, f"node{r}", "step-00000003")):
            _flip(f)
    if corrupt.get("durable") and r == 0:
        for f in _data_files(os.path.join(base, "durable", "step-00000003")):
            _flip(f)
    dist.barrier()
    logger = logging.getLogger("dckpt")
    handler, old = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        mgr = _manager(base)
        st = _state(0)
        step = mgr.restore(st)
        ok = step is not None and _same(st, _state(step))
        mgr.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return step, mgr.restored_from, ok, handler.got


def _warnings(got: list, about: str) -> list[str]:
    return [m for lvl, m in got if lvl == "WARNING" and about in m]


def test_fast_tier_fallback_is_warned_once_by_rank0_naming_every_failing_rank(ranks, tmp_path):
    base = str(tmp_path)
    ranks(3).run(_save_steps, base, [1, 2, 3])
    out = ranks(3).run(_restore_logged, base, {"local": [1, 2]})
    assert [o[:3] for o in out] == [(3, "durable", True)] * 3  # the durable copy is good
    w0 = _warnings(out[0][3], "fast tier")
    assert len(w0) == 1, out[0][3]
    # Both failing ranks are named, each with its cause (the file that fails).
    assert "ranks 1, 2" in w0[0] and "rank 1: IntegrityError" in w0[0], w0[0]
    assert "rank 2: IntegrityError" in w0[0] and "data-" in w0[0], w0[0]
    assert "node0" not in w0[0], w0[0]  # not rank 0's directory: each rank reads its own
    for r in (1, 2):
        got = out[r][3]
        assert not _warnings(got, "fast tier"), got
        assert any(lvl == "DEBUG" and "fast tier" in m for lvl, m in got), got


def _save_each_durable(base: str, steps: list[int]) -> None:
    mgr = _manager(base)
    for s in steps:
        assert mgr.save(s, _state(s))
        mgr.wait()  # each durable copy done: a copy not begun when the next step is
        # queued is skipped for it (StageQueue), and this test needs step 2's
    mgr.close()


def test_durable_skip_is_warned_once_by_rank0(ranks, tmp_path):
    base = str(tmp_path)
    ranks(3).run(_save_each_durable, base, [1, 2, 3])
    out = ranks(3).run(_restore_logged, base, {"local": [0], "durable": [3]})
    assert [o[:3] for o in out] == [(2, "durable", True)] * 3  # the fast tier keeps step 3 only
    w0 = [m for lvl, m in out[0][3] if lvl == "WARNING"]
    # Step 3 twice (fast tier on rank 0, then its durable copy), once each.
    assert len(_warnings(out[0][3], "fast tier")) == 1, w0
    durable = _warnings(out[0][3], "unusable")
    assert len(durable) == 1 and "step 3" in durable[0] and "rank" in durable[0], w0
    for r in (1, 2):
        assert not [m for lvl, m in out[r][3] if lvl == "WARNING"], out[r][3]
