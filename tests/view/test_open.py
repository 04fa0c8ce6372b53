"""dckpt.open in one process: keys as `dckpt inspect` lists them, info, whole tensors and
JSON values, get_slice against torch's own indexing, to_state_dict, memory:// and S3,
incremental and compressed checkpoints, damaged chunks, and the bytes a slice reads
(counted through the storage). Multi-rank saves: tests/multirank/test_open.py."""
from __future__ import annotations

import itertools
import os
import threading
import uuid

import pytest
import torch

import dckpt
from dckpt import CheckpointError, IntegrityError, ManifestError, NotCommittedError
from dckpt.cli.main import main
from dckpt.protocol.manifest_read import read_manifest
from dckpt.engine.reader import ChunkReader, find_stored
from dckpt.storage.fsspec_storage import make_storage
from dckpt.view.open import Checkpoint, MissingKeyError, TensorInfo, ValueInfo
from dckpt.view.slices import SliceError, region
from statekit import ALL_DTYPES, bits, flip_byte, rand


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": rand((7, 5, 3), torch.float32, g), "b": rand((5,), torch.bfloat16, g),
                  "mask": rand((4, 4), torch.bool, g), "scalar": torch.tensor(2.5),
                  "empty": torch.zeros(0, 3)},
        "opt": {"state": {0: {"exp_avg": rand((7,), torch.float32, g)},
                          1: {"exp_avg": rand((5,), torch.float32, g)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "layers": [rand((2, 2), torch.int64, g), rand((3,), torch.float16, g)],
        "step": 12, "name": "run-a", "loss": 1.5, "none": None, "flag": True,
    }


def _leaves(obj, prefix=""):
    """{dotted key: leaf} of a nested state, as dckpt flattens it."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    out = {}
    for k, v in items:
        out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(bits(a), bits(b)))
    return type(a) is type(b) and a == b


class Counting:
    """A storage that counts the bytes read through it (headers, data), delegating
    everything else to a real storage."""

    def __init__(self, inner) -> None:
        self.inner, self.bytes, self.lock = inner, 0, threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n

    def read(self, path, start=0, length=None):
        data = self.inner.read(path, start, length)
        self.add(len(data))
        return data

    def open_read(self, path):
        return _CountingFile(self.inner.open_read(path), self)


class _CountingFile:
    def __init__(self, f, c: Counting) -> None:
        self.f, self.c = f, c

    def readv(self, start, bufs):
        n = self.f.readv(start, bufs)
        self.c.add(n)
        return n

    def close(self):
        self.f.close()


def _counting(path: str) -> tuple[Checkpoint, Counting]:
    storage, root = make_storage(path)
    m, _ = read_manifest(storage, root)
    c = Counting(storage)
    return Checkpoint(c, root, m, path=path), c


def _file_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))


# ------------------------------------------------------------------ keys, info, values
def test_keys_info_and_values_match_what_was_saved_and_inspect(tmp_path, capsys):
    sd = _state()
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    want = _leaves(sd)
    assert main(["inspect", path]) == 0
    rows = capsys.readouterr().out.splitlines()
    shown = [r.split()[0] for r in rows if r and not r.startswith(("checkpoint", "  ", "-"))
             and r.split()[0] not in ("tensor", "value")]
    with dckpt.open(path) as ck:
        assert ck.keys() == shown  # same keys, same order as `dckpt inspect`
        assert sorted(ck.keys()) == sorted(want) and len(ck) == len(want)
        assert list(ck) == ck.keys() and "model.w" in ck and "model" not in ck and 3 not in ck
        for k, v in want.items():
            got = ck[k]
            assert _same(v, got), k
            info = ck.info(k)
            if isinstance(v, torch.Tensor):
                assert isinstance(info, TensorInfo) and info.kind == "tensor"
                assert (info.dtype, info.shape, info.nbytes) == (
                    v.dtype, tuple(v.shape), v.numel() * v.element_size()), k
                if v.numel():
                    assert info.chunks == 1 and info.sharding == "whole (1 chunk)"
                else:  # an empty tensor has no bytes to store
                    assert info.chunks == 0 and info.sharding == "empty (no chunk)"
            else:
                assert isinstance(info, ValueInfo) and info.kind == "value"
                assert info.value == v and info.type == type(v).__name__
        assert ck.get_tensor("model.b").dtype == torch.bfloat16
        assert ck.world_size == 1 and ck.save_id and "keys" in repr(ck)
    with pytest.raises(CheckpointError, match="was closed"):
        ck["model.w"]
    with pytest.raises(CheckpointError, match="was closed"):
        ck.keys()


def test_missing_keys_raise_keyerror_naming_the_key(tmp_path):
    path = str(tmp_path / "c")
    dckpt.save(_state(), path)
    with dckpt.open(path) as ck:
        for call in (lambda: ck["model.ww"], lambda: ck.info("model.ww"),
                     lambda: ck.get_slice("model.ww"), lambda: ck.to_state_dict("nope")):
            with pytest.raises(KeyError) as e:
                call()
            assert isinstance(e.value, CheckpointError) and isinstance(e.value, MissingKeyError)
        with pytest.raises(MissingKeyError, match="no key 'model.ww'; did you mean 'model.w'"):
            ck["model.ww"]
        with pytest.raises(MissingKeyError, match=r"prefix of 5 key.*to_state_dict\('model'\)"):
            ck["model"]
        with pytest.raises(MissingKeyError, match="'step' is a JSON value, not a tensor"):
            ck.get_slice("step")
        with pytest.raises(MissingKeyError, match="no sub-tree 'nope'"):
            ck.to_state_dict("nope")
        with pytest.raises(MissingKeyError, match="keys are dotted strings"):
            ck[0]


def test_not_committed_and_garbage_manifests_raise_as_load_does(tmp_path):
    with pytest.raises(NotCommittedError, match="no committed checkpoint"):
        dckpt.open(str(tmp_path / "nothing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError):
        dckpt.open(str(tmp_path / "bad"))


# ------------------------------------------------------------------ get_slice
INDEXES = [(), (...,), 0, -1, 3, slice(None), slice(2, 5), slice(-3, None), slice(5, 2),
           slice(0, 100), (slice(1, 3), 2), (..., 1), (2, ..., slice(0, 2)), (-7, -5, -3),
           (slice(1, 6), slice(1, 4), slice(1, 2)), (..., slice(2, 2)), (Ellipsis, -1, 0),
           (slice(None), 4, ...)]


def test_get_slice_equals_torch_indexing_on_every_dim(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {f"t.{str(dt).split('.')[-1]}": rand((7, 5, 3), dt, g) for dt in ALL_DTYPES}
    sd["scalar"], sd["vec"] = torch.tensor(7, dtype=torch.int32), torch.arange(10.0)
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    with dckpt.open(path) as ck:
        for k, t in sd.items():
            sl = ck.get_slice(k)
            assert sl.shape == tuple(t.shape) and sl.get_shape() == list(t.shape)
            assert sl.dtype == t.dtype and isinstance(sl.get_dtype(), str)
            for idx in INDEXES if t.dim() == 3 else [(), (...,)]:
                assert _same(t[idx].contiguous(), sl[idx]), (k, idx)
        v = ck.get_slice("vec")
        assert len(v) == 10 and _same(v[2:5], sd["vec"][2:5]) and _same(v[-1], sd["vec"][-1])
        for a, b in itertools.product(range(-11, 12, 3), repeat=2):
            assert _same(v[a:b], sd["vec"][a:b]), (a, b)


@pytest.mark.parametrize("index, match", [
    (slice(None, None, 2), "step 2; get_slice reads only contiguous ranges"),
    (slice(None, None, -1), "step -1"),
    ((0, 0, 0, 0), "has 3 dim.*has 4"),
    ((..., 0, ...), "single Ellipsis"),
    (None, "None at dim 0 is not supported"),
    (torch.tensor([0, 1]), "not supported"),
    ([0, 1], "type list at dim 0 is not supported"),
    (7, "index 7 is out of range for dim 0 of size 7"),
    ((0, -6), "index -6 is out of range for dim 1 of size 5"),
    (True, "True at dim 0 is not supported"),
    (slice(0, "x"), "bound of type str at dim 0"),  # review: was a bare TypeError
    ((0, slice(1.5, None)), "bound of type float at dim 1"),
])
def test_get_slice_refuses_what_it_cannot_read_as_ranges(index, match):
    with pytest.raises(SliceError, match=match) as e:
        region(index, (7, 5, 3), "w")
    assert isinstance(e.value, IndexError) and isinstance(e.value, CheckpointError)
    assert "'w'" in str(e.value)


# ------------------------------------------------------------------ to_state_dict
def test_to_state_dict_rebuilds_the_nesting_and_int_keys(tmp_path):
    sd = _state()
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    with dckpt.open(path) as ck:
        full = ck.to_state_dict()
        assert set(full) == set(sd)
        # int keys of a dict come back as ints (the manifest records them)
        assert set(full["opt"]["state"]) == {0, 1}
        assert _same(full["opt"]["state"][1]["exp_avg"], sd["opt"]["state"][1]["exp_avg"])
        # lists are not recorded: dicts keyed by strings
        assert set(full["layers"]) == {"0", "1"} and _same(full["layers"]["1"], sd["layers"][1])
        assert full["opt"]["param_groups"]["0"]["params"] == {"0": 0, "1": 1}
        assert full["step"] == 12 and full["none"] is None
        flat = _leaves(full)  # every saved leaf, at its place, with its value
        assert set(flat) == set(_leaves(sd))
        assert all(_same(v, flat[k]) for k, v in _leaves(sd).items())
        model = ck.to_state_dict("model")
        assert set(model) == set(sd["model"])
        assert all(_same(sd["model"][k], model[k]) for k in model)
        assert ck.to_state_dict("model.").keys() == model.keys()  # a trailing dot is accepted
        assert _same(ck.to_state_dict("model.w"), sd["model"]["w"])  # a leaf's key: the leaf
        assert set(ck.to_state_dict("opt.state")) == {0, 1}
    # what to_state_dict returns loads back into the model it came from
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
    with dckpt.open(path) as ck:
        target["model"].update(ck.to_state_dict("model"))
    assert all(_same(sd["model"][k], target["model"][k]) for k in sd["model"])


def test_a_leaf_that_is_also_a_prefix_is_reported(tmp_path):
    path = str(tmp_path / "c")
    dckpt.save({"a": torch.ones(2), "a.b": torch.zeros(2)}, path)  # both flatten fine
    with dckpt.open(path) as ck:
        assert _same(ck["a.b"], torch.zeros(2))
        with pytest.raises(CheckpointError, match="is a leaf and also the prefix of 'a.b'"):
            ck.to_state_dict()


# ------------------------------------------------------------------ storages and formats
def test_memory_storage(tmp_path):
    sd = _state(3)
    url = f"memory://open-{uuid.uuid4().hex[:8]}/c"
    dckpt.save(sd, url)
    with dckpt.open(url) as ck:
        for k, v in _leaves(sd).items():
            assert _same(v, ck[k]), k
        assert _same(ck.get_slice("model.w")[2:4, 1], sd["model"]["w"][2:4, 1])


def test_s3(s3):
    sd = _state(4)
    url = s3.url("open")
    dckpt.save(sd, url, storage_options=s3.options)
    with dckpt.open(url, storage_options=s3.options) as ck:
        assert sorted(ck.keys()) == sorted(_leaves(sd))
        for k, v in _leaves(sd).items():
            assert _same(v, ck[k]), k
        assert _same(ck.get_slice("model.w")[-2:, ..., 0], sd["model"]["w"][-2:, ..., 0])
        assert set(ck.to_state_dict("opt.state")) == {0, 1}
    with pytest.raises(NotCommittedError):
        dckpt.open(s3.url("none"), storage_options=s3.options)


def test_incremental_checkpoint_reads_its_base_files(tmp_path):
    g = torch.Generator().manual_seed(5)
    sd = {"frozen": torch.randn(512, 1024, generator=g), "head": torch.randn(64, 8, generator=g),
          "step": 1}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save(sd, a)
    sd["head"] = sd["head"] + 1
    sd["step"] = 2
    dckpt.save(sd, b, base=a)
    with dckpt.open(b) as ck:
        assert any(f.dir == "a" for f in ck.manifest.files)  # it does reference its base
        assert _same(ck["frozen"], sd["frozen"]) and _same(ck["head"], sd["head"])
        assert ck["step"] == 2
        assert _same(ck.get_slice("frozen")[300:302, 5:9], sd["frozen"][300:302, 5:9])
        assert _same(ck.to_state_dict()["head"], sd["head"])


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_compressed_checkpoint(tmp_path, compression):
    g = torch.Generator().manual_seed(6)
    sd = {"zeros": torch.zeros(700, 1024), "ints": torch.randint(0, 3, (600, 999), generator=g),
          "rand": torch.randn(300, 70, generator=g).to(torch.bfloat16), "n": 3}
    sd["zeros"][123, 45] = 7.0
    path = str(tmp_path / "c")
    dckpt.save(sd, path, compression=compression)
    with dckpt.open(path) as ck:
        assert ck.manifest.tensors["zeros"].encoded(0) is not None  # blocks really encoded
        for k in ("zeros", "ints", "rand"):
            assert _same(ck[k], sd[k]), k
        assert _same(ck.get_slice("zeros")[120:130, 40:50], sd["zeros"][120:130, 40:50])
        assert _same(ck.get_slice("ints")[-1, 5:], sd["ints"][-1, 5:])
        assert ck["n"] == 3


# ------------------------------------------------------------------ damage and costs
def test_a_damaged_chunk_fails_only_the_reads_that_touch_it(tmp_path):
    g = torch.Generator().manual_seed(7)
    sd = {"a": torch.randn(1024, 256, generator=g), "b": torch.randn(1024, 256, generator=g),
          "c": 1}  # 1 MiB each: four 256 KiB checksum blocks
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    storage, root = make_storage(path)
    m, _ = read_manifest(storage, root)
    e = m.tensors["a"]
    tensors, block = ChunkReader(storage, root, m).header(int(e.chunks.file[0]))
    st = find_stored(tensors, "a", e.chunks.offsets[0])
    flip_byte(os.path.join(path, m.files[int(e.chunks.file[0])].name), st.start + 3 * block + 8)
    with dckpt.open(path) as ck:
        with pytest.raises(IntegrityError, match=r"key 'a'.*checksum") as err:
            ck["a"]
        assert "'b'" not in str(err.value)
        with pytest.raises(IntegrityError, match="key 'a'"):
            ck.get_slice("a")[900:]  # rows in the damaged block
        with pytest.raises(IntegrityError, match="key 'a'"):
            ck.to_state_dict()
        # the same file's other tensor, and a's other blocks, still read fine
        assert _same(ck["b"], sd["b"]) and ck["c"] == 1
        assert _same(ck.get_slice("a")[:500], sd["a"][:500])
        assert _same(ck.to_state_dict("b"), sd["b"])


def test_get_slice_and_getitem_read_only_what_they_need(tmp_path):
    sd = {"big": torch.randn(1024, 2048), "small": torch.arange(10.0)}  # 8 MiB, one chunk
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    total = _file_bytes(path)
    ck, c = _counting(path)
    with ck:
        row = ck.get_slice("big")[700]  # 8 KiB inside one 256 KiB checksum block
        assert _same(row, sd["big"][700])
        head = 8 + ck.manifest.files[0].header_len
        assert c.bytes <= (256 << 10) + head, c.bytes  # the block, plus the file's header
        c.bytes = 0
        assert _same(ck["small"], sd["small"])
        assert c.bytes == 40, c.bytes  # the small tensor's bytes only (header cached)
        c.bytes = 0
        col = ck.get_slice("big")[:, 3]  # a column touches every block: the whole tensor
        assert _same(col, sd["big"][:, 3]) and c.bytes >= 8 << 20
        c.bytes = 0
        ck.get_slice("big")[5:5]  # an empty region reads nothing
        assert c.bytes == 0
    assert total > 8 << 20


def test_whole_tensor_reads_stay_within_the_budget_of_temporaries(tmp_path):
    # a chunk read into a non-contiguous destination goes through bounded temporaries:
    # a tiny budget still assembles the tensor exactly
    g = torch.Generator().manual_seed(8)
    sd = {"w": torch.randn(256, 512, generator=g)}
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    with dckpt.open(path, read_budget=1 << 16, read_workers=2) as ck:
        assert _same(ck["w"], sd["w"])
        assert _same(ck.get_slice("w")[10:200, 100:400], sd["w"][10:200, 100:400])
