"""Export to Hugging Face safetensors and import from DCP, safetensors and torch.save,
in one process (the multi-rank cases are in tests/multirank/test_interop.py)."""
from __future__ import annotations

import json
import os
import pickle
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

import dckpt
from dckpt.cli.main import main
from dckpt.format import manifest as mf


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"train": {"model": {
        "embed.weight": torch.randn(40, 16, generator=g),
        "layers.0.w": torch.randn(16, 16, generator=g),
        "layers.0.b": torch.randn(16, generator=g).to(torch.bfloat16),
        "layers.0.scale": torch.tensor(2.5, dtype=torch.float64),  # 0-d
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4)},
        "optim": {"state.embed.weight.exp_avg": torch.ones(40, 16)}},
        "step": 3}


def _model(state: dict) -> dict:
    return state["train"]["model"]


def _ckpt(tmp_path, name="ckpt", **kw) -> str:
    path = str(tmp_path / name)
    dckpt.save(_state(), path, **kw)
    return path


def _manifest(path: str) -> mf.Manifest:
    return mf.parse(open(os.path.join(path, "manifest.json"), "rb").read())


# ------------------------------------------------------------------------ export

def test_export_single_file_is_plain_safetensors(tmp_path):
    path = _ckpt(tmp_path)
    out = str(tmp_path / "hf")
    info = dckpt.export(path, out, prefix="train.model.")
    assert info.files == ("model.safetensors",) and sorted(os.listdir(out)) == ["model.safetensors"]
    got = load_file(os.path.join(out, "model.safetensors"))  # safetensors' own reader
    want = _model(_state())
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert info.tensors == len(want) and info.bytes == sum(t.nbytes for t in want.values())
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers checks it


def test_export_sharded_with_index_and_prefix_without_dot(tmp_path):
    path = _ckpt(tmp_path)
    out = str(tmp_path / "hf")
    info = dckpt.export(path, out, prefix="train.model", max_shard_size="3KB")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    n = len(info.files)
    assert n > 1 and list(info.files) == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                         for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(info.files)
    want = _model(_state())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    got = {}
    for f in info.files:
        part = load_file(os.path.join(out, f))
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # a tensor over the limit gets a file of its own (embed.weight is 2560 bytes)
    assert dckpt.export(path, str(tmp_path / "hf2"), prefix="train.model.",
                        max_shard_size=100).files[0].startswith("model-00001-of-")


def test_export_dtype_converts_floats_only(tmp_path):
    path = _ckpt(tmp_path)
    out = str(tmp_path / "hf")
    dckpt.export(path, out, prefix="train.model.", dtype="bf16", max_shard_size="2KB")
    got = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, f)))
    want = _model(_state())
    for k, t in want.items():
        if t.is_floating_point():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], t.to(torch.bfloat16)), k
        else:
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_export_slabs_reassemble_big_tensors(tmp_path):
    """A tensor read in several slabs (a read budget under its size) comes out whole."""
    path = str(tmp_path / "ckpt")
    t = torch.randn(300, 70)
    dckpt.save({"m": {"w": t, "v": torch.randn(7, 3, 5)}}, path)
    out = str(tmp_path / "hf")
    dckpt.export(path, out, prefix="m.", dtype="fp16", read_budget=4096)
    got = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(got["w"], t.half())


def test_export_follows_incremental_and_compressed_checkpoints(tmp_path):
    base = _ckpt(tmp_path, "step-1")
    s = _state()
    _model(s)["embed.weight"][3] += 1
    dckpt.save(s, str(tmp_path / "step-2"), base=base, compression="zstd")
    out = str(tmp_path / "hf")
    dckpt.export(str(tmp_path / "step-2"), out, prefix="train.model.")
    got = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in _model(s).items())


def test_export_from_and_to_fsspec_urls(tmp_path):
    name = uuid.uuid4().hex
    dckpt.save(_state(), f"memory://{name}/ckpt")
    info = dckpt.export(f"memory://{name}/ckpt", f"memory://{name}/hf", prefix="train.model.",
                        max_shard_size="3KB")
    import fsspec

    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"/{name}/hf", detail=False))
    assert names == sorted(info.files + ("model.safetensors.index.json",))
    # and back: an import of the exported directory loads the same tensors
    local = str(tmp_path / "hf")
    dckpt.export(f"memory://{name}/ckpt", local, prefix="train.model.", max_shard_size="3KB")
    dckpt.import_checkpoint(local, f"memory://{name}/back", prefix="train.model.")
    target = {"train": {"model": {k: torch.zeros_like(v) for k, v in _model(_state()).items()}}}
    dckpt.load(target, f"memory://{name}/back")
    assert all(torch.equal(target["train"]["model"][k], v) for k, v in _model(_state()).items())


def test_export_prefix_and_argument_errors(tmp_path):
    path = _ckpt(tmp_path)
    with pytest.raises(dckpt.CheckpointError, match=r"'nope\.'.*'train\.model\.'"):
        dckpt.export(path, str(tmp_path / "a"), prefix="nope")
    with pytest.raises(dckpt.CheckpointError, match="dtype"):
        dckpt.export(path, str(tmp_path / "a"), prefix="train.model.", dtype="int8")
    with pytest.raises(dckpt.CheckpointError, match="max_shard_size"):
        dckpt.export(path, str(tmp_path / "a"), prefix="train.model.", max_shard_size="5 parsecs")
    with pytest.raises(dckpt.NotCommittedError):
        dckpt.export(str(tmp_path / "missing"), str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a")  # nothing was created for a failed export


def test_export_refuses_non_empty_dir_and_overwrite_replaces_weights(tmp_path):
    path = _ckpt(tmp_path)
    out = tmp_path / "hf"
    dckpt.export(path, str(out), prefix="train.model.", max_shard_size="2KB")
    (out / "config.json").write_text("{}")
    (out / ".model-00001-of-00009.safetensors.tmp-0123456789ab").write_bytes(b"killed")
    with pytest.raises(dckpt.CheckpointError, match="not empty.*overwrite"):
        dckpt.export(path, str(out), prefix="train.model.")
    dckpt.export(path, str(out), prefix="train.model.", overwrite=True)  # now one file
    # old shards, index and a killed export's temporary file gone; config.json kept
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    (out / "model.safetensors").write_bytes(b"junk")  # a non-directory target
    with pytest.raises(dckpt.CheckpointError, match="not a directory"):
        dckpt.export(path, str(out / "model.safetensors"), prefix="train.model.")


def test_export_verifies_checksums_and_leaves_no_loadable_dir(tmp_path):
    path = _ckpt(tmp_path)
    data = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    b = bytearray(open(data, "rb").read())
    b[-20] ^= 0x10  # a flipped bit in the last tensor of the file
    open(data, "wb").write(b)
    out = tmp_path / "hf"
    with pytest.raises(dckpt.IntegrityError, match="checksum"):
        dckpt.export(path, str(out), prefix="train.", max_shard_size="2KB")
    # neither an index nor model.safetensors, and no temporary file left behind
    left = os.listdir(out)
    assert "model.safetensors.index.json" not in left and "model.safetensors" not in left
    assert not [f for f in left if f.startswith(".")]


def test_export_and_safetensors_import_never_unpickle(tmp_path, monkeypatch):
    """Only the DCP and torch.save readers may unpickle: with every unpickling entry
    point booby-trapped, an export, a safetensors import and its load still work."""
    path = _ckpt(tmp_path)

    def trap(*a, **k):
        raise AssertionError("dckpt unpickled something")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                      (torch, "load")):
        monkeypatch.setattr(mod, name, trap)
    hf = str(tmp_path / "hf")
    dckpt.export(path, hf, prefix="train.model.", max_shard_size="2KB", dtype="bf16")
    dckpt.import_checkpoint(hf, str(tmp_path / "imp"), prefix="train.model.")
    got = _load_like({"train": {"model": {k: v.to(torch.bfloat16) if v.is_floating_point()
                                          else v for k, v in _model(_state()).items()}}},
                     str(tmp_path / "imp"))
    assert torch.equal(got["embed.weight"], _model(_state())["embed.weight"].bfloat16())


# ------------------------------------------------------------------------ import

def _load_like(state: dict, path: str) -> dict:
    target = {"train": {"model": {k: torch.zeros_like(v) for k, v in _model(state).items()}}}
    dckpt.load(target, path)
    return _model(target)


def test_import_safetensors_file_and_directory_with_index(tmp_path):
    want = _model(_state())
    single = str(tmp_path / "one.safetensors")
    save_file(want, single, metadata={"format": "pt"})
    dckpt.import_checkpoint(single, str(tmp_path / "a"), prefix="train.model.")
    got = _load_like(_state(), str(tmp_path / "a"))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    hf = str(tmp_path / "hf")
    dckpt.export(_ckpt(tmp_path), hf, prefix="train.model.", max_shard_size="2KB")
    assert os.path.exists(os.path.join(hf, "model.safetensors.index.json"))
    info = dckpt.import_checkpoint(hf, str(tmp_path / "b"), prefix="train.model",
                                   max_shard_size="1KB")
    got = _load_like(_state(), str(tmp_path / "b"))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert info.num_files > 3 and main(["verify", str(tmp_path / "b")]) == 0
    m = _manifest(str(tmp_path / "b"))
    assert m.meta["imported_from"]["format"] == "safetensors" and m.world_size == 1
    # embed.weight (2560 bytes) over a 1KB file limit: cut along dim 0, one slab per file
    e = m.tensors["train.model.embed.weight"]
    assert len(e.chunks) > 1 and e.chunks.grid[0][0] == 0 and e.blocks is not None


def test_import_torch_save_with_optimizer_and_values(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    src = str(tmp_path / "ckpt.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 7}, src)
    dst = str(tmp_path / "imp")
    dckpt.import_checkpoint(src, dst, max_shard_size=64)
    model2 = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    state = {"model": model2.state_dict(), "optimizer": opt2.state_dict(), "epoch": 0}
    dckpt.load(state, dst)  # into a fresh optimizer: its empty state is rebuilt
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    assert state["epoch"] == 7 and opt2.param_groups[0]["lr"] == 0.01
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][1]["exp_avg"],
                       opt2.state_dict()["state"][1]["exp_avg"])


def test_import_dcp_single_process_with_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    sd = {"model": {"w": torch.randn(9, 4), "i": torch.arange(5)}, "step": 11,
          "sched": {"lrs": [0.1, 0.2], "name": "cos"}}
    with pytest.warns(UserWarning):  # DCP's "assuming ... a single process"
        dcp.save(sd, checkpoint_id=src)
    dst = str(tmp_path / "imp")
    dckpt.import_checkpoint(src, dst, prefix="app")
    target = {"app": {"model": {"w": torch.zeros(9, 4), "i": torch.zeros(5, dtype=torch.int64)},
                      "step": 0, "sched": {"lrs": [0.0, 0.0], "name": ""}}}
    dckpt.load(target, dst)
    assert torch.equal(target["app"]["model"]["w"], sd["model"]["w"])
    assert target["app"]["step"] == 11 and target["app"]["sched"] == sd["sched"]


class _Opaque:
    """Not plain data: weights_only refuses it."""


def test_import_dcp_refuses_an_object_naming_its_entry(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(3), "n": 1, "obj": _Opaque()}, checkpoint_id=src)
    with pytest.raises(dckpt.UnsupportedValueError, match="entry 'obj'.*weights_only"):
        dckpt.import_checkpoint(src, str(tmp_path / "imp"))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_import_dcp_metadata_unpickler_refuses_foreign_globals(tmp_path, monkeypatch):
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(dckpt.CheckpointError, match=r"\.metadata.*system.*not unpickle"):
        dckpt.import_checkpoint(str(src), str(tmp_path / "imp"))
    assert not (tmp_path / "PWNED").exists()
    (src / ".metadata").write_bytes(b"garbage")
    with pytest.raises(dckpt.CheckpointError, match="not DCP metadata"):
        dckpt.import_checkpoint(str(src), str(tmp_path / "imp"))


def test_import_aliases_for_tied_weights(tmp_path):
    emb = torch.randn(10, 4)
    src = str(tmp_path / "m.safetensors")
    save_file({"model.embed_tokens.weight": emb}, src)
    dst = str(tmp_path / "imp")
    dckpt.import_checkpoint(src, dst, aliases={"lm_head.weight": "model.embed_tokens.weight"})
    t = {"model.embed_tokens.weight": torch.zeros(10, 4), "lm_head.weight": torch.zeros(10, 4)}
    dckpt.load(t, dst)
    assert torch.equal(t["lm_head.weight"], emb)
    assert torch.equal(t["model.embed_tokens.weight"], emb)
    with pytest.raises(dckpt.CheckpointError, match="'nope'"):
        dckpt.import_checkpoint(src, str(tmp_path / "x"), aliases={"a": "nope"})
    with pytest.raises(dckpt.StateMismatchError, match="twice"):
        dckpt.import_checkpoint(src, str(tmp_path / "x"),
                                aliases={"model.embed_tokens.weight": "model.embed_tokens.weight"})


def test_import_bad_sources_name_the_file(tmp_path):
    with pytest.raises(dckpt.CheckpointError, match="does not exist"):
        dckpt.import_checkpoint(str(tmp_path / "nope"), str(tmp_path / "d"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(dckpt.CheckpointError, match="neither"):
        dckpt.import_checkpoint(str(tmp_path / "empty"), str(tmp_path / "d"))
    bad = tmp_path / "bad.safetensors"
    save_file({"w": torch.randn(8, 8)}, str(bad))
    bad.write_bytes(bad.read_bytes()[:-10])  # truncated
    with pytest.raises(dckpt.CheckpointError, match=r"bad\.safetensors.*'w'"):
        dckpt.import_checkpoint(str(bad), str(tmp_path / "d"))
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(dckpt.CheckpointError, match="bad.safetensors"):
        dckpt.import_checkpoint(str(bad), str(tmp_path / "d"), format="safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.randn(2)}, str(hf / "a.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "a.safetensors", "v": "../b.safetensors"}}))
    with pytest.raises(dckpt.CheckpointError, match=r"index.*\.\./b\.safetensors"):
        dckpt.import_checkpoint(str(hf), str(tmp_path / "d"))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    with pytest.raises(dckpt.CheckpointError, match="missing.*b.safetensors"):
        dckpt.import_checkpoint(str(hf), str(tmp_path / "d"))
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"v": "a.safetensors"}}))
    with pytest.raises(dckpt.CheckpointError, match="'v'"):
        dckpt.import_checkpoint(str(hf), str(tmp_path / "d"))
    pt = tmp_path / "t.pt"
    torch.save(torch.randn(3), str(pt))  # a bare tensor, not a state dict
    with pytest.raises(dckpt.CheckpointError, match="t.pt"):
        dckpt.import_checkpoint(str(pt), str(tmp_path / "d"))
    torch.save({"w": torch.randn(3)}, str(pt), _use_new_zipfile_serialization=False)
    with pytest.raises(dckpt.CheckpointError, match="legacy"):
        dckpt.import_checkpoint(str(pt), str(tmp_path / "d"), format="torch")
    torch.save({"w": torch.randn(3, dtype=torch.complex128)}, str(pt))
    with pytest.raises(dckpt.UnsupportedValueError, match="'w'"):
        dckpt.import_checkpoint(str(pt), str(tmp_path / "d"))
    with pytest.raises(dckpt.CheckpointError, match="format="):
        dckpt.import_checkpoint(str(pt), str(tmp_path / "d"), format="onnx")
    assert not os.path.exists(tmp_path / "d" / "manifest.json")


def test_import_existing_destination_and_overwrite(tmp_path):
    src = str(tmp_path / "m.safetensors")
    save_file({"w": torch.ones(4)}, src)
    dst = str(tmp_path / "imp")
    dckpt.import_checkpoint(src, dst)
    save_file({"w": torch.full((4,), 2.0)}, src)
    with pytest.raises(dckpt.AlreadyExistsError):
        dckpt.import_checkpoint(src, dst)
    dckpt.import_checkpoint(src, dst, overwrite=True, compression="lz4")
    t = {"w": torch.zeros(4)}
    dckpt.load(t, dst)
    assert torch.equal(t["w"], torch.full((4,), 2.0))
    assert len([f for f in os.listdir(dst) if f.startswith("data-")]) == 1  # old files gone


@pytest.mark.parametrize("fault", ["write:1:raise", "commit:0:raise"])
def test_import_failure_commits_nothing(tmp_path, monkeypatch, fault):
    src = str(tmp_path / "m.safetensors")
    save_file({"a": torch.ones(300), "b": torch.ones(300), "c": torch.ones(300)}, src)
    monkeypatch.setenv("DCKPT_FAULT", fault)  # dckpt's own fault injection
    with pytest.raises(dckpt.CheckpointError, match="injected fault"):
        dckpt.import_checkpoint(src, str(tmp_path / "imp"), max_shard_size=1200)
    assert os.listdir(tmp_path / "imp") == []  # files written so far removed, no manifest


def test_import_damaged_dcp_data_commits_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"a": torch.ones(300), "b": torch.ones(300)}, checkpoint_id=str(src))
    data = next(p for p in src.iterdir() if p.suffix == ".distcp")
    raw = data.read_bytes()  # the tensor written last loses its end (same file size: a
    data.write_bytes(raw[:-200] + bytes(200))  # shorter file fails the import's size check)
    with pytest.raises(dckpt.CheckpointError, match=r"DCP checkpoint .*dcp failed: Runtime"):
        dckpt.import_checkpoint(str(src), str(tmp_path / "imp"), max_shard_size=1200)
    assert os.listdir(tmp_path / "imp") == []


# ------------------------------------------------------------------------ CLI

def test_cli_export_and_import(tmp_path, capsys):
    path = _ckpt(tmp_path)
    out = str(tmp_path / "hf")
    assert main(["export", path, out, "--prefix", "train.model.", "--dtype", "fp32",
                 "--max-shard-size", "2KB"]) == 0
    assert "exported 7 tensor(s)" in capsys.readouterr().out
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    dst = str(tmp_path / "imp")
    assert main(["import", out, dst, "--prefix", "train.model.",
                 "--alias", "tied=embed.weight"]) == 0
    assert f"imported {out} into {dst}" in capsys.readouterr().out
    assert "train.model.tied" in _manifest(dst).tensors
    assert main(["export", path, out, "--prefix", "nope."]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dckpt export: ") and "'nope.'" in err and len(err.splitlines()) == 1
    assert main(["import", out, dst]) == 2
    assert "already holds a committed checkpoint" in capsys.readouterr().err
    assert main(["import", out, str(tmp_path / "x"), "--alias", "oops"]) == 2
    assert "NEW=EXISTING" in capsys.readouterr().err


def test_cli_import_help_warns_about_pickle(capsys):
    with pytest.raises(SystemExit):
        main(["import", "--help"])
    assert "pickle" in capsys.readouterr().out
