"""Hostile or damaged input read by load, incremental saves, import and history: a
decompression bomb in a compressed block, DCP metadata whose sizes lie, safetensors
headers and history lines nested too deeply, sources dckpt could not load back. Each
must end in a clear CheckpointError (or a skipped line with a warning), quickly and in
bounded memory, never a raw Python error or a commit of what load refuses."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

import dckpt
from dckpt.errors import CheckpointError, IntegrityError
from dckpt.format import codec
from dckpt.format import manifest as mf

MiB = 1 << 20


# ------------------------------------------------------------------ helpers

def _manifest(path: str) -> mf.Manifest:
    with open(os.path.join(path, mf.MANIFEST_NAME), "rb") as f:
        return mf.parse(f.read())


def _replace_block(path: str, key: str, k: int, stored: bytes) -> str:
    """Put ``stored`` (zero padded to the block's stored length) in place of the stored
    bytes of block ``k`` of ``key``'s chunk 0, and re-seal every checksum over it (the
    shard header's CRCs, the manifest's header CRC): the file passes every CRC check,
    as a hostile file would. Returns the data file's name."""
    m = _manifest(path)
    row = m.tensors[key].blocks[0].table[k].tolist()
    fi, off, length = row[0], row[1], row[2]
    assert len(stored) <= length, (len(stored), length)
    stored = stored + bytes(length - len(stored))
    f = m.files[fi]
    with open(os.path.join(path, f.name), "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        head = json.loads(fh.read(n))
        start, end = (8 + n + x for x in head[key]["data_offsets"])
        fh.seek(start + off)
        fh.write(stored)
        fh.seek(start)
        data = fh.read(end - start)
        block = int(head["__metadata__"]["dckpt.block"])
        head["__metadata__"]["crc32:" + key] = "".join(
            f"{zlib.crc32(data[i:i + block]):08x}" for i in range(0, len(data), block))
        raw = json.dumps(head, separators=(",", ":")).encode()
        assert len(raw) <= n
        raw += b" " * (n - len(raw))
        fh.seek(8)
        fh.write(raw)
    files = list(m.files)
    files[fi] = dataclasses.replace(f, header_crc32=zlib.crc32(n.to_bytes(8, "little") + raw))
    with open(os.path.join(path, mf.MANIFEST_NAME), "wb") as fh:
        fh.write(mf.to_json(dataclasses.replace(m, files=tuple(files))))
    return f.name


def _zstd_bomb(declared: int, produced: int) -> bytes:
    """A zstd frame that states ``declared`` bytes of content and decodes to
    ``produced`` zero bytes: RLE blocks of 128 KiB, 4 bytes each (a 256 MiB frame is 8
    KiB). Built by hand: no large buffer in the test itself."""
    out = bytearray((0xFD2FB528).to_bytes(4, "little"))
    out.append(0xE0)  # frame header: 8-byte content size, single segment
    out += declared.to_bytes(8, "little")
    blk = 128 << 10
    nb = -(-produced // blk)
    for i in range(nb):
        size = min(blk, produced - i * blk)
        out += ((size << 3) | (1 << 1) | int(i == nb - 1)).to_bytes(3, "little")  # RLE
        out.append(0)
    return bytes(out)


def _zstd_unsized(produced: int) -> bytes:
    """A zstd frame without a content size that decodes to ``produced`` zero bytes."""
    import zstandard

    c = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    z = bytes(4 * MiB)
    return b"".join(c.compress(z) for _ in range(produced // len(z))) + c.flush()


def _lz4_bomb(produced: int, sized: bool) -> bytes:
    """An lz4 frame of ``produced`` zero bytes, with or without its content size."""
    import lz4.frame

    c = lz4.frame.LZ4FrameCompressor(block_size=lz4.frame.BLOCKSIZE_MAX4MB)
    z = bytes(4 * MiB)
    return (c.begin(source_size=produced if sized else 0)
            + b"".join(c.compress(z) for _ in range(produced // len(z))) + c.flush())


def _half_random() -> torch.Tensor:
    """1 MiB (one hash block) that compresses to about half: zeros, then random. Its
    stored block has room for a bomb, and a bomb of zeros looks like its start."""
    a = np.zeros(MiB, np.uint8)
    a[MiB // 2:] = np.random.default_rng(0).integers(0, 256, MiB // 2, np.uint8)
    return torch.from_numpy(a)


def _peak(fn) -> tuple[int, float, object]:
    """(peak bytes Python allocated, seconds, fn's result or exception) of ``fn()``."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - returned for the caller to check
            out = e
        return tracemalloc.get_traced_memory()[1], time.perf_counter() - t0, out
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ 1.2 decompression bomb

BOMBS = {
    "zstd-declares-256MiB": ("zstd", lambda: _zstd_bomb(256 * MiB, 256 * MiB), "declares"),
    "zstd-unsized-64MiB": ("zstd", lambda: _zstd_unsized(64 * MiB), "more than"),
    "lz4-declares-64MiB": ("lz4", lambda: _lz4_bomb(64 * MiB, True), "declares"),
    "lz4-unsized-64MiB": ("lz4", lambda: _lz4_bomb(64 * MiB, False), "more than"),
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_decompression_bomb_is_refused_without_decoding_it(tmp_path, bomb):
    """A compressed block whose frame declares (or decodes to) far more than the
    block's 1 MiB is refused as an IntegrityError naming the block and file, before or
    while decoding at most the block's size: never the whole frame."""
    compression, make, words = BOMBS[bomb]
    sd = {"w": _half_random()}
    path = str(tmp_path / "c")
    dckpt.save(sd, path, compression=compression)
    assert _manifest(path).tensors["w"].blocks[0].table[0, 3] & codec.COMPRESSOR
    name = _replace_block(path, "w", 0, make())
    peak, secs, out = _peak(lambda: dckpt.load({"w": torch.zeros(MiB, dtype=torch.uint8)}, path))
    assert isinstance(out, IntegrityError), out
    msg = str(out)
    assert "tensor 'w' chunk 0 block 0" in msg and name in msg and words in msg, msg
    assert peak < 24 * MiB, f"{peak / MiB:.0f} MiB allocated to refuse it"
    assert secs < 5


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_incremental_save_over_a_bombed_base_peeks_in_bounded_memory(tmp_path, compression,
                                                                      caplog):
    """The cheap look at a compressed base block (whether a delta may pay) and the
    verified anchor read both stop at the block's size: an incremental save over a base
    holding a bomb writes the block in full, with a warning, and loads back exactly."""
    sd = {"w": _half_random()}
    base = str(tmp_path / "base")
    dckpt.save(sd, base, compression=compression)
    make = BOMBS[f"{compression}-declares-{'256' if compression == 'zstd' else '64'}MiB"][1]
    _replace_block(base, "w", 0, make())
    # sparse, in the zeros the bomb's start looks like: the cheap look says a delta may
    # pay, so the whole anchor is read (and refused)
    sd["w"][:MiB // 2:4096] += 1
    child = str(tmp_path / "child")
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        peak, secs, out = _peak(lambda: dckpt.save(sd, child, base=base,
                                                   compression=compression))
    assert not isinstance(out, Exception), out
    assert peak < 40 * MiB, f"{peak / MiB:.0f} MiB allocated"
    assert "cannot be read" in caplog.text and "writing it in full" in caplog.text
    got = dckpt.load({"w": torch.zeros(MiB, dtype=torch.uint8)}, child)
    assert torch.equal(got["w"], sd["w"])
    assert not _manifest(child).tensors["w"].blocks[0].table[0, 3] & codec.XOR


def test_decode_prefix_stops_at_what_it_was_asked_for():
    """The unverified peek decodes at most ``n`` bytes, whatever the frame declares (a
    frame that asks for a window larger than a block gives no look at all)."""
    frames = [(codec.ZSTD, _zstd_unsized(64 * MiB), True),
              (codec.LZ4, _lz4_bomb(64 * MiB, True), True),
              (codec.ZSTD, _zstd_bomb(256 * MiB, 256 * MiB), False)]
    for flags, frame, looks in frames:
        peak, _, out = _peak(lambda: codec.decode_prefix(flags, frame[:160 << 10], 4096))
        assert out == (bytes(4096) if looks else None), type(out)
        assert peak < 16 * MiB, f"{peak / MiB:.0f} MiB allocated"


# ------------------------------------------------------------------ 1.6 nested headers

def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _safetensors_with_header(path, header: bytes, data: bytes = b"") -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_deeply_nested_safetensors_header_is_a_checkpoint_error(tmp_path):
    """A header nested 200k deep is a CheckpointError naming the file (it was a raw
    RecursionError), in a lone file and in an index."""
    src = tmp_path / "deep.safetensors"
    _safetensors_with_header(src, b'{"w":' + _nested(200_000) + b"}")
    with pytest.raises(CheckpointError, match=r"deep\.safetensors.*nested too deeply"):
        dckpt.import_checkpoint(str(src), str(tmp_path / "imp"))
    d = tmp_path / "hf"
    d.mkdir()
    _safetensors_with_header(d / "model.safetensors", json.dumps(
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode(), bytes(4))
    (d / "model.safetensors.index.json").write_bytes(
        b'{"metadata":' + _nested(200_000) + b',"weight_map":{"w":"model.safetensors"}}')
    with pytest.raises(CheckpointError, match=r"index\.json.*nested too deeply"):
        dckpt.import_checkpoint(str(d), str(tmp_path / "imp"))
    assert not os.path.exists(tmp_path / "imp" / mf.MANIFEST_NAME)


def test_deeply_nested_shard_header_is_an_integrity_error(tmp_path):
    """The same for a dckpt shard file's header (its CRC re-sealed, as a hostile file
    would): load raises IntegrityError naming the file."""
    path = str(tmp_path / "c")
    dckpt.save({"w": torch.ones(4)}, path)
    m = _manifest(path)
    f = m.files[0]
    p = os.path.join(path, f.name)
    with open(p, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        fh.seek(8 + n)
        data = fh.read()
    raw = b'{"x":' + _nested(200_000) + b"}"
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    with open(p, "wb") as fh:
        fh.write(head + data)
    entry = dataclasses.replace(f, size=len(head) + len(data), header_len=len(raw),
                                header_crc32=zlib.crc32(head))
    with open(os.path.join(path, mf.MANIFEST_NAME), "wb") as fh:
        fh.write(mf.to_json(dataclasses.replace(m, files=(entry,))))
    with pytest.raises(IntegrityError, match=f"{f.name}.*nested too deeply"):
        dckpt.load({"w": torch.zeros(4)}, path)


# ------------------------------------------------------------------ 1.10 history lines

def test_history_line_with_valid_crc_and_deep_nesting_is_skipped(tmp_path, caplog, capsys):
    """A history line whose CRC matches but whose JSON is nested too deeply for Python's
    parser is skipped with a warning, as torn lines are; `dckpt history` shows the rest
    (it crashed with a RecursionError)."""
    from dckpt.cli.main import main
    from dckpt.manager.history import HISTORY_FILE, SaveRecord, parse

    good = [SaveRecord(s, 1.7e9 + s, "durable", "sync", 100, 0.1, 0.2, 1).encode()
            for s in (1, 2)]
    body = b'{"v":1,"x":' + _nested(200_000) + b"}"
    deep = body[:-1] + b',"crc32":"%08x"}\n' % zlib.crc32(body)
    (tmp_path / HISTORY_FILE).write_bytes(good[0] + deep + good[1])
    recs, bad = parse(good[0] + deep + good[1])
    assert [r.step for r in recs] == [1, 2] and bad == 1
    with caplog.at_level(logging.WARNING, logger="dckpt.manager.history"):
        assert main(["history", str(tmp_path), "--json"]) == 0
    assert [d["step"] for d in json.loads(capsys.readouterr().out)] == [1, 2]
    assert "skipped 1 torn or corrupt line" in caplog.text


# ------------------------------------------------------------------ 1.7 import = save's checks

def _one_tensor_file(path, name: str, shape: list[int]) -> None:
    """A safetensors file with one F32 tensor ``name`` of ``shape`` (zeros), written by
    hand: safetensors' own writer refuses neither case below."""
    n = int(np.prod(shape)) * 4
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, n]}}).encode()
    _safetensors_with_header(path, header, bytes(n))


@pytest.mark.parametrize("case", ["65-dims", "lone-surrogate-key", "prefix-surrogate",
                                  "metadata-key"])
def test_import_refuses_what_load_would_refuse_and_commits_nothing(tmp_path, case):
    """Import applies save's checks to every key and shape before it writes anything:
    a 65-dimension tensor and a key that is not valid UTF-8 were committed, and then
    refused by every load."""
    src = tmp_path / "src.safetensors"
    prefix = None
    if case == "65-dims":
        _one_tensor_file(src, "w", [1] * 65)
        want = r"'w'.*65 dims.*at most 64"
    elif case == "lone-surrogate-key":
        _one_tensor_file(src, "w\ud800", [2])  # json.dumps escapes it: a valid header
        want = r"key 'w\\ud800' is not valid UTF-8"
    elif case == "prefix-surrogate":
        _one_tensor_file(src, "w", [2])
        prefix, want = "m\udc80", r"key 'm\\udc80\.w' is not valid UTF-8"
    else:
        _one_tensor_file(src, "w", [2])
        src2 = tmp_path / "torch.pt"
        torch.save({"__metadata__": torch.ones(2)}, src2)
        src, want = src2, r"__metadata__"
    dst = tmp_path / "imp"
    with pytest.raises(CheckpointError, match=want):
        dckpt.import_checkpoint(str(src), str(dst), prefix=prefix)
    assert not dst.exists() or os.listdir(dst) == []  # no data file, no manifest


def test_import_checks_the_manifest_it_commits_as_load_would(tmp_path, monkeypatch):
    """Whatever a source gets past the per-key checks, the manifest is parsed back, as
    load parses it, before the commit: an import never commits what load refuses."""
    from dckpt.interop import importer

    src = tmp_path / "src.safetensors"
    _one_tensor_file(src, "w", [2])
    real = importer._entry

    def broken(t, placed):  # a chunk table that does not cover the tensor
        e = real(t, placed)
        return dataclasses.replace(e, shape=(3,))

    monkeypatch.setattr(importer, "_entry", broken)
    dst = tmp_path / "imp"
    with pytest.raises(CheckpointError, match=r"would not load.*tensor 'w'"):
        dckpt.import_checkpoint(str(src), str(dst))
    assert os.listdir(dst) == []


# ------------------------------------------------------------------ 1.5 DCP sizes

def _dcp_dir(tmp_path) -> str:
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    sd = {"w": torch.randn(9, 4), "b": torch.ones(5, dtype=torch.bfloat16),
          "e": torch.zeros(0, 4), "s": torch.tensor(2.0), "n": 3}
    with pytest.warns(UserWarning):  # DCP's "assuming ... a single process"
        dcp.save(sd, checkpoint_id=src)
    return src


def _edit_metadata(src: str, edit) -> None:
    """Rewrite DCP's ``.metadata`` (our own file here: plain pickle is fine) after
    ``edit(md)``."""
    import pickle

    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _storage(md, fqn: str):
    return next(k for k in md.storage_data if k.fqn == fqn)


def _set_size(fqn: str, size, chunk=None):
    def edit(md):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        m = md.state_dict_metadata[fqn]
        m.size = size
        if chunk is not None:  # one chunk, the whole (declared) tensor, same storage
            key = _storage(md, fqn)
            info = md.storage_data.pop(key)
            m.chunks = [ChunkStorageMetadata(torch.Size(chunk[0]), torch.Size(chunk[1]))]
            md.storage_data[type(key)(fqn, chunk[0], 0)] = info
    return edit


def _set_storage(fqn: str, **kw):
    def edit(md):
        info = md.storage_data[_storage(md, fqn)]
        for k, v in kw.items():
            setattr(info, k, v)
    return edit


def _same_storage(fqn: str, as_fqn: str):
    def edit(md):
        md.storage_data[_storage(md, fqn)] = md.storage_data[_storage(md, as_fqn)]
    return edit


DCP_LIES = {
    # a shape whose chunks still say 9 x 4: they do not cover it
    "huge-shape": (_set_size("w", torch.Size([2**40, 2**20])), r"'w'.*cover"),
    # shape and chunk agree; the stored bytes (1.7 KB) cannot hold 4 TiB
    "huge-chunk": (_set_size("w", torch.Size([2**40, 2**20]), ([0, 0], [2**40, 2**20])),
                   r"'w'.*declares 4611686018427387904 bytes.*__0_0\.distcp holds 1\d\d\d bytes"),
    "negative-size": (_set_size("w", torch.Size([-3, 4])), r"'w'.*size"),
    "int-size": (_set_size("w", 36), r"'w'.*size"),
    "str-dtype": (lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "f32"),
                  r"'w'.*dtype"),
    "chunk-outside": (_set_size("b", torch.Size([5]), ([3], [5])), r"'b'.*chunk"),
    "past-end-of-file": (_set_storage("w", offset=10**9), r"'w'.*__0_0\.distcp.*end"),
    "negative-length": (_set_storage("w", length=-5), r"'w'.*length"),
    "missing-file": (_set_storage("w", relative_path="nope.distcp"), r"'w'.*nope\.distcp"),
    "outside-dir": (_set_storage("w", relative_path="../x.distcp"), r"'w'.*x\.distcp"),
    "shared-bytes": (_same_storage("b", "w"), r"overlap"),
    "no-storage": (lambda md: md.storage_data.pop(_storage(md, "w")), r"'w'.*no storage"),
    "bytes-past-end": (_set_storage("n", length=10**9), r"'n'.*end"),
}


@pytest.mark.parametrize("case", sorted(DCP_LIES))
def test_dcp_import_checks_declared_sizes_against_the_files(tmp_path, case):
    """Every size, offset and storage reference of a ``.metadata`` is checked against
    the files' bytes before anything is planned or allocated: each lie is a
    CheckpointError naming the key, within seconds (a 2**40 x 2**20 shape looped for
    minutes; a negative or non-list size was a raw RuntimeError/TypeError)."""
    import subprocess
    import sys

    src = _dcp_dir(tmp_path)
    edit, want = DCP_LIES[case]
    _edit_metadata(src, edit)
    dst = str(tmp_path / "imp")
    # In a child process with a deadline: the unchecked import of a huge shape never ends.
    code = ("import sys, dckpt\n"
            "try:\n"
            f"    dckpt.import_checkpoint({src!r}, {dst!r})\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, isinstance(e, dckpt.CheckpointError), str(e))\n"
            "else:\n"
            "    print('imported')\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    assert time.perf_counter() - t0 < 30
    kind, is_ckpt, msg = (out.split(" ", 2) + ["", ""])[:3]
    assert is_ckpt == "True", out
    import re

    assert re.search(want, msg), msg
    assert not os.path.exists(os.path.join(dst, mf.MANIFEST_NAME))


def test_dcp_import_of_a_sound_checkpoint_still_restores(tmp_path):
    """The checks refuse nothing DCP writes: values, bf16, 0-d and empty tensors."""
    src = _dcp_dir(tmp_path)
    dst = str(tmp_path / "imp")
    dckpt.import_checkpoint(src, dst)
    got = dckpt.load({"w": torch.zeros(9, 4), "b": torch.zeros(5, dtype=torch.bfloat16),
                      "e": torch.zeros(0, 4), "s": torch.tensor(0.0), "n": 0}, dst)
    assert got["b"].eq(1).all() and got["s"].item() == 2.0 and got["n"] == 3
