"""Review of issue 38 (a plain save records no block hashes; a base without them is read
back and hashed): what held up, pinned. An unhashed base serves an incremental save on
fsspec's memory file system, as an old (version 1) or columnar (version 4) manifest,
with 0-byte, tiny, bf16, int8, bool, 0-d and non-contiguous tensors and chunks read in
several slabs; a read-back that fails (a timeout, a base replaced after rank 0 read its
manifest) costs a full write of that chunk, never the save or a wrong byte. The
multi-rank half (ranks that disagree on ``base``) is tests/multirank/."""
from __future__ import annotations

import json
import os

import torch

import dckpt
from dckpt.catalog.verify import verify_checkpoint
from dckpt.engine import encode
from dckpt.engine.reader import ChunkReader
from dckpt.format import filetable
from dckpt.protocol import commit

from .test_incremental import _loads_as


def _sd(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(3)} | {"step": 1}


def _hashed(path) -> bool:
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    return any("blocks" in t for t in json.loads(raw[raw.index(b"{"):])["tensors"].values())


def test_an_unhashed_base_on_the_memory_file_system_serves():
    sd = _sd()
    root = f"memory://review-bh-{os.getpid()}"
    dckpt.save(sd, f"{root}/a")
    sd["w1"][3] += 1
    sd["step"] = 2
    info = dckpt.save(sd, f"{root}/b", base=f"{root}/a")
    assert info.bytes_written < 64 << 10
    _loads_as(f"{root}/b", sd)


def test_a_failed_read_back_writes_the_chunk_in_full(tmp_path, monkeypatch):
    """A timeout (not an OSError) while reading the base back: that chunk is written in
    full, the others are still referenced, the base is untouched."""
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "a"))
    before = {n: open(tmp_path / "a" / n, "rb").read() for n in os.listdir(tmp_path / "a")}
    real = ChunkReader.stored_bytes

    def flaky(self, fi, key, *a):
        if key == "w1":
            raise TimeoutError("read timed out")
        return real(self, fi, key, *a)

    monkeypatch.setattr(ChunkReader, "stored_bytes", flaky)
    sd["step"] = 2
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    monkeypatch.setattr(ChunkReader, "stored_bytes", real)
    assert 1 << 20 <= info.bytes_written < (1 << 20) + (64 << 10)  # w1 only
    _loads_as(str(tmp_path / "b"), sd)
    assert verify_checkpoint(str(tmp_path / "b")).ok
    assert before == {n: open(tmp_path / "a" / n, "rb").read() for n in os.listdir(tmp_path / "a")}


def test_a_base_replaced_after_its_manifest_was_read(tmp_path, monkeypatch):
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "a"))
    other = {k: (v + 1 if torch.is_tensor(v) else 9) for k, v in sd.items()}
    real = commit._encoding

    def replaced(*a):
        enc = real(*a)
        dckpt.save(other, str(tmp_path / "a"), overwrite=True)
        return enc

    monkeypatch.setattr(commit, "_encoding", replaced)
    sd["step"] = 2
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written >= 3 * (1 << 20)  # nothing of the vanished base referenced
    _loads_as(str(tmp_path / "b"), sd)
    _loads_as(str(tmp_path / "a"), other)


def test_a_version_1_manifest_serves_as_a_base(tmp_path):
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "a"))
    path = tmp_path / "a" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    doc["version"] = 1
    path.write_text(json.dumps(doc))
    sd["w0"][9] += 1
    sd["step"] = 2
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written < 64 << 10
    _loads_as(str(tmp_path / "b"), sd)


def test_a_columnar_file_table_base_serves(tmp_path, monkeypatch):
    monkeypatch.setattr(filetable, "TABLE_MIN_FILES", 1)
    sd = _sd()
    dckpt.save(sd, str(tmp_path / "a"))
    assert json.loads((tmp_path / "a" / "manifest.json").read_bytes())["version"] == 4
    sd["w2"][0] += 1
    sd["step"] = 2
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written < 64 << 10
    _loads_as(str(tmp_path / "b"), sd)


def test_odd_tensors_and_slabs_on_an_unhashed_base(tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "HASH_READ", 1 << 20)  # a chunk read in several slabs
    g = torch.Generator().manual_seed(0)
    sd = {"e0": torch.empty(0), "e2": torch.empty(0, 5), "tiny": torch.randn(3, generator=g),
          "s0": torch.tensor(3.0), "flags": torch.ones(100, dtype=torch.bool),
          "bf": torch.randn(300, 1000, generator=g).bfloat16(),
          "i8": torch.randint(-100, 100, (3000, 700), dtype=torch.int8, generator=g),
          "nc": torch.randn(1000, 600, generator=g).t(),
          "long": torch.randn(3 * 262144 + 777, generator=g), "step": 1}
    full = dckpt.save(sd, str(tmp_path / "a"))
    assert not _hashed(tmp_path / "a")
    sd["tiny"][0] += 1
    sd["long"][-1] += 1
    sd["long"][262144 + 5] += 1
    sd["i8"][1000, 3] += 1
    sd["step"] = 2
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written < 0.01 * full.bytes_written
    _loads_as(str(tmp_path / "b"), sd)
    assert verify_checkpoint(str(tmp_path / "b")).ok and _hashed(tmp_path / "b")
    again = dckpt.save(sd, str(tmp_path / "c"), base=str(tmp_path / "b"), compression="zstd")
    assert again.bytes_written < 16 << 10
    _loads_as(str(tmp_path / "c"), sd)


def test_async_save_records_hashes_and_builds_on_an_unhashed_base(tmp_path):
    sd = _sd()
    dckpt.async_save(sd, str(tmp_path / "h"), block_hashes=True).result()
    assert _hashed(tmp_path / "h")
    dckpt.async_save(sd, str(tmp_path / "p")).result()
    assert not _hashed(tmp_path / "p")
    sd["w0"][1] += 1
    sd["step"] = 2
    info = dckpt.async_save(sd, str(tmp_path / "b"), base=str(tmp_path / "p")).result()
    assert info.bytes_written < 64 << 10
    _loads_as(str(tmp_path / "b"), sd)
