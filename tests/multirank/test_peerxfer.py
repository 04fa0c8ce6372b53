"""The peer transfer primitive (issue 28, dckpt/tiers/peerxfer.py) between two real gloo
ranks: a real shard file written by dckpt, sent from rank 0 to rank 1 in many small
pieces; damage, a missing file and an oversize file are refused on both sides, no rank
waits out a timeout, and nothing appears under the final name."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from statekit import flip_byte

PIECE = 4 << 10  # small: a 1.6 MB shard goes over in ~390 pieces
DEADLINE = 60.0  # every case either completes or fails on both ranks well within this


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    """A real dckpt data file (several 256 KiB CRC blocks), saved in this process."""
    import dckpt

    d = tmp_path_factory.mktemp("src")
    dckpt.save({"w": torch.arange(400_000, dtype=torch.float32),
                "b": torch.ones(7, dtype=torch.int64)}, str(d / "ckpt"))
    names = [n for n in os.listdir(d / "ckpt") if n.startswith("data-")]
    assert len(names) == 1
    return str(d / "ckpt" / names[0])


def _transfer(src_file: str, dst_dir: str, own: bool, cap: int = 1 << 40,
              recv_piece: int = PIECE) -> tuple:
    """Rank 0 sends ``src_file``, rank 1 receives it into ``dst_dir``. Returns
    ("ok", bytes, seconds) or (error type, message, seconds) on each rank."""
    import torch.distributed as dist

    from dckpt.protocol.collectives import OwnGroup
    from dckpt.storage.local import LocalStorage
    from dckpt.tiers.peers.xfer import recv_file, send_file

    group = OwnGroup([0, 1], 30.0) if own else None
    storage = LocalStorage()
    t0 = time.monotonic()
    try:
        if dist.get_rank() == 0:
            n = send_file(group, storage, src_file, 1, piece=PIECE)
        else:
            n = recv_file(group, storage, os.path.join(dst_dir, os.path.basename(src_file)),
                          0, piece=recv_piece, cap=cap)
        return "ok", n, time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        if own:
            group.shutdown()


def _leftovers(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".peer-" in n)


@pytest.mark.parametrize("own", [True, False], ids=["own-group", "world"])
def test_shard_arrives_identical_and_verified(ranks, shard, tmp_path, own):
    dst = tmp_path / "node1"
    dst.mkdir()
    out = ranks(2).run(_transfer, shard, str(dst), own, timeout=DEADLINE)
    size = os.path.getsize(shard)
    assert [o[:2] for o in out] == [("ok", size), ("ok", size)]
    got = dst / os.path.basename(shard)
    assert got.read_bytes() == open(shard, "rb").read()
    assert size > 300 * PIECE  # many pieces went over
    assert _leftovers(str(dst)) == []


def test_damaged_file_refused_on_both_sides(ranks, shard, tmp_path):
    bad = tmp_path / "src" / os.path.basename(shard)
    bad.parent.mkdir()
    shutil.copy(shard, bad)
    flip_byte(str(bad), os.path.getsize(bad) - 100)  # in the data region
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / bad.name
    final.write_bytes(b"old")  # what was there before must survive a refused transfer
    out = ranks(2).run(_transfer, str(bad), str(dst), False, timeout=DEADLINE)
    (t0, m0, _), (t1, m1, _) = out
    assert t1 == "IntegrityError", out
    assert "checksum" in m1 and bad.name in m1 and "rank 0" in m1
    assert t0 == "IntegrityError" and "receiver (rank 1)" in m0 and "checksum" in m0
    assert final.read_bytes() == b"old"
    assert _leftovers(str(dst)) == []


def test_missing_file_makes_receiver_raise(ranks, tmp_path):
    missing = str(tmp_path / "src" / "data-00000.safetensors")
    dst = tmp_path / "node1"
    dst.mkdir()
    out = ranks(2).run(_transfer, missing, str(dst), True, timeout=DEADLINE)
    (t0, m0, s0), (t1, m1, s1) = out
    assert t0 == "CheckpointError" and "cannot read" in m0 and "rank 1" in m0, out
    assert t1 == "CheckpointError" and "sender (rank 0)" in m1 and "cannot read" in m1
    assert "data-00000.safetensors" in m1
    assert max(s0, s1) < 20  # raised at once, not after the group's 30 s timeout
    assert os.listdir(dst) == []


def test_size_over_cap_refused(ranks, shard, tmp_path):
    dst = tmp_path / "node1"
    dst.mkdir()
    out = ranks(2).run(_transfer, shard, str(dst), False, 1000, timeout=DEADLINE)
    (t0, m0, _), (t1, m1, _) = out
    assert t1 == "CheckpointError" and "1000-byte cap" in m1 and "rank 0" in m1, out
    assert t0 == "CheckpointError" and "receiver (rank 1)" in m0 and "1000-byte cap" in m0
    assert os.listdir(dst) == []


def test_pieces_larger_than_the_receiver_takes_refused(ranks, shard, tmp_path):
    dst = tmp_path / "node1"
    dst.mkdir()
    out = ranks(2).run(_transfer, shard, str(dst), True, 1 << 40, PIECE // 2,
                       timeout=DEADLINE)
    (t0, m0, _), (t1, m1, _) = out
    assert t1 == "CheckpointError" and f"pieces of {PIECE} bytes" in m1, out
    assert t0 == "CheckpointError" and "receiver (rank 1)" in m0
    assert os.listdir(dst) == []
