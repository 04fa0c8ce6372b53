"""Single-process save/load: every dtype and leaf, errors, integrity, overwrite."""
from __future__ import annotations

import json
import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import dckpt
from dckpt.errors import (AlreadyExistsError, CheckpointError, IntegrityError, ManifestError,
                          NotCommittedError, StateMismatchError, UnsupportedValueError)
from statekit import plain_state, same, zeros_like_state


def data_files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def saved(tmp_path, sd=None, name="ckpt"):
    sd = plain_state() if sd is None else sd
    path = str(tmp_path / name)
    dckpt.save(sd, path)
    return path, sd


def test_round_trip_every_dtype_and_leaf(tmp_path):
    path, sd = saved(tmp_path)
    target = zeros_like_state(sd)
    ids = {k: id(v) for k, v in target["dtypes"].items()}
    out = dckpt.load(target, path)
    assert out is target
    assert same(sd, target)
    assert type(target["nested"]["tuple"]) is tuple
    assert all(id(target["dtypes"][k]) == i for k, i in ids.items()), "tensors filled in place"


def test_info_and_files_are_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([True, False]), "x": 1}
    info = dckpt.save(sd, str(tmp_path / "c"))
    assert info.world_size == 1 and info.num_files == 1 and info.seconds > 0
    files = data_files(tmp_path / "c")
    assert info.bytes_written == os.path.getsize(tmp_path / "c" / files[0])
    loaded = load_file(str(tmp_path / "c" / files[0]))
    assert torch.equal(loaded["a"], sd["a"]) and torch.equal(loaded["b"], sd["b"])


def test_file_url_and_memory_fs(tmp_path):
    sd = plain_state(1)
    dckpt.save(sd, f"file://{tmp_path}/u")
    t = zeros_like_state(sd)
    dckpt.load(t, str(tmp_path / "u"))
    assert same(sd, t)
    dckpt.save(sd, "memory://dckpt-test/m1")
    t = zeros_like_state(sd)
    dckpt.load(t, "memory://dckpt-test/m1")
    assert same(sd, t)
    with pytest.raises(AlreadyExistsError):
        dckpt.save(sd, "memory://dckpt-test/m1")
    dckpt.save(plain_state(2), "memory://dckpt-test/m1", overwrite=True)
    t = zeros_like_state(sd)
    dckpt.load(t, "memory://dckpt-test/m1")
    assert same(plain_state(2), t)


@pytest.mark.parametrize("bad, what", [
    (lambda: None, "function"),
    (torch.nn.Linear(2, 2), "Linear"),
    (object(), "object"),
    ({(1, 2): torch.ones(1)}, "key \\(1, 2\\)"),
    (bytearray(b"bytes"), "bytearray"),
    ({1.5, 2}, "set"),
])
def test_refused_leaves_write_nothing(tmp_path, bad, what):
    sd = {"ok": torch.ones(2), "deep": {"bad": bad}}
    with pytest.raises(UnsupportedValueError, match=what) as e:
        dckpt.save(sd, str(tmp_path / "r"))
    assert "deep" in str(e.value)
    assert not (tmp_path / "r").exists()


def test_key_collision_refused(tmp_path):
    with pytest.raises(UnsupportedValueError, match="a.b"):
        dckpt.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, str(tmp_path / "c"))


def test_not_committed(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "data-0123456789abcdef-00000.safetensors").write_bytes(b"x" * 100)
    with pytest.raises(NotCommittedError, match="no committed checkpoint"):
        dckpt.load({"a": torch.zeros(1)}, str(tmp_path / "half"))
    with pytest.raises(NotCommittedError):
        dckpt.load({"a": torch.zeros(1)}, str(tmp_path / "nowhere"))


def test_mismatches(tmp_path):
    path, _ = saved(tmp_path, {"w": torch.ones(2, 3), "n": 1, "extra": torch.ones(1)})
    with pytest.raises(StateMismatchError, match="'missing'"):
        dckpt.load({"w": torch.zeros(2, 3), "n": 0, "extra": torch.zeros(1), "missing": torch.zeros(1)}, path)
    with pytest.raises(StateMismatchError, match=r"'w'.*shape \[3, 2\]"):
        dckpt.load({"w": torch.zeros(3, 2), "n": 0, "extra": torch.zeros(1)}, path)
    with pytest.raises(StateMismatchError, match=r"'w'.*F64"):
        dckpt.load({"w": torch.zeros(2, 3, dtype=torch.float64), "n": 0, "extra": torch.zeros(1)}, path)
    with pytest.raises(StateMismatchError, match="'extra'.*strict=False"):
        dckpt.load({"w": torch.zeros(2, 3), "n": 0}, path)
    with pytest.raises(StateMismatchError, match="'n'"):
        dckpt.load({"w": torch.zeros(2, 3), "n": torch.zeros(1), "extra": torch.zeros(1)}, path)
    t = {"w": torch.zeros(2, 3), "n": 0}
    dckpt.load(t, path, strict=False)
    assert torch.equal(t["w"], torch.ones(2, 3)) and t["n"] == 1
    # A failed load leaves the target untouched.
    t = {"w": torch.zeros(2, 3), "n": 0, "bad": torch.zeros(1)}
    with pytest.raises(StateMismatchError):
        dckpt.load(t, path, strict=False)
    assert torch.equal(t["w"], torch.zeros(2, 3)) and t["n"] == 0


def test_overwrite_refused_then_allowed_and_old_files_cleaned(tmp_path):
    path, old = saved(tmp_path, plain_state(1))
    before = data_files(path)
    with pytest.raises(AlreadyExistsError, match="overwrite=True"):
        dckpt.save(plain_state(2), path)
    assert data_files(path) == before
    t = zeros_like_state(old)
    dckpt.load(t, path)
    assert same(old, t)
    dckpt.save(plain_state(2), path, overwrite=True)
    after = data_files(path)
    assert len(after) == 1 and after != before
    t = zeros_like_state(old)
    dckpt.load(t, path)
    assert same(plain_state(2), t)


def _corrupt(path, fn):
    f = os.path.join(path, data_files(path)[0])
    b = bytearray(open(f, "rb").read())
    b = fn(b)
    if b is None:
        os.unlink(f)
    else:
        open(f, "wb").write(bytes(b))
    return os.path.basename(f)


def _flip_data(b):
    b[-7] ^= 0x10
    return b


def _flip_header(b):
    b[20] ^= 0x01
    return b


@pytest.mark.parametrize("damage, match", [
    (_flip_data, "checksum mismatch"),
    (_flip_header, "header checksum"),
    (lambda b: b[:-5], "truncated"),
    (lambda b: b + b"\0", "bytes, the manifest recorded"),
    (lambda b: None, "missing"),
])
def test_integrity(tmp_path, damage, match):
    path, sd = saved(tmp_path, {"a": torch.randn(300, 7), "b": torch.arange(10)})
    name = _corrupt(path, damage)
    t = zeros_like_state(sd)
    with pytest.raises(IntegrityError, match=match) as e:
        dckpt.load(t, path)
    assert name in str(e.value)
    from dckpt.catalog.verify import verify_checkpoint
    rep = verify_checkpoint(path)
    assert not rep.ok and any(name in p for p in rep.problems)


def _rewrite_manifest(path, fn, reseal=False):
    """Edit the manifest's bytes; ``reseal`` recomputes its checksum after the edit, so
    that the edited content (not the checksum) is what load refuses."""
    from dckpt.format import manifest as mf

    p = os.path.join(path, "manifest.json")
    with open(p, "rb") as f:
        raw = f.read()
    new = fn(raw)
    with open(p, "wb") as f:
        f.write(mf.seal(json.loads(new)) if reseal else new)


@pytest.mark.parametrize("edit, match, reseal", [
    (lambda raw: b"\x00garbage{", "not valid JSON", False),
    (lambda raw: b"[1, 2]", "not a dckpt manifest", False),
    (lambda raw: raw.replace(b'"version":2', b'"version":99'), "version 99", True),
    (lambda raw: raw.replace(b'"version":2', b'"version":99'), "checksum mismatch", False),
    (lambda raw: raw.replace(b'"format":', b'"format" :'), "checksum mismatch", False),
    (lambda raw: raw.replace(b'"data-', b'"../../data-'), "plain file name", True),
    (lambda raw: raw.replace(b'"data-', b'"/etc/data-'), "plain file name", True),
    (lambda raw: raw.replace(b'"data-', b'"s3://bucket/data-'), "plain file name", True),
    (lambda raw: raw[: len(raw) // 2], "not valid JSON", False),
])
def test_bad_manifests(tmp_path, edit, match, reseal):
    path, sd = saved(tmp_path, {"a": torch.ones(3)})
    _rewrite_manifest(path, edit, reseal)
    with pytest.raises(ManifestError, match=match):
        dckpt.load(zeros_like_state(sd), path)


def test_manifest_lying_about_shapes(tmp_path):
    path, sd = saved(tmp_path, {"a": torch.ones(3)})
    _rewrite_manifest(path, lambda raw: raw.replace(b'"shape":[3]', b'"shape":[4]')
                      .replace(b'"grid":[[0,3]]', b'"grid":[[0,4]]'), reseal=True)
    with pytest.raises(IntegrityError, match="does not hold"):
        dckpt.load({"a": torch.zeros(4)}, path)
    from dckpt.catalog.verify import verify_checkpoint

    report = verify_checkpoint(path)  # the files themselves are sound: only the lie shows
    assert not report.ok and len(report.problems) == 1, report.problems
    assert "tensor 'a' chunk 0: not in" in report.problems[0]


def test_errors_are_exceptions():
    import inspect

    import dckpt.errors as errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert len(classes) >= 8, classes
    for cls in classes:
        assert issubclass(cls, Exception)
        assert issubclass(cls, CheckpointError)


def test_manifest_is_json_not_pickle(tmp_path):
    path, _ = saved(tmp_path)
    doc = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
    assert doc["format"] == "dckpt" and doc["version"] == 2  # no hashes, no references
    import dckpt as pkg
    root = os.path.dirname(pkg.__file__)
    # The one exception: `dckpt import` reads DCP checkpoints and torch.save files, which
    # are pickles (docs/INTEROP.md). Only its two source readers may; nothing else.
    # And Lightning's metadata: what is neither JSON nor a tensor (an argparse.Namespace in
    # the hyper-parameters) is kept as Lightning keeps it, a torch.save blob, committed and
    # checksummed with the checkpoint and loaded with Lightning's weights_only
    # (docs/LIGHTNING.md says so). And the import of a stock DeepSpeed tag (its rank files
    # are torch.save pickles), read with weights_only=True allowing DeepSpeed's four plain
    # record classes only, mapped to stand-ins (docs/DEEPSPEED.md "Migration").
    readers = {os.path.join(root, "interop", "dcp_source.py"),
               os.path.join(root, "interop", "sources.py"),
               os.path.join(root, "integrations", "lightning", "meta.py"),
               os.path.join(root, "integrations", "deepspeed", "stock_files.py")}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and os.path.join(dirpath, f) not in readers:
                src = open(os.path.join(dirpath, f)).read()
                assert "import pickle" not in src and "torch.load" not in src, f


def test_save_and_load_never_unpickle(tmp_path, monkeypatch):
    """Behaviour, not just source text: with every unpickling entry point booby-trapped,
    a full save and load of every kind of leaf still works."""
    import pickle

    def trap(*a, **k):
        raise AssertionError("dckpt unpickled something")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                      (torch, "load")):
        monkeypatch.setattr(mod, name, trap)
    path, sd = saved(tmp_path)
    target = zeros_like_state(sd)
    dckpt.load(target, path)
    assert same(target, sd)


def test_failed_header_crc_detected_via_zlib(tmp_path):
    # The manifest's header checksum is the CRC32 of the file's first 8+header_len bytes.
    path, _ = saved(tmp_path, {"a": torch.ones(3)})
    m = json.loads(open(os.path.join(path, "manifest.json")).read())
    name, size, hlen, crc, rank = m["files"][0]
    head = open(os.path.join(path, name), "rb").read(8 + hlen)
    assert zlib.crc32(head) == crc and os.path.getsize(os.path.join(path, name)) == size


class Cursor:
    """A user object: a resumable data position."""

    def __init__(self, epoch=0, index=0):
        self.epoch, self.index, self.loaded = epoch, index, 0

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "order": torch.arange(5) * self.epoch}

    def load_state_dict(self, sd):
        self.epoch, self.index = sd["epoch"], sd["index"]
        assert torch.equal(sd["order"], torch.arange(5) * sd["epoch"])
        self.loaded += 1


def test_stateful_objects_round_trip(tmp_path):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        opt.step()
        sched.step()
    sd = {"sched": sched, "data": {"cursor": Cursor(3, 41)}, "step": 5}
    dckpt.save(sd, str(tmp_path / "s"))

    p2 = torch.nn.Parameter(torch.ones(2))
    opt2 = torch.optim.SGD([p2], lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    cur = Cursor()
    target = {"sched": sched2, "data": {"cursor": cur}, "step": 0}
    dckpt.load(target, str(tmp_path / "s"))
    assert target["sched"] is sched2 and target["data"]["cursor"] is cur
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()
    assert (cur.epoch, cur.index, cur.loaded) == (3, 41, 1)
    assert target["step"] == 5


def test_modules_and_optimizers_point_to_training_state(tmp_path):
    m = torch.nn.Linear(2, 2)
    for bad in (m, torch.optim.SGD(m.parameters(), lr=0.1)):
        with pytest.raises(UnsupportedValueError, match="TrainingState"):
            dckpt.save({"x": bad}, str(tmp_path / "m"))


def test_read_budget_bounds_temporaries(tmp_path, monkeypatch):
    from dckpt.engine.reader import ChunkReader

    g = torch.Generator().manual_seed(3)
    w = torch.randn(8192, 2048, generator=g)  # 64 MiB, one chunk
    v = torch.randn(300_000, generator=g)
    dckpt.save({"w": w, "v": v}, str(tmp_path / "b"))
    seen: dict[str, list[int]] = {}
    orig = ChunkReader.copy_one

    def spy(self, region, files):
        n = orig(self, region, files)
        seen.setdefault(region.piece.key, []).append(n)
        return n

    monkeypatch.setattr(ChunkReader, "copy_one", spy)
    # A transposed (non-contiguous) target goes through temporaries of the bytes each
    # region reads: cut to read_budget / 4 workers (2 MiB here) plus block widening.
    for budget, lo, hi in ((8 << 20, 1 << 20, 2 << 20), (None, 3 << 20, 4 << 20)):
        seen.clear()
        target = {"w": torch.zeros(2048, 8192).t(), "v": torch.zeros(300_000)}
        kw = {} if budget is None else {"read_budget": budget}
        dckpt.load(target, str(tmp_path / "b"), **kw)
        assert torch.equal(target["w"], w) and torch.equal(target["v"], v)
        # The default budget (256 MiB) leaves pieces of total / 16 for balance: larger.
        assert lo < max(seen["w"]) <= hi + (512 << 10), (budget, seen["w"])
        assert sum(seen["w"]) == 64 << 20


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), max_size=60), st.integers(1, 8))
def test_reader_runs_keep_order_and_balance(sizes, n):
    from dckpt.engine.reader import _runs

    tasks = list(range(len(sizes)))
    runs = _runs(tasks, n, sizes)
    assert [t for r in runs for t in r] == tasks and len(runs) <= n and all(runs)
    if sizes:  # each run holds at most its fair share plus one task
        fair = -(-sum(sizes) // n)
        assert all(sum(sizes[t] for t in r) <= fair + max(sizes) for r in runs)


def test_reader_workers_split_one_tensor_into_runs(tmp_path, monkeypatch):
    """Several workers read consecutive runs of one large tensor, each through its own
    open file; a file whose second half was zeroed after the save fails naming it."""
    from dckpt.storage.local import LocalStorage

    w = torch.randn(4096, 256)  # 4 MiB: cut into pieces for 4 runs
    dckpt.save({"w": w}, str(tmp_path / "c"))
    opened: list[str] = []
    orig = LocalStorage.open_read
    monkeypatch.setattr(LocalStorage, "open_read", lambda self, p: opened.append(p) or orig(self, p))
    target = {"w": torch.zeros(4096, 256)}
    dckpt.load(target, str(tmp_path / "c"))
    assert torch.equal(target["w"], w) and len(opened) == 4
    shard = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] + bytes(len(data) - len(data) // 2))
    with pytest.raises(IntegrityError, match=shard.name):
        dckpt.load(target, str(tmp_path / "c"))


def test_reader_stops_every_worker_after_a_failure(tmp_path, monkeypatch):
    """A corrupt region fails the load without the other workers reading the rest."""
    from dckpt.engine.reader import ChunkReader

    w = torch.randn(32768, 256)  # 32 MiB: 32 regions of 1 MiB over 4 runs
    dckpt.save({"w": w}, str(tmp_path / "c"))
    calls: list[int] = []
    orig = ChunkReader.copy_one

    def failing(self, region, files):
        calls.append(1)
        if len(calls) == 1:
            raise IntegrityError("injected: region 0 is corrupt")
        return orig(self, region, files)

    monkeypatch.setattr(ChunkReader, "copy_one", failing)
    with pytest.raises(IntegrityError, match="injected"):
        dckpt.load({"w": torch.zeros(32768, 256)}, str(tmp_path / "c"), read_budget=1 << 20)
    assert len(calls) <= 8, len(calls)  # of 32: the others stop at their next region


@pytest.mark.parametrize("target, match", [
    (lambda: torch.zeros(10)[::5][:1], None),  # one element, stride 5: "contiguous"
    (lambda: torch.zeros(3, 3).t()[:1, :1], None),
    (lambda: torch.zeros(1).expand(1), None),
    (lambda: torch.zeros(1).expand(4), "expanded view"),
    (lambda: torch.zeros(4, device="meta"), "meta device"),
])
def test_unusual_load_targets(tmp_path, target, match):
    """Found in review: one-element strided views failed with a raw RuntimeError;
    expanded and meta targets now get a clear error naming the key."""
    t = target()
    src = torch.arange(t.numel() if t.device.type != "meta" else 4, dtype=torch.float32)
    src = src.reshape(t.shape)
    path = str(tmp_path / "u")
    dckpt.save({"x": src if match != "expanded view" else torch.arange(4.0)}, path)
    if match is None:
        dckpt.load({"x": t}, path)
        assert torch.equal(t, src)
    else:
        with pytest.raises(CheckpointError, match=f"'x'.*{match}|{match}.*'x'"):
            dckpt.load({"x": t}, path)


def test_refused_tensors_name_their_key(tmp_path):
    """Sparse, meta and '__metadata__'-keyed tensors are refused before anything is
    written; conjugate and negative views are saved by value."""
    for sd, match in (({"s": torch.eye(3).to_sparse()}, "'s' has layout"),
                      ({"m": torch.zeros(2, device="meta")}, "'m' is on the meta device"),
                      ({"__metadata__": torch.ones(2)}, "__metadata__")):
        with pytest.raises(UnsupportedValueError, match=match):
            dckpt.save(sd, str(tmp_path / "r"))
        assert not (tmp_path / "r").exists() or not list((tmp_path / "r").iterdir())
    c = torch.randn(3, dtype=torch.complex64)
    x = torch.randn(3)
    dckpt.save({"c": c.conj(), "n": torch._neg_view(x)}, str(tmp_path / "v"))
    out = {"c": torch.zeros(3, dtype=torch.complex64), "n": torch.zeros(3)}
    dckpt.load(out, str(tmp_path / "v"))
    assert torch.equal(out["c"], c.conj().resolve_conj()) and torch.equal(out["n"], -x)


def test_storage_setup_errors_are_checkpoint_errors(tmp_path):
    for call in (lambda: dckpt.save({"x": torch.ones(1)}, "nosuchproto://b/x"),
                 lambda: dckpt.load({"x": torch.ones(1)}, "nosuchproto://b/x")):
        with pytest.raises(CheckpointError, match="nosuchproto"):
            call()


def test_absurd_sizes_in_a_manifest_are_refused_before_allocating(tmp_path):
    path, sd = saved(tmp_path)
    man = os.path.join(path, "manifest.json")
    doc = json.loads(open(man).read())
    doc["files"][0][1], doc["files"][0][2] = 1 << 51, 1 << 50  # size and header_len
    from dckpt.format import manifest as mf
    with open(man, "wb") as f:
        f.write(mf.seal(doc))  # a valid checksum: the sizes are what must be refused
    with pytest.raises(ManifestError, match="header_len .* over the"):
        dckpt.load(zeros_like_state(sd), path)


def test_object_store_loads_coalesce_small_regions(monkeypatch):
    """Many small tensors on an object store: a few ranged GETs, not one per tensor (a
    request costs a round trip), and a flipped byte is still caught."""
    import uuid

    import fsspec

    url = f"memory://coalesce-{uuid.uuid4().hex[:8]}/ck"
    st = {f"t{i}": torch.full((100,), float(i)) for i in range(300)}
    dckpt.save(st, url)
    fs = fsspec.filesystem("memory")
    calls = []
    real = type(fs).cat_file

    def counting(self, path, start=None, end=None, **kw):
        calls.append((path, start, end))
        return real(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(type(fs), "cat_file", counting)
    dst = {k: torch.zeros(100) for k in st}
    dckpt.load(dst, url)
    assert all(torch.equal(dst[k], st[k]) for k in st)
    assert len(calls) < 10, len(calls)
    data = [p for p in fs.ls(url.split("://")[1], detail=False) if "data-" in p][0]
    raw = bytearray(fs.cat_file(data))
    raw[-50] ^= 0xFF
    fs.pipe_file(data, bytes(raw))
    with pytest.raises(dckpt.IntegrityError):
        dckpt.load({k: torch.zeros(100) for k in st}, url)
