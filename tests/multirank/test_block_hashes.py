"""Block hashes at 4 gloo ranks (issue 38): a plain FSDP-style save votes with 20-byte
records and writes a manifest without hashes; an incremental save on such a base reads
back only each rank's own chunks; ranks that disagree on compression or block_hashes
fail the save on every rank alike and keep the old checkpoint."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist


def _state(seed: int = 0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {f"w{i}": distribute_tensor(torch.randn(256, 512, generator=g), mesh, [Shard(0)],
                                     src_data_rank=None) for i in range(3)}
    sd["step"] = 1
    return sd


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(v.full_tensor(), b[k].full_tensor()) if torch.is_tensor(v)
               else v == b[k] for k, v in a.items())


def _zeros(sd: dict) -> dict:
    return {k: (torch.zeros_like(v) if torch.is_tensor(v) else None) for k, v in sd.items()}


def _plain_then_incremental(root: str) -> tuple:
    import dckpt
    from dckpt.engine.reader import ChunkReader
    from dckpt.protocol import commit

    sent: list = []
    real_vote = commit.vote_bytes
    commit.vote_bytes = lambda v, s, r: sent.append(real_vote(v, s, r)) or sent[-1]
    read: list = []
    real_read = ChunkReader.stored_bytes
    ChunkReader.stored_bytes = lambda self, *a: read.append((self.m.files[a[0]].rank, a[1])) \
        or real_read(self, *a)
    try:
        sd = _state()
        full = dckpt.save(sd, f"{root}/a")
        first_vote = sent[-1]
        sd["w1"].to_local().add_(1.0)  # one tensor changed on every rank
        sd["step"] = 2
        inc = dckpt.save(sd, f"{root}/b", base=f"{root}/a")
        got = dckpt.load(_zeros(sd), f"{root}/b")
    finally:
        commit.vote_bytes = real_vote
        ChunkReader.stored_bytes = real_read
    doc = None
    if dist.get_rank() == 0:
        raw = open(os.path.join(root, "a", "manifest.json"), "rb").read()
        doc = json.loads(raw[raw.index(b"{"):])
    return (len(first_vote), sorted(set(read)), inc.bytes_written / full.bytes_written,
            _same(sd, got), doc and any("blocks" in t for t in doc["tensors"].values()))


def test_a_plain_save_votes_records_and_its_base_is_read_rank_by_rank(ranks, tmp_path):
    from dckpt.protocol import votes

    out = ranks(4).run(_plain_then_incremental, str(tmp_path), timeout=90)
    for rank, (vote_len, read, ratio, same, _) in enumerate(out):
        assert vote_len == votes.RECORD_LEN
        # each rank compares only its own chunks of w0, w2 (w1 changed densely: not read)
        assert read == [(rank, "w0"), (rank, "w2")], (rank, read)
        assert same
    assert out[0][2] < 0.4  # w1 written, w0 and w2 referenced
    assert out[0][4] is False  # the plain base's manifest holds no block hashes


def _differ(root: str, what: str) -> tuple:
    import dckpt

    sd = _state()
    dckpt.save(sd, root)  # the checkpoint that must survive
    new = _state(seed=1)
    kw = {}
    if dist.get_rank() == 2:
        kw = {"block_hashes": True} if what == "block_hashes" else {"compression": "zstd"}
    try:
        dckpt.save(new, root, overwrite=True, **kw)
        got = None
    except dckpt.CheckpointError as e:
        got = (type(e).__name__, str(e))
    dist.barrier()
    kept = _same(sd, dckpt.load(_zeros(sd), root))
    left = sorted(n for n in os.listdir(root) if n.startswith("data-"))
    return got, kept, len(left)


@pytest.mark.parametrize("what", ["block_hashes", "compression"])
def test_ranks_that_disagree_on_hashes_fail_alike_and_keep_the_old(ranks, tmp_path, what):
    out = ranks(4).run(_differ, str(tmp_path / "ck"), what, timeout=90)
    assert all(o == out[0] for o in out), out
    got, kept, files = out[0]
    assert got is not None, "a save mixing hashed and plain chunks was committed"
    assert "ranks 0, 1, 3 saved without block hashes while ranks 2 recorded them" in got[1]
    assert kept and files == 4  # the old checkpoint's files only
