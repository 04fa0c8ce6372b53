"""Block hashes are recorded only when asked for (issue 38): a plain save's manifest and
vote carry none, ``block_hashes=True`` (and incremental managers, compressed and
incremental saves) record them, and a base saved without them still serves an
incremental save, whose ranks read the base's chunks back to compare."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import dckpt
from dckpt.catalog.verify import verify_checkpoint
from dckpt.engine.reader import ChunkReader
from dckpt.protocol import commit, votes

from .test_incremental import _flip_in_entry, _loads_as


def _doc(path) -> dict:
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    return json.loads(raw[raw.index(b"{"):])


def _hashed(path) -> bool:
    return any("blocks" in t for t in _doc(path)["tensors"].values())


def _sd(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(3)} | {
        "b": torch.randn(16, generator=g), "step": 1}


def test_plain_saves_record_no_hashes_unless_asked(tmp_path, monkeypatch):
    sent = []
    real = commit.vote_bytes
    monkeypatch.setattr(commit, "vote_bytes", lambda v, s, r: sent.append(real(v, s, r))
                        or sent[-1])
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "plain"))
    dckpt.save(sd, str(tmp_path / "hashed"), block_hashes=True)
    dckpt.save(sd, str(tmp_path / "zstd"), compression="zstd")
    assert not _hashed(tmp_path / "plain") and len(sent[0]) == votes.RECORD_LEN
    assert _hashed(tmp_path / "hashed") and sent[1][:1] == b"{"
    assert _hashed(tmp_path / "zstd")
    for name in ("plain", "hashed", "zstd"):
        _loads_as(str(tmp_path / name), sd)
        assert verify_checkpoint(str(tmp_path / name)).ok


@pytest.mark.parametrize("base_hashes", [False, True])
def test_an_unhashed_base_serves_an_incremental_save(tmp_path, monkeypatch, caplog,
                                                     base_hashes):
    """Unchanged chunks are referenced, not written; without hashes each compared chunk
    of the base is read once (verified), with them none is."""
    sd = _sd()
    full = dckpt.save(sd, str(tmp_path / "a"), block_hashes=base_hashes)
    read = []
    real = ChunkReader.stored_bytes
    monkeypatch.setattr(ChunkReader, "stored_bytes",
                        lambda self, *a: read.append((a[1], a[3])) or real(self, *a))
    sd["b"] += 1
    sd["step"] = 2
    with caplog.at_level(logging.INFO, logger="dckpt.engine.encode"):
        info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written < 0.05 * full.bytes_written
    _loads_as(str(tmp_path / "b"), sd)
    assert verify_checkpoint(str(tmp_path / "b")).ok
    assert _hashed(tmp_path / "b")  # an incremental save records them: the next compares
    if base_hashes:
        assert read == []
    else:
        # "b" changed everywhere: the look at its bytes rules it out without a read
        assert sorted(k for k, _ in read) == ["w0", "w1", "w2"]
        assert sum(n for _, n in read) == 3 * 512 * 1024 * 4
        assert "read 3 of its chunks back" in caplog.text
    # the next save on top of it compares hashes only
    read.clear()
    sd["step"] = 3
    dckpt.save(sd, str(tmp_path / "c"), base=str(tmp_path / "b"))
    assert read == []
    _loads_as(str(tmp_path / "c"), sd)


def test_a_dense_change_on_an_unhashed_base_reads_no_chunk(tmp_path, monkeypatch):
    """Pre-training changes every block: a small unverified look rules it out, so the
    incremental save costs no read of the base's bytes."""
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "a"))
    read = []
    real = ChunkReader.stored_bytes
    monkeypatch.setattr(ChunkReader, "stored_bytes",
                        lambda self, *a: read.append(a[1]) or real(self, *a))
    for k, v in sd.items():
        if torch.is_tensor(v) and v.numel() > 1000:
            v.add_(torch.randn_like(v))
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert read == ["b"]  # the small tensor, under the look's size, is read and compared
    assert info.bytes_written > 3 * 2 * 2**20
    _loads_as(str(tmp_path / "b"), sd)


def test_a_damaged_unhashed_base_costs_a_full_write_not_the_save(tmp_path, caplog):
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "a"))
    name = next(n for n in os.listdir(tmp_path / "a") if n.startswith("data-"))
    _flip_in_entry(str(tmp_path / "a"), name, "w1", at=300_000)
    sd["step"] = 2
    with caplog.at_level(logging.WARNING, logger="dckpt.engine.encode"):
        info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert "'w1': the base's chunk cannot be read to compare" in caplog.text
    assert 2 * 2**20 <= info.bytes_written < 3 * 2**20  # w1 in full, the rest referenced
    _loads_as(str(tmp_path / "b"), sd)
    # b references the damaged file for w0 and w2: verify names that file, nothing else
    rep = verify_checkpoint(str(tmp_path / "b"))
    assert rep.problems and all(name in p for p in rep.problems)


def test_an_incremental_manager_records_hashes_on_its_full_saves(tmp_path):
    sd = _sd()
    m = dckpt.CheckpointManager(str(tmp_path), every_steps=1, incremental=True, full_every=3)
    for step in range(1, 5):
        sd["step"] = step
        m.save(step, sd)
    m.wait()
    assert all(_hashed(m.path(s)) for s in range(1, 5))
    plain = dckpt.CheckpointManager(str(tmp_path / "p"), every_steps=1)
    plain.save(1, sd)
    plain.wait()
    assert not _hashed(plain.path(1))


def test_an_embedding_whose_first_rows_changed_is_still_compared(tmp_path):
    """The look for a dense change covers several places of a chunk, not just its start:
    frequent tokens' rows (the first ones) changed densely, the rest did not, so the
    save on an unhashed base writes about one block, not the table."""
    g = torch.Generator().manual_seed(3)
    sd = {"emb": torch.randn(8192, 1024, generator=g)}  # 32 MiB
    dckpt.save(sd, str(tmp_path / "a"))
    sd["emb"][:8] += 1.0
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written < 2 * 2**20, info.bytes_written
    _loads_as(str(tmp_path / "b"), sd)
