"""Unit and property tests of the pure on-disk format layer: dckpt.format.{intarray,
manifest, shards}. No torch.distributed, no processes."""
from __future__ import annotations

import copy
import json
import math
import os
import random
import struct
import tempfile
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from dckpt.errors import CheckpointError, IntegrityError, ManifestError
from dckpt.format import intarray, shards
from dckpt.format import manifest as mf
from dckpt.format.dtypes import ITEMSIZE, to_code, to_torch
from dckpt.storage.local import LocalStorage

# DCKPT_TEST_EXAMPLES=k multiplies every max_examples by k (a deeper hunt).
def _n(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


_GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden")
GOLDEN = os.path.join(_GOLDEN, "manifest_v1.json")  # version 1
GOLDEN_V2 = os.path.join(_GOLDEN, "manifest_v2.json")
I64 = st.integers(-(2**63), 2**63 - 1)


# ----------------------------------------------------------------------------- intarray

@st.composite
def int_arrays(draw):
    """Concatenated arithmetic runs (possibly of length 1) and random values."""
    parts: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            first = draw(st.integers(-1000, 1000) | I64)
            step = draw(st.integers(-3, 3) | st.integers(-(2**40), 2**40))
            count = draw(st.integers(1, 40))
            parts += [(first + step * i) for i in range(count)]
        else:
            parts += draw(st.lists(I64, max_size=5))
    # keep within int64: the inputs are int64 arrays
    return np.array([((x + 2**63) % 2**64) - 2**63 for x in parts], np.int64)


@settings(max_examples=_n(200), deadline=None)
@given(int_arrays())
def test_intarray_roundtrip(v):
    enc = intarray.encode(v)
    text = json.dumps(enc)  # plain JSON
    back = intarray.decode(json.loads(text), "x")
    assert back.dtype == np.int64 and back.shape == v.shape
    assert (back == v).all()
    if isinstance(enc, dict):
        runs = enc["runs"]
        assert 3 * len(runs) < len(v)  # only used when shorter
        assert all(r[2] >= 1 for r in runs) and sum(r[2] for r in runs) == len(v)
    else:
        assert enc == v.tolist()


def test_intarray_examples():
    assert intarray.encode(np.arange(4096)) == {"runs": [[0, 1, 4096]]}
    assert intarray.encode(np.array([5, 5, 5, 5, 5])) == {"runs": [[5, 0, 5]]}
    assert intarray.encode(np.array([1, 2, 3])) == [1, 2, 3]
    assert intarray.encode(np.array([], np.int64)) == []
    # greedy: a value whose incoming step differs starts a run of its own
    assert intarray.encode(np.array([0, 1, 2, 3, 4, 5, 10, 20, 30, 40, 50, 60])) == {
        "runs": [[0, 1, 6], [10, 0, 1], [20, 10, 5]]}
    # int64 wrap-around steps round-trip
    v = np.array([2**63 - 3, 2**63 - 2, 2**63 - 1, -(2**63), -(2**63) + 1, -(2**63) + 2, 5],
                 np.int64)
    assert intarray.encode(v) == {"runs": [[2**63 - 3, 1, 6], [5, 0, 1]]}
    assert (intarray.decode(json.loads(json.dumps(intarray.encode(v))), "x") == v).all()
    assert intarray.decode({"runs": []}, "x").tolist() == []
    assert intarray.decode({"runs": [[3, -2, 3], [0, 0, 1]]}, "x").tolist() == [3, 1, -1, 0]


@pytest.mark.parametrize("obj", [
    [1.0], [1, 2.5], [True], [None], ["1"], [[1]], "1,2", None, 3, 1.5,
    {"run": [[0, 1, 2]]}, {"runs": [[0, 1, 2]], "x": 1}, {"runs": "0,1,2"},
    {"runs": [[0, 1]]}, {"runs": [[0, 1, 2, 3]]}, {"runs": [[0, 1.0, 2]]},
    {"runs": [[0, True, 2]]}, {"runs": [[0, 1, 0]]}, {"runs": [[0, 1, -1]]},
    {"runs": [[0, 1, 2**31], [0, 1, 2]]}, {"runs": [0, 1, 2]}, {"runs": [None]},
    [2**63], [-(2**63) - 1], {"runs": [[2**64, 1, 2]]},
    {"runs": [[0, 2**63, 2]]}, {"runs": [[0, 0, 2**62]] * 4}, {"runs": [[0, 1, 2**31 + 1]]},
])
def test_intarray_decode_rejects(obj):
    with pytest.raises(ValueError) as e:
        intarray.decode(obj, "tensor 'w' grid")
    assert "tensor 'w' grid" in str(e.value)


# Values a hand-built triple may hold: near the fast path's bounds (64 values), int64
# edges, and what the parser must refuse. None in [5000, 2**31]: as a count, the general
# path would allocate it.
_RUN_INT = st.one_of(
    st.integers(-3, 70), I64.map(lambda x: -x if 5000 <= x <= 2**31 else x),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 2**31 + 1, 2**62, 2**63 - 1, -(2**63)]))
_JUNK = st.sampled_from([None, 1.0, 2.5, True, False, "1", [], [1], {}, (0, 1, 2)])


@st.composite
def _run_triples(draw):
    """A [first, step, count] triple, one of whose values may be bad, or not a triple."""
    r = [draw(_RUN_INT), draw(_RUN_INT), draw(st.integers(1, 40) | _RUN_INT)]
    how = draw(st.integers(0, 5))
    if how == 4:
        r[draw(st.integers(0, 2))] = draw(_JUNK | _RUN_INT)
    return draw(st.lists(_RUN_INT | _JUNK, max_size=4) | _JUNK) if how == 5 else r


@st.composite
def int_encodings(draw):
    """What decode may meet: encode's output for short and long arrays, hand-built runs
    (well-formed or not), and mutations of both."""
    kind = draw(st.integers(0, 4))
    if kind == 0:  # encode of a random array (0 to ~240 values)
        return intarray.encode(draw(int_arrays()))
    if kind == 1:  # long runs, plus a short tail
        n = draw(st.integers(1, 5000))
        head = np.arange(n, dtype=np.int64) * draw(st.integers(-5, 5)) + draw(I64)
        return intarray.encode(np.concatenate([head, draw(int_arrays())]))
    if kind == 2:  # hand-built triples, mostly well-formed
        return {"runs": draw(st.lists(_run_triples(), max_size=8))}
    if kind == 3:  # a plain list, maybe with junk
        return draw(st.lists(_RUN_INT | _JUNK if draw(st.booleans()) else _RUN_INT, max_size=70))
    if draw(st.booleans()):  # junk at the top, or a key added
        obj = copy.deepcopy(draw(int_encodings()))
        if isinstance(obj, dict) and draw(st.booleans()):
            obj[draw(st.sampled_from(["x", "run"]))] = 1
            return obj
        return draw(_JUNK | st.just({"runs": obj}) | st.just({"runs": [], "x": 1}))
    # a few short well-formed runs (the fast path's input), one value then replaced
    small = st.integers(-(2**40), 2**40)
    runs = draw(st.lists(st.tuples(small, small, st.integers(1, 20)).map(list),
                         min_size=1, max_size=4))
    runs[draw(st.integers(0, len(runs) - 1))][draw(st.integers(0, 2))] = draw(_JUNK | _RUN_INT)
    return {"runs": runs}


def _decode_outcome(fn, obj, limit):
    """What ``fn`` makes of ``obj``: the array's type, dtype, shape, flags and values,
    or the error's type and message."""
    try:
        a = fn(obj, "tensor 'w' grid", limit)
    except Exception as e:  # noqa: BLE001 -- any error must match too
        return ("error", type(e), str(e))
    return ("ok", type(a), a.dtype, a.shape, a.flags.writeable, a.flags.c_contiguous,
            a.flags.owndata, a.tolist())


@settings(max_examples=_n(400), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(int_encodings(), st.one_of(st.just(1 << 31), st.integers(-2, 300)))
@example({"runs": [[0, 1, 64]]}, 1 << 31)            # the fast path's largest
@example({"runs": [[0, 1, 60], [7, 0, 5]]}, 1 << 31)  # one over: general path
@example({"runs": [[0, 1, 8]]}, 8)                   # limit met exactly
@example({"runs": [[0, 1, 8]]}, 7)                   # and exceeded
@example({"runs": [[2**63 - 3, 1, 6], [5, 0, 1]]}, 1 << 31)  # wraps past int64 max
@example({"runs": [[-(2**63), -(2**63), 3]]}, 1 << 31)      # wraps past int64 min
@example({"runs": []}, -1)
@example({"runs": [[0, 2**63, 1]]}, 1 << 31)  # out-of-range step, count 1: no wrap hides it
@example({"runs": [[-(2**63) - 1, 0, 1]]}, 1 << 31)
@example({"runs": [[0, 1, 2], [0, 1, 0]]}, 1 << 31)
@example({"runs": [[0, 1, 2**31 + 1]]}, 1 << 31)
@example({"runs": [[0, 0, 2**62]] * 4}, 1 << 31)
def test_intarray_decode_fast_path_agrees(obj, limit):
    """decode (with its small-input fast path) and _decode_general agree on every input:
    same array or same error, and neither touches its input."""
    before = copy.deepcopy(obj)
    fast = _decode_outcome(intarray.decode, obj, limit)
    assert obj == before
    assert fast == _decode_outcome(intarray._decode_general, obj, limit)


def test_intarray_decode_fast_path_taken(monkeypatch):
    """Small well-formed runs never reach the numpy path (the parser's hot case)."""
    def general(*a):
        raise AssertionError("general path taken")
    monkeypatch.setattr(intarray, "_decode_general", general)
    a = intarray.decode({"runs": [[0, 4096, 8], [32768, 0, 1]]}, "x", 9)
    assert a.dtype == np.int64 and a.tolist() == [4096 * i for i in range(9)]


# ----------------------------------------------------------------------------- golden manifest

def _grid_chunks(grid, files):
    o, s = mf.grid_cells(grid)
    return mf.Chunks(o, s, np.asarray(files, np.int64), grid)


def golden_manifest(non_finite: bool = False) -> mf.Manifest:
    """The manifest both golden files hold; the version-2 one adds non-finite and
    negative-zero values (``non_finite``), which version 1 could not write as JSON."""
    # names as docs/FORMAT.md gives them: data-<save_id>-<rank>.safetensors
    # 8 ranks; a file holds at most one chunk of each tensor (a format invariant)
    files = tuple(mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors", 4096 - 256 * r,
                               512 - 8 * r, 0x1234ABCD + r, r) for r in range(8))
    irregular_o = np.array([[0, 0], [0, 2], [1, 0], [1, 1], [1, 3]], np.int64)
    irregular_s = np.array([[1, 2], [1, 2], [1, 1], [1, 2], [1, 1]], np.int64)
    tensors = {
        # FSDP x TP style: 2x2 grid, rows split over the two files
        "model.w": mf.TensorEntry("model.w", "F32", (4, 6),
                                  _grid_chunks(((0, 2, 4), (0, 3, 6)), [0, 1, 2, 3])),
        "model.b": mf.TensorEntry("model.b", "BF16", (6,), _grid_chunks(((0, 6),), [1])),
        # 8 pieces: the breakpoints are one arithmetic run
        "emb": mf.TensorEntry("emb", "I32", (8,),
                              _grid_chunks((tuple(range(9)),), [0, 1, 2, 3, 4, 5, 6, 7])),
        # 8 cells of 2 in files 7..0: breakpoints and file list both runs
        "pos": mf.TensorEntry("pos", "I64", (16,), _grid_chunks((tuple(range(0, 17, 2)),),
                                                                list(range(7, -1, -1)))),
        "step": mf.TensorEntry("step", "I64", (), _grid_chunks((), [1])),
        "irregular": mf.TensorEntry("irregular", "F16", (2, 4), mf.Chunks(
            irregular_o, irregular_s, np.array([0, 1, 2, 3, 4], np.int64), None)),
        "empty": mf.TensorEntry("empty", "F32", (0, 3), mf.Chunks(
            np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64), np.zeros(0, np.int64), None)),
    }
    values = {"epoch": 3, "name": "run-a", "none": None, "flag": True, "lr": 0.001}
    if non_finite:
        values.update({"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "negzero": -0.0})
    meta = {"dckpt_version": "0.1.0", "save_seconds": 1.5}
    return mf.Manifest("0123456789abcdef", 8, 0.0, files, tensors, values, meta)


def test_manifest_golden_bytes():
    got = mf.to_json(golden_manifest(non_finite=True))
    with open(GOLDEN_V2, "rb") as f:
        want = f.read()
    assert got == want, "the manifest format changed: bump VERSION or fix the writer"


def test_manifest_golden_v2_content():
    with open(GOLDEN_V2, "rb") as f:
        raw = f.read()
    # the checksum prefix, then the compact JSON of the document without its "{"
    head, rest = raw[:29], raw[29:]
    assert head == b'{"checksum":"crc32:%08x",' % zlib.crc32(rest)
    assert head == b'{"checksum":"crc32:a3a4aaf1",'

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")
    doc = json.loads(raw, parse_constant=refuse)
    assert list(doc) == ["checksum", "format", "version", "save_id", "world_size", "created",
                         "meta", "files", "tensors", "values"]
    assert doc["version"] == 2 and mf.VERSION == 3  # plain manifests are still written as version 2
    assert b'"save_id":"0123456789abcdef"' in raw  # protocol/coordinator.py searches for it
    v1 = golden_doc()
    v1.update(version=2)
    v1["values"].update({"nan": {"$float": "nan"}, "inf": {"$float": "inf"},
                         "ninf": {"$float": "-inf"}, "negzero": -0.0})
    assert {k: v for k, v in doc.items() if k != "checksum"} == v1  # otherwise as version 1
    assert rest.endswith(b',"nan":{"$float":"nan"},"inf":{"$float":"inf"},'
                         b'"ninf":{"$float":"-inf"},"negzero":-0.0}}')
    m = mf.parse(raw)
    want = golden_manifest(non_finite=True)
    assert m.files == want.files and m.meta == want.meta and m.created == 0.0
    assert math.isnan(m.values.pop("nan")) and want.values.pop("nan") is not None
    assert m.values == want.values and math.copysign(1.0, m.values["negzero"]) == -1.0
    assert mf.to_json(mf.parse(raw)) == raw  # parse . to_json is the identity


def test_manifest_golden_content():
    with open(GOLDEN, "rb") as f:
        raw = f.read()
    doc = json.loads(raw)
    assert doc["format"] == "dckpt" and doc["version"] == 1
    assert list(doc) == ["format", "version", "save_id", "world_size", "created", "meta",
                         "files", "tensors", "values"]  # field order, as docs/FORMAT.md
    assert list(doc["tensors"]) == ["model.w", "model.b", "emb", "pos", "step", "irregular",
                                    "empty"]
    assert doc["tensors"]["pos"]["chunks"] == {"grid": [{"runs": [[0, 2, 9]]}],
                                               "file": {"runs": [[7, -1, 8]]}}
    assert doc["tensors"]["emb"]["chunks"]["grid"] == [{"runs": [[0, 1, 9]]}]
    assert doc["tensors"]["model.w"]["chunks"] == {"grid": [[0, 2, 4], [0, 3, 6]],
                                                   "file": {"runs": [[0, 1, 4]]}}
    assert doc["tensors"]["step"] == {"dtype": "I64", "shape": [],
                                      "chunks": {"grid": [], "file": [1]}}

    m = mf.parse(raw)
    assert m.save_id == "0123456789abcdef" and m.world_size == 8 and m.created == 0.0
    assert m.files == golden_manifest().files
    assert m.total_bytes == sum(4096 - 256 * r for r in range(8))
    assert m.values == {"epoch": 3, "name": "run-a", "none": None, "flag": True, "lr": 0.001}
    assert type(m.values["flag"]) is bool and type(m.values["epoch"]) is int
    assert m.meta == {"dckpt_version": "0.1.0", "save_seconds": 1.5}
    assert m.files[1].name == "data-0123456789abcdef-00001.safetensors" and m.files[1].rank == 1
    assert (m.files[0].size, m.files[0].header_len, m.files[0].header_crc32) == (4096, 512, 0x1234ABCD)
    w = m.tensors["model.w"]
    assert (w.dtype, w.shape, w.nbytes, len(w.chunks)) == ("F32", (4, 6), 96, 4)
    assert w.chunks.grid == ((0, 2, 4), (0, 3, 6))
    assert w.chunks.offsets.tolist() == [[0, 0], [0, 3], [2, 0], [2, 3]]
    assert w.chunks.sizes.tolist() == [[2, 3]] * 4
    assert w.chunks.file.tolist() == [0, 1, 2, 3]
    e = m.tensors["emb"]
    assert e.chunks.offsets.ravel().tolist() == list(range(8)) and e.chunks.file.tolist() == list(range(8))
    p = m.tensors["pos"]
    assert p.chunks.offsets.ravel().tolist() == list(range(0, 16, 2))
    assert p.chunks.sizes.ravel().tolist() == [2] * 8 and p.chunks.file.tolist() == list(range(7, -1, -1))
    s = m.tensors["step"]
    assert s.shape == () and s.nbytes == 8 and s.chunks.offsets.shape == (1, 0)
    assert s.chunks.file.tolist() == [1]
    ir = m.tensors["irregular"]
    assert ir.chunks.grid is None and ir.chunks.sizes.tolist() == [[1, 2], [1, 2], [1, 1], [1, 2], [1, 1]]
    assert m.tensors["empty"].shape == (0, 3) and len(m.tensors["empty"].chunks) == 0
    assert m.tensors["empty"].nbytes == 0
    assert m.tensors["model.b"].nbytes == 12
    # version 1 reads as the same manifest, and is written back as version 2
    assert mf.to_json(m) == mf.to_json(golden_manifest())


# ----------------------------------------------------------------------------- validation

def golden_doc() -> dict:
    with open(GOLDEN, "rb") as f:
        return json.loads(f.read())


def _bad(doc_or_bytes, *fragments):
    data = doc_or_bytes if isinstance(doc_or_bytes, bytes) else json.dumps(doc_or_bytes).encode()
    with pytest.raises(ManifestError) as e:
        mf.parse(data, where="ckpt/manifest.json")
    msg = str(e.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert isinstance(e.value, IntegrityError) and isinstance(e.value, CheckpointError)
    return msg


def _mut(fn):
    doc = golden_doc()
    fn(doc)
    return doc


@pytest.mark.parametrize("data", [
    b"", b"\x00\xff\xfe garbage", random.Random(7).randbytes(64) + b"\x80", b"{",
    b"{\"format\": \"dckpt\",",
    b"\xef\xbb\xbf\xff{}",
])
def test_manifest_not_json(data):
    _bad(data, "ckpt/manifest.json")


@pytest.mark.parametrize("data", [b"[]", b"3", b"null", b"\"dckpt\"", b"[{\"format\": \"dckpt\"}]"])
def test_manifest_not_object(data):
    _bad(data, "not a dckpt manifest")


def test_manifest_format_and_version():
    _bad(_mut(lambda d: d.pop("format")), "not a dckpt manifest")
    _bad(_mut(lambda d: d.update(format="other")), "not a dckpt manifest")
    # version 2 is checksummed: a document claiming it without the checksum is refused
    _bad(_mut(lambda d: d.update(version=2)), "checksum mismatch")
    _bad(_mut(lambda d: d.update(version=6)), "version 6", "upgrade")
    _bad(_mut(lambda d: d.pop("version")), "version None")
    _bad(_mut(lambda d: d.update(version="1")), "version '1'")
    _bad(_mut(lambda d: d.update(version=True)), "version True")
    _bad(_mut(lambda d: d.update(version=1.0)), "version 1.0")


@pytest.mark.parametrize("name", [
    "../evil.safetensors", "/etc/passwd", "s3://bucket/x", "a/b.safetensors", ".hidden", "",
    "a\\b.safetensors", "..", "x..safetensors", "C:evil", "evil.safetensors\n",
    "a b.safetensors", "x" * 256, "é.safetensors", None, 3,
])
def test_manifest_bad_file_name(name):
    _bad(_mut(lambda d: d["files"][0].__setitem__(0, name)), "files[0]", "name")


def test_manifest_good_file_names():
    for name in ["rank0.safetensors", "a-b_c.D.1", "_x", "x" * 255]:
        m = mf.parse(json.dumps(_mut(lambda d: d["files"][0].__setitem__(0, name))).encode())
        assert m.files[0].name == name


def test_manifest_bad_files():
    _bad(_mut(lambda d: d["files"][1].__setitem__(1, -5)), "files[1].size", "-5")
    _bad(_mut(lambda d: d["files"][1].__setitem__(1, 1.5)), "files[1].size")
    _bad(_mut(lambda d: d["files"][0].__setitem__(2, 5000)), "header_len 5000 exceeds size 4096")
    _bad(_mut(lambda d: d["files"][0].__setitem__(2, 0)), "files[0].header_len")
    _bad(_mut(lambda d: d["files"][0].__setitem__(3, -1)), "files[0].header_crc32")
    _bad(_mut(lambda d: d["files"][0].__setitem__(4, True)), "files[0].rank")
    _bad(_mut(lambda d: d["files"][1].__setitem__(0, d["files"][0][0])), "listed twice")
    _bad(_mut(lambda d: d["files"][0].pop()), "files[0] must be")
    _bad(_mut(lambda d: d.update(files={"a": 1})), "'files'", "wrong JSON type")
    _bad(_mut(lambda d: d.pop("files")), "missing field", "files")
    _bad(_mut(lambda d: d.pop("tensors")), "missing field", "tensors")
    _bad(_mut(lambda d: d.pop("values")), "missing field", "values")
    _bad(_mut(lambda d: d.update(world_size=0)), "world_size")
    _bad(_mut(lambda d: d.update(world_size="2")), "world_size")


def test_manifest_bad_tensors():
    t = lambda d: d["tensors"]  # noqa: E731
    _bad(_mut(lambda d: t(d)["model.w"].update(dtype="F128")), "'model.w'", "dtype")
    _bad(_mut(lambda d: t(d)["model.w"].update(dtype=["F32"])), "'model.w'", "dtype")
    _bad(_mut(lambda d: t(d)["model.w"].pop("dtype")), "'model.w'", "dtype")
    _bad(_mut(lambda d: t(d).update(x=[1])), "'x'")
    _bad(_mut(lambda d: t(d)["model.w"].update(shape=[4, -6])), "'model.w' shape", "-6")
    _bad(_mut(lambda d: t(d)["model.w"].update(shape=[4, 6.0])), "'model.w' shape")
    _bad(_mut(lambda d: t(d)["model.w"].update(shape="4,6")), "'model.w'", "shape")
    _bad(_mut(lambda d: t(d)["model.w"].pop("chunks")), "'model.w'", "chunks")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(file=[0, 1, 2, 8])),
         "'model.w'", "file index out of range")
    # a file holds at most MAX_CHUNKS_PER_FILE (1024) chunks of a tensor: more chunks
    # than that per file (8 files here) is refused
    _bad(_mut(lambda d: t(d)["emb"]["chunks"].update(grid=[{"runs": [[0, 1, 8194]]}],
                                                     file={"runs": [[0, 1, 8193]]})),
         "'emb'", "at most 8192")
    _bad(_mut(lambda d: t(d)["emb"].update(shape=[8193]) or t(d)["emb"]["chunks"].update(
        grid=[{"runs": [[0, 1, 8194]]}])), "'emb'", "at most 8193")
    _bad(_mut(lambda d: t(d)["model.w"].update(shape=[128, 128]) or t(d)["model.w"][
        "chunks"].update(grid=[{"runs": [[0, 1, 129]]}, {"runs": [[0, 1, 129]]}])),
         "'model.w'", "more cells than 1024 per file")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(file=[0, 0, -1, 1])),
         "'model.w'", "file index out of range")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(file=[0, 0, 1])),
         "'model.w'", "3 file indexes for 4 chunks")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(file=[0, 0, 1, 1.0])),
         "'model.w'", "integers")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].pop("file")), "'model.w'")
    # grids: must rise strictly from 0 to the dim's length
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(grid=[[1, 2, 4], [0, 3, 6]])),
         "'model.w'", "grid of dim 0", "from 0 to 4")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(grid=[[0, 2, 4], [0, 3, 5]])),
         "'model.w'", "grid of dim 1", "from 0 to 6")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(grid=[[0, 2, 4], [0, 3, 7]])),
         "'model.w'", "grid of dim 1")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(grid=[[0, 3, 2, 4], [0, 6]])),
         "'model.w'", "grid of dim 0")
    _bad(_mut(lambda d: t(d)["model.w"]["chunks"].update(grid=[[0, 4]])),
         "'model.w'", "one breakpoint list per dim")
    _bad(_mut(lambda d: t(d)["emb"]["chunks"].update(grid=[{"runs": [[0, 1, 8]]}])),
         "'emb'", "grid of dim 0")


def test_manifest_bad_chunk_lists():
    def irregular(offsets, sizes, file):
        def fn(d):
            d["tensors"]["irregular"]["chunks"] = {"offsets": offsets, "sizes": sizes, "file": file}
        return _mut(fn)

    ok = irregular([[0, 0], [0, 2], [1, 0], [1, 1], [1, 3]],
                   [[1, 2], [1, 2], [1, 1], [1, 2], [1, 1]], [0, 1, 0, 1, 0])
    assert mf.parse(json.dumps(ok).encode()).tensors["irregular"].chunks.grid is None
    # gap: the last cell of row 1 is missing
    _bad(irregular([[0, 0], [0, 2], [1, 0], [1, 1]], [[1, 2], [1, 2], [1, 1], [1, 2]],
                   [0, 1, 0, 1]), "'irregular'", "cover 7 elements of 8")
    # overlap with the right element count
    _bad(irregular([[0, 0], [0, 2], [1, 0], [1, 1]], [[1, 2], [1, 2], [1, 2], [1, 2]],
                   [0, 1, 0, 1]), "'irregular'", "overlap")
    # a chunk outside the tensor, an empty chunk
    _bad(irregular([[0, 0], [1, 0]], [[1, 4], [2, 4]], [0, 1]), "'irregular'", "outside")
    _bad(irregular([[0, 0], [1, 0], [1, 0]], [[1, 4], [1, 4], [0, 4]], [0, 1, 1]),
         "'irregular'", "empty")
    # malformed tables
    _bad(irregular([[0, 0], [1, 0]], [[1, 4]], [0, 1]), "'irregular'")
    _bad(irregular([[0], [1]], [[1], [1]], [0, 1]), "'irregular'")
    _bad(irregular([0, 1], [1, 1], [0, 1]), "'irregular'")
    _bad(irregular([[0, 0], [1, 0]], [[1, 4], [1, 4]], [0]), "'irregular'", "2 chunks")
    _bad(irregular([[0, 0], [1, 0]], [[1, 4], [1, 4]], [0, 8]), "'irregular'", "out of range")
    _bad(irregular([[0, 0], [1, "0"]], [[1, 4], [1, 4]], [0, 1]), "'irregular'")
    _bad(irregular([[0, 0], [1, 0]], [[1, 4], [1, 4.0]], [0, 1]), "'irregular'")
    _bad(irregular([[0, 0], [1, 0.5]], [[1, 4], [1, 4]], [0, 1]), "'irregular'")
    _bad(irregular([[0, 0], [True, 0]], [[1, 4], [1, 4]], [0, 1]), "'irregular'")
    _bad(irregular([[0, 0], [1, 0]], [[1, 4], [1, 2**64]], [0, 1]), "'irregular'")
    _bad(irregular(None, None, [0, 1]), "'irregular'")
    _bad(irregular({"a": 1}, {"a": 1}, [0, 1]), "'irregular'")


def test_manifest_bad_values():
    _bad(_mut(lambda d: d["values"].update(x=[1, 2])), "value 'x'", "scalar")
    _bad(_mut(lambda d: d["values"].update(x={"a": 1})), "value 'x'", "scalar")
    _bad(_mut(lambda d: d["values"].update({"model.w": 1})), "'model.w'", "both a tensor and a value")
    _bad(_mut(lambda d: d.update(values=[1])), "'values'", "wrong JSON type")
    _bad(_mut(lambda d: d.update(tensors=[])), "'tensors'", "wrong JSON type")


def test_manifest_bad_top_level_fields():
    _bad(_mut(lambda d: d.update(created="yesterday")), "created")
    _bad(_mut(lambda d: d.update(created=[1])), "created")


def test_manifest_huge_shape():
    def fn(d):
        d["tensors"]["irregular"]["shape"] = [2**70, 4]
    _bad(_mut(fn), "'irregular'")

    def fn2(d):
        d["tensors"]["model.w"]["shape"] = [2**62, 2**62]
        d["tensors"]["model.w"]["chunks"] = {"grid": [[0, 2**62], [0, 2**62]], "file": [0]}
    _bad(_mut(fn2), "'model.w'")


def test_manifest_size_cap(monkeypatch):
    raw = open(GOLDEN, "rb").read()
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(raw) - 1)
    _bad(raw, "exceeds", str(len(raw) - 1))
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(raw))
    assert mf.parse(raw).world_size == 8


@settings(max_examples=_n(150), deadline=None)
@given(st.data())
def test_manifest_fuzz_only_manifest_errors(data):
    """Random corruption of the golden bytes: parse either succeeds or raises
    ManifestError, never another exception."""
    raw = bytearray(open(GOLDEN, "rb").read())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.sampled_from(b'0123456789-.,:[]{}"eE tnfalsruxz\\'))
    try:
        m = mf.parse(bytes(raw))
    except ManifestError:
        return
    # accepted: every tensor's chunks are inside it and in range of the files
    for t in m.tensors.values():
        assert (t.chunks.offsets >= 0).all() and (t.chunks.sizes > 0).all()
        assert ((t.chunks.offsets + t.chunks.sizes) <= np.asarray(t.shape, np.int64)).all()
        assert ((t.chunks.file >= 0) & (t.chunks.file < len(m.files))).all()


@settings(max_examples=_n(150), deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                    max_leaves=8),
       st.sampled_from(["files", "tensors", "values", "t", "chunks", "grid", "file", "offsets",
                        "shape", "dtype", "created", "world_size", "f0", "meta"]))
def test_manifest_fuzz_wrong_types(junk, where):
    doc = golden_doc()
    if where == "t":
        doc["tensors"]["model.w"] = junk
    elif where == "chunks":
        doc["tensors"]["irregular"]["chunks"] = junk
    elif where in ("grid", "file"):
        doc["tensors"]["model.w"]["chunks"][where] = junk
    elif where == "offsets":
        doc["tensors"]["irregular"]["chunks"]["offsets"] = junk
    elif where in ("shape", "dtype"):
        doc["tensors"]["model.w"][where] = junk
    elif where == "f0":
        doc["files"][0] = junk
    else:
        doc[where] = junk
    try:
        data = json.dumps(doc).encode()
    except ValueError:
        return
    try:
        mf.parse(data)
    except ManifestError:
        pass


# ----------------------------------------------------------------------------- shard files

def _buf(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(7, 5, generator=g),
        "model.bf": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "mask": torch.rand(11, generator=g) > 0.5,
        "ids": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "empty_i8": torch.zeros(3, 0, dtype=torch.int8),
        "big": torch.randn(1000, generator=g),  # 4000 bytes: 4 blocks of 1024
        "half": torch.randn(513, generator=g).to(torch.float16),  # 1026 bytes: 2 blocks
        "u8": torch.randint(0, 255, (2, 3, 5), dtype=torch.uint8, generator=g),
        "i32": torch.randint(-100, 100, (4,), dtype=torch.int32, generator=g),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
    }


def _write(tmp, tensors, random_write, block=1024, name="rank0.safetensors"):
    st_ = LocalStorage()
    path = os.path.join(tmp, name)
    entries = [(k, to_code(t.dtype, k), tuple(t.shape), t.numel() * t.element_size())
               for k, t in tensors.items()]
    order = shards.order_entries(entries)
    entries = [entries[i] for i in order]
    buffers = [_buf(tensors[e[0]]) for e in entries]
    w = st_.open_write(path)
    size, hlen, crc = shards.write_shard(w, entries, buffers, random_write=random_write, block=block)
    w.commit()
    return path, entries, size, hlen, crc


def _check_shard(path, tensors, entries, size, hlen, crc, block):
    data = open(path, "rb").read()
    assert len(data) == size == os.path.getsize(path)
    assert struct.unpack("<Q", data[:8])[0] == hlen and hlen % 8 == 0
    assert zlib.crc32(data[:8 + hlen]) == crc
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for k, t in tensors.items():
        assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape
        assert torch.equal(loaded[k], t), k
    stored, blk = shards.parse_header(data[:8 + hlen], path, size)
    assert blk == block and set(stored) == set(tensors)
    pos = 8 + hlen
    for name, dt, shape, nbytes in entries:  # file order, back to back
        s = stored[name]
        assert (s.name, s.dtype, s.shape, s.nbytes, s.start) == (name, dt, shape, nbytes, pos)
        assert s.start % ITEMSIZE[dt] == 0  # aligned, as safetensors requires
        raw = data[s.start:s.start + s.nbytes]
        assert raw == bytes(_buf(tensors[name]))
        nblocks = max(1, -(-nbytes // block))
        assert len(s.crcs) == nblocks and s.crcs.dtype == np.uint32
        assert s.crcs.tolist() == [zlib.crc32(raw[i:i + block]) for i in range(0, nbytes, block)] or (
            nbytes == 0 and s.crcs.tolist() == [0])
        shards.verify(memoryview(raw), 0, s.crcs, block, name)
        for b in range(1, nblocks):  # a partial read from any block on verifies too
            shards.verify(memoryview(raw)[b * block:], b, s.crcs, block, name)
        pos += nbytes
    assert pos == size
    return data, stored


@pytest.mark.parametrize("random_write", [True, False])
def test_shard_roundtrip(tmp_path, random_write):
    tensors = _sample_tensors()
    path, entries, size, hlen, crc = _write(str(tmp_path), tensors, random_write)
    _check_shard(path, tensors, entries, size, hlen, crc, 1024)
    assert [ITEMSIZE[e[1]] for e in entries] == sorted((ITEMSIZE[e[1]] for e in entries), reverse=True)


def test_shard_write_modes_identical(tmp_path):
    tensors = _sample_tensors()
    a = _write(str(tmp_path), tensors, True, name="a.safetensors")
    b = _write(str(tmp_path), tensors, False, name="b.safetensors")
    assert open(a[0], "rb").read() == open(b[0], "rb").read()
    assert a[2:] == b[2:]


def test_shard_default_block(tmp_path):
    tensors = {"x": torch.arange(10, dtype=torch.float32)}
    st_ = LocalStorage()
    path = os.path.join(str(tmp_path), "x.safetensors")
    w = st_.open_write(path)
    size, hlen, _ = shards.write_shard(w, [("x", "F32", (10,), 40)], [_buf(tensors["x"])], True)
    w.commit()
    data = open(path, "rb").read()
    stored, blk = shards.parse_header(data[:8 + hlen], path, size)
    assert blk == shards.BLOCK and stored["x"].crcs.tolist() == [zlib.crc32(data[-40:])]
    assert torch.equal(load_file(path)["x"], tensors["x"])


dtypes_st = st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.float16,
                             torch.uint8, torch.int8, torch.float64, torch.int32])


@settings(max_examples=_n(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(dtypes_st, st.lists(st.integers(0, 12), max_size=3)), min_size=0,
                max_size=6),
       st.booleans(), st.sampled_from([16, 64, 1024]), st.integers(0, 2**32 - 1))
def test_shard_property(specs, random_write, block, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (dt, shape) in enumerate(specs):
        if dt == torch.bool:
            t = torch.rand(shape, generator=g) > 0.5
        elif dt.is_floating_point:
            t = torch.randn(shape, generator=g).to(dt)
        else:
            t = torch.randint(-100 if dt != torch.uint8 else 0, 100, shape, generator=g).to(dt)
        tensors[f"t{i}.{to_code(dt)}"] = t
    with tempfile.TemporaryDirectory() as tmp:
        path, entries, size, hlen, crc = _write(tmp, tensors, random_write, block=block)
        _check_shard(path, tensors, entries, size, hlen, crc, block)


def test_shard_verify_detects_bit_flips(tmp_path):
    tensors = _sample_tensors()
    path, entries, size, hlen, crc = _write(str(tmp_path), tensors, True)
    data, stored = _check_shard(path, tensors, entries, size, hlen, crc, 1024)
    rng = np.random.default_rng(1)
    for name, s in stored.items():
        if s.nbytes == 0:
            continue
        for _ in range(5):
            raw = bytearray(data[s.start:s.start + s.nbytes])
            i = int(rng.integers(len(raw)))
            raw[i] ^= 1 << int(rng.integers(8))
            with pytest.raises(IntegrityError) as e:
                shards.verify(memoryview(bytes(raw)), 0, s.crcs, 1024, f"{path}:{name}")
            assert name in str(e.value) and f"block {i // 1024}" in str(e.value)
    # a buffer longer or shorter (by a block) than recorded is refused too
    big = stored["big"]
    raw = data[big.start:big.start + big.nbytes]
    with pytest.raises(IntegrityError):
        shards.verify(memoryview(raw + b"\0" * 1024), 0, big.crcs, 1024, "big")
    with pytest.raises(IntegrityError):
        shards.verify(memoryview(raw[:1024]), 0, big.crcs[1:], 1024, "big")
    # a file changed on disk no longer matches the manifest's header checksum
    assert zlib.crc32(data[:8 + hlen]) == crc
    flipped = bytearray(data[:8 + hlen])
    flipped[20] ^= 4
    assert zlib.crc32(bytes(flipped)) != crc


def _reheader(data: bytes, hlen: int, fn) -> tuple[bytes, int]:
    doc = json.loads(data[8:8 + hlen])
    fn(doc)
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    new = struct.pack("<Q", len(raw)) + raw + data[8 + hlen:]
    return new, len(raw)


def _bad_header(data, hlen, fn, size_delta=0):
    new, nh = _reheader(data, hlen, fn)
    with pytest.raises(IntegrityError) as e:
        shards.parse_header(new[:8 + nh], "rank0.safetensors", len(new) + size_delta)
    assert "rank0.safetensors" in str(e.value)


def test_shard_bad_headers(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.arange(4, dtype=torch.int16)}
    path, entries, size, hlen, crc = _write(str(tmp_path), tensors, False, block=8)
    data = open(path, "rb").read()
    ok, _ = shards.parse_header(data[:8 + hlen], path, size)
    assert ok["a"].nbytes == 24 and ok["b"].nbytes == 8

    def set_off(name, off):
        return lambda d: d[name].__setitem__("data_offsets", off)

    _bad_header(data, hlen, set_off("b", [24, 24 + 4096]))  # past the end of the file
    _bad_header(data, hlen, set_off("b", [30, 24]))  # end before start
    _bad_header(data, hlen, set_off("b", [-8, 0]))
    _bad_header(data, hlen, set_off("a", [0, 16]))  # 2x3 F32 is 24 bytes, not 16
    _bad_header(data, hlen, set_off("b", [24, 30]))  # 4 x I16 is 8 bytes, not 6
    _bad_header(data, hlen, set_off("b", ["24", 32]))
    _bad_header(data, hlen, set_off("b", [24]))
    _bad_header(data, hlen, lambda d: d["a"].update(dtype="F128"))
    _bad_header(data, hlen, lambda d: d["a"].update(shape=[2, -3]))
    _bad_header(data, hlen, lambda d: d["a"].update(shape="2x3"))
    _bad_header(data, hlen, lambda d: d["a"].pop("data_offsets"))
    _bad_header(data, hlen, lambda d: d["__metadata__"].pop("dckpt.block"))
    _bad_header(data, hlen, lambda d: d["__metadata__"].update({"dckpt.block": "x"}))
    _bad_header(data, hlen, lambda d: d["__metadata__"].update({"crc32:a": "00"}))
    _bad_header(data, hlen, lambda d: d["__metadata__"].update({"crc32:a": "zz" * 12}))
    _bad_header(data, hlen, lambda d: d.update(__metadata__=[1]))
    _bad_header(data, hlen, lambda d: d.update(a=7))
    # the file is shorter than the header says
    with pytest.raises(IntegrityError):
        shards.parse_header(data[:8 + hlen], path, size - 1)
    # not JSON, not an object, truncated length prefix
    for head in (b"\x08\0\0\0\0\0\0\0not json", struct.pack("<Q", 4) + b"[1] ",
                 struct.pack("<Q", 4) + b"\"x\" ", struct.pack("<Q", 4) + b"3   ", b"\x01\x02"):
        with pytest.raises(IntegrityError):
            shards.parse_header(head, "f", 100)


def test_order_entries():
    e = [("a", "U8", (3,), 3), ("b", "F64", (1,), 8), ("c", "BF16", (2,), 4),
         ("d", "F32", (1,), 4), ("e", "I64", (), 8), ("f", "BOOL", (1,), 1)]
    assert [e[i][0] for i in shards.order_entries(e)] == ["b", "e", "d", "c", "a", "f"]


def test_dtype_codes_roundtrip():
    for code, size in ITEMSIZE.items():
        try:
            dt = to_torch(code)
        except KeyError:
            continue  # not offered by this torch
        assert to_code(dt) == code
        assert torch.empty((), dtype=dt).element_size() == size


def test_grid_breakpoints_that_would_overflow_are_refused():
    big = int(1.9 * 2**62)
    doc = golden_doc()
    doc["tensors"]["emb"]["chunks"]["grid"] = [[0, big, -big, 8]]
    doc["tensors"]["emb"]["chunks"]["file"] = [0, 1, 2]
    _bad(doc, "'emb'", "grid of dim 0")
