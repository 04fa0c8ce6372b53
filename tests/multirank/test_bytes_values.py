"""Issue 36: a dataloader's per-rank state as native dckpt bytes values, at 2 real gloo
ranks. Shaped like torchtitan's ParallelAwareDataloader: ``{"dp_rank_<r>": bytes,
"world_size": N}``, each rank a key no other rank has with an opaque (pickled) bytes
value. Saved with dckpt.save and with dckpt.CheckpointManager, loaded back at 2 ranks
(each rank gets its own bytes) and at 1 rank (rank 0 gets dp_rank_0's)."""
from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist

DEADLINE = 120


class Loader:
    """A Stateful shaped like torchtitan's ParallelAwareDataloader: its state is one
    pickled blob under a key of its own rank, and the world size."""

    def __init__(self, pos: int, rank: int | None = None, world: int | None = None) -> None:
        self.pos = pos
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world

    def state_dict(self) -> dict:
        blob = pickle.dumps({"pos": self.pos, "rank": self.rank, "pad": b"\x00" * 1000})
        return {f"dp_rank_{self.rank}": blob, "world_size": self.world}

    def load_state_dict(self, sd: dict) -> None:
        blob = sd[f"dp_rank_{self.rank}"]
        assert isinstance(blob, bytes), type(blob)
        state = pickle.loads(blob)  # the framework unpickles its own bytes; dckpt never does
        assert state["rank"] == self.rank, state
        self.pos = state["pos"]
        self.world = sd["world_size"]


def _save_load(path: str) -> tuple[int, int]:
    import dckpt

    r = dist.get_rank()
    w = torch.full((4,), float(r))
    dckpt.save({"dataloader": Loader(100 + r), "step": 7, "w": w}, path)
    back = Loader(-1)
    state = {"dataloader": back, "step": 0, "w": torch.zeros(4)}
    dckpt.load(state, path)  # strict: every saved key is some rank's
    assert state["step"] == 7
    return back.pos, back.world


def _manager(root: str) -> tuple[int, int, int]:
    import dckpt

    r = dist.get_rank()
    mgr = dckpt.CheckpointManager(root, every_steps=1)
    for step in (1, 2):
        mgr.save(step, {"dataloader": Loader(10 * step + r), "x": torch.ones(2)})
    mgr.close()
    back = Loader(-1)
    mgr = dckpt.CheckpointManager(root, every_steps=1)
    step = mgr.restore({"dataloader": back, "x": torch.zeros(2)})
    mgr.close()
    return step, back.pos, back.world


def _values_on_disk(path: str) -> dict:
    import json

    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read())["values"]


def _load_at_one_rank(path: str) -> Loader:
    """A 1-rank load, in this process (no process group), of the 2-rank checkpoint:
    rank 0 reads dp_rank_0's bytes; dp_rank_1 is a key it does not ask for."""
    import dckpt

    back = Loader(-1, rank=0, world=1)
    dckpt.load({"dataloader": back}, path, strict=False)
    return back


def test_dckpt_save_and_load_give_each_rank_its_own_bytes(ranks, tmp_path):
    path = str(tmp_path / "ck")
    assert ranks(2).run(_save_load, path, timeout=DEADLINE) == [(100, 2), (101, 2)]
    values = _values_on_disk(path)
    assert set(values["dataloader.dp_rank_0"]) == {"$bytes"}  # the tag, not pickle
    assert set(values["dataloader.dp_rank_1"]) == {"$bytes"}
    back = _load_at_one_rank(path)
    assert back.pos == 100 and back.world == 2


def test_checkpoint_manager_gives_each_rank_its_own_bytes(ranks, tmp_path):
    root = str(tmp_path / "run")
    assert ranks(2).run(_manager, root, timeout=DEADLINE) == [(2, 20, 2), (2, 21, 2)]
    import dckpt
    from dckpt.tiers.localnames import step_name

    with dckpt.open(os.path.join(root, step_name(2))) as ck:  # the manager's "state." prefix
        assert pickle.loads(ck["state.dataloader.dp_rank_1"])["pos"] == 21
    back = Loader(-1, rank=0, world=1)  # a restart on 1 rank, in this process
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False)
    assert mgr.restore({"dataloader": back, "x": torch.zeros(2)}, strict=False) == 2
    mgr.close()
    assert back.pos == 20 and back.world == 2
