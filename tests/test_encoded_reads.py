"""Reading compressed and incremental chunks costs one read per file span, not one per
1 MiB block (an object store pays a round trip per read: issue 30's restore of a
compressed durable chain from S3 was 10x slower than a raw one)."""
from __future__ import annotations

import base64
import itertools
import json
import os
import threading

import pytest
import torch

import dckpt
from dckpt.errors import CheckpointError, ManifestError
from dckpt.format import codec
from dckpt.format import manifest as mf
from dckpt.protocol.restore import read_manifest
from dckpt.storage.fsspec_storage import make_storage
from dckpt.view.open import Checkpoint


class CountingCalls:
    """A storage counting the data reads made through it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.lock = inner, 0, threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, path, start=0, length=None):
        with self.lock:
            self.calls += 1
        return self.inner.read(path, start, length)

    def open_read(self, path):
        outer, f = self, self.inner.open_read(path)

        class _F:
            def readv(self, start, bufs):
                with outer.lock:
                    outer.calls += 1
                return f.readv(start, bufs)

            def close(self):
                f.close()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return _F()


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_chunk_is_read_in_one_span_not_one_read_per_block(tmp_path, codec):
    pytest.importorskip("zstandard" if codec == "zstd" else "lz4")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32 << 18, generator=g).reshape(-1, 1024)  # 32 MiB: 32 blocks of 1 MiB
    w[::2] = 0  # compressible
    path = str(tmp_path / "ck")
    dckpt.save({"w": w}, path, compression=codec)
    storage, root = make_storage(path)
    m, _ = read_manifest(storage, root)
    assert m.tensors["w"].blocks[0].table is not None  # stored encoded, in blocks
    counting = CountingCalls(storage)
    with Checkpoint(counting, root, m, path=path, read_workers=1) as ck:
        got = ck["w"]
    assert torch.equal(got, w)
    # one header read, then one read per 8 MiB task (a quarter of the bytes for one
    # worker), its blocks in one span: 5 reads (was 33: one per block)
    assert counting.calls <= 6, counting.calls


# ------------------------------------------------- block tables a manifest may declare

def _reblock(path: str, key: str, size: int, raw: bytes) -> None:
    """Rewrite the manifest at ``path`` so that ``key``'s chunk 0 (stored raw, in one
    block, as a compressed save stores a tiny tensor) is declared as blocks of ``size``
    bytes: their content hashes and one raw row per block, each pointing at its bytes,
    resealed. Every hash, row and checksum agrees: only the block size is hostile."""
    mpath = os.path.join(path, mf.MANIFEST_NAME)
    with open(mpath, "rb") as f:
        doc = json.loads(f.read())
    b = doc["tensors"][key]["blocks"]
    assert len(b["enc"]["0"]) == mf.TABLE_COLS and b["enc"]["0"][3] == codec.RAW
    n = codec.nblocks(len(raw), size)
    rows = [[0, k * size, min(size, len(raw) - k * size), codec.RAW, -1, -1, -1, -1]
            for k in range(n)]
    b["size"] = size
    b["hash"] = base64.b64encode(codec.block_hashes(memoryview(raw), size)).decode()
    b["enc"] = {"0": [x for col in zip(*rows) for x in col]}  # column-major
    with open(mpath, "wb") as f:
        f.write(mf.seal(doc))


def _tiny_compressed(tmp_path) -> tuple[str, torch.Tensor]:
    pytest.importorskip("zstandard")
    w = torch.arange(8.).reshape(2, 4)
    path = str(tmp_path / "ck")
    dckpt.save({"w": w}, path, compression="zstd")
    return path, w


def test_a_block_size_that_cuts_elements_is_refused_naming_key_and_file(tmp_path):
    """A manifest declaring 6-byte blocks of a float32 chunk (hashes and rows agreeing)
    read back denormal garbage for w[0:1, 2:4] and raised a raw RuntimeError for
    w[0:1, 2:3]: a block boundary inside an element. Refused at parse."""
    path, w = _tiny_compressed(tmp_path)
    _reblock(path, "w", 6, w.numpy().tobytes())
    for index in [(slice(0, 1), slice(2, 4)), (slice(0, 1), slice(2, 3))]:
        with pytest.raises(CheckpointError, match=r"manifest\.json.*'w'.*block size 6") as e:
            dckpt.open(path).get_slice("w")[index]
        assert isinstance(e.value, ManifestError)
    with pytest.raises(ManifestError, match=r"manifest\.json.*'w'.*block size 6"):
        dckpt.load({"w": torch.zeros(2, 4)}, path)


@pytest.mark.parametrize("size", [4, 8, 12, 20, 32, codec.HASH_BLOCK])
def test_any_block_size_of_whole_elements_reads_every_slice_right(tmp_path, size):
    """Block sizes other than the 1 MiB dckpt writes, when whole elements, are read
    right: every slice of every block split."""
    path, w = _tiny_compressed(tmp_path)
    _reblock(path, "w", size, w.numpy().tobytes())
    with dckpt.open(path) as ck:
        s = ck.get_slice("w")
        for r0, r1, c0, c1 in itertools.product(range(3), range(3), range(5), range(5)):
            if r0 < r1 and c0 < c1:
                assert torch.equal(s[r0:r1, c0:c1], w[r0:r1, c0:c1]), (r0, r1, c0, c1)
    got = {"w": torch.zeros(2, 4)}
    dckpt.load(got, path)
    assert torch.equal(got["w"], w)


@pytest.mark.parametrize("size", [0, -4, 2, 6, 1023, codec.HASH_BLOCK + 4,
                                  2 * codec.HASH_BLOCK, 1 << 40, (1 << 63) - 1, 1 << 64])
def test_block_sizes_out_of_whole_elements_or_over_1_MiB_are_refused(tmp_path, size):
    """Not a multiple of the item size, zero, negative, or over the 1 MiB that bounds
    what decoding one block may allocate (see the test below)."""
    path, w = _tiny_compressed(tmp_path)
    if 1 <= size <= 2 * codec.HASH_BLOCK:  # hashes and rows agree: only the size is wrong
        _reblock(path, "w", size, w.numpy().tobytes())
    else:
        mpath = os.path.join(path, mf.MANIFEST_NAME)
        with open(mpath, "rb") as f:
            doc = json.loads(f.read())
        doc["tensors"]["w"]["blocks"]["size"] = size
        with open(mpath, "wb") as f:
            f.write(mf.seal(doc))
    with pytest.raises(ManifestError, match=r"manifest\.json.*tensor 'w'.*block size"):
        dckpt.open(path)


def test_a_block_declared_over_1_MiB_cannot_make_a_read_decode_that_much(tmp_path):
    """The 1 MiB cap on what one block's frame may decode to (codec._decompress) holds
    only if a block is at most 1 MiB: a manifest declaring one 64 MiB block (of a 64
    MiB tensor) made a read of one element decode a 2 KiB zstd frame to 64 MiB before
    the hash check refused it (a 64 MiB peak). Refused at parse now, before any read."""
    pytest.importorskip("zstandard")
    from test_untrusted_input import _half_random, _peak, _replace_block, _zstd_bomb

    size = 64 << 20
    path = str(tmp_path / "ck")
    dckpt.save({"w": _half_random()}, path, compression="zstd")
    bomb = _zstd_bomb(size, size)
    _replace_block(path, "w", 0, bomb)  # every CRC resealed over it
    mpath = os.path.join(path, mf.MANIFEST_NAME)
    with open(mpath, "rb") as f:
        doc = json.loads(f.read())
    t = doc["tensors"]["w"]
    assert t["dtype"] == "U8" and t["blocks"]["enc"]["0"][3] == codec.ZSTD
    t["shape"], t["chunks"]["grid"] = [size], [[0, size]]
    t["blocks"]["size"] = size  # one block: hashes and row agree in number
    t["blocks"]["enc"]["0"][2] = len(bomb)
    with open(mpath, "wb") as f:
        f.write(mf.seal(doc))
    peak, _, got = _peak(lambda: dckpt.open(path).get_slice("w")[0:1])
    assert isinstance(got, ManifestError), got
    assert "tensor 'w' block size" in str(got) and mf.MANIFEST_NAME in str(got)
    assert peak < 8 << 20, peak
