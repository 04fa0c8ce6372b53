"""Reading compressed and incremental chunks costs one read per file span, not one per
1 MiB block (an object store pays a round trip per read: issue 30's restore of a
compressed durable chain from S3 was 10x slower than a raw one)."""
from __future__ import annotations

import threading

import pytest
import torch

import dckpt
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
