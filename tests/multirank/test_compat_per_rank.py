"""Issue 36: a dataloader's per-rank state through dckpt.compat.dcp, as torchtitan's
ParallelAwareDataloader saves it: {"dp_rank_<r>": bytes, "world_size": N}, each rank a
key no other rank has, with an opaque bytes value. Saved at 2 ranks, loaded at 2 (each
rank gets its own back), compared with DCP itself in the same test. Before: the shim
kept the lowest rank's value and raised a mismatch."""
from __future__ import annotations

import os

import torch.distributed as dist

DEADLINE = 120


class Loader:
    """A Stateful shaped like torchtitan's ParallelAwareDataloader."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        r = dist.get_rank()
        return {f"dp_rank_{r}": f"position {self.pos} of rank {r}".encode() * 3,
                "world_size": dist.get_world_size()}

    def load_state_dict(self, sd: dict) -> None:
        r = dist.get_rank()
        blob = sd[f"dp_rank_{r}"]
        assert isinstance(blob, bytes), type(blob)
        self.pos = int(blob.split(b" ")[1])
        assert sd["world_size"] == dist.get_world_size()


def _roundtrip(base: str, which: str) -> int:
    import torch.distributed.checkpoint as torch_dcp

    from dckpt.compat import dcp as dckpt_dcp

    dcp = torch_dcp if which == "dcp" else dckpt_dcp
    path = os.path.join(base, which)
    dcp.save({"dataloader": Loader(100 + dist.get_rank())}, checkpoint_id=path)
    back = Loader(-1)
    dcp.load({"dataloader": back}, checkpoint_id=path)
    return back.pos


def test_per_rank_keys_with_bytes_round_trip_like_dcp(ranks, tmp_path):
    for which in ("dcp", "dckpt"):
        assert ranks(2).run(_roundtrip, str(tmp_path), which, timeout=DEADLINE) == [100, 101], which


def test_records_merge_every_ranks_record_and_the_older_single_one():
    """Pure: a checkpoint written before per-rank records (one ``__dckpt_compat_bytes__``
    value) still loads, and every rank's record counts."""
    import json
    from types import SimpleNamespace

    import pytest

    from dckpt.compat.dcp_state import BYTES_KEY
    from dckpt.compat.dcp_values import EMPTY_KEY, records
    from dckpt.errors import ManifestError

    m = SimpleNamespace(values={BYTES_KEY: json.dumps({"a": "bytes"}),
                                f"{BYTES_KEY}.0": json.dumps({"d.dp_rank_0": "bytes"}),
                                f"{BYTES_KEY}.1": json.dumps({"d.dp_rank_1": "bytesio"}),
                                f"{EMPTY_KEY}.1": json.dumps(["x.y"]), "other": 3})
    assert records(m, BYTES_KEY, dict) == {"a": "bytes", "d.dp_rank_0": "bytes",
                                           "d.dp_rank_1": "bytesio"}
    assert records(m, EMPTY_KEY, list) == ["x.y"]
    m.values[f"{EMPTY_KEY}.0"] = "[1]"
    with pytest.raises(ManifestError, match=rf"{EMPTY_KEY}\.0"):
        records(m, EMPTY_KEY, list)
