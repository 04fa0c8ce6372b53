"""Byte ranges of a shard file from a peer (issue 28, dckpt/tiers/peerranges.py) between
two real gloo ranks: rank 1 asks rank 0 for some chunks of a real dckpt shard file and
gets a sparse copy that a load reads; damage in a requested chunk, an unknown chunk and
a size mismatch are refused on both sides, well within the deadline, leaving nothing."""
from __future__ import annotations

import dataclasses
import os
import shutil
import time

import pytest
import torch

from statekit import flip_byte

PIECE = 4 << 10  # small: the requested chunks go over in ~400 pieces
DEADLINE = 60.0  # every case completes or fails on both ranks well within this
WANT = [("a", (0,)), ("c", (0,))]  # "b" (1.6 MB, between them or not) is skipped


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, object]:
    """A real dckpt checkpoint of three tensors in one data file; (its data file, the
    manifest's FileEntry for it)."""
    import dckpt
    from dckpt.format import manifest as mf

    d = tmp_path_factory.mktemp("src") / "ckpt"
    dckpt.save({"a": torch.arange(400_000, dtype=torch.float32),  # 7 CRC blocks
                "b": torch.arange(400_000, dtype=torch.int32) * 3,  # 1.6 MB, not asked for
                "c": torch.ones(7, dtype=torch.int64),
                "z": torch.zeros(5000)}, str(d))  # a hole would pass its CRCs
    m = mf.parse((d / "manifest.json").read_bytes())
    assert len(m.files) == 1
    return str(d / m.files[0].name), m.files[0]


def _stored(path: str) -> dict:
    """{name: StoredTensor} of the shard file ``path``."""
    from dckpt.format import shards

    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        f.seek(0)
        return shards.parse_header(f.read(8 + hlen), path, os.path.getsize(path))[0]


def _transfer(src_file: str, dst: str, entry, chunks: list, own: bool) -> tuple:
    """Rank 0 sends ``chunks`` of ``src_file``, rank 1 receives them into ``dst``.
    Returns ("ok", bytes, seconds) or (error type, message, seconds) on each rank."""
    import torch.distributed as dist

    from dckpt.protocol.collectives import OwnGroup
    from dckpt.storage.local import LocalStorage
    from dckpt.tiers.peers.ranges import recv_ranges, send_ranges

    group = OwnGroup([0, 1], 30.0) if own else None
    t0 = time.monotonic()
    try:
        if dist.get_rank() == 0:
            n = send_ranges(group, LocalStorage(), src_file, chunks, 1, piece=PIECE)
        else:
            n = recv_ranges(group, dst, entry, chunks, 0, piece=PIECE)
        return "ok", n, time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        if own:
            group.shutdown()


def _leftovers(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".peer-" in n)


def test_requested_chunks_arrive_in_a_sparse_copy_a_load_reads(ranks, saved, tmp_path):
    import dckpt
    from dckpt.engine.reader import ChunkReader
    from dckpt.format import manifest as mf
    from dckpt.storage.local import LocalStorage

    src, entry = saved
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / os.path.basename(src)
    out = ranks(2).run(_transfer, src, str(final), entry, WANT, True, timeout=DEADLINE)
    st = _stored(src)
    sent = 8 + entry.header_len + st["a"].nbytes + st["c"].nbytes
    assert [o[:2] for o in out] == [("ok", sent), ("ok", sent)], out
    assert st["a"].nbytes > 300 * PIECE  # many pieces went over
    got, want = final.read_bytes(), open(src, "rb").read()
    assert len(got) == entry.size == len(want)
    assert got[:8 + entry.header_len] == want[:8 + entry.header_len]
    for k in ("a", "c"):
        s = st[k]
        assert got[s.start:s.start + s.nbytes] == want[s.start:s.start + s.nbytes], k
    b = st["b"]
    assert b.nbytes >= 1 << 20 and got[b.start:b.start + b.nbytes] == bytes(b.nbytes)  # a hole
    assert os.stat(final).st_blocks * 512 < entry.size - (1 << 20)  # sparse: b takes no space
    assert _leftovers(dst) == []
    # What a load checks: the header against the manifest's FileEntry...
    shutil.copy(os.path.join(os.path.dirname(src), "manifest.json"), dst / "manifest.json")
    m = mf.parse((dst / "manifest.json").read_bytes())
    tensors, _ = ChunkReader(LocalStorage(), str(dst), m).header(0)
    assert set(tensors) == {"a", "b", "c", "z"}
    # ... and a real load of the chunks that came over, each checked against its CRCs.
    target = {"a": torch.zeros(400_000), "c": torch.zeros(7, dtype=torch.int64)}
    dckpt.load(target, str(dst), strict=False)
    assert torch.equal(target["a"], torch.arange(400_000, dtype=torch.float32))
    assert torch.equal(target["c"], torch.ones(7, dtype=torch.int64))


def _damaged(src: str, tmp_path, key: str) -> str:
    bad = tmp_path / "src" / os.path.basename(src)
    bad.parent.mkdir()
    shutil.copy(src, bad)
    st = _stored(str(bad))[key]
    flip_byte(str(bad), st.start + st.nbytes // 2)
    return str(bad)


def test_damaged_requested_chunk_refused_on_both_sides(ranks, saved, tmp_path):
    src, entry = saved
    bad = _damaged(src, tmp_path, "a")
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / os.path.basename(src)
    out = ranks(2).run(_transfer, bad, str(final), entry, WANT, False, timeout=DEADLINE)
    (t0, m0, _), (t1, m1, _) = out
    assert t1 == "IntegrityError", out
    assert "checksum" in m1 and "chunk 'a'" in m1 and "rank 0" in m1 and final.name in m1
    assert t0 == "IntegrityError" and "receiver (rank 1)" in m0 and "chunk 'a'" in m0
    assert not final.exists() and _leftovers(dst) == []


def test_damage_in_an_unrequested_chunk_does_not_matter(ranks, saved, tmp_path):
    src, entry = saved
    bad = _damaged(src, tmp_path, "b")
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / os.path.basename(src)
    out = ranks(2).run(_transfer, bad, str(final), entry, WANT, True, timeout=DEADLINE)
    assert [o[0] for o in out] == ["ok", "ok"], out
    assert final.stat().st_size == entry.size and _leftovers(dst) == []


def test_unknown_chunk_refused_on_both_sides_at_once(ranks, saved, tmp_path):
    src, entry = saved
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / os.path.basename(src)
    out = ranks(2).run(_transfer, src, str(final), entry, [("a", (0,)), ("zz", (0, 4))],
                       True, timeout=DEADLINE)
    (t0, m0, s0), (t1, m1, s1) = out
    assert t0 == "CheckpointError" and "no chunk 'zz' at offsets (0, 4)" in m0, out
    assert "rank 1" in m0 and os.path.basename(src) in m0
    assert t1 == "CheckpointError" and "sender (rank 0)" in m1 and "chunk 'zz'" in m1
    assert max(s0, s1) < 20  # raised at once, not after the group's 30 s timeout
    assert os.listdir(dst) == []


def test_a_chunk_the_sender_did_not_send_is_refused_though_its_hole_passes_crcs(
        ranks, saved, tmp_path):
    """The ranks disagree on the chunks: "z" (all zeros) is left a hole, which reads as
    its own bytes; the receiver refuses it for not being sent, not for its CRCs."""
    src, entry = saved
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / os.path.basename(src)

    def chunks_of(rank: int) -> list:
        return [("a", (0,))] if rank == 0 else [("a", (0,)), ("z", (0,))]

    out = ranks(2).run(_per_rank, src, str(final), entry, chunks_of(0), chunks_of(1),
                       timeout=DEADLINE)
    (t0, m0, _), (t1, m1, _) = out
    assert t1 == "CheckpointError" and "chunk 'z' at offsets (0,)" in m1, out
    assert "was not sent" in m1 and "rank 0" in m1
    assert t0 == "CheckpointError" and "receiver (rank 1)" in m0 and "was not sent" in m0
    assert not final.exists() and _leftovers(dst) == []


def _per_rank(src_file: str, dst: str, entry, chunks0: list, chunks1: list) -> tuple:
    import torch.distributed as dist

    mine = chunks0 if dist.get_rank() == 0 else chunks1
    return _transfer(src_file, dst, entry, mine, False)


def test_size_mismatch_refused_on_both_sides(ranks, saved, tmp_path):
    src, entry = saved
    dst = tmp_path / "node1"
    dst.mkdir()
    final = dst / os.path.basename(src)
    final.write_bytes(b"old")  # what was there before survives a refused transfer
    other = dataclasses.replace(entry, size=entry.size + 8)
    out = ranks(2).run(_transfer, src, str(final), other, WANT, False, timeout=DEADLINE)
    (t0, m0, s0), (t1, m1, s1) = out
    assert t1 == "CheckpointError" and f"recorded {entry.size + 8}" in m1, out
    assert "rank 0" in m1 and final.name in m1
    assert t0 == "CheckpointError" and "receiver (rank 1)" in m0 and "refused" in m0
    assert max(s0, s1) < 20
    assert final.read_bytes() == b"old" and _leftovers(dst) == []
