"""dckpt.load_hf in one process: Hugging Face safetensors (one file, an indexed set of
shards, a lone file path, an fsspec URL) loaded in place into plain tensors, nested
dicts and Statefuls; rename, missing and extra keys, shape and dtype rules; hostile
files and indexes refused with a CheckpointError naming the file and key; the read
planner's runs cover each box exactly, within its waste allowance."""
from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

import dckpt
from dckpt.errors import CheckpointError, StateMismatchError
from dckpt.format.shards import MAX_HEADER
from dckpt.interop import hf_read
from dckpt.interop.sources import INDEX_NAME, MAX_INDEX
from dckpt.layout.chunks import Box


def _weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(50, 16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(40, 16, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 40, generator=g),
        "model.norm.weight": torch.rand(16, generator=g).half(),
        "model.rotary.inv_freq": torch.rand(8, generator=g).double(),
        "model.pos": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "model.mask": torch.tensor([True, False, True]),
        "model.scale": torch.tensor(2.5),
        "model.empty": torch.zeros(0, 4),
        "lm_head.weight": torch.randn(50, 16, generator=g),
    }


def _zeros_like(w: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in w.items()}


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def _sharded(d, w: dict, n: int = 3) -> None:
    """``w`` as ``n`` safetensors files and an index, as save_pretrained writes them."""
    os.makedirs(d, exist_ok=True)
    keys = list(w)
    wm = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: w[k] for k in keys[i::n]}
        save_file(part, os.path.join(d, name), metadata={"format": "pt"})
        wm.update({k: name for k in part})
    with open(os.path.join(d, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)


def test_single_file_fills_in_place_and_reads_exactly_its_bytes(tmp_path):
    w = _weights()
    save_file(w, str(tmp_path / "model.safetensors"))
    state = _zeros_like(w)
    ids = {k: id(v) for k, v in state.items()}
    info = dckpt.load_hf(state, str(tmp_path))
    _same(state, w)
    assert {k: id(v) for k, v in state.items()} == ids  # in place
    assert info.files == ("model.safetensors",) and sorted(info.keys) == sorted(w)
    need = sum(v.numel() * v.element_size() for v in w.values())
    assert info.bytes_read == info.bytes_needed == (need,) and info.missing == ()
    assert isinstance(info, dckpt.HFLoadInfo)


def test_indexed_shards_nested_state_and_a_lone_file(tmp_path):
    w = _weights(1)
    _sharded(tmp_path / "hf", w)
    # nested dicts, a list and a tuple: dotted keys name the files' tensors
    state = {"model": {"embed_tokens": {"weight": torch.zeros(50, 16)},
                       "layers": [{"mlp": {"down_proj": {"weight": torch.zeros(16, 40)}}}],
                       "pos": torch.zeros(3, 4, dtype=torch.int64)},
             "lm_head.weight": torch.zeros(50, 16)}
    info = dckpt.load_hf(state, str(tmp_path / "hf"))
    assert torch.equal(state["model"]["embed_tokens"]["weight"], w["model.embed_tokens.weight"])
    assert torch.equal(state["model"]["layers"][0]["mlp"]["down_proj"]["weight"],
                       w["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(state["model"]["pos"], w["model.pos"])
    assert torch.equal(state["lm_head.weight"], w["lm_head.weight"])
    assert len(info.files) == 3
    one = tmp_path / "one.safetensors"
    save_file({"x": torch.arange(6.0)}, str(one))
    t = {"x": torch.zeros(6)}
    dckpt.load_hf(t, str(one))
    assert torch.equal(t["x"], torch.arange(6.0))


def test_hub_cache_snapshot_of_symlinks(tmp_path):
    """The Hugging Face hub cache's layout: a snapshot directory of symbolic links to
    blobs elsewhere (the links are the user's own, not the index's names)."""
    w = _weights(6)
    _sharded(tmp_path / "blobs", w, n=2)
    snap = tmp_path / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name in os.listdir(tmp_path / "blobs"):
        os.symlink(tmp_path / "blobs" / name, snap / name)
    state = _zeros_like(w)
    dckpt.load_hf(state, str(snap))
    _same(state, w)


def test_fsspec_url(tmp_path):
    pytest.importorskip("fsspec")
    import fsspec

    w = _weights(2)
    _sharded(tmp_path / "hf", w, n=2)
    fs = fsspec.filesystem("memory")
    for name in os.listdir(tmp_path / "hf"):
        fs.pipe_file(f"/hfload/{name}", (tmp_path / "hf" / name).read_bytes())
    state = _zeros_like(w)
    info = dckpt.load_hf(state, "memory://hfload")
    _same(state, w)
    need = sum(v.numel() * v.element_size() for v in w.values())
    assert info.bytes_read == (need,)


def test_rename_mapping_and_callable(tmp_path):
    w = _weights(3)
    save_file(w, str(tmp_path / "model.safetensors"))
    state = {"tok.weight": torch.zeros(50, 16), "out.weight": torch.zeros(50, 16)}
    dckpt.load_hf(state, str(tmp_path), rename={"tok.": "model.embed_tokens.",
                                                "out.": "lm_head."})
    assert torch.equal(state["tok.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(state["out.weight"], w["lm_head.weight"])
    state = {"module.model.norm.weight": torch.zeros(16, dtype=torch.float16)}
    dckpt.load_hf(state, str(tmp_path), rename=lambda k: k.removeprefix("module."))
    assert torch.equal(state["module.model.norm.weight"], w["model.norm.weight"])
    with pytest.raises(StateMismatchError, match="one checkpoint key"):
        dckpt.load_hf({"a": torch.zeros(50, 16), "b": torch.zeros(50, 16)}, str(tmp_path),
                      rename=lambda k: "lm_head.weight")


def test_missing_extra_and_strict(tmp_path):
    w = _weights(4)
    save_file(w, str(tmp_path / "model.safetensors"))
    state = {"lm_head.weight": torch.zeros(50, 16), "nope.a": torch.ones(2),
             "nope.b": torch.ones(3), "step": 7}
    with pytest.raises(StateMismatchError, match=r"lack 2 key.*'nope\.a', 'nope\.b'.*allow_missing"):
        dckpt.load_hf(state, str(tmp_path))
    info = dckpt.load_hf(state, str(tmp_path), allow_missing=True)
    assert info.missing == ("nope.a", "nope.b") and info.keys == ("lm_head.weight",)
    assert torch.equal(state["nope.a"], torch.ones(2)) and state["step"] == 7
    assert torch.equal(state["lm_head.weight"], w["lm_head.weight"])
    # extra file keys are fine by default; strict=True names them
    with pytest.raises(StateMismatchError, match=r"hold 9 tensor.*strict"):
        dckpt.load_hf({"lm_head.weight": torch.zeros(50, 16)}, str(tmp_path), strict=True)


def test_shape_and_dtype_rules(tmp_path):
    w = _weights(5)
    save_file(w, str(tmp_path / "model.safetensors"))
    p = str(tmp_path)
    with pytest.raises(StateMismatchError,
                       match=r"'lm_head\.weight' has shape \[50, 15\] in the state and \[50, 16\]"
                             r" in .*model\.safetensors"):
        dckpt.load_hf({"lm_head.weight": torch.zeros(50, 15)}, p)
    # bf16 in the file, fp32 state: converted (cast=True, the default); cast=False refuses
    state = {"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 16)}
    dckpt.load_hf(state, p)
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"],
                       w["model.layers.0.mlp.up_proj.weight"].float())
    with pytest.raises(StateMismatchError, match=r"BF16 in the file and F32.*cast=True"):
        dckpt.load_hf(state, p, cast=False)
    # fp32 into bf16: rounded as Tensor.to does
    state = {"lm_head.weight": torch.zeros(50, 16, dtype=torch.bfloat16)}
    dckpt.load_hf(state, p)
    assert torch.equal(state["lm_head.weight"], w["lm_head.weight"].bfloat16())
    with pytest.raises(StateMismatchError, match=r"'model\.pos'.*I64 in the file and F32"):
        dckpt.load_hf({"model.pos": torch.zeros(3, 4)}, p)


def test_fp8_loads_only_into_its_own_dtype(tmp_path):
    f8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    save_file({"w": f8, "w_scale_inv": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    state = {"w": torch.zeros(4, 8, dtype=torch.float8_e4m3fn)}
    dckpt.load_hf(state, str(tmp_path))
    assert torch.equal(state["w"].view(torch.uint8), f8.view(torch.uint8))
    with pytest.raises(StateMismatchError, match=r"'w' .*model\.safetensors.*F8_E4M3.*BF16.*scales"):
        dckpt.load_hf({"w": torch.zeros(4, 8, dtype=torch.bfloat16)}, str(tmp_path))


def _raw_file(path, header, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if length is None else length
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + raw + data)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("case, header, data, length, want", [
    ("length over the cap", {"w": _entry()}, bytes(8), MAX_HEADER + 1, r"header length"),
    ("length past the end", {"w": _entry()}, bytes(8), 1 << 20, r"header length"),
    ("tiny file", None, b"", None, r"header length"),
    ("not json", b"{not json", b"", None, r"unreadable safetensors header"),
    ("not an object", b"[1, 2]", b"", None, r"not a JSON object"),
    ("offsets past the end", {"w": _entry(offsets=(0, 8))}, bytes(4), None, r"'w'.*byte range"),
    ("negative offsets", {"w": _entry(offsets=(-8, 0))}, bytes(8), None, r"'w'.*byte range"),
    ("length not shape", {"w": _entry(offsets=(0, 12))}, bytes(12), None, r"'w'.*byte range"),
    ("overlap", {"w": _entry(offsets=(0, 8)), "v": _entry(offsets=(4, 12))}, bytes(12), None,
     r"'w' and 'v' overlap"),
    ("bad shape", {"w": _entry(shape=(-2,))}, bytes(8), None, r"'w'.*bad shape"),
    ("unknown dtype", {"w": _entry(dtype="F8_E8M0", shape=(8,))}, bytes(8), None,
     r"'w' has dtype 'F8_E8M0'"),
    ("sub-byte dtype", {"w": _entry(dtype="F4", shape=(16,))}, bytes(8), None,
     r"'w' has dtype 'F4'"),
])
def test_hostile_headers_are_checkpoint_errors_naming_file_and_key(tmp_path, case, header,
                                                                   data, length, want):
    path = tmp_path / "model.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02")
    else:
        _raw_file(path, header, data, length)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*" + want):
        dckpt.load_hf({"w": torch.zeros(2)}, str(tmp_path))


def test_hostile_indexes(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.ones(2)}, str(d / "a.safetensors"))
    index = d / INDEX_NAME
    state = {"w": torch.zeros(2)}

    def refused(doc, want):
        index.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        with pytest.raises(CheckpointError, match=want):
            dckpt.load_hf(state, str(d))

    refused({"weight_map": {"w": "a.safetensors", "v": "../b.safetensors"}},
            r"index\.json.*\.\./b\.safetensors.*not safetensors files in that directory")
    refused({"weight_map": {"w": "/etc/passwd.safetensors"}}, r"index\.json.*/etc/passwd")
    refused({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}},
            r"index\.json names file.*missing.*b\.safetensors")
    refused({"weight_map": {"v": "a.safetensors"}}, r"index\.json.*'v'.*not in the file")
    refused({"weight_map": ["a.safetensors"]}, r"index\.json.*no weight_map")
    refused(b"\xff\xfe garbage", r"index\.json.*not a safetensors index")
    with open(index, "wb") as f:  # a huge index: refused by its size, never read
        f.truncate(MAX_INDEX + 1)
    with pytest.raises(CheckpointError, match=r"index\.json.*over 100 MiB"):
        dckpt.load_hf(state, str(d))
    index.unlink()
    save_file({"w": torch.ones(2)}, str(d / "b.safetensors"))  # no index: w twice
    with pytest.raises(CheckpointError, match=r"'w' is in both .*a\.safetensors.*b\.safetensors"):
        dckpt.load_hf(state, str(d))


def test_paths_that_are_not_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        dckpt.load_hf({"w": torch.zeros(2)}, str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors file"):
        dckpt.load_hf({"w": torch.zeros(2)}, str(tmp_path / "empty"))
    # the reason load_hf is its own function: dckpt.load never reads an HF directory
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(dckpt.NotCommittedError):
        dckpt.load({"w": torch.zeros(2)}, str(tmp_path))


def test_truncated_data_is_a_short_read(tmp_path, monkeypatch):
    """A file that shrinks between its header check and its data read."""
    save_file({"w": torch.arange(1000.0)}, str(tmp_path / "model.safetensors"))
    from dckpt.interop import sources

    real = sources.read_safetensors_header

    def then_truncate(path, storage=None):
        out = real(path, storage)
        os.truncate(path, os.path.getsize(path) - 100)
        return out

    monkeypatch.setattr("dckpt.interop.hf_load.read_safetensors_header", then_truncate)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: short read of tensor 'w'"):
        dckpt.load_hf({"w": torch.zeros(1000)}, str(tmp_path))


def test_statefuls_and_unsupported_targets(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    save_file(dict(src.state_dict()), str(tmp_path / "model.safetensors"))
    state = {"train": dckpt.TrainingState(model)}
    dckpt.load_hf(state, str(tmp_path), rename={"train.model.": ""})
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    with pytest.raises(dckpt.UnsupportedValueError, match="meta"):
        dckpt.load_hf({"0.weight": torch.empty(3, 4, device="meta")}, str(tmp_path))
    with pytest.raises(dckpt.UnsupportedValueError, match="expanded view"):
        dckpt.load_hf({"0.bias": torch.zeros(1).expand(3)}, str(tmp_path))
    # a non-contiguous destination goes through a temporary
    t = torch.zeros(4, 3)
    state = {"0.weight": t.T}
    dckpt.load_hf(state, str(tmp_path))
    assert torch.equal(t.T, src.state_dict()["0.weight"])


def test_progress_lines(tmp_path, caplog, monkeypatch):
    save_file({"w": torch.randn(256, 1024)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setenv("DCKPT_PROGRESS_SECONDS", "0")
    with caplog.at_level(logging.INFO, logger="dckpt.interop.hf_load"):
        dckpt.load_hf({"w": torch.zeros(256, 1024)}, str(tmp_path), read_budget=4 << 20)
    assert "load_hf" in caplog.text and "MiB" in caplog.text and "%" in caplog.text
    assert "loaded Hugging Face safetensors" in caplog.text


def test_transformers_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg)
    src.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")  # several shards
    assert os.path.exists(tmp_path / "hf" / INDEX_NAME)
    torch.manual_seed(1)
    dst = transformers.LlamaForCausalLM(cfg)
    sd = dst.state_dict()  # views of the parameters: filled in place
    info = dckpt.load_hf(sd, str(tmp_path / "hf"), allow_missing=True)
    assert set(info.missing) <= {"lm_head.weight"}  # tied: save_pretrained drops it
    want = src.state_dict()
    for k, v in dst.state_dict().items():
        assert torch.equal(v, want[k]), k
    whole = {}
    for f in info.files:
        whole.update(load_file(str(tmp_path / "hf" / f)))
    assert sorted(whole) == sorted(k for k in want if k not in info.missing)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_tensors(tmp_path):
    """CUDA targets: read into a host temporary of the part, copied to the device (and
    converted there: bf16 file, fp32 state)."""
    w = {"a": torch.randn(300, 70).bfloat16(), "b": torch.arange(10)}
    save_file(w, str(tmp_path / "model.safetensors"))
    state = {"a": torch.zeros(300, 70, device="cuda"), "b": torch.zeros(10, dtype=torch.int64,
                                                                       device="cuda")}
    dckpt.load_hf(state, str(tmp_path))
    assert torch.equal(state["a"].cpu(), w["a"].float()) and torch.equal(state["b"].cpu(), w["b"])


# ------------------------------------------------------------------ the read planner

def _check_runs(shape, box, isz, join_gap, waste, local_t=False):
    """Reading the requests of :class:`hf_read.Runs` out of the bytes of an arange
    tensor, and placing them as the loader does, reproduces the box exactly, each
    element once; the bytes read beyond the box are at most ``waste``."""
    n = 1
    for s in shape:
        n *= s
    full = torch.arange(n, dtype=torch.int64).reshape(shape) if shape else torch.tensor(7)
    item = hf_read.box_item(shape, box)
    if item is None:
        return
    got = torch.full(box.sizes, -1, dtype=torch.int64)
    if local_t and got.dim() >= 2:  # a non-contiguous destination
        got = torch.full(box.sizes[::-1], -1, dtype=torch.int64).permute(
            *range(got.dim() - 1, -1, -1))
    flat = full.reshape(-1)
    runs = hf_read.Runs(shape, item, isz, got.stride(), join_gap, waste, max_runs=3)
    read = 0
    for start, nbytes, m, dst in runs:
        assert start % isz == 0 and nbytes % isz == 0 and 1 <= m <= 3
        data = flat[start // isz:(start + nbytes) // isz].clone()  # as a read
        src = torch.as_strided(data, (m, *runs.run_shape), runs.src_strides, 0)
        out = torch.as_strided(got, (m, *runs.run_shape), runs.dst_strides,
                               got.storage_offset() + dst)
        assert torch.all(out == -1)  # each element once
        out.copy_(src)
        read += nbytes
    region = full[tuple(slice(o, o + z) for o, z in zip(box.offsets, box.sizes))]
    assert torch.equal(got, region)
    assert read == box.numel * isz + runs.extra and runs.extra <= waste


def test_runs_cover_each_box_exactly_within_the_allowance():
    rng = random.Random(0)
    for _ in range(600):
        nd = rng.randint(0, 4)
        shape = tuple(rng.randint(1, 7) for _ in range(nd))
        offs = tuple(rng.randint(0, s - 1) for s in shape)
        sizes = tuple(rng.randint(1, s - o) for s, o in zip(shape, offs))
        _check_runs(shape, Box(offs, sizes), 8, rng.choice([0, 16, 1 << 20]),
                    rng.choice([0, 8, 64, 1 << 20]), local_t=rng.random() < 0.3)


def test_runs_of_a_column_slice():
    # 4096 rows of 8 KiB, the right half: 4 KiB runs 4 KiB apart
    shape, box = (4096, 2048), Box((0, 1024), (4096, 1024))
    runs = hf_read.Runs(shape, hf_read.box_item(shape, box), 4, (1024, 1),
                          hf_read.WASTE, hf_read.WASTE)
    assert len(list(runs)) == 4096 - 16 and runs.extra == 16 * 4096 and runs.dst_contiguous()
    # row blocks: one read; object-store joining: one read per 512 rows across the gaps
    box = Box((100, 0), (200, 2048))
    assert len(list(hf_read.Runs(shape, hf_read.box_item(shape, box), 4, (2048, 1), 0, 0))) == 1
    box = Box((0, 1024), (4096, 1024))
    runs = hf_read.Runs(shape, hf_read.box_item(shape, box), 4, (1024, 1), 1 << 20, 1 << 62)
    assert [m for _, _, m, _ in runs] == [512] * 8 and runs.extra == (4096 - 8) * 4096
