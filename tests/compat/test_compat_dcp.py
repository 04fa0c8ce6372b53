"""dckpt.compat.dcp runs code written for torch.distributed.checkpoint unchanged: the
cases follow PyTorch's own DCP tests (test_e2e_save_and_load.py, test_save_load_api.py),
each run with DCP itself and with dckpt's module, one process."""
from __future__ import annotations

import os
import pathlib

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import dckpt
from dckpt.compat import dcp as dckpt_dcp
from dckpt.errors import CheckpointError, UnsupportedValueError
from tests.dcpkit import Net, StatefulObj, TrainState, train

BOTH = pytest.mark.parametrize("dcp", [torch_dcp, dckpt_dcp], ids=["torch-dcp", "dckpt"])


@BOTH
def test_e2e_modules_optimizers_statefuls_and_bytes(tmp_path, dcp):
    model, optim = Net(), None
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    ts = train(model, optim, 2)
    obj = StatefulObj()
    dcp.save({"model": model, "optimizer": optim, "s": obj, "train_state": ts},
             checkpoint_id=str(tmp_path / "c"))

    model2 = Net()
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    train(model2, optim2, 1)  # DCP loads into existing optimizer state
    obj2, ts2 = StatefulObj(), TrainState()
    dcp.load({"model": model2, "optimizer": optim2, "s": obj2, "train_state": ts2},
             checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(obj.data, obj2.data)
    assert ts == ts2
    train(model, optim, 1)
    train(model2, optim2, 1)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


@BOTH
def test_stateful_objects_stay_and_plain_values_are_replaced(tmp_path, dcp):
    class StateDict(dict):
        set_called = False

        def __setitem__(self, k, v):
            self.set_called = True
            super().__setitem__(k, v)

    class Foo:
        called = False

        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            self.called = True

    foo, sd = Foo(), StateDict()
    sd["foo"] = foo
    sd.set_called = False
    dcp.save(sd, checkpoint_id=str(tmp_path / "a"))
    dcp.load(sd, checkpoint_id=str(tmp_path / "a"))
    assert foo.called and not sd.set_called and sd["foo"] is foo

    sd = StateDict()
    sd["foo"] = {"replicated": torch.rand(10, 10), "list": [1, 2, 3, 4]}
    want = sd["foo"]["replicated"].clone()
    sd.set_called = False
    dcp.save(sd, checkpoint_id=str(tmp_path / "b"))
    sd["foo"]["replicated"].zero_()
    dcp.load(sd, checkpoint_id=str(tmp_path / "b"))
    assert sd.set_called and torch.equal(sd["foo"]["replicated"], want)


@BOTH
def test_empty_state_and_pathlike_ids(tmp_path, dcp):
    dcp.save({}, checkpoint_id=tmp_path / "e")
    dcp.load({}, checkpoint_id=tmp_path / "e")
    sd = {"w": torch.arange(6.0), "step": 3, "name": "run", "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}
    dcp.save(sd, checkpoint_id=pathlib.Path(tmp_path / "p"))
    back = {"w": torch.zeros(6), "step": 0, "name": "", "cfg": {"lr": 0.0, "betas": [0.0, 0.0]}}
    dcp.load(back, checkpoint_id=pathlib.Path(tmp_path / "p"))
    assert torch.equal(back["w"], sd["w"]) and back["step"] == 3 and back["name"] == "run"
    assert back["cfg"] == {"lr": 0.5, "betas": [0.9, 0.99]}


@BOTH
def test_save_replaces_and_partial_load(tmp_path, dcp):
    path = str(tmp_path / "c")
    dcp.save({"a": torch.ones(3), "b": torch.ones(2)}, checkpoint_id=path)
    dcp.save({"a": torch.full((3,), 2.0), "b": torch.full((2,), 2.0)}, checkpoint_id=path)
    only_a = {"a": torch.zeros(3)}  # keys the state_dict does not ask for are ignored
    dcp.load(only_a, checkpoint_id=path)
    assert torch.equal(only_a["a"], torch.full((3,), 2.0))


@BOTH
def test_missing_key_fails_unless_partial_load_is_allowed(tmp_path, dcp):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    path = str(tmp_path / "c")
    dcp.save({"a": torch.ones(3)}, checkpoint_id=path)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: b"):
        dcp.load({"a": torch.zeros(3), "b": torch.zeros(2)}, checkpoint_id=path)
    sd = {"a": torch.zeros(3), "extra": {"b": torch.full((2,), 7.0)}}
    dcp.load(sd, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(sd["a"], torch.ones(3)) and torch.equal(sd["extra"]["b"], torch.full((2,), 7.0))


@BOTH
def test_file_system_writer_and_reader(tmp_path, dcp):
    sd = {"w": torch.randn(4, 4)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")))
    back = {"w": torch.zeros(4, 4)}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")))
    assert torch.equal(back["w"], sd["w"])


@BOTH
def test_async_save_returns_a_future_or_with_a_stager_an_async_save_response(tmp_path, dcp):
    """Issue 36 (item 4): frameworks check ``isinstance(result, Future)`` and, with a
    stager, read DCP's AsyncSaveResponse. Before: a SaveHandle, and async_stager was
    refused. The shim's values are those of the call in both forms, as DCP's."""
    import concurrent.futures as cf

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    sd = {"w": torch.randn(16, 16), "step": 5}
    want = sd["w"].clone()
    fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / "f"))
    assert isinstance(fut, cf.Future)
    sd["w"].add_(1)
    fut.result()
    for use_async in (False, True):
        stager = DefaultStager(StagingOptions(False, False, use_async, False))
        sd["w"].copy_(want)
        got = dcp.async_save(sd, checkpoint_id=str(tmp_path / f"s{use_async}"),
                             async_stager=stager)
        if use_async:  # a response only for async staging, in DCP and the shim
            assert isinstance(got, AsyncSaveResponse), type(got)
            got.staging_completion.result()
            sd["w"].add_(1)  # after the staging: not in the checkpoint
            assert isinstance(got.upload_completion, cf.Future)
            got.upload_completion.result()
        else:
            assert isinstance(got, cf.Future)
            sd["w"].add_(1)
            got.result()
        stager.close()
        back = {"w": torch.zeros(16, 16), "step": 0}
        dcp.load(back, checkpoint_id=str(tmp_path / f"s{use_async}"))
        assert torch.equal(back["w"], want) and back["step"] == 5
    back = {"w": torch.zeros(16, 16), "step": 0}
    dcp.load(back, checkpoint_id=str(tmp_path / "f"))
    assert torch.equal(back["w"], want)


def test_a_failed_async_save_fails_its_future_with_dcps_exception(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    blocked = tmp_path / "file"
    blocked.write_text("")
    fut = dckpt_dcp.async_save({"w": torch.ones(4)}, checkpoint_id=str(blocked / "c"))
    with pytest.raises(CheckpointException) as e:
        fut.result(timeout=60)
    assert isinstance(e.value, CheckpointError)
    assert isinstance(fut.exception(), CheckpointException)


@BOTH
def test_async_save(tmp_path, dcp):
    sd = {"w": torch.randn(64, 64), "step": 5}
    want = sd["w"].clone()
    fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / "c"))
    sd["w"].add_(1)  # after the call: not in the checkpoint
    fut.result()
    assert fut.done()
    back = {"w": torch.zeros(64, 64), "step": 0}
    dcp.load(back, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(back["w"], want) and back["step"] == 5


def test_a_dckpt_checkpoint_written_through_compat_is_a_dckpt_checkpoint(tmp_path):
    dckpt_dcp.save({"w": torch.ones(3), "blob": b"\x00\x01"}, checkpoint_id=str(tmp_path / "c"))
    from dckpt.catalog.verify import verify_checkpoint

    assert verify_checkpoint(str(tmp_path / "c")).ok
    back = {"w": torch.zeros(3), "blob": b""}
    dckpt_dcp.load(back, checkpoint_id=str(tmp_path / "c"))
    assert back["blob"] == b"\x00\x01" and torch.equal(back["w"], torch.ones(3))


def test_what_dckpt_refuses_is_clear(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner
    p = str(tmp_path / "c")

    class MyPlanner(DefaultSavePlanner):
        pass

    with pytest.raises(CheckpointError, match="planner MyPlanner"):
        dckpt_dcp.save({"a": torch.ones(1)}, checkpoint_id=p, planner=MyPlanner())
    dckpt_dcp.save({"a": torch.ones(1)}, checkpoint_id=p, planner=DefaultSavePlanner())
    with pytest.raises(CheckpointError, match="checkpoint_id"):
        dckpt_dcp.save({"a": torch.ones(1)})
    with pytest.raises(UnsupportedValueError, match="'odd'.*no pickle"):
        dckpt_dcp.save({"odd": {1, 2}}, checkpoint_id=p)
    assert dckpt.load({"a": torch.zeros(1)}, p)["a"].item() == 1.0  # still the old one


# --- load is in place (issue 25, 1.8): containers keep identity, tensors their storage --

@BOTH
def test_load_fills_nested_dicts_in_place(tmp_path, dcp):
    sd = {"model": {"w": torch.randn(4, 4), "inner": {"b": torch.randn(3), "n": 1, "s": "a"}},
          "step": 7}
    want = {"w": sd["model"]["w"].clone(), "b": sd["model"]["inner"]["b"].clone()}
    dcp.save(sd, checkpoint_id=str(tmp_path / "c"))

    msd, inner = sd["model"], sd["model"]["inner"]
    w, b = msd["w"], inner["b"]
    ptrs = [w.data_ptr(), b.data_ptr()]
    alias = {"held elsewhere": inner}  # e.g. a config dict another object keeps
    w.zero_(), b.zero_()
    inner["n"], inner["s"], sd["step"] = 0, "b", 0

    dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["model"] is msd and msd["inner"] is inner
    assert alias["held elsewhere"]["n"] == 1 and inner["s"] == "a"  # no stale values
    assert sd["step"] == 7
    assert msd["w"] is w and inner["b"] is b
    assert [w.data_ptr(), b.data_ptr()] == ptrs  # copied into, not replaced
    assert torch.equal(w, want["w"]) and torch.equal(b, want["b"])


def test_load_fills_lists_in_place(tmp_path):
    """DCP (torch 2.13) rebuilds a list while it initialises meta tensors, so a list
    held elsewhere keeps stale values there; dckpt fills lists in place like dicts."""
    sd = {"hist": [torch.ones(2), 5, {"x": "a"}, [3, torch.full((1,), 4.0)]], "flat": [1, 2]}
    dckpt_dcp.save(sd, checkpoint_id=str(tmp_path / "c"))
    hist, flat = sd["hist"], sd["flat"]
    h0, in_list, inner_list = hist[0], hist[2], hist[3]
    ptr = h0.data_ptr()
    h0.zero_(), inner_list[1].zero_()
    hist[1], in_list["x"], inner_list[0], flat[1] = 0, "b", 0, 0

    dckpt_dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["hist"] is hist and sd["flat"] is flat
    assert hist[2] is in_list and hist[3] is inner_list and hist[0] is h0
    assert hist[1] == 5 and in_list["x"] == "a" and inner_list[0] == 3 and flat == [1, 2]
    assert h0.data_ptr() == ptr and torch.equal(h0, torch.ones(2))
    assert torch.equal(inner_list[1], torch.full((1,), 4.0))


@BOTH
def test_load_keeps_modules_and_their_parameters(tmp_path, dcp):
    model = Net()
    dcp.save({"model": model}, checkpoint_id=str(tmp_path / "c"))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sd = {"model": model}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["model"] is model
    for n, p in model.named_parameters():
        assert p is params[n][0] and p.data_ptr() == params[n][1], n
        assert torch.equal(p, want[n]), n


@BOTH
def test_bytes_are_replaced_inside_their_own_container(tmp_path, dcp):
    dcp.save({"meta": {"blob": b"abc", "k": 3}}, checkpoint_id=str(tmp_path / "c"))
    meta = {"blob": b"", "k": 0}
    sd = {"meta": meta}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["meta"] is meta and meta == {"blob": b"abc", "k": 3}


class Counter:
    """A Stateful holding plain values and a nested dict; records what it was given."""

    def __init__(self, n: int = 0) -> None:
        self.n, self.cfg, self.w = n, {"lr": 0.1 * n, "tags": [f"t{n}", n]}, torch.full((3,), float(n))
        self.given = None

    def state_dict(self):
        return {"n": self.n, "cfg": self.cfg, "w": self.w}

    def load_state_dict(self, sd) -> None:
        self.given = sd
        self.n, self.cfg = sd["n"], sd["cfg"]
        self.w.copy_(sd["w"])


def test_stateful_load_state_dict_gets_the_loaded_values_at_any_depth(tmp_path):
    top, nested = Counter(2), Counter(3)
    dckpt_dcp.save({"top": top, "group": {"nested": nested, "x": 1}},
                   checkpoint_id=str(tmp_path / "c"))
    top2, nested2 = Counter(0), Counter(0)
    group = {"nested": nested2, "x": 0}
    ptr = nested2.w.data_ptr()
    sd = {"top": top2, "group": group}
    dckpt_dcp.load(sd, checkpoint_id=str(tmp_path / "c"))
    assert sd["top"] is top2 and sd["group"] is group and group["nested"] is nested2
    assert group["x"] == 1
    for got, want in ((top2, top), (nested2, nested)):
        assert got.given is not None and got.n == want.n and got.cfg == want.cfg
        assert torch.equal(got.w, want.w)
    assert nested2.w.data_ptr() == ptr


def test_partial_load_keeps_what_the_checkpoint_lacks_in_place(tmp_path):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    dckpt_dcp.save({"m": {"a": torch.ones(3), "n": 1}}, checkpoint_id=str(tmp_path / "c"))
    m = {"a": torch.zeros(3), "n": 0, "new": torch.full((2,), 7.0), "tag": "mine"}
    sd = {"m": m}
    dckpt_dcp.load(sd, checkpoint_id=str(tmp_path / "c"),
                   planner=DefaultLoadPlanner(allow_partial_load=True))
    assert sd["m"] is m and m["n"] == 1 and m["tag"] == "mine"
    assert torch.equal(m["a"], torch.ones(3)) and torch.equal(m["new"], torch.full((2,), 7.0))


def test_hugging_face_writer_and_reader_pass_through_to_dcp(tmp_path):
    """Issue 36 (item 4): torchtitan passes DCP's HuggingFaceStorageWriter/Reader for
    last_save_in_hf / initial_load_in_hf. Before: refused. Now DCP itself runs them:
    the same files as DCP writes (safetensors and a JSON index, no pickle), loaded back,
    sync and async."""
    import concurrent.futures as cf

    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    sd = {"model.w": torch.randn(4, 3), "model.b": torch.randn(3)}
    for name, dcp in (("dcp", torch_dcp), ("shim", dckpt_dcp)):
        out = str(tmp_path / name)
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out))
        fut = dcp.async_save(sd, storage_writer=HuggingFaceStorageWriter(out + "-async"))
        assert isinstance(fut, cf.Future)
        fut.result()
        for d in (out, out + "-async"):
            back = {k: torch.zeros_like(v) for k, v in sd.items()}
            dcp.load(back, storage_reader=HuggingFaceStorageReader(d))
            assert all(torch.equal(back[k], sd[k]) for k in sd)
    names = sorted(os.listdir(tmp_path / "shim"))
    assert names == sorted(os.listdir(tmp_path / "dcp"))
    assert names == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
