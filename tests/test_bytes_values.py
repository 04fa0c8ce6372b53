"""Issue 36: ``bytes`` values, natively, in dckpt.save / dckpt.load / CheckpointManager /
dckpt.open, as frameworks' Stateful objects return them (torchtitan's dataloader:
``{"dp_rank_<r>": pickle.dumps(...), "world_size": N}``; dckpt stores the bytes and never
unpickles them). A bytes value of at most 64 KiB is the JSON object ``{"$bytes":
"<base64>"}`` in the flattened state, the plans and the manifest; a larger one (up to
4 GiB) is a 1-D U8 entry of the saving rank's data file marked ``"bytes": true`` in a
version-5 manifest (torchtitan's token buffers: megabytes). Single process, no process
group; the 2-rank tests are in tests/multirank/test_bytes_values.py."""
from __future__ import annotations

import base64
import json
import os
import pickle
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dckpt
from dckpt.errors import ManifestError, StateMismatchError, UnsupportedValueError
from dckpt.format import manifest as mf
from dckpt.format import sealed
from dckpt.format.sealed import BYTES_TAG, INLINE_BYTES, MAX_BYTES_TAG, MAX_BYTES_VALUE
from dckpt.layout import localplan
from dckpt.layout import plan as gplan
from dckpt.protocol import plancache
from dckpt.state.flatten import flatten
from dckpt.view import MissingKeyError

BLOB = pickle.dumps({"sampler": list(range(50)), "epoch": 3})  # opaque to dckpt
ALL = bytes(range(256))  # every byte value, NUL and 0xff included
WHERE = "ckpt/manifest.json"


class Loader:
    """A Stateful shaped like torchtitan's ParallelAwareDataloader, one process."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def state_dict(self) -> dict:
        return {"dp_rank_0": self.blob, "world_size": 1}

    def load_state_dict(self, sd: dict) -> None:
        assert isinstance(sd["dp_rank_0"], bytes) and sd["world_size"] == 1
        self.blob = sd["dp_rank_0"]


# ------------------------------------------------------------------ round trips

def test_bytes_values_round_trip_through_save_and_load(tmp_path):
    path = str(tmp_path / "ck")
    state = {"w": torch.arange(4.0), "dataloader": Loader(BLOB), "all": ALL, "empty": b"",
             "nested": {"xs": [b"a", (b"\x00b", 7)]}, "max": b"\x5a" * MAX_BYTES_TAG}
    dckpt.save(state, path)
    back = Loader(b"")
    out = {"w": torch.zeros(4), "dataloader": back, "all": b"", "empty": b"old",
           "nested": {"xs": [b"", (b"", 0)]}, "max": b""}
    dckpt.load(out, path)
    assert back.blob == BLOB and pickle.loads(back.blob)["epoch"] == 3
    assert out["all"] == ALL and type(out["all"]) is bytes and out["empty"] == b""
    assert out["nested"]["xs"] == [b"a", (b"\x00b", 7)]
    assert out["max"] == b"\x5a" * MAX_BYTES_TAG
    assert torch.equal(out["w"], torch.arange(4.0))


def test_a_bytes_target_of_any_length_gets_the_saved_bytes(tmp_path):
    """The target's bytes only say where to read: its length does not matter (not even
    one over the save bound) and it is not encoded."""
    path = str(tmp_path / "ck")
    dckpt.save({"b": b"saved"}, path)
    for placeholder in (b"", b"x" * 1000, b"y" * (MAX_BYTES_TAG + 1)):
        out = {"b": placeholder}
        dckpt.load(out, path)
        assert out["b"] == b"saved"
    flat = flatten({"b": b"y" * (MAX_BYTES_TAG + 1)}, target=True)
    assert flat.values == {"b": b"y" * (MAX_BYTES_TAG + 1)}


def test_value_kinds_follow_the_usual_rules_on_load(tmp_path):
    """A JSON leaf takes whatever value the checkpoint holds (as a str target gets a
    saved int today); a tensor on one side and a value on the other is refused."""
    path = str(tmp_path / "ck")
    dckpt.save({"b": b"raw", "s": "text", "i": 5, "t": torch.ones(2)}, path)
    out = {"b": "a str target", "s": b"a bytes target", "i": b"", "t": torch.zeros(2)}
    dckpt.load(out, path)
    assert out == {"b": b"raw", "s": "text", "i": 5, "t": out["t"]}
    with pytest.raises(StateMismatchError, match="tensors on one side"):
        dckpt.load({"b": torch.zeros(3), "s": "", "i": 0, "t": torch.zeros(2)}, path)
    with pytest.raises(StateMismatchError, match="tensors on one side"):
        dckpt.load({"b": b"", "s": "", "i": 0, "t": b""}, path)


def test_manager_round_trips_bytes(tmp_path):
    root = str(tmp_path / "run")
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False)
    mgr.save(1, {"dataloader": Loader(BLOB), "w": torch.ones(3)})
    mgr.save(2, {"dataloader": Loader(BLOB + b"!"), "w": torch.ones(3)})
    mgr.close()
    back = Loader(b"")
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False)
    assert mgr.restore({"dataloader": back, "w": torch.zeros(3)}) == 2
    mgr.close()
    assert back.blob == BLOB + b"!"


def test_incremental_manager_and_async_save_keep_bytes(tmp_path):
    """Delta checkpoints rebuild manifests from a base's values; async saves snapshot
    the values: both keep the tag."""
    root = str(tmp_path / "inc")
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False, incremental=True)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.ones(64), "b": bytes([step]) * 10})
    mgr.close()
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False, incremental=True)
    out = {"w": torch.zeros(64), "b": b""}
    assert mgr.restore(out) == 3 and out["b"] == b"\x03" * 10
    mgr.close()
    path = str(tmp_path / "async")
    dckpt.async_save({"w": torch.ones(2), "b": ALL}, path).result(timeout=60)
    out = {"w": torch.zeros(2), "b": b""}
    dckpt.load(out, path)
    assert out["b"] == ALL


# ------------------------------------------------------------------ what is refused

def test_a_bytes_value_over_the_bound_is_refused_naming_key_and_size(tmp_path, monkeypatch):
    """The bound is 4 GiB (a load allocates a value whole); lowered here so the test
    does not allocate it. Nothing is written."""
    from dckpt.state import flatten as fl

    assert MAX_BYTES_VALUE == 4 << 30
    monkeypatch.setattr(fl, "MAX_BYTES_VALUE", 300_000)
    path = tmp_path / "ck"
    n = 300_001
    with pytest.raises(UnsupportedValueError) as e:
        dckpt.save({"dl": {"dp_rank_0": b"\x01" * n}, "w": torch.zeros(2)}, str(path))
    msg = str(e.value)
    assert "'dl.dp_rank_0'" in msg and str(n) in msg and "300000-byte limit" in msg
    assert isinstance(e.value, dckpt.CheckpointError)
    assert not path.exists() or os.listdir(path) == []


def test_flatten_without_blobs_keeps_the_1_mib_tag_bound():
    """Callers that write no data file for values (imports) keep every bytes value as
    a tag, so the manifest bound (1 MiB) still applies to them."""
    assert flatten({"b": b"\x01" * MAX_BYTES_TAG}).values["b"][BYTES_TAG]
    with pytest.raises(UnsupportedValueError, match=f"'b'.*{MAX_BYTES_TAG + 1}"):
        flatten({"b": b"\x01" * (MAX_BYTES_TAG + 1)})


@pytest.mark.parametrize("value", [bytearray(b"ab"), memoryview(b"ab")],
                         ids=["bytearray", "memoryview"])
def test_bytearray_and_memoryview_are_refused_with_a_hint(tmp_path, value):
    """Only ``bytes`` exactly: a load hands back bytes, so a bytearray or memoryview
    would not come back as what was saved (and a buffer cannot be refilled in place at
    another length)."""
    with pytest.raises(UnsupportedValueError, match=r"'x'.*bytes\(x\)"):
        dckpt.save({"x": value}, str(tmp_path / "ck"))


def test_a_bytes_subclass_is_refused():
    class Tagged(bytes):
        pass

    with pytest.raises(UnsupportedValueError, match="no pickle"):
        flatten({"x": Tagged(b"ab")})


# ------------------------------------------------------------------ the plan layers

def test_flatten_carries_the_tag_and_plans_keep_it():
    flat = flatten({"a": ALL, "n": 1})
    assert flat.values["a"] == {BYTES_TAG: base64.b64encode(ALL).decode()}
    plan = localplan.LocalPlan(values=dict(flat.values))
    back = localplan.decode(localplan.encode(plan))
    assert back.values == flat.values  # JSON through the wire, unchanged
    # the values hash is stable, and differs for different bytes
    same = plancache.values_hash(dict(flat.values))
    assert same == plancache.values_hash(back.values)
    other = flatten({"a": ALL[::-1], "n": 1}).values
    assert plancache.values_hash(dict(other)) != same


def test_ranks_with_different_bytes_under_one_key_conflict():
    """Equality between ranks' values is JSON equality of the tags: the same bytes
    merge, different bytes are a conflict (the lowest rank's is kept), and per-rank
    keys merge without one."""
    a, b = flatten({"k": b"one"}).values, flatten({"k": b"two"}).values
    assert gplan._same(a["k"], flatten({"k": b"one"}).values["k"])
    assert not gplan._same(a["k"], b["k"])
    assert not gplan._same(a["k"], "one")
    values, conflicts = plancache.merge_values([(b"h0", a), (b"h1", b)])
    assert values == a and conflicts == {"k": 1}
    per_rank = [(b"h0", flatten({"dp_rank_0": b"r0", "ws": 2}).values),
                (b"h1", flatten({"dp_rank_1": b"r1", "ws": 2}).values)]
    values, conflicts = plancache.merge_values(per_rank)
    assert conflicts == {} and sealed.user_value(values["dp_rank_1"]) == b"r1"


# ------------------------------------------------------------------ the manifest

def _manifest(values: dict) -> mf.Manifest:
    return mf.Manifest("00000000000000aa", 1, 1700000000.0, (), {}, values, {})


def test_manifest_holds_the_tag_and_round_trips_byte_for_byte(tmp_path):
    path = str(tmp_path / "ck")
    dckpt.save({"b": ALL, "e": b"", "n": float("nan")}, path)
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    doc = json.loads(raw)
    assert doc["values"]["b"] == {"$bytes": base64.b64encode(ALL).decode()}
    assert doc["values"]["e"] == {"$bytes": ""} and doc["version"] == 2
    m = mf.parse(raw)
    assert m.values["b"] == {"$bytes": base64.b64encode(ALL).decode()}  # the tag, in memory
    assert mf.to_json(m) == raw  # a tool's rewrite of a parsed manifest is the same file
    again = mf.parse(mf.to_json(_manifest(dict(m.values))))
    assert sealed.user_value(again.values["b"]) == ALL


def test_old_checkpoints_without_bytes_still_load(tmp_path):
    golden = os.path.join(os.path.dirname(__file__), "golden")
    for name in ("manifest_v1.json", "manifest_v2.json"):
        m = mf.parse(open(os.path.join(golden, name), "rb").read())
        assert not any(isinstance(v, dict) for v in m.values.values())


def _sealed(values: dict) -> bytes:
    doc = json.loads(mf.to_json(_manifest({})))
    doc.pop("checksum")
    doc["values"] = values
    body = json.dumps(doc, separators=(",", ":")).encode()[1:]
    return b'{"checksum":"crc32:%08x",' % zlib.crc32(body) + body


_B64_MAX = 4 * -(-MAX_BYTES_TAG // 3)


@pytest.mark.parametrize("tag, fragment", [
    ({"$bytes": 5}, "exactly one key"),
    ({"$bytes": None}, "exactly one key"),
    ({"$bytes": ["QQ=="]}, "exactly one key"),
    ({"$bytes": {"a": "QQ=="}}, "exactly one key"),
    ({"$bytes": "QQ==", "x": 1}, "2 keys"),
    ({"$bytes": "QQ==", "$float": "nan"}, "2 keys"),
    ({"$bytes": "!!!!"}, "not valid base64"),
    ({"$bytes": "QQ="}, "not valid base64"),  # bad padding
    ({"$bytes": "QQ"}, "not valid base64"),  # no padding
    ({"$bytes": "Q Q=="}, "not valid base64"),
    ({"$bytes": "QQ==\n"}, "not valid base64"),
    ({"$bytes": "QR=="}, "not canonical"),  # unused bits set: decodes, but we never write it
    ({"$bytes": "-_8="}, "not valid base64"),  # the URL-safe alphabet
    ({"$bytes": "h\u00e9llo="}, "not valid base64"),
    ({"$bytes": "A" * (_B64_MAX + 4)}, "limit"),
    ({"bytes": "QQ=="}, "not a JSON scalar"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_hostile_bytes_entries_are_manifest_errors(tag, fragment):
    with pytest.raises(ManifestError) as e:
        mf.parse(_sealed({"dl.dp_rank_0": tag}), WHERE)
    msg = str(e.value)
    assert msg.startswith(WHERE) and "'dl.dp_rank_0'" in msg and fragment in msg, msg
    assert len(msg) < 600  # never the blob itself


def test_a_huge_bytes_entry_is_refused_before_it_is_decoded(monkeypatch):
    """A 64 MiB string is refused on its length: no decode is attempted."""
    def no_decode(*a, **k):
        raise AssertionError("decoded")

    raw = _sealed({"x": {"$bytes": "A" * (64 << 20)}})
    monkeypatch.setattr(sealed.base64, "b64decode", no_decode)
    with pytest.raises(ManifestError, match="limit"):
        mf.parse(raw, WHERE)


def test_the_largest_bytes_entry_parses():
    raw = b"\xfe" * MAX_BYTES_TAG
    m = mf.parse(_sealed({"x": sealed.tag_bytes(raw)}), WHERE)
    assert sealed.user_value(m.values["x"]) == raw


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_round_trip_through_tag_and_parse(raw):
    m = mf.parse(mf.to_json(_manifest({"k": flatten({"k": raw}).values["k"]})))
    assert sealed.user_value(m.values["k"]) == raw
    assert mf.to_json(m) == mf.to_json(_manifest({"k": sealed.tag_bytes(raw)}))


# ------------------------------------------------------------------ reading without a job

def test_open_hands_back_bytes(tmp_path):
    path = str(tmp_path / "ck")
    dckpt.save({"dataloader": Loader(BLOB), "w": torch.ones(2)}, path)
    with dckpt.open(path) as ck:
        assert ck["dataloader.dp_rank_0"] == BLOB
        info = ck.info("dataloader.dp_rank_0")
        assert info.kind == "value" and info.type == "bytes" and info.value == BLOB
        assert ck.to_state_dict("dataloader") == {"dp_rank_0": BLOB, "world_size": 1}
        assert "dataloader.dp_rank_0" in ck.keys()
        with pytest.raises(MissingKeyError, match="JSON value"):
            ck.get_slice("dataloader.dp_rank_0")


def test_diff_and_inspect_show_length_and_a_hex_prefix(tmp_path, capsys):
    from dckpt.cli.main import main

    big = b"\x80\x04" + b"z" * 100_000  # over INLINE_BYTES: an entry of the data file
    mid = b"\x80\x04" + b"y" * 10_000  # inline
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"blob": big, "mid": mid, "same": b"s", "w": torch.ones(2)}, a)
    dckpt.save({"blob": big + b"!", "mid": mid, "same": b"s", "w": torch.ones(2)}, b)
    res = dckpt.diff(a, b)
    st_ = {k.key: k for k in res.keys}
    assert st_["same"].status == "equal" and st_["blob"].status == "changed"
    assert st_["mid"].status == "equal"
    detail = st_["blob"].detail
    assert "bytes[100002]" in detail and "bytes[100003]" in detail and "8004" in detail
    assert len(detail) < 100
    json.loads(res.to_json())  # strict JSON, no bytes in it
    capsys.readouterr()
    assert main(["inspect", a]) == 0
    out = capsys.readouterr().out
    assert "bytes[10002] 8004797979797979..." in out and "bytes[1] 73" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("blob "))
    assert row[1:3] == ["bytes", "100002"], row  # listed with the entries, dtype "bytes"
    assert base64.b64encode(mid)[:40].decode() not in out  # not the base64
    assert len(out) < 2000
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "bytes[100002]" in out and len(out) < 2000


def test_bytes_text_is_short():
    assert sealed.bytes_text(b"") == "bytes[0]"
    assert sealed.bytes_text(b"\x01\x02") == "bytes[2] 0102"
    assert sealed.bytes_text(bytes(range(20))) == "bytes[20] 0001020304050607..."


# ------------------------------------------------------------------ values over 64 KiB: data-file entries

BIG = os.urandom(4 << 20)  # 4 MiB: in the saving rank's data file, not the manifest


def _doc(path: str) -> dict:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return json.loads(f.read())


def test_a_4_mib_bytes_value_round_trips_through_save_load_and_open(tmp_path, capsys):
    from dckpt.cli.main import main

    path = str(tmp_path / "ck")
    dckpt.save({"dataloader": Loader(BIG), "w": torch.arange(4.0), "small": b"s"}, path)
    assert os.path.getsize(os.path.join(path, "manifest.json")) < 4096  # not the value
    doc = _doc(path)
    assert doc["version"] == mf.BYTES_VERSION == 5
    entry = doc["tensors"]["dataloader.dp_rank_0"]
    assert entry["bytes"] is True and entry["dtype"] == "U8" and entry["shape"] == [4 << 20]
    assert "dataloader.dp_rank_0" not in doc["values"] and "bytes" not in doc["tensors"]["w"]
    back = Loader(b"")
    out = {"dataloader": back, "w": torch.zeros(4), "small": b""}
    dckpt.load(out, path)
    assert type(back.blob) is bytes and back.blob == BIG and out["small"] == b"s"
    with dckpt.open(path) as ck:
        got = ck["dataloader.dp_rank_0"]
        assert type(got) is bytes and got == BIG
        info = ck.info("dataloader.dp_rank_0")
        assert info.kind == "value" and info.type == "bytes" and info.value == BIG
        assert ck.to_state_dict("dataloader") == {"dp_rank_0": BIG, "world_size": 1}
        for read in (ck.get_slice, ck.get_tensor):
            with pytest.raises(MissingKeyError, match="JSON value"):
                read("dataloader.dp_rank_0")
    capsys.readouterr()
    assert main(["verify", path]) == 0
    assert main(["inspect", path]) == 0
    assert "dataloader.dp_rank_0  bytes" in capsys.readouterr().out


def test_inline_up_to_64_kib_data_file_above(tmp_path):
    path = str(tmp_path / "ck")
    at, over = b"\x01" * INLINE_BYTES, b"\x02" * (INLINE_BYTES + 1)
    dckpt.save({"at": at, "over": over}, path)
    doc = _doc(path)
    assert set(doc["values"]["at"]) == {BYTES_TAG} and doc["tensors"]["over"]["bytes"] is True
    out = {"at": b"", "over": b""}
    dckpt.load(out, path)
    assert out == {"at": at, "over": over}


def _flip_in(path: str, key: str) -> None:
    """Flip one byte of ``key``'s stored bytes in the checkpoint's (only) data file."""
    from dckpt.format import shards

    name = next(n for n in os.listdir(path) if n.startswith("data-"))
    with open(os.path.join(path, name), "r+b") as f:
        data = f.read()
        tensors, _ = shards.parse_header(data, name, len(data))
        st = tensors[key]
        f.seek(st.start + 10)
        f.write(bytes([data[st.start + 10] ^ 0xFF]))


def test_a_load_reads_a_bytes_entry_only_when_asked(tmp_path):
    """Keys a target does not ask for are not read (one damaged here loads fine until
    asked for); any JSON leaf asks (as for values); a tensor target is refused."""
    path = str(tmp_path / "ck")
    other = os.urandom(300_000)
    dckpt.save({"a": BIG, "b": other}, path)
    _flip_in(path, "b")
    out = {"a": None}
    dckpt.load(out, path, strict=False)
    assert out["a"] == BIG
    with pytest.raises(dckpt.IntegrityError, match="'b'"):
        dckpt.load({"b": b""}, path, strict=False)
    with pytest.raises(StateMismatchError, match="tensors on one side"):
        dckpt.load({"a": torch.zeros(4 << 20, dtype=torch.uint8)}, path, strict=False)


def test_bytes_entries_grow_back_under_an_empty_int_keyed_dict(tmp_path):
    path = str(tmp_path / "ck")
    dckpt.save({"opt": {0: BIG, 1: b"small", 2: torch.ones(2)}}, path)
    out: dict = {"opt": {}}
    dckpt.load(out, path)
    assert out["opt"][0] == BIG and out["opt"][1] == b"small"
    assert torch.equal(out["opt"][2], torch.ones(2))


def test_incremental_and_compressed_saves_keep_bytes_entries(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    other = BIG[::-1]
    dckpt.save({"v": BIG, "w": torch.ones(8)}, a, block_hashes=True)
    info = dckpt.save({"v": BIG, "w": torch.ones(8)}, b, base=a, compression="zstd")
    assert info.bytes_written < len(BIG) // 2  # the unchanged value is referenced
    dckpt.save({"v": other, "w": torch.ones(8)}, c, base=b, compression="lz4")
    for path, want in ((a, BIG), (b, BIG), (c, other)):
        m = mf.parse(open(os.path.join(path, "manifest.json"), "rb").read())
        assert m.tensors["v"].bytes_value and m.tensors["v"].blocks is not None
        out = {"v": b"", "w": torch.zeros(8)}
        dckpt.load(out, path)
        assert out["v"] == want
        with dckpt.open(path) as ck:
            assert ck["v"] == want
    res = dckpt.diff(a, c)
    assert {k.key: k.status for k in res.keys} == {"v": "changed", "w": "equal"}


@pytest.mark.parametrize("kw", [{}, {"compression": "zstd"}], ids=["copy", "encoded"])
def test_fast_tier_and_its_stager_keep_bytes_entries(tmp_path, kw):
    """A manager with a local_root: the local commit, its byte-for-byte or encoded
    durable copy, and a restore from either."""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False, local_root=local, **kw)
    for step in (1, 2):
        mgr.save(step, {"b": BIG + bytes([step]), "w": torch.ones(4)})
    mgr.close()
    for lr in (local, None):  # the fast tier, then the durable copy alone
        mgr = dckpt.CheckpointManager(root, every_steps=1, capture_rng=False, local_root=lr, **kw)
        out = {"b": b"", "w": torch.zeros(4)}
        assert mgr.restore(out) == 2
        mgr.close()
        assert out["b"] == BIG + b"\x02"


def test_hf_export_skips_bytes_entries(tmp_path):
    path = str(tmp_path / "ck")
    dckpt.save({"model": {"w": torch.ones(2)}, "blob": BIG}, path)
    info = dckpt.export(path, str(tmp_path / "hf"))
    assert info.tensors == 1


def test_ranks_disagreeing_on_bytes_or_tensor_under_one_key_are_refused():
    n = INLINE_BYTES + 1
    box = np.array([0, n], np.int64)
    as_bytes = localplan.LocalPlan([("k", "U8", (n,))], box, bytes_keys=["k"])
    as_tensor = localplan.LocalPlan([("k", "U8", (n,))], box)
    with pytest.raises(StateMismatchError, match="'k' is a bytes value on one rank and a "
                                                 "uint8 tensor on rank 1"):
        gplan.plan_global([as_bytes, as_tensor])
    back = localplan.decode(localplan.encode(as_bytes))
    assert back.bytes_keys == ["k"]
    assert gplan.plan_global([back, back]).bytes_keys == ["k"]
    # the plan cache tells the two apart (same key table and boxes)
    assert plancache.fingerprints(as_bytes, localplan.encode(as_bytes))[0] != \
        plancache.fingerprints(as_tensor, localplan.encode(as_tensor))[0]


def _rank_plan(state: dict) -> localplan.LocalPlan:
    """A rank's local plan of ``state`` (1-D tensors and bytes), built as a save builds
    it (flatten with blobs; one whole box per tensor), then sent through the wire."""
    flat = flatten(state, blobs=True)
    items = [(k, "U8" if t.dtype == torch.uint8 else "F32", tuple(t.shape))
             for k, t in flat.tensors.items()]
    boxes = np.array([x for t in flat.tensors.values() for x in (0, t.shape[0])], np.int64)
    plan = localplan.LocalPlan(items, boxes, dict(flat.values), bytes_keys=flat.bytes_keys,
                               tensors=flat.tensors)
    return localplan.decode(localplan.encode(plan))


def _writes(gp: gplan.GlobalPlan, plans: list, key: str) -> list[int]:
    """The ranks whose write mask writes their item ``key``."""
    return [r for r, p in enumerate(plans) for (k, _, _), w in zip(p.items, gp.writes[r])
            if k == key and w]


BIGGER = INLINE_BYTES + 4096


@pytest.mark.parametrize("sizes", [(BIGGER, BIGGER), (BIGGER, BIGGER + 8192),
                                   (INLINE_BYTES - 4096, BIGGER), (BIGGER, INLINE_BYTES - 4096),
                                   (100, 200)],
                         ids=["equal-sizes", "both-over", "inline-first", "inline-second",
                              "both-inline"])
def test_a_shared_bytes_key_keeps_the_lowest_ranks_value_with_a_conflict(sizes):
    """A bytes key is a value whatever its size: the lowest rank holding it gives what
    is saved (its inline tag, or its item, written by it alone), and a rank whose bytes
    differ is reported in ``conflicts``, equal sizes with other contents included."""
    t = torch.ones(4)
    plans = [_rank_plan({"s": bytes([r + 1]) * n, "w": t}) for r, n in enumerate(sizes)]
    gp = gplan.plan_global(plans)
    assert gp.conflicts == {"s": 1}
    if sizes[0] > INLINE_BYTES:
        assert gp.bytes_keys == ["s"] and "s" not in gp.values
        assert gp.tensors["s"].shape == (sizes[0],) and _writes(gp, plans, "s") == [0]
        assert gp.bytes_per_rank[0] >= sizes[0] and gp.bytes_per_rank[1] < BIGGER
    else:
        assert "s" not in gp.tensors and sealed.user_value(gp.values["s"]) == b"\x01" * sizes[0]
        assert _writes(gp, plans, "s") == [] and gp.bytes_keys == []
        assert gp.shadowed == ({"s": 1} if sizes[1] > INLINE_BYTES else {})
    assert "w" in gp.tensors and sorted(_writes(gp, plans, "w")) in ([0], [1])
    assert [len(w) for w in gp.writes] == [len(p.items) for p in plans]


def test_the_same_bytes_on_every_rank_are_written_once_by_the_lowest_without_conflict():
    """Not a replicated tensor whose writer the round robin picks (here it would pick
    rank 1: ranks 1-3 also share other tensors): the lowest rank's copy, and the ranks
    keep one key table (no plan is copied)."""
    plans = [_rank_plan({**({f"x{j}": torch.ones(2) for j in range(4)} if r else {}),
                         "s": b"\x05" * BIGGER}) for r in range(4)]
    gp = gplan.plan_global(plans)
    assert gp.conflicts == {} and gp.bytes_keys == ["s"] and _writes(gp, plans, "s") == [0]
    plans = [_rank_plan({"w": torch.ones(2), "s": b"\x05" * BIGGER}) for _ in range(4)]
    gp = gplan.plan_global(plans)
    assert gp.conflicts == {} and _writes(gp, plans, "s") == [0]
    # a rank that does not hold the key at all changes nothing
    plans[0] = _rank_plan({"w": torch.ones(2)})
    gp = gplan.plan_global(plans)
    assert gp.conflicts == {} and _writes(gp, plans, "s") == [1]


def test_mixed_holders_keep_each_keys_lowest_copy_and_each_ranks_own_items():
    """Several bytes keys at once: "a" the same size everywhere (dropped in place), "b"
    inline on rank 0 (every item dropped), "c" other sizes (copies without it), "d"
    rank 2's alone; the masks stay on each rank's own items."""
    big = lambda r, n=BIGGER: bytes([r + 1]) * n  # noqa: E731
    states = [{"a": big(0), "b": b"\x00", "w": torch.ones(4)},
              {"a": big(1), "b": big(1), "c": big(1), "w": torch.ones(4)},
              {"a": big(0), "b": big(2), "c": big(2, BIGGER + 1), "d": big(2), "w": torch.ones(4)},
              {"c": big(1), "w": torch.ones(4)}]
    plans = [_rank_plan(st) for st in states]
    gp = gplan.plan_global(plans)
    assert gp.bytes_keys == ["a", "c", "d"] and "b" in gp.values and gp.shadowed == {"b": 1}
    assert gp.conflicts == {"a": 1, "b": 1, "c": 2}  # rank 3's "c" equals rank 1's
    assert [_writes(gp, plans, k) for k in "abcd"] == [[0], [], [1], [2]]
    assert gp.tensors["c"].shape == (BIGGER,)
    assert [len(w) for w in gp.writes] == [len(p.items) for p in plans]
    back = [gplan.decode_writes(gplan.encode_writes(gp), r) for r in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(back, gp.writes))


def test_per_rank_bytes_keys_are_each_ranks_own():
    """torchtitan's ``dp_rank_<r>``: one key per rank, each written by its rank; the
    plans are not copied."""
    plans = [_rank_plan({f"dp_rank_{r}": bytes([r]) * BIGGER, "ws": 4, "w": torch.ones(2)})
             for r in range(4)]
    gp = gplan.plan_global(plans)
    assert gp.conflicts == {} and gp.shadowed == {}
    assert gp.bytes_keys == [f"dp_rank_{r}" for r in range(4)]
    assert [_writes(gp, plans, f"dp_rank_{r}") for r in range(4)] == [[0], [1], [2], [3]]


def test_a_bytes_key_held_as_a_tensor_of_another_shape_names_both():
    a = _rank_plan({"k": b"\x01" * BIGGER})
    b = _rank_plan({"k": torch.ones(3)})
    with pytest.raises(StateMismatchError, match="'k' is a bytes value on one rank and a "
                                                 "tensor on another"):
        gplan.plan_global([a, b])
    with pytest.raises(StateMismatchError, match="'k' is a bytes value on one rank and a "
                                                 "tensor on another"):
        gplan.plan_global([b, a])
    # a lower rank's inline copy takes the key; a tensor under it is still refused
    small = _rank_plan({"k": b"\x01"})
    with pytest.raises(StateMismatchError, match="'k' is a tensor on one rank and a plain"):
        gplan.plan_global([small, a, b])


def test_a_plan_listing_a_bytes_key_it_does_not_hold_is_refused():
    a = _rank_plan({"k": b"\x01" * BIGGER})
    b = localplan.LocalPlan([("w", "F32", (2,))], np.array([0, 2], np.int64), bytes_keys=["k"])
    with pytest.raises(StateMismatchError, match="rank 1 lists 'k' as a bytes value"):
        gplan.plan_global([a, b])


def test_plans_carry_a_content_hash_of_each_bytes_item():
    a = _rank_plan({"k": b"\x01" * BIGGER})
    b = _rank_plan({"k": b"\x02" * BIGGER})
    assert set(a.bytes_digests) == {"k"} and a.bytes_digests != b.bytes_digests
    assert a.bytes_digests == _rank_plan({"k": b"\x01" * BIGGER}).bytes_digests
    bad = localplan.LocalPlan(a.items, a.boxes, bytes_keys=["k"], bytes_digests={"k": [1]})
    with pytest.raises(ValueError, match="malformed local plan"):
        localplan.decode(localplan.encode(bad))


def _cache_with(plans: list) -> plancache.CoordCache:
    """A coordinator cache holding the full plan of ``plans``."""
    cache = plancache.CoordCache()
    offers = [plancache.decode_offer(plancache.encode_offer(
        False, plancache.fingerprints(p, localplan.encode(p)), localplan.encode(p)))
        for p in plans]
    cache.store(offers, plans, gplan.plan_global(plans))
    return cache


def _finish(cache: plancache.CoordCache, plans: list):
    return cache._finish([(plancache.values_hash(p.values), p.values) for p in plans])


def test_a_cached_plan_replans_when_the_value_that_shadowed_a_bytes_item_goes():
    """Rank 0's inline copy took the key and rank 1's item is not written; a later save
    with the same structures in which rank 0 no longer holds the key must not reuse
    those masks (rank 1's item would be lost): the cache answers "plan again"."""
    t = torch.ones(2)
    plans = [_rank_plan({"s": b"\x01" * 100, "w": t}), _rank_plan({"s": b"\x02" * BIGGER, "w": t})]
    cache = _cache_with(plans)
    assert _finish(cache, plans) is not None  # unchanged: reused
    gone = [_rank_plan({"w": t}), plans[1]]
    assert _finish(cache, gone) is None
    assert gplan.plan_global(gone).bytes_keys == ["s"]  # the full plan keeps rank 1's


def test_a_cached_plan_drops_a_higher_ranks_inline_copy_and_replans_for_a_lower_one():
    t = torch.ones(2)
    big, small = {"s": b"\x01" * BIGGER, "w": t}, {"s": b"\x02", "w": t}
    plans = [_rank_plan({"w": t}), _rank_plan(big), _rank_plan(small)]
    gp = gplan.plan_global(plans)
    assert gp.bytes_keys == ["s"] and "s" not in gp.values and gp.conflicts == {"s": 2}
    cache = _cache_with(plans)
    got = _finish(cache, plans)
    assert got is not None and "s" not in got.values and got.conflicts == {"s": 2}
    lower = [_rank_plan(small), plans[1], plans[2]]  # rank 0 now gives the key inline
    assert _finish(cache, lower) is None


def _entry_doc(tmp_path) -> dict:
    path = str(tmp_path / "src")
    dckpt.save({"dl": b"\x07" * (INLINE_BYTES + 5)}, path)
    doc = _doc(path)
    doc.pop("checksum")
    return doc


def test_a_bytes_entry_is_pinned_and_round_trips_byte_for_byte(tmp_path):
    doc = _entry_doc(tmp_path)
    n = INLINE_BYTES + 5
    assert json.dumps(doc["tensors"], separators=(",", ":")) == (
        '{"dl":{"dtype":"U8","shape":[%d],"chunks":{"grid":[[0,%d]],"file":[0]},'
        '"bytes":true}}' % (n, n))
    raw = mf.seal(doc)
    m = mf.parse(raw)
    assert m.tensors["dl"].bytes_value and mf.to_json(m) == raw


def _set(doc: dict, **entry) -> dict:
    doc["tensors"]["dl"].update(entry)
    return doc


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: _set(d, bytes=1), '"bytes" must be true'),
    (lambda d: _set(d, bytes=False), '"bytes" must be true'),
    (lambda d: _set(d, bytes="yes"), '"bytes" must be true'),
    (lambda d: _set(d, dtype="F32"), "1-D U8"),
    (lambda d: _set(d, shape=[2, 4]), "1-D U8"),
    (lambda d: _set(d, shape=[MAX_BYTES_VALUE + 1]), "limit"),
    (lambda d: _set(d, shape=[-1]), "limit"),
    (lambda d: _set(d, shape=[True]), "limit"),
    (lambda d: dict(d, version=4), "version 4 does not have"),
    (lambda d: dict(d, version=2), "version 2 does not have"),
], ids=["one", "false", "str", "dtype", "2-D", "over 4 GiB", "negative", "bool", "v4", "v2"])
def test_hostile_bytes_data_entries_are_manifest_errors(tmp_path, mutate, fragment):
    """Checked before the entry's shape is trusted: a 4 GiB + 1 declaration is refused
    before anything is allocated for it."""
    with pytest.raises(ManifestError) as e:
        mf.parse(mf.seal(mutate(_entry_doc(tmp_path))), WHERE)
    msg = str(e.value)
    assert msg.startswith(WHERE) and "'dl'" in msg and fragment in msg, msg
