"""A side file's header records the key prefix its names lack (``dckpt.prefix``); the
parse adds it back, so every reader looks chunks up by key. Hostile prefixes (not a
string, over the bound) and side-file votes naming another file are refused with the
file or the rank named. Pure (no processes)."""
from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import torch

from dckpt.errors import CheckpointError, IntegrityError
from dckpt.format import shards
from dckpt.format.filenames import DATA_FILE, side_name
from dckpt.protocol import votes

SID = "00112233445566aa"


class _Buf(io.BytesIO):
    def commit(self) -> None:
        pass


def _shard(prefix: str) -> bytes:
    t = torch.arange(6, dtype=torch.float32)
    buf = _Buf()
    shards.write_shard(buf, [("w", "F32", (6,), 24)], [memoryview(t.numpy()).cast("B")],
                       False, at={"w": (0,)}, prefix=prefix)
    return buf.getvalue()


def _forge(data: bytes, prefix) -> bytes:
    (hlen,) = struct.unpack_from("<Q", data, 0)
    doc = json.loads(data[8:8 + hlen])
    doc["__metadata__"]["dckpt.prefix"] = prefix
    raw = json.dumps(doc).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + hlen:]


def test_parse_adds_the_recorded_prefix_back():
    data = _shard("models.0.")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    tensors, _ = shards.parse_header(data[:8 + hlen], "f", len(data))
    assert list(tensors) == ["models.0.w"] and tensors["models.0.w"].at == (0,)
    plain = _shard("")
    (plen,) = struct.unpack_from("<Q", plain, 0)
    assert list(shards.parse_header(plain[:8 + plen], "f", len(plain))[0]) == ["w"]


@pytest.mark.parametrize("prefix", [5, ["a"], "x" * (shards.MAX_PREFIX + 1)])
def test_hostile_prefix_is_refused(prefix):
    data = _forge(_shard("models.0."), prefix)
    (hlen,) = struct.unpack_from("<Q", data, 0)
    with pytest.raises(IntegrityError, match="shard file f9.*dckpt.prefix"):
        shards.parse_header(data[:8 + hlen], "f9", len(data))


def test_side_names_are_dckpt_files():
    assert DATA_FILE.fullmatch(side_name(SID, 3)).group(1) == SID


def _vote(r: int, side: dict) -> bytes:
    return json.dumps({"file": None, "side": side}).encode()


def test_side_vote_naming_another_file_is_refused():
    ok = {"prefix": "m.", "file": side_name(SID, 0), "size": 200, "hlen": 100, "crc": 1}
    t = votes.decode([_vote(0, ok)], SID)
    assert t.side == {0: (side_name(SID, 0), 200, 100, 1)} and t.side_rows() == {0: 0}
    assert [f.name for f in t.files()] == [side_name(SID, 0)]
    bad = dict(ok, file=side_name(SID, 1))
    with pytest.raises(CheckpointError, match="rank 0.*not its own"):
        votes.decode([_vote(0, bad)], SID)
    with pytest.raises(CheckpointError, match="rank 0.*prefix is not a string"):
        votes.decode([_vote(0, {"prefix": 3})], SID)
    with pytest.raises(CheckpointError, match="rank 0.*malformed"):
        votes.decode([_vote(0, dict(ok, size=-1))], SID)


def test_side_prefixes_must_agree():
    t = votes.decode([_vote(0, {"prefix": "m."}), _vote(1, {"prefix": "n."})], SID)
    with pytest.raises(CheckpointError, match="rank 1.*side differs") as e:
        votes.check_side(t, "m.")
    assert set(e.value.failures) == {1}
    votes.check_side(votes.decode([_vote(0, {"prefix": "m."})], SID), "m.")
    rec = votes.encode({"file": None}, SID, 0)  # a plain vote while rank 0 asked for one
    with pytest.raises(CheckpointError, match="rank 0"):
        votes.check_side(votes.decode([rec], SID), "m.")
    assert np.asarray(votes.decode([rec], SID).has_file).tolist() == [False]
