"""Imports carry bytes values as dckpt.save stores them: up to 64 KiB inline in the
manifest, a larger one (torchtitan's pickled dataloader state: megabytes) as a bytes
entry of a data file, whole, up to 4 GiB (manifest version 5)."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import dckpt
from dckpt.cli.main import main
from dckpt.format import manifest as mf
from dckpt.format.sealed import INLINE_BYTES

BIG = bytes(range(256)) * (20 << 10)  # 5 MiB, over the old 1 MiB bound
MID = b"\x07" * (INLINE_BYTES + 1)  # just over the inline size
SMALL = b"\x01\x02" * 100


def _dcp(src: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=src)


def _raw(path: str) -> bytes:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("kw", [{}, {"compression": "zstd"}], ids=["plain", "zstd"])
def test_dcp_import_stores_large_bytes_values_as_entries_of_any_size(tmp_path, kw):
    """Over a file limit smaller than the value, it is still one chunk (a bytes entry is
    one); the manifest holds none of its bytes; load, open and verify read it back."""
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "imp")
    dl = {"dp_rank_0": BIG, "dp_rank_1": MID, "dp_rank_2": SMALL, "world_size": 3}
    _dcp(src, {"w": torch.arange(6.0), "dataloader": dl})
    dckpt.import_checkpoint(src, dst, prefix="train", max_shard_size="1MB", **kw)
    raw = _raw(dst)
    assert len(raw) < 8192 and json.loads(raw)["version"] == mf.BYTES_VERSION
    m = mf.parse(raw)
    for key, value in (("dp_rank_0", BIG), ("dp_rank_1", MID)):
        e = m.tensors[f"train.dataloader.{key}"]
        assert e.bytes_value and e.shape == (len(value),) and len(e.chunks) == 1
    assert set(m.values["train.dataloader.dp_rank_2"]) == {"$bytes"}  # inline, as save
    target = {"train": {"w": torch.zeros(6), "dataloader": {
        "dp_rank_0": b"", "dp_rank_1": b"", "dp_rank_2": b"", "world_size": 0}}}
    dckpt.load(target, dst)
    assert target["train"]["dataloader"] == dl
    assert torch.equal(target["train"]["w"], torch.arange(6.0))
    with dckpt.open(dst) as ck:
        assert ck["train.dataloader.dp_rank_0"] == BIG
        assert ck.info("train.dataloader.dp_rank_1").value == MID
    assert main(["verify", dst]) == 0


def test_torch_save_import_stores_large_bytes_values_as_entries(tmp_path):
    src, dst = str(tmp_path / "ckpt.pt"), str(tmp_path / "imp")
    torch.save({"model": {"w": torch.ones(3)}, "blob": BIG, "small": SMALL}, src)
    dckpt.import_checkpoint(src, dst, max_shard_size=64)
    m = mf.parse(_raw(dst))
    assert m.tensors["blob"].bytes_value and len(m.tensors["blob"].chunks) == 1
    with dckpt.open(dst) as ck:
        assert ck["blob"] == BIG and ck["small"] == SMALL
        assert torch.equal(ck["model.w"], torch.ones(3))
    # an HF export of the import skips the bytes, as it skips every value
    assert dckpt.export(dst, str(tmp_path / "hf")).tensors == 1


def test_an_import_without_large_bytes_values_stays_version_4(tmp_path):
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "imp")
    _dcp(src, {"w": torch.ones(2), "dl": {"dp_rank_0": SMALL}})
    dckpt.import_checkpoint(src, dst)
    assert json.loads(_raw(dst))["version"] < mf.BYTES_VERSION
    with dckpt.open(dst) as ck:
        assert ck["dl.dp_rank_0"] == SMALL
