"""dckpt.compat.dcp.load replaces values that are not tensors whole, as DCP does
(issue 34, section 2, defect 2): a list of plain values is one value to DCP (its
flatten stops at a list holding no tensor and no dict), so a load gives the saved list
whatever the length of the list it replaces. The shim filled such lists by index:
[0.9, 0.5, 0.3] into [] gave [], [1, 2, 3] into [0] gave [1], and into [0, 0, 0, 0]
raised "Missing key". Each case runs through DCP itself too, one process."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

import dckpt
from dckpt.compat import dcp as dckpt_dcp
from dckpt.errors import CheckpointError

BOTH = pytest.mark.parametrize("dcp", [torch_dcp, dckpt_dcp], ids=["torch-dcp", "dckpt"])


class Holder:
    """A Stateful holding one plain value (a scheduler's lr list, a sampler's queue)."""

    def __init__(self, v) -> None:
        self.v = v

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, sd) -> None:
        self.v = sd["v"]


@BOTH
@pytest.mark.parametrize("saved, into", [
    ([0.9, 0.5, 0.3], []), ([1, 2, 3], [0]), ([1, 2, 3], [0, 0, 0, 0]), ([], [1, 2]),
    ([[1, 2], []], [[0], [5, 6]]), ([None, "s", True], [1]), (5, [1]), ([1.5], None),
], ids=["into-empty", "into-shorter", "into-longer", "empty-into-two", "nested",
        "mixed", "scalar-into-list", "list-into-None"])
def test_plain_values_are_replaced_whole(tmp_path, dcp, saved, into):
    dcp.save({"s": Holder(saved)}, checkpoint_id=str(tmp_path / "c"))
    target = Holder(into)
    dcp.load({"s": target}, checkpoint_id=str(tmp_path / "c"))
    assert target.v == saved


@BOTH
def test_in_plain_dicts_and_beside_tensors(tmp_path, dcp):
    saved = {"cfg": {"lrs": [0.1, 0.2, 0.3], "betas": (0.9, 0.99)},
             "hist": [torch.ones(2), [1, 2, 3], {"x": [4, 5]}]}
    dcp.save(saved, checkpoint_id=str(tmp_path / "c"))
    sd = {"cfg": {"lrs": [0.0], "betas": (0.0, 0.0)},
          "hist": [torch.zeros(2), [], {"x": [0, 0, 0]}]}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["cfg"] == saved["cfg"]
    hist = sd["hist"]  # holds a tensor: filled by index (DCP rebuilds it, dckpt fills it)
    assert torch.equal(hist[0], torch.ones(2)) and hist[1:] == [[1, 2, 3], {"x": [4, 5]}]


@BOTH
def test_a_list_the_checkpoint_lacks(tmp_path, dcp):
    dcp.save({"m": {"a": torch.ones(1)}}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: m.v"):
        dcp.load({"m": {"a": torch.zeros(1), "v": [1, 2]}}, checkpoint_id=str(tmp_path / "c"))
    sd = {"m": {"a": torch.zeros(1), "v": [1, 2]}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert sd["m"]["v"] == [1, 2] and torch.equal(sd["m"]["a"], torch.ones(1))


def test_lists_keep_their_identity_and_partial_loads_work_inside_lists(tmp_path):
    """dckpt's extra over DCP: a list the caller holds elsewhere sees the loaded values
    (filled in place, nested lists too), and allow_partial_load keeps entries of a list
    the checkpoint lacks (DCP's flatten addresses them by index; the shim refused)."""
    dckpt_dcp.save({"q": [[1, 2], [3]], "l": [torch.ones(1)]}, checkpoint_id=str(tmp_path / "c"))
    q = [[0], [0, 0, 0]]
    inner = q[0]
    sd = {"q": q, "l": [torch.zeros(1), 7, torch.full((1,), 2.0)]}
    dckpt_dcp.load(sd, checkpoint_id=str(tmp_path / "c"),
                   planner=DefaultLoadPlanner(allow_partial_load=True))
    assert sd["q"] is q and q[0] is inner and q == [[1, 2], [3]]
    assert torch.equal(sd["l"][0], torch.ones(1)) and sd["l"][1] == 7
    assert torch.equal(sd["l"][2], torch.full((1,), 2.0))


def test_the_checkpoint_stays_a_dckpt_checkpoint(tmp_path):
    """An empty list leaves no leaf key, so the shim lists them in one JSON value;
    dckpt.load and a shim without it still read the leaves."""
    path = str(tmp_path / "c")
    dckpt_dcp.save({"a": [], "b": [[], [1]], "c": [2, 3]}, checkpoint_id=path)
    back = dckpt.load({"b": [[], [0]], "c": [0, 0]}, path, strict=False)
    assert back == {"b": [[], [1]], "c": [2, 3]}
    sd = {"a": [9], "b": [9], "c": [9]}
    dckpt_dcp.load(sd, checkpoint_id=path)
    assert sd == {"a": [], "b": [[], [1]], "c": [2, 3]}


def test_a_damaged_list_record_is_a_manifest_error(tmp_path):
    path = str(tmp_path / "c")
    dckpt.save({"__dckpt_compat_empty__": "[1, 2", "a": 1}, path)
    with pytest.raises(CheckpointError, match="__dckpt_compat_empty__"):
        dckpt_dcp.load({"a": []}, checkpoint_id=path)
