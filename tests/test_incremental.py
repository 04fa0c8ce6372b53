"""Incremental (base=) and compressed saves in one process: bytes written, bitwise
round trips, codecs, damage detection, references and what may remove them."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

import dckpt
from dckpt.errors import CheckpointError, IntegrityError, ManifestError
from dckpt.format import codec
from dckpt.format import manifest as mf
from dckpt.catalog.verify import verify_checkpoint


def _clone(sd: dict) -> dict:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd.items()}


def _zeros(sd: dict) -> dict:
    return {k: (torch.zeros_like(v) if torch.is_tensor(v) else None) for k, v in sd.items()}


def _loads_as(path: str, want: dict) -> None:
    got = dckpt.load(_zeros(want), path)
    for k, v in want.items():
        if torch.is_tensor(v):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_frozen_backbone_writes_little_and_restores_bitwise(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"backbone.{i}": torch.randn(256, 1024, generator=g) for i in range(8)}  # 8 MiB
    sd.update({"lora.a": torch.randn(256, 64, generator=g), "lora.b": torch.zeros(64, 1024),
               "step": 0})
    full = dckpt.save(sd, str(tmp_path / "step-0"))
    prev = "step-0"
    for step in range(1, 4):
        sd["lora.a"] += 0.01 * step
        sd["lora.b"] += 0.02
        sd["step"] = step
        info = dckpt.save(sd, str(tmp_path / f"step-{step}"), base=str(tmp_path / prev))
        assert info.bytes_written <= 0.15 * full.bytes_written, (step, info.bytes_written)
        _loads_as(str(tmp_path / f"step-{step}"), sd)
        assert verify_checkpoint(str(tmp_path / f"step-{step}")).ok
        prev = f"step-{step}"


def test_embedding_with_two_percent_rows_touched(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {"emb": torch.randn(32768, 64, generator=g)}  # 8 MiB
    full = dckpt.save(sd, str(tmp_path / "s0"))
    for step, name in enumerate(("s1", "s2"), 1):
        rows = torch.randperm(32768, generator=g)[:655]  # 2% of the rows
        sd["emb"][rows] += 0.001 * torch.randn(655, 64, generator=g)
        base = str(tmp_path / ("s0" if step == 1 else "s1"))
        info = dckpt.save(sd, str(tmp_path / name), base=base)
        # against the full anchor: 2% new rows per step, deltas as sparse words
        assert info.bytes_written <= 0.10 * step * full.bytes_written, info.bytes_written
        _loads_as(str(tmp_path / name), sd)
    m = mf.parse(open(tmp_path / "s2" / "manifest.json", "rb").read())
    t = m.tensors["emb"].encoded(0)
    assert t is not None and (t[:, 3] & codec.XOR).all()  # every block a delta
    # anchors are full blocks of s0, never deltas of s1: depth one
    assert {m.files[f].dir for f in t[:, 4].tolist()} == {"s0"}


def test_dense_change_writes_plain_and_no_more(tmp_path):
    sd = {"w": torch.randn(1024, 1024)}
    full = dckpt.save(sd, str(tmp_path / "a"))
    sd["w"] += torch.randn(1024, 1024)
    info = dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"))
    assert info.bytes_written <= 1.01 * full.bytes_written
    m = mf.parse(open(tmp_path / "b" / "manifest.json", "rb").read())
    assert m.tensors["w"].encoded(0) is None and not any(f.dir for f in m.files)
    _loads_as(str(tmp_path / "b"), sd)


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_dense_change_reads_no_whole_anchor_and_sparse_still_deltas(tmp_path, monkeypatch,
                                                                     compression):
    """A dense change is ruled out from a small unverified look at the base (raw or
    compressed), so an incremental save of pre-training state reads no base block in
    full; a sparse change on a compressed base still becomes deltas."""
    from dckpt.engine.reader import ChunkReader

    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(512, 1024, generator=g) * 0.02 for i in range(4)}
    dckpt.save(sd, str(tmp_path / "a"), compression=compression)
    verified = []
    real = ChunkReader.stored_bytes
    monkeypatch.setattr(ChunkReader, "stored_bytes",
                        lambda self, *a: verified.append(a[1]) or real(self, *a))
    for v in sd.values():
        v.add_(torch.randn(v.shape, generator=g) * 1e-5)
    dckpt.save(sd, str(tmp_path / "b"), base=str(tmp_path / "a"), compression=compression)
    assert verified == []
    _loads_as(str(tmp_path / "b"), sd)
    for v in sd.values():
        v[1::64] += 1.0  # one row in 64: sparse
    info = dckpt.save(sd, str(tmp_path / "c"), base=str(tmp_path / "b"), compression=compression)
    assert verified  # anchors read (verified) for the deltas
    assert info.bytes_written <= 0.2 * sum(v.numel() * 4 for v in sd.values())
    _loads_as(str(tmp_path / "c"), sd)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_compression_round_trips_every_dtype(tmp_path, compression):
    g = torch.Generator().manual_seed(2)
    sd = {}
    for dt in DTYPES:
        x = torch.randn(300, 1111, generator=g) * 3  # 1.3 MB: two blocks, one partial
        sd[str(dt)] = (x > 0) if dt == torch.bool else x.to(dt)
    sd["empty"] = torch.zeros(0, 3)
    info = dckpt.save(sd, str(tmp_path / "c"), compression=compression)
    _loads_as(str(tmp_path / "c"), sd)
    assert verify_checkpoint(str(tmp_path / "c")).ok
    raw = dckpt.save(sd, str(tmp_path / "r"))
    assert info.bytes_written < raw.bytes_written


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_zeros_shrink_50x_and_random_never_grows_1pct(tmp_path, compression):
    z = {"z": torch.zeros(4 << 20)}  # 16 MiB
    zi = dckpt.save(z, str(tmp_path / "z"), compression=compression)
    assert zi.bytes_written * 50 <= 16 << 20, zi.bytes_written
    r = {"r": torch.from_numpy(np.random.default_rng(3).integers(0, 255, 8 << 20, np.uint8))}
    ri = dckpt.save(r, str(tmp_path / "r"), compression=compression)
    plain = dckpt.save(r, str(tmp_path / "p"))
    assert ri.bytes_written <= 1.01 * plain.bytes_written
    _loads_as(str(tmp_path / "z"), z)
    _loads_as(str(tmp_path / "r"), r)


def test_missing_extra_and_bad_value_are_clear(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="one of None"):
        dckpt.save({"a": torch.ones(2)}, str(tmp_path / "x"), compression="gzip")
    import builtins
    real = builtins.__import__

    def no_zstd(name, *a, **k):
        if name == "zstandard":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_zstd)
    with pytest.raises(CheckpointError, match=r"dckpt\[compress\]"):
        dckpt.save({"a": torch.ones(2)}, str(tmp_path / "y"), compression="zstd")
    assert not os.path.exists(tmp_path / "y" / "manifest.json")


def _flip_in_entry(path: str, fname: str, key: str, at: int = 100) -> None:
    import safetensors  # noqa: F401  (the header layout is safetensors')
    with open(os.path.join(path, fname), "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        start = 8 + n + head[key]["data_offsets"][0]
        f.seek(start + at)
        b = f.read(1)
        f.seek(start + at)
        f.write(bytes([b[0] ^ 0x10]))


def test_bit_flip_in_compressed_and_delta_chunks_is_detected(tmp_path):
    sd = {"w": torch.randn(512, 512)}
    dckpt.save(sd, str(tmp_path / "c"), compression="zstd")
    name = next(n for n in os.listdir(tmp_path / "c") if n.startswith("data-"))
    _flip_in_entry(str(tmp_path / "c"), name, "w")
    with pytest.raises(IntegrityError, match="checksum"):
        dckpt.load(_zeros(sd), str(tmp_path / "c"))
    assert not verify_checkpoint(str(tmp_path / "c")).ok

    e = {"emb": torch.randn(8192, 64)}
    dckpt.save(e, str(tmp_path / "b0"))
    e["emb"][::50] += 1
    dckpt.save(e, str(tmp_path / "b1"), base=str(tmp_path / "b0"))
    name = next(n for n in os.listdir(tmp_path / "b1") if n.startswith("data-"))
    _flip_in_entry(str(tmp_path / "b1"), name, "emb", at=8)
    with pytest.raises(IntegrityError):
        dckpt.load(_zeros(e), str(tmp_path / "b1"))


def test_corrupt_or_missing_base_file_is_named(tmp_path):
    sd = {"w": torch.randn(256, 1024), "b": torch.randn(16)}
    dckpt.save(sd, str(tmp_path / "s0"))
    sd["b"] += 1
    dckpt.save(sd, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    base_file = next(n for n in os.listdir(tmp_path / "s0") if n.startswith("data-"))
    _flip_in_entry(str(tmp_path / "s0"), base_file, "w", at=4096)
    with pytest.raises(IntegrityError, match=base_file):
        dckpt.load(_zeros(sd), str(tmp_path / "s1"))
    rep = verify_checkpoint(str(tmp_path / "s1"))
    assert not rep.ok and any(base_file in p for p in rep.problems)
    os.remove(tmp_path / "s0" / base_file)
    with pytest.raises(IntegrityError, match="missing"):
        dckpt.load(_zeros(sd), str(tmp_path / "s1"))
    rep = verify_checkpoint(str(tmp_path / "s1"))
    assert any(base_file in p for p in rep.problems)


def test_base_must_be_a_sibling(tmp_path):
    sd = {"w": torch.ones(4)}
    dckpt.save(sd, str(tmp_path / "a" / "s0"))
    for path, base in ((tmp_path / "b" / "s1", tmp_path / "a" / "s0"),  # another parent
                       (tmp_path / "a" / "s1", tmp_path / "s0"),
                       (tmp_path / "a" / "s1", tmp_path / "a" / "s0" / "..")):
        with pytest.raises(CheckpointError, match="same parent"):
            dckpt.save(sd, str(path), base=str(base))
        assert not os.path.exists(path / "manifest.json")
    with pytest.raises(CheckpointError, match="same parent"):
        dckpt.save(sd, str(tmp_path / "a" / "s0"), base=str(tmp_path / "a" / "s0"), overwrite=True)


@pytest.mark.parametrize("evil", ["../x", "/abs", "s3://bucket/x", "..", "a/b", ".hidden"])
def test_references_outside_the_parent_are_refused(tmp_path, evil):
    sd = {"w": torch.randn(64, 64)}
    dckpt.save(sd, str(tmp_path / "s0"))
    dckpt.save(sd, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    p = tmp_path / "s1" / "manifest.json"
    doc = json.loads(open(p, "rb").read())
    doc.pop("checksum")
    assert any(len(f) == 6 for f in doc["files"])
    for f in doc["files"]:
        if len(f) == 6:
            f[5] = evil
    open(p, "wb").write(mf.seal(doc))
    with pytest.raises(ManifestError, match="sibling"):
        dckpt.load(_zeros(sd), str(tmp_path / "s1"))


def _base_and_child(tmp_path) -> dict:
    """s0 full, s1 incremental on it (referencing most of s0's bytes); s1's state."""
    sd = {"w": torch.randn(256, 256), "x": torch.randn(8)}
    dckpt.save(sd, str(tmp_path / "s0"))
    sd["x"] += 1
    dckpt.save(sd, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    return sd


def test_overwriting_a_base_keeps_what_siblings_reference(tmp_path):
    sd = _base_and_child(tmp_path)
    dckpt.save({"w": torch.zeros(3)}, str(tmp_path / "s0"), overwrite=True)
    _loads_as(str(tmp_path / "s1"), sd)
    assert verify_checkpoint(str(tmp_path / "s1")).ok


def test_gc_keeps_referenced_files(tmp_path, monkeypatch):
    from dckpt.catalog import listing as catalog
    from dckpt.catalog import gc as catalog_gc

    sd = _base_and_child(tmp_path)
    # s0's manifest is gone (as retention removes a referenced step): its data stays
    os.remove(tmp_path / "s0" / "manifest.json")
    monkeypatch.setattr(catalog_gc, "_now", lambda: time.time() + 10 * 86400)
    removed = catalog_gc.collect_garbage(str(tmp_path), min_age_s=0)
    assert not removed, removed
    _loads_as(str(tmp_path / "s1"), sd)


def test_cli_du_and_inspect_show_references(tmp_path, capsys):
    from dckpt.cli.main import main

    _base_and_child(tmp_path)
    assert main(["du", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    s0 = sum(os.path.getsize(tmp_path / "s0" / n) for n in os.listdir(tmp_path / "s0"))
    s1 = sum(os.path.getsize(tmp_path / "s1" / n) for n in os.listdir(tmp_path / "s1"))
    assert "2 checkpoint(s)" in out and str(tmp_path / "s1") in out
    from dckpt.catalog.listing import disk_usage

    usage, total = disk_usage(str(tmp_path))
    assert total == s0 + s1
    own = {os.path.basename(u.path): (u.own, u.referenced) for u in usage}
    assert own["s1"][1] == own["s0"][0] and own["s1"][0] < own["s0"][0] / 10
    assert main(["inspect", str(tmp_path / "s1")]) == 0
    out = capsys.readouterr().out
    assert "inherited" in out and "all" in out  # w is unchanged: wholly in s0
