"""dckpt.open on checkpoints saved by 1, 2 and 3 gloo ranks (DTensor Shard(0) and
Shard(1), replicated, plain tensors and JSON values), then read in the test's own process
with no process group: whole tensors, slices across chunk boundaries, to_state_dict,
bytes read counted through the storage, a damaged chunk, compressed and incremental
saves."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

import dckpt
from dckpt import IntegrityError
from dckpt.engine.reader import ChunkReader, find_stored
from dckpt.storage.fsspec_storage import make_storage
from statekit import flip_byte, rand
from tests.view.test_open import _counting, _file_bytes, _same

SHARD0 = ("s0", "big")
SHARD1 = ("s1", "s1_3d")


def _full(bump: float = 0.0) -> dict[str, torch.Tensor]:
    """The global tensors, the same in every process (the ranks and the test)."""
    g = torch.Generator().manual_seed(0)
    out = {"s0": rand((10, 6), torch.float32, g), "s1": rand((5, 9), torch.bfloat16, g),
           "s1_3d": rand((3, 8, 2), torch.float64, g), "rep": rand((4, 4), torch.int64, g),
           "big": torch.randn(192, 4096, generator=g),  # 3 MiB: 1 MiB a chunk at 3 ranks
           "plain": rand((7,), torch.float16, g)}
    out["s0"] = out["s0"] + bump
    return out


def _save(path: str, compression: str | None = None, base: str | None = None,
          bump: float = 0.0) -> None:
    """Runs on every rank: the tensors as DTensors over all ranks, plus a plain tensor
    and JSON values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = _full(bump)

    def d(k, p):
        return distribute_tensor(full[k], mesh, [p], src_data_rank=None)

    sd = {"model": {**{k: d(k, Shard(0)) for k in SHARD0}, **{k: d(k, Shard(1)) for k in SHARD1},
                    "rep": d("rep", Replicate())},
          "plain": full["plain"], "step": 7, "cfg": {"name": "run", "lr": 0.5, "ids": [1, 2]}}
    dckpt.save(sd, path, compression=compression, base=base)


def _check_all(ck, full: dict) -> None:
    """Every key, whole and sliced across chunk boundaries, against the full tensors."""
    for k, t in full.items():
        key = k if k == "plain" else f"model.{k}"
        assert _same(ck[key], t), key
    s0, s1, s3 = (ck.get_slice(f"model.{k}") for k in ("s0", "s1", "s1_3d"))
    for idx in [(slice(3, 7), slice(2, None)), 9, (slice(-4, None), -1), (..., 0)]:
        assert _same(s0[idx], full["s0"][idx].contiguous()), idx
    for idx in [(slice(None), slice(2, 7)), (-1, slice(1, 8)), (..., 4), (2, 8)]:
        assert _same(s1[idx], full["s1"][idx].contiguous()), idx
    for idx in [(1, slice(2, 6)), (..., slice(3, 5), 1), (slice(0, 2), slice(0, 8), 0)]:
        assert _same(s3[idx], full["s1_3d"][idx].contiguous()), idx
    g = torch.Generator().manual_seed(9)
    big = ck.get_slice("model.big")
    for _ in range(10):  # random boxes: rows over chunk boundaries, any columns
        r0 = int(torch.randint(0, 191, (1,), generator=g))
        r1 = int(torch.randint(r0 + 1, 193, (1,), generator=g))
        c0 = int(torch.randint(0, 4000, (1,), generator=g))
        assert _same(big[r0:r1, c0:c0 + 77], full["big"][r0:r1, c0:c0 + 77]), (r0, r1, c0)
    assert ck["step"] == 7 and ck["cfg.name"] == "run" and ck["cfg.ids.1"] == 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_open_reads_what_n_ranks_saved(ranks, tmp_path, world):
    path = str(tmp_path / "c")
    ranks(world).run(_save, path)
    full = _full()
    with dckpt.open(path) as ck:
        assert ck.world_size == world
        assert set(ck.keys()) == {*(f"model.{k}" for k in (*SHARD0, *SHARD1, "rep")), "plain",
                                  "step", "cfg.name", "cfg.lr", "cfg.ids.0", "cfg.ids.1"}
        for k in (*SHARD0, *SHARD1):
            info = ck.info(f"model.{k}")
            assert info.shape == tuple(full[k].shape) and info.dtype == full[k].dtype
            assert info.nbytes == full[k].numel() * full[k].element_size()
            dim = 0 if k in SHARD0 else 1
            assert info.chunks == world
            assert info.sharding == (f"{world} chunks along dim {dim}" if world > 1
                                     else "whole (1 chunk)"), info
        for k in ("model.rep", "plain"):  # stored once, whatever the world size
            assert (ck.info(k).chunks, ck.info(k).sharding) == (1, "whole (1 chunk)")
        assert ck.info("cfg.lr").value == 0.5
        _check_all(ck, full)
        sd = ck.to_state_dict()
        assert set(sd) == {"model", "plain", "step", "cfg"}
        assert all(_same(sd["model"][k], full[k]) for k in sd["model"])
        assert sd["cfg"] == {"name": "run", "lr": 0.5, "ids": {"0": 1, "1": 2}}
        assert set(ck.to_state_dict("model")) == {*SHARD0, *SHARD1, "rep"}


def test_a_one_row_slice_of_a_three_chunk_tensor_reads_one_block(ranks, tmp_path):
    path = str(tmp_path / "c")
    ranks(3).run(_save, path)
    full = _full()
    total = _file_bytes(path)
    ck, c = _counting(path)
    with ck:
        assert ck.info("model.big").chunks == 3
        assert _same(ck.get_slice("model.big")[100], full["big"][100])  # rank 1's chunk
        head = max(8 + f.header_len for f in ck.manifest.files)
        assert c.bytes <= (256 << 10) + head, (c.bytes, total)  # one block + one header
        assert c.bytes < total / 2
        c.bytes = 0
        rows = ck.get_slice("model.big")[60:70]  # rows 60-63 in rank 0's, 64-69 in rank 1's
        assert _same(rows, full["big"][60:70])
        assert c.bytes <= 2 * (256 << 10) + head, c.bytes  # a block of each (one header new)
        c.bytes = 0
        assert _same(ck["model.big"], full["big"])  # the whole tensor: its bytes once
        assert 3 << 20 <= c.bytes <= (3 << 20) + 3 * head, c.bytes


def test_a_damaged_chunk_fails_only_the_keys_that_touch_it(ranks, tmp_path):
    path = str(tmp_path / "c")
    ranks(3).run(_save, path)
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    full = _full()
    with dckpt.open(bad) as ck:
        e, m = ck.manifest.tensors["model.s0"], ck.manifest
        ci = next(i for i, f in enumerate(e.chunks.file.tolist()) if m.files[f].rank == 1)
        fi = int(e.chunks.file[ci])
        storage, root = make_storage(bad)
        tensors, _ = ChunkReader(storage, root, m).header(fi)
        st = find_stored(tensors, "model.s0", e.chunks.offsets[ci])
        flip_byte(f"{bad}/{m.files[fi].name}", st.start + 8)  # rows 4..7 of s0
        with pytest.raises(IntegrityError, match=rf"key 'model.s0'.*{m.files[fi].name}"):
            ck["model.s0"]
        with pytest.raises(IntegrityError, match="key 'model.s0'"):
            ck.get_slice("model.s0")[3:6]
        assert _same(ck.get_slice("model.s0")[:4], full["s0"][:4])  # rank 0's chunk
        assert _same(ck.get_slice("model.s0")[8:], full["s0"][8:])  # rank 2's chunk
        for k in ("s1", "s1_3d", "big", "rep"):  # rank 1's file holds chunks of these too
            assert _same(ck[f"model.{k}"], full[k]), k
        with pytest.raises(IntegrityError, match="key 'model.s0'"):
            ck.to_state_dict("model")
        assert ck.to_state_dict("cfg")["name"] == "run"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_compressed_and_incremental_saves_at_three_ranks(ranks, tmp_path, compression):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    pool = ranks(3)
    pool.run(_save, a, compression)
    pool.run(_save, b, compression, a, 1.0)  # s0 changed; the rest referenced in a/
    with dckpt.open(b) as ck:
        assert any(f.dir == "a" for f in ck.manifest.files)
        if compression:
            assert any(e.blocks is not None and e.encoded(0) is not None
                       for e in ck.manifest.tensors.values())
        _check_all(ck, _full(1.0))
    with dckpt.open(a) as ck:
        _check_all(ck, _full())
