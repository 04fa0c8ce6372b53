"""Issue 36: a dataloader's per-rank state as native dckpt bytes values, at 2 real gloo
ranks. Shaped like torchtitan's ParallelAwareDataloader: ``{"dp_rank_<r>": bytes,
"world_size": N}``, each rank a key no other rank has with an opaque (pickled) bytes
value. Saved with dckpt.save and with dckpt.CheckpointManager, loaded back at 2 ranks
(each rank gets its own bytes) and at 1 rank (rank 0 gets dp_rank_0's). Values of
megabytes (a long document's token buffer) live in each rank's own data file: loaded
back at 2, 1 and 3 ranks, each rank reading only the keys it asks for."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

DEADLINE = 120


class Loader:
    """A Stateful shaped like torchtitan's ParallelAwareDataloader: its state is one
    pickled blob under a key of its own rank, and the world size."""

    def __init__(self, pos: int, rank: int | None = None, world: int | None = None,
                 pad: int = 1000) -> None:
        self.pos, self.pad = pos, pad
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world

    def state_dict(self) -> dict:
        pad = bytes([self.rank]) * self.pad
        blob = pickle.dumps({"pos": self.pos, "rank": self.rank, "pad": pad})
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


BIG = 1_600_000  # a pickled token buffer's size: over 1 MiB, the old manifest bound


def _save_big(path: str) -> tuple[int, int]:
    """Each rank saves its own 1.6 MB dataloader blob, then loads it back (2 ranks)."""
    import dckpt

    r = dist.get_rank()
    dckpt.save({"dataloader": Loader(100 + r, pad=BIG), "step": 7, "w": torch.ones(4)}, path)
    back = Loader(-1)
    state = {"dataloader": back, "step": 0, "w": torch.zeros(4)}
    dckpt.load(state, path)
    assert state["step"] == 7 and torch.equal(state["w"], torch.ones(4))
    return back.pos, back.world


def _load_as(path: str, src: int) -> int:
    """A load at another world size: this rank asks for the key of saved rank ``src``."""
    import dckpt

    back = Loader(-1, rank=src, world=0)  # world: set from the checkpoint
    dckpt.load({"dataloader": back}, path, strict=False)
    assert back.world == 2  # the saved world size, a plain value
    return back.pos


def test_megabyte_bytes_values_per_rank_reload_at_2_1_and_3_ranks(ranks, tmp_path):
    import shutil

    import dckpt
    from dckpt.format import manifest as mf

    path = str(tmp_path / "ck")
    assert ranks(2).run(_save_big, path, timeout=DEADLINE) == [(100, 2), (101, 2)]
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    assert len(raw) < 8192  # neither blob is in the manifest every rank reads
    m = mf.parse(raw)
    for r in range(2):  # each in the data file of the rank that saved it
        e = m.tensors[f"dataloader.dp_rank_{r}"]
        assert e.bytes_value and e.shape[0] > BIG and m.files[int(e.chunks.file[0])].rank == r
    # 1 rank, in this process: rank 0 asks for either rank's key, the other is not read
    for src in (0, 1):
        assert _load_as(path, src) == 100 + src
    damaged = str(tmp_path / "damaged")
    shutil.copytree(path, damaged)
    name = m.files[int(m.tensors["dataloader.dp_rank_1"].chunks.file[0])].name
    with open(os.path.join(damaged, name), "r+b") as f:  # a flipped bit in rank 1's blob
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    assert _load_as(damaged, 0) == 100  # dp_rank_1 is never read
    with pytest.raises(dckpt.IntegrityError, match="dp_rank_1"):
        _load_as(damaged, 1)
    # 3 ranks: rank 2 asks for rank 0's key (ranks mod the saved world size)
    assert ranks(3).run(_load_as_mod, path, timeout=DEADLINE) == [100, 101, 100]


def _load_as_mod(path: str) -> int:
    return _load_as(path, dist.get_rank() % 2)


def _shared_key_saves(base: str) -> tuple[list[str], list[bool]]:
    """Saves of one key every rank holds with its own bytes (a rank-local blob under a
    shared key), in one process group so later saves may reuse the plan: (rank 0's
    coordinator warnings, whether each save reused the plan)."""
    import logging

    import dckpt

    r = dist.get_rank()
    got: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: got.append(rec.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("dckpt.protocol.coordinator")
    log.addHandler(handler)
    big, w = 70 << 10, torch.ones(2)
    try:
        cached = [
            # equal sizes, different contents; then the same structure with new contents
            dckpt.save({"s": bytes([r + 1]) * big, "w": w}, f"{base}/equal").plan_cached,
            dckpt.save({"s": bytes([r + 5]) * big, "w": w}, f"{base}/again").plan_cached,
            # rank 0 inline, rank 1 in its data file; then rank 0 drops the key
            dckpt.save({"s": b"\x01" * (60 << 10) if r == 0 else b"\x02" * big, "w": w},
                       f"{base}/inline").plan_cached,
            dckpt.save({"s": b"\x02" * big, "w": w} if r else {"w": w},
                       f"{base}/gone").plan_cached,
        ]
    finally:
        log.removeHandler(handler)
    return got, cached


def test_a_shared_bytes_key_keeps_rank_0s_bytes_and_warns_whatever_the_sizes(ranks, tmp_path):
    """The values rule for bytes over 64 KiB: the lowest rank's copy is saved and a
    differing one warns, equal sizes included (they were a silent "replicated tensor"
    whose writer was whichever rank the round robin picked); a later save that reuses
    the plan keeps to the rule, and replans when the inline value that took the key is
    gone (rank 1's data-file copy is then saved, not lost)."""
    import dckpt

    base = str(tmp_path)
    out = ranks(2).run(_shared_key_saves, base, timeout=DEADLINE)
    warned, cached = out[0]
    assert cached == [False, True, False, False], cached
    assert len(warned) == 2 and all("'s' on rank 1" in m for m in warned), warned
    big = 70 << 10
    want = {"equal": b"\x01" * big, "again": b"\x05" * big, "inline": b"\x01" * (60 << 10),
            "gone": b"\x02" * big}
    for name, value in want.items():
        with dckpt.open(os.path.join(base, name)) as ck:
            assert ck["s"] == value, name
