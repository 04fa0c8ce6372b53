"""CheckpointManager across ranks: time decisions agreed, RNG per rank, resharding."""
from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist


def _time_based(root: str) -> list[int]:
    import dckpt

    mgr = dckpt.CheckpointManager(root, every_seconds=0.15, capture_rng=False)
    saved = []
    for step in range(1, 25):
        # Ranks run at different speeds: their clocks would disagree on their own.
        time.sleep(0.02 if dist.get_rank() == 0 else 0.035)
        if mgr.save(step, {"x": torch.full((2,), float(step))}):
            saved.append(step)
    mgr.close()
    assert mgr.steps() == saved
    return saved


def test_time_based_saves_agree_across_ranks(ranks, tmp_path):
    out = ranks(2).run(_time_based, str(tmp_path))
    assert out[0] == out[1] and len(out[0]) >= 2


def _draws() -> tuple:
    import numpy as np

    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _save_rng(root: str) -> tuple:
    import numpy as np

    import dckpt

    r = dist.get_rank()
    random.seed(100 + r), np.random.seed(200 + r), torch.manual_seed(300 + r)
    mgr = dckpt.CheckpointManager(root, every_steps=1)
    mgr.save(1, {"x": torch.zeros(2)})
    return _draws()


def _restore_rng(root: str) -> tuple:
    import dckpt

    random.seed(0)
    torch.manual_seed(0)
    mgr = dckpt.CheckpointManager(root, every_steps=1)
    assert mgr.restore({"x": torch.zeros(2)}) == 1
    return _draws()


def test_rng_per_rank_same_and_other_world_size(ranks, tmp_path):
    root = str(tmp_path)
    want = ranks(2).run(_save_rng, root)
    assert want[0] != want[1]
    assert ranks(2).run(_restore_rng, root) == want  # each rank gets its own back
    got = ranks(3).run(_restore_rng, root)  # grown: documented mapping
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2] not in want, "the new rank gets a stream of its own"
    assert ranks(3).run(_restore_rng, root)[2] == got[2], "deterministic"
