"""PyTorch's own DCP tests, one process, run through dckpt.compat.dcp (and through DCP
itself where the case is meant to agree), issue 26 section 2.

Adapted from pytorch/pytorch test/distributed/checkpoint/ (facts kept, code rewritten):
- test_planner.py, TestLoadPlanner.test_strict: a module with an extra parameter loads
  with DefaultLoadPlanner(allow_partial_load=True) and keeps the extra value; without
  it, CheckpointException "Missing key in checkpoint". test_load_different_sizes_throws:
  CheckpointException "Size mismatch". Not adapted: test_version_key_in_planner_data
  (reads planner.metadata, a DCP internal: dckpt plans by itself) and the planner-unit
  tests (create_default_local_load_plan, plan caching: DCP internals).
- e2e/test_e2e_save_and_load.py: test_stateful_and_non_stateful_loads (in
  tests/compat/test_compat_dcp.py), test_no_dist (empty state without a process group),
  test_overwrite (FileSystemWriter(overwrite=True/False): CheckpointException
  "Checkpoint already exists"), TestInitStateDict.test_init_state_dict (plain
  get_model_state_dict/get_optimizer_state_dict dicts loaded in place, then
  set_state_dict; the optimizer's lr comes back). Multi-rank cases:
  tests/multirank/test_dcp_reference.py.
- test_save_load_api.py, test_auto_detect: an unknown URL scheme raises RuntimeError
  "Cannot detect". Not adapted: the patch of FileSystemReader.validate_checkpoint_id
  (a DCP storage internal: dckpt has its own storage layer).
- test_file_system_checkpoint_cpu.py's dtype/shape facts: a tensor saved in another
  dtype is converted by the copy (int64 <- float32 included).
Also: the exceptions are DCP's type and dckpt's at once; a DCP checkpoint given to the
shim says how to convert it.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from dckpt.compat import dcp as dckpt_dcp
from dckpt.errors import (AlreadyExistsError, CheckpointError, NotCommittedError,
                          StateMismatchError)
from tests.dcpkit import Net

BOTH = pytest.mark.parametrize("dcp", [torch_dcp, dckpt_dcp], ids=["torch-dcp", "dckpt"])


def _with_extra_param() -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    m.extra_param = torch.nn.Parameter(torch.randn(2, 2))
    return m


@BOTH
def test_strict_missing_key_and_partial_load(tmp_path, dcp):
    original = torch.nn.Linear(2, 2)
    dcp.save({"module": original}, checkpoint_id=str(tmp_path))
    new = _with_extra_param()
    extra = new.extra_param.detach().clone()
    dcp.load({"module": new}, checkpoint_id=str(tmp_path),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(new.weight, original.weight) and torch.equal(new.bias, original.bias)
    assert torch.equal(new.extra_param, extra)  # what the checkpoint lacks is kept
    with pytest.raises(CheckpointException, match="Missing key in checkpoint") as info:
        dcp.load({"module": new}, checkpoint_id=str(tmp_path),
                 planner=DefaultLoadPlanner(allow_partial_load=False))
    assert "module.extra_param" in str(info.value)


def test_the_exception_is_dcps_and_dckpts(tmp_path):
    dckpt_dcp.save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path))
    target = {"a": torch.zeros(2), "b": torch.zeros(1)}
    with pytest.raises(StateMismatchError) as info:  # dckpt's own class hierarchy
        dckpt_dcp.load(target, checkpoint_id=str(tmp_path))
    e = info.value
    assert isinstance(e, CheckpointException) and isinstance(e, CheckpointError)
    assert isinstance(e, Exception)  # unlike DCP's: `except Exception` catches it
    (exc, _trace), = e.failures.values()  # DCP's shape: {rank: (exception, traceback)}
    assert "Missing key in checkpoint state_dict: b." in str(exc)
    assert torch.equal(target["a"], torch.zeros(2))  # nothing filled before the error


@BOTH
def test_load_different_sizes_throws(tmp_path, dcp):
    dcp.save({"module": torch.nn.Linear(2, 2)}, checkpoint_id=str(tmp_path))
    with pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load({"module": torch.nn.Linear(3, 2)}, checkpoint_id=str(tmp_path),
                 planner=DefaultLoadPlanner())


@BOTH
def test_overwrite(tmp_path, dcp):
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, checkpoint_id=str(tmp_path))
    dcp.save({"random": t2}, storage_writer=dcp.FileSystemWriter(str(tmp_path), overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    assert torch.equal(sd["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t1},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path), overwrite=False))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    assert torch.equal(sd["random"], t2)  # the refused save changed nothing


def test_overwrite_false_is_also_an_already_exists_error(tmp_path):
    dckpt_dcp.save({"x": torch.ones(1)}, checkpoint_id=str(tmp_path))
    writer = torch_dcp.FileSystemWriter(str(tmp_path), overwrite=False)  # DCP's own class
    with pytest.raises(AlreadyExistsError, match="Checkpoint already exists"):
        dckpt_dcp.save({"x": torch.zeros(1)}, storage_writer=writer)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dckpt_dcp.async_save({"x": torch.zeros(1)}, storage_writer=writer).result()


@BOTH
def test_no_dist(tmp_path, dcp):
    dcp.save({}, checkpoint_id=str(tmp_path))
    dcp.load({}, checkpoint_id=str(tmp_path))




@BOTH
def test_init_state_dict(tmp_path, dcp):
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_state_dict)

    model = Net()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    dcp.save({"model": get_model_state_dict(model),
              "optimizer": get_optimizer_state_dict(model, optim)}, checkpoint_id=str(tmp_path))

    model2 = Net()
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.2)  # a non-tensor that must change
    msd, osd = get_model_state_dict(model2), get_optimizer_state_dict(model2, optim2)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    assert sd["model"] is msd and sd["optimizer"] is osd  # in place
    set_state_dict(model2, optim2, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert optim2.param_groups[0]["lr"] == 0.1
    for k, v in get_model_state_dict(model).items():
        assert torch.equal(v, get_model_state_dict(model2)[k]), k


@BOTH
def test_auto_detect_unknown_scheme(tmp_path, dcp):
    with pytest.raises(RuntimeError, match="Cannot detect"):
        dcp.save({"a": torch.ones(1)}, checkpoint_id="abc://abc.abc")
    with pytest.raises(RuntimeError, match="Cannot detect"):
        dcp.load({"a": torch.ones(1)}, checkpoint_id="abc://abc.abc")


@BOTH
def test_a_tensor_saved_in_another_dtype_is_converted(tmp_path, dcp):
    dcp.save({"f": torch.tensor([1.0, 2.0]), "i": torch.tensor([3, 4]),
              "h": torch.tensor([0.5], dtype=torch.float64)}, checkpoint_id=str(tmp_path))
    sd = {"f": torch.zeros(2, dtype=torch.int64), "i": torch.zeros(2),
          "h": torch.zeros(1, dtype=torch.bfloat16)}
    f, i = sd["f"], sd["i"]
    dcp.load(sd, checkpoint_id=str(tmp_path))
    assert sd["f"] is f and sd["f"].dtype == torch.int64 and sd["f"].tolist() == [1, 2]
    assert sd["i"] is i and sd["i"].dtype == torch.float32 and sd["i"].tolist() == [3.0, 4.0]
    assert sd["h"].item() == 0.5


def test_meta_tensors_are_initialised(tmp_path):
    """DCP initialises a meta tensor it loads into (planner_helpers._init_state_dict;
    DCP itself needs a process group for it: the multirank file runs the TP case)."""
    dcp = dckpt_dcp
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(tmp_path))
    sd = {"w": torch.empty(2, 3, device="meta")}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    assert not sd["w"].is_meta and torch.equal(sd["w"], torch.arange(6.0).reshape(2, 3))


def test_a_dcp_checkpoint_says_how_to_convert_it(tmp_path):
    torch_dcp.save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path))
    with pytest.raises(NotCommittedError, match="dckpt import") as info:
        dckpt_dcp.load({"a": torch.zeros(2)}, checkpoint_id=str(tmp_path))
    assert isinstance(info.value, CheckpointException)


def test_deprecated_names(tmp_path):
    sd = {"w": torch.randn(3)}
    dckpt_dcp.save_state_dict(sd, storage_writer=dckpt_dcp.FileSystemWriter(str(tmp_path)))
    back = {"w": torch.zeros(3)}
    dckpt_dcp.load_state_dict(back, storage_reader=dckpt_dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(back["w"], sd["w"])
    assert dckpt_dcp.DefaultLoadPlanner is torch_dcp.DefaultLoadPlanner
    assert dckpt_dcp.CheckpointException is CheckpointException


@BOTH
def test_partial_load_in_a_list_keeps_what_the_checkpoint_lacks(tmp_path, dcp):
    """Was a documented difference (the shim refused, naming 'h.1'); issue 34 keeps such
    entries as DCP does."""
    dcp.save({"h": [torch.ones(1)]}, checkpoint_id=str(tmp_path))
    sd = {"h": [torch.zeros(1), torch.full((1,), 2.0), 5]}
    dcp.load(sd, checkpoint_id=str(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(sd["h"][0], torch.ones(1)) and torch.equal(sd["h"][1], torch.full((1,), 2.0))
    assert sd["h"][2] == 5
