"""The votes rank 0 gathers after the writes (issue 38): the 20-byte record and the
JSON form, decoded together; hostile bytes are a CheckpointError naming the rank, and
the coordinator turns it into that rank's failure for every rank. Pure (no processes)."""
from __future__ import annotations

import json
import os
import random
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dckpt.errors import CheckpointError
from dckpt.format.filenames import data_name
from dckpt.format.shards import MAX_HEADER
from dckpt.protocol import votes
from dckpt.protocol.collectives import raise_gathered
from dckpt.protocol.coordinator import _Coordinator, _unpack

SID = "00112233445566aa"


def _n(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


def file_vote(r: int, size: int = 5000, hlen: int = 100, crc: int = 7) -> dict:
    return {"file": data_name(SID, r), "size": size, "hlen": hlen, "crc": crc}


vote_st = st.one_of(
    st.builds(lambda h, extra, c: {"file": None} if extra < 0 else
              {"size": h + 8 + extra, "hlen": h, "crc": c},
              st.integers(1, MAX_HEADER), st.integers(-1, 2**62), st.integers(0, 2**32 - 1)),
    st.just({"error": {"type": "RankFailure", "message": "OSError: disk full"}}),
    st.just({"chunks": []}),  # an incremental save's vote: JSON
    st.just({"name": "other-name.safetensors"}),  # another file name: JSON
)


def _vote_for(r: int, v: dict) -> dict:
    if "size" in v:
        return {"file": data_name(SID, r), **v}
    if "chunks" in v:
        return {**file_vote(r), "chunks": []}
    if "name" in v:  # one name per rank: two ranks naming one file are refused
        return {**file_vote(r), "file": f"{r}-{v['name']}"}
    return v


@settings(max_examples=_n(100), deadline=None)
@given(vs=st.lists(vote_st, min_size=1, max_size=30))
def test_round_trip_records_and_json(vs):
    dicts = [_vote_for(r, v) for r, v in enumerate(vs)]
    blobs = [votes.encode(d, SID, r) for r, d in enumerate(dicts)]
    for d, b in zip(dicts, blobs):
        record = (d == {"file": None}) or set(d) == {"file", "size", "hlen", "crc"} and \
            d["file"].startswith("data-")
        assert (len(b) == votes.RECORD_LEN and b[:4] == votes.MAGIC) == record, d
    t = votes.decode(blobs, SID)
    same = votes.VoteTable.from_dicts(dicts, SID)
    for a, b in ((t.has_file, same.has_file), (t.size, same.size), (t.hlen, same.hlen),
                 (t.crc, same.crc)):
        assert a.tolist() == b.tolist()
    assert t.errors == same.errors == {r: d["error"] for r, d in enumerate(dicts) if "error" in d}
    assert t.names == same.names and t.files() == same.files()
    want = [(d["file"], d["size"], d["hlen"], d["crc"], r) for r, d in enumerate(dicts)
            if d.get("file")]
    assert [(f.name, f.size, f.header_len, f.header_crc32, f.rank) for f in t.files()] == want
    assert set(t.docs) == {r for r, b in enumerate(blobs) if b[:1] == b"{"}


def test_a_save_sends_records():
    """The common vote is a record; its file table derives names (no strings kept)."""
    blobs = [votes.encode(file_vote(r, 10**9 + r, 4000 + r, r), SID, r) for r in range(1000)]
    assert {len(b) for b in blobs} == {votes.RECORD_LEN}
    t = votes.decode(blobs, SID)
    f = t.files()
    assert f.regular and not t.docs and f.names[7] == data_name(SID, 7)
    assert f.size.tolist() == [10**9 + r for r in range(1000)]
    # a save id other than the file's: the name travels (JSON)
    assert votes.encode(file_vote(3), "ffffffffffffffff", 3)[:1] == b"{"
    # out-of-range numbers are never packed
    for bad in (dict(hlen=0), dict(hlen=MAX_HEADER + 1), dict(size=50, hlen=43),
                dict(crc=2**32), dict(size=2**63)):
        assert votes.encode({**file_vote(0), **bad}, SID, 0)[:1] == b"{", bad


def _pack(size: int, hlen: int, crc: int, magic: bytes = votes.MAGIC) -> bytes:
    return struct.pack("<4sQII", magic, size, hlen, crc)


def test_hostile_votes_name_the_rank():
    good = [votes.encode(file_vote(r), SID, r) for r in range(6)]
    cases = {
        "a header of 0 bytes": _pack(100, 0, 1),
        "a header over the cap": _pack(2**40, MAX_HEADER + 1, 1),
        "a size under the header": _pack(50, 43, 1),
        "a size over 2**63": _pack(2**63 + 5, 100, 1),
        "a no-file record with a crc": _pack(0, 0, 5),
        "garbage of 20 bytes": b"\x00" * 20,
        "garbage": b"\xff\xfe\x00garbage",
        "empty": b"",
        "JSON not an object": b"[1, 2]",
        "JSON with a bad size": json.dumps({**file_vote(4), "size": -1}).encode(),
        "JSON with a bool size": json.dumps({**file_vote(4), "size": True}).encode(),
        "JSON with an unsafe name": json.dumps({**file_vote(4), "file": "../x"}).encode(),
        "JSON with a bad error": json.dumps({"error": "boom"}).encode(),
        "deep JSON": b"[" * 100000 + b"]" * 100000,
    }
    for why, blob in cases.items():
        bs = list(good)
        bs[4] = blob
        with pytest.raises(CheckpointError) as e:
            votes.decode(bs, SID)
        assert str(e.value).startswith("rank 4: ") and list(e.value.failures) == [4], why


@settings(max_examples=_n(200), deadline=None)
@given(blobs=st.lists(st.one_of(st.binary(max_size=30), st.binary(min_size=16, max_size=16).map(
    lambda b: votes.MAGIC + b)), min_size=1, max_size=8))
def test_random_bytes_decode_or_name_one_rank(blobs):
    try:
        t = votes.decode(blobs, SID)
    except CheckpointError as e:
        assert len(e.failures) == 1 and 0 <= next(iter(e.failures)) < len(blobs)
        return
    f = t.files()
    assert (f.header_len >= 1).all() and (f.header_len + 8 <= f.size).all()


def test_coordinator_sends_a_bad_vote_as_its_ranks_failure():
    """A malformed vote fails the save on every rank alike, naming that rank (the
    coordinator's reply is what every rank raises from)."""
    coord = _Coordinator(None, "ckpt", False, 3)
    coord.save_id = SID
    blobs = [votes.encode(file_vote(r), SID, r) for r in range(3)]
    blobs[2] = _pack(10, 0, 0)
    doc, _ = _unpack(coord.commit(blobs, time.perf_counter()))
    with pytest.raises(CheckpointError, match="save to ckpt failed on rank 2: its vote") as e:
        raise_gathered({int(r): x for r, x in doc["errors"].items()}, "save to ckpt")
    assert list(e.value.failures) == [2]
    # a rank's own error (JSON) among records reaches everyone as that rank's
    blobs[2] = votes.encode({"error": {"type": "RankFailure", "message": "OSError: x"}}, SID, 2)
    blobs[0] = votes.encode({"file": None}, SID, 0)
    doc, _ = _unpack(coord.commit(blobs, time.perf_counter()))
    assert doc["errors"] == {"2": {"type": "RankFailure", "message": "OSError: x"}}


def test_decode_is_vectorised():
    """131,072 records decode in well under a second (about 10 ms quiet)."""
    n = 131072
    rng = random.Random(0)
    blobs = [_pack(10**9 + rng.randrange(10**6), 4000, rng.randrange(2**32)) for _ in range(n)]
    t0 = time.perf_counter()
    f = votes.decode(blobs, SID).files()
    assert time.perf_counter() - t0 < 1.0 and len(f) == n and f.regular
    assert np.array_equal(f.rank, np.arange(n))
