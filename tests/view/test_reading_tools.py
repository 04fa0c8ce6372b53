"""Issue 34, section 2: the reading tools on hostile or surprising input. A fast-tier view
that declares 10**12 ranks (2.3), tensors as get_slice indices (2.5), shard headers whose
block size is not a multiple of the item size or is absurd (2.6), a regular file where a
checkpoint directory is expected and a forged int key (2.7), and `dckpt diff` on a root
or on a fast-tier step (2.8). Every bad input is a CheckpointError naming the file or key."""
from __future__ import annotations

import json
import os
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

import dckpt
from dckpt import CheckpointError, NotCommittedError
from dckpt.cli.main import main
from dckpt.format import shards
from dckpt.view.slices import SliceError, region
from tests.catalog.test_gc_fast_tier import _local_root
from tests.format.test_manifest_hostile import seal


def _resealed(path: str, edit) -> None:
    """Apply ``edit`` to the manifest (or view) document at ``path``, re-checksummed."""
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("checksum", None)
    edit(doc)
    with open(path, "wb") as f:
        f.write(seal(doc))


def _fast_tier(tmp_path) -> tuple[str, str]:
    """(local_root, its one step): step 11 saved locally by one process."""
    return _local_root(tmp_path)


# ------------------------------------------------------------------ 2.3
def test_a_view_declaring_a_trillion_ranks_is_described_in_bounded_memory(tmp_path, capsys):
    """Issue 34 (2.3): ls, inspect and verify listed the missing ranks as a set of
    range(world_size): a 230-byte view made them allocate terabytes (MemoryError)."""
    shm, step = _fast_tier(tmp_path)
    _resealed(os.path.join(step, "manifest-00000.json"),
              lambda d: d.update(world_size=10 ** 12))
    tracemalloc.start()
    try:
        assert main(["ls", shm]) == 0
        out = capsys.readouterr().out
        assert "views of rank(s) 0 of 1000000000000, not 1-999999999999" in out, out
        assert main(["inspect", step]) == 0
        out = capsys.readouterr().out
        assert "by 1000000000000 rank(s)" in out and "not 1-999999999999" in out, out
        assert main(["verify", step]) == 0  # what this node holds is intact
        assert "incomplete on this node" in capsys.readouterr().out
        assert main(["du", shm]) == 0
        capsys.readouterr()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def test_missing_ranks_are_listed_as_ranges_of_what_is_held():
    from dckpt.catalog.local import missing_ranks, ranks_text

    assert missing_ranks({0, 2, 5}, 8) == [(1, 1), (3, 4), (6, 7)]
    assert missing_ranks({0, 1}, 2) == []
    assert missing_ranks({}, 3) == [(0, 2)]
    assert missing_ranks({0, 9}, 4) == [(1, 3)]  # a rank beyond the world is not a gap
    assert ranks_text([(1, 1), (3, 4), (6, 10 ** 12 - 1)]) == "1,3-4,6-999999999999"
    assert ranks_text([0, 1, 2, 5]) == "0-2,5"  # plain ranks, as before


# ------------------------------------------------------------------ 2.5
@pytest.mark.parametrize("index", [torch.tensor([3]), torch.tensor(True), torch.tensor(3),
                                   torch.tensor([True, False, True, False, True]),
                                   np.array([3]), np.array(3), np.bool_(True),
                                   (0, torch.tensor(1))])
def test_get_slice_refuses_tensor_and_array_indices(index):
    """Issue 34 (2.5): a one-element tensor has __index__, so sl[torch.tensor([3])] read
    row 3 as shape (10,) where torch gives (1, 10), and sl[torch.tensor(True)] read row 1.
    OPEN.md says tensors are refused."""
    with pytest.raises(SliceError, match="not supported") as e:
        region(index, (5, 10), "w")
    assert "'w'" in str(e.value) and isinstance(e.value, CheckpointError)


def test_get_slice_keeps_int_like_scalars(tmp_path):
    path = str(tmp_path / "c")
    w = torch.arange(50.0).reshape(5, 10)
    dckpt.save({"w": w}, path)
    with dckpt.open(path) as ck:
        sl = ck.get_slice("w")
        assert torch.equal(sl[np.int64(3)], w[3]) and torch.equal(sl[1:np.int32(3)], w[1:3])
        with pytest.raises(SliceError):
            sl[torch.tensor([3])]


# ------------------------------------------------------------------ 2.6
def _reblock(ck: str, block: int) -> str:
    """Rewrite the one data file of checkpoint ``ck`` with ``dckpt.block = block`` (its
    checksums recomputed) and its manifest entry to match: a file that passes every
    checksum. Returns the file's path."""
    name = next(n for n in os.listdir(ck) if n.startswith("data-"))
    path = os.path.join(ck, name)
    data = open(path, "rb").read()
    (hlen,) = struct.unpack("<Q", data[:8])
    doc = json.loads(data[8:8 + hlen])
    meta = doc["__metadata__"]
    meta["dckpt.block"] = str(block)
    for k, t in doc.items():
        if k == "__metadata__":
            continue
        s, e = t["data_offsets"]
        raw = data[8 + hlen + s:8 + hlen + e]
        meta["crc32:" + k] = "".join(f"{zlib.crc32(raw[i:i + block]):08x}"
                                     for i in range(0, len(raw), block)) or "00000000"
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    new = struct.pack("<Q", len(head)) + head + data[8 + hlen:]
    with open(path, "wb") as f:
        f.write(new)

    def edit(m):
        for f in m["files"]:
            if f[0] == name:
                f[1], f[2], f[3] = len(new), len(head), zlib.crc32(new[:8 + len(head)])
    _resealed(os.path.join(ck, "manifest.json"), edit)
    return path


def test_a_block_size_that_splits_items_is_refused_at_header_parse(tmp_path, capsys):
    """Issue 34 (2.6): dckpt.block=6 on a float32 file passed verify and read whole, but
    get_slice[0:2, 2:4] returned garbage (2.3e-41) and [0:1, 2:3] a raw RuntimeError."""
    ck = str(tmp_path / "c")
    dckpt.save({"w": torch.arange(16.0).reshape(4, 4)}, ck)
    path = _reblock(ck, 6)
    with dckpt.open(ck) as view:
        for idx in ((slice(0, 2), slice(2, 4)), (slice(0, 1), slice(2, 3)), ...):
            with pytest.raises(CheckpointError, match="not a multiple of its item size 4") as e:
                view.get_slice("w")[idx]
            assert path in str(e.value) and "'w'" in str(e.value), str(e.value)
    assert main(["verify", ck]) == 1
    out = capsys.readouterr().out
    assert "block size 6" in out and path in out, out


def test_an_absurd_block_size_is_refused(tmp_path):
    ck = str(tmp_path / "c")
    dckpt.save({"w": torch.arange(16.0).reshape(4, 4)}, ck)
    path = _reblock(ck, 1 << 30)
    with dckpt.open(ck) as view:
        with pytest.raises(CheckpointError, match="block size 1073741824") as e:
            view["w"]
    assert path in str(e.value)


@pytest.mark.parametrize("block, ok", [(4, True), (8, True), (shards.BLOCK, True),
                                       (shards.MAX_BLOCK, True), (6, False), (2, False),
                                       (shards.MAX_BLOCK * 2, False), (1 << 30, False)])
def test_header_parse_checks_the_block_against_each_item_size(block, ok):
    data = np.arange(8, dtype=np.float32).tobytes()
    crcs = [[zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)]]
    head = shards.header_json([("w", "F32", (8,), len(data))], crcs, block)
    raw = struct.pack("<Q", len(head)) + head
    if ok:
        tensors, got = shards.parse_header(raw, "f.safetensors", len(raw) + len(data))
        assert got == block and tensors["w"].nbytes == 32
        return
    with pytest.raises(CheckpointError, match=f"f.safetensors.*block size {block}"):
        shards.parse_header(raw, "f.safetensors", len(raw) + len(data))


# ------------------------------------------------------------------ 2.7
def test_a_regular_file_is_not_a_checkpoint_directory(tmp_path, capsys):
    """Issue 34 (2.7): open/diff/inspect/verify of a file raised NotADirectoryError."""
    ck = str(tmp_path / "c")
    dckpt.save({"w": torch.ones(2)}, ck)
    f = str(tmp_path / "notes.txt")
    open(f, "w").write("x")
    msg = f"{f} is a file, not a checkpoint directory"
    with pytest.raises(NotCommittedError, match=msg):
        dckpt.open(f)
    with pytest.raises(NotCommittedError, match=msg):
        dckpt.diff(f, ck)
    with dckpt.open(ck) as view, pytest.raises(NotCommittedError, match=msg):
        dckpt.diff(view, f)
    for cmd in ("inspect", "verify", "diff"):
        argv = [cmd, f] + ([ck] if cmd == "diff" else [])
        assert main(argv) == 2, cmd
        assert capsys.readouterr().err == f"dckpt {cmd}: {msg}\n"
    # below a file: no such path
    with pytest.raises(NotCommittedError, match="no such path"):
        dckpt.open(os.path.join(f, "x"))


def test_a_forged_int_key_is_a_checkpoint_error_naming_it(tmp_path):
    """Issue 34 (2.7): meta.int_keys naming "a.²": "²".isdigit() is True, int() refuses
    it, and to_state_dict raised ValueError."""
    ck = str(tmp_path / "c")
    dckpt.save({"a": {1: torch.ones(2)}, "b": {"٣": torch.zeros(1)}}, ck)

    def forge(d):
        d["tensors"]["a.²"] = d["tensors"].pop("a.1")
        d["meta"]["int_keys"] = ["a.²", "b.٣"]  # an Arabic-Indic 3: int() takes it
    _resealed(os.path.join(ck, "manifest.json"), forge)
    with dckpt.open(ck) as view:
        with pytest.raises(CheckpointError, match="is recorded as an int key"):
            view.to_state_dict()
        with pytest.raises(CheckpointError, match=r"'a\.²'.*not an integer"):
            view.to_state_dict("a")
        with pytest.raises(CheckpointError, match=r"'b\.٣'.*not an integer"):
            view.to_state_dict("b")
        assert "a.²" in view.keys()  # listed as it is recorded


# ------------------------------------------------------------------ 2.8
def test_diff_says_what_a_root_or_a_fast_tier_step_is(tmp_path, capsys):
    """Issue 34 (2.8): diff of a root, or of a fast-tier step that verify accepts, said
    "the save that wrote it did not finish"."""
    root = tmp_path / "run"
    for n in (10, 20):
        dckpt.save({"w": torch.zeros(2)}, str(root / f"step-{n}"))
    one = str(root / "step-10")
    assert main(["diff", str(root), one]) == 2
    err = capsys.readouterr().err
    assert err == (f"dckpt diff: {root} is a root holding step-10, step-20 (2 checkpoints): "
                   "name one of them\n"), err
    with pytest.raises(NotCommittedError, match="is a root holding step-10, step-20"):
        dckpt.diff(one, str(root))

    shm, step = _fast_tier(tmp_path)
    assert main(["verify", step]) == 0
    capsys.readouterr()
    assert main(["diff", one, step]) == 2
    err = capsys.readouterr().err
    assert "did not finish" not in err and f"{step} is a fast-tier step" in err, err
    assert "durable copy" in err, err
    with pytest.raises(NotCommittedError, match="is a fast-tier step"):
        dckpt.open(step)
    # the fast tier's root is a root holding its steps
    assert main(["diff", shm, one]) == 2
    assert f"{shm} is a root holding step-00000011" in capsys.readouterr().err
    # a save that did not finish still says so
    half = tmp_path / "half"
    half.mkdir()
    (half / "data-0123456789abcdef-00000.safetensors").write_bytes(b"x" * 10)
    assert main(["diff", str(half), one]) == 2
    assert "the save that wrote it did not finish" in capsys.readouterr().err


def test_a_forged_int_key_in_a_load_into_an_empty_dict_is_a_checkpoint_error(tmp_path):
    """Issue 34 (2.7, the load side): dckpt.load growing an empty dict (a fresh
    optimizer's state) from a key recorded as an int that is not one raised ValueError
    ("a.²") or silently made 3 of "a.٣"."""
    ck = str(tmp_path / "c")
    dckpt.save({"a": {1: torch.ones(2)}}, ck)
    for forged in ("²", "٣"):
        def forge(d, forged=forged):
            d["tensors"][f"a.{forged}"] = d["tensors"].pop(next(iter(d["tensors"])))
            d["meta"]["int_keys"] = [f"a.{forged}"]
        _resealed(os.path.join(ck, "manifest.json"), forge)
        with pytest.raises(dckpt.ManifestError, match=rf"'a\.{forged}'.*not an integer"):
            dckpt.load({"a": {}}, ck)
