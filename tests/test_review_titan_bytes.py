"""Adversarial review of b9b0cbc (bytes values over 64 KiB stored in data files): what
a single process can show. Multi-rank cases: tests/multirank/test_review_titan_bytes.py."""
from __future__ import annotations

import warnings

import pytest
import torch


def test_importing_a_dcp_checkpoint_with_a_large_dataloader_blob(tmp_path):
    """The case b9b0cbc was written for (torchtitan's dataloader state pickled to
    megabytes, {"dp_rank_<r>": bytes}) saved by DCP: `dckpt import` must carry it as
    save does now (a data-file entry; "bytes of any size" in the design). It raises
    UnsupportedValueError "... over the 1048576-byte limit for bytes values kept in a
    manifest (dckpt.save stores larger ones in its data files)": a run cannot move its
    DCP checkpoint to dckpt, and the message points at an API the user did not call."""
    import torch.distributed.checkpoint as dcp

    import dckpt

    src, dst = str(tmp_path / "dcp"), str(tmp_path / "imported")
    blob = bytes(range(256)) * (6 << 10)  # 1.5 MiB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(3), "dataloader": {"dp_rank_0": blob}}, checkpoint_id=src)
    dckpt.import_checkpoint(src, dst)
    ck = dckpt.open(dst)
    assert ck["dataloader.dp_rank_0"] == blob
    assert torch.equal(ck["w"], torch.ones(3))
