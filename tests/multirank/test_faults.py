"""A failure on any rank, at any phase of a save or load, raises the same error on every
rank, commits nothing, and leaves an existing checkpoint intact."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness import RankFailed


def _state(gen: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4) + 1000 * gen
    return {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
            "b": torch.full((8,), float(gen)), "gen": gen}


def _listing(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _save_expect_error(path: str, gen: int, overwrite: bool, error: str, words: list[str]):
    import dckpt

    try:
        dckpt.save(_state(gen), path, overwrite=overwrite)
    except dckpt.CheckpointError as e:
        assert type(e).__name__ == error, (type(e).__name__, str(e))
        for w in words:
            assert w in str(e), (w, str(e))
        dist.barrier()
        return _listing(path), str(e)
    raise AssertionError("save did not fail")


def _load_gen(path: str) -> int:
    import dckpt

    t = _state(-1)
    t["w"] = t["w"] * 0
    dckpt.load(t, path)
    gen = t["gen"]
    assert torch.equal(t["b"], torch.full((8,), float(gen)))
    assert torch.equal(t["w"].full_tensor(), torch.arange(64.0).reshape(16, 4) + 1000 * gen)
    return gen


def _save(path: str, gen: int, overwrite: bool = False):
    import dckpt

    return dckpt.save(_state(gen), path, overwrite=overwrite)


POINTS = [("plan", 1), ("write", 1), ("write", 0), ("vote", 0), ("commit", 0)]


@pytest.mark.parametrize("point, rank", POINTS)
def test_fault_on_fresh_path(ranks, tmp_path, point, rank):
    pool = ranks(2)
    path = str(tmp_path / "c")
    out = pool.run(_save_expect_error, path, 1, False, "RankFailure",
                   [f"failed on rank {rank}:", f"injected fault at {point}"],
                   env={"DCKPT_FAULT": f"{point}:{rank}:raise"})
    listings = [listing for listing, _ in out]
    assert len({msg for _, msg in out}) == 1, "every rank raises the same error"
    assert "manifest.json" not in listings[0]
    assert not [f for f in listings[0] if f.endswith(".safetensors")], listings[0]
    with pytest.raises(RankFailed, match="NotCommittedError"):
        pool.run(_load_gen, path)
    pool.run(_save, path, 2)  # the path is usable afterwards
    assert pool.run(_load_gen, path) == [2, 2]


@pytest.mark.parametrize("point, rank", POINTS)
def test_fault_during_overwrite_keeps_old_checkpoint(ranks, tmp_path, point, rank):
    pool = ranks(2)
    path = str(tmp_path / "c")
    pool.run(_save, path, 1)
    before = _listing(path)
    out = pool.run(_save_expect_error, path, 2, True, "RankFailure",
                   [f"failed on rank {rank}:"], env={"DCKPT_FAULT": f"{point}:{rank}:raise"})
    assert len({msg for _, msg in out}) == 1, "every rank raises the same error"
    assert _listing(path) == before, "the old checkpoint's files are untouched"
    assert pool.run(_load_gen, path) == [1, 1]
    pool.run(_save, path, 3, True)
    assert pool.run(_load_gen, path) == [3, 3]
    assert len([f for f in _listing(path) if f.endswith(".safetensors")]) == 2


def test_existing_checkpoint_refused_on_every_rank(ranks, tmp_path):
    pool = ranks(2)
    path = str(tmp_path / "c")
    pool.run(_save, path, 1)
    pool.run(_save_expect_error, path, 2, False, "AlreadyExistsError", ["overwrite=True"])
    assert pool.run(_load_gen, path) == [1, 1]


def _mismatch_shapes(path: str):
    import dckpt

    n = 4 + dist.get_rank()
    try:
        dckpt.save({"x": torch.zeros(n)}, path)
    except dckpt.StateMismatchError as e:
        assert "'x'" in str(e) and "rank 0" in str(e) and "rank 1" in str(e), str(e)
        return _listing(path)
    raise AssertionError("no error")


def test_ranks_disagree_on_shape(ranks, tmp_path):
    assert ranks(2).run(_mismatch_shapes, str(tmp_path / "m")) == [[], []]


def _bad_leaf_on_one_rank(path: str):
    import dckpt

    sd = {"x": torch.zeros(3), "cfg": {"fn": print} if dist.get_rank() == 1 else {"fn": "print"}}
    try:
        dckpt.save(sd, path)
    except dckpt.UnsupportedValueError as e:
        assert "rank 1" in str(e) and "cfg.fn" in str(e), str(e)
        return _listing(path)
    raise AssertionError("no error")


def test_refused_leaf_on_one_rank_refused_everywhere(ranks, tmp_path):
    assert ranks(2).run(_bad_leaf_on_one_rank, str(tmp_path / "u")) == [[], []]


def _corrupt_rank1_file(path: str):
    if dist.get_rank() == 0:
        name = sorted(f for f in os.listdir(path) if f.endswith("-00001.safetensors"))[0]
        p = os.path.join(path, name)
        b = bytearray(open(p, "rb").read())
        b[-1] ^= 0xFF
        open(p, "wb").write(b)
    dist.barrier()


def _load_expect(path: str, error: str, words: list[str]):
    import dckpt

    try:
        _load_gen(path)
    except dckpt.CheckpointError as e:
        assert type(e).__name__ == error, (type(e).__name__, str(e))
        for w in words:
            assert w in str(e), (w, str(e))
        return str(e)
    raise AssertionError("load did not fail")


def test_corruption_seen_by_one_rank_fails_every_rank(ranks, tmp_path):
    pool = ranks(2)
    path = str(tmp_path / "c")
    pool.run(_save, path, 1)
    pool.run(_corrupt_rank1_file, path)
    # Only rank 1 reads the damaged chunk; both ranks raise, naming rank 1 and the file.
    msgs = pool.run(_load_expect, path, "IntegrityError",
                    ["failed on rank 1:", "-00001.safetensors"])
    assert len(set(msgs)) == 1, msgs


def _missing_key_on_rank1(path: str):
    import dckpt

    t = _state(0)
    if dist.get_rank() == 1:
        t["extra"] = torch.zeros(1)
    try:
        dckpt.load(t, path)
    except dckpt.StateMismatchError as e:
        assert "rank 1" in str(e) and "'extra'" in str(e)
        return t["gen"]
    raise AssertionError("no error")


def test_load_mismatch_on_one_rank(ranks, tmp_path):
    pool = ranks(2)
    path = str(tmp_path / "c")
    pool.run(_save, path, 5)
    assert pool.run(_missing_key_on_rank1, path) == [0, 0], "nothing filled on any rank"


def test_injected_load_fault(ranks, tmp_path):
    pool = ranks(2)
    path = str(tmp_path / "c")
    pool.run(_save, path, 1)
    msgs = pool.run(_load_expect, path, "RankFailure",
                    ["failed on rank 0:", "injected fault at load"],
                    env={"DCKPT_FAULT": "load:0:raise"})
    assert len(set(msgs)) == 1, msgs
