"""Every chunk knows where it belongs (issue 51, defect 14): a shard file records each
chunk's global offsets in its header (``at:<name>``), and every reader of chunks holds
what a manifest names against them. A manifest that points a cell at the wrong file
(two files' cells swapped for one key) is an IntegrityError naming the tensor and the
file for ``dckpt.load``, ``dckpt.open`` and ``dckpt verify``, never a neighbour's values.
Files written before offsets were recorded still load, except where a file is assigned
two or more cells of a key it holds under the bare key (the one ambiguous case).
The recorded offsets are untrusted input: hostile values are IntegrityErrors."""
from __future__ import annotations

import json
import os
import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dckpt
from dckpt.catalog.verify import verify_checkpoint
from dckpt.errors import IntegrityError
from dckpt.format import manifest as mf
from dckpt.format import shards
from dckpt.format.checksum import crc32
from dckpt.format.chunknames import checked_stored
from dckpt.format.filenames import data_name
from dckpt.layout.chunks import Box
from dckpt.protocol.commit import write_file
from dckpt.state.tensors import LocalPiece
from dckpt.storage.fsspec_storage import make_storage

SID = "00112233445566aa"
ROWS, COLS = 8, 3


def _full(key: str) -> torch.Tensor:
    base = 100.0 if key == "b" else 0.0
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + base


def _strip_offsets(path: str) -> tuple[int, int, int]:
    """Rewrite shard file ``path`` as dckpt wrote it before offsets were recorded (no
    ``at:`` keys). Returns its (size, header length, header CRC32)."""
    raw = open(path, "rb").read()
    (hlen,) = struct.unpack_from("<Q", raw)
    doc = json.loads(raw[8:8 + hlen])
    doc["__metadata__"] = {k: v for k, v in doc["__metadata__"].items()
                           if not k.startswith("at:")}
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    out = struct.pack("<Q", len(head)) + head + raw[8 + hlen:]
    with open(path, "wb") as f:
        f.write(out)
    return len(out), len(head), crc32(out[:8 + len(head)])


def build(root: str, files: list[list[tuple[str, int, int]]], legacy: bool = False,
          keys: tuple[str, ...] = ("w",)) -> list[int]:
    """A checkpoint written by hand through dckpt's own file writer: file ``i`` holds,
    for each ``(key, lo, hi)`` of ``files[i]``, rows ``lo:hi`` of that key (several of
    one key in a file: ``key@offsets`` names); ``legacy``: the files rewritten as dckpt
    wrote them before offsets were recorded. The manifest assigns every chunk to the
    file that holds it (grid cells in row order). Returns the first key's cell -> file
    list, as the manifest holds it."""
    storage, root = make_storage(root)
    storage.makedirs(root)
    entries, cells = [], {k: [] for k in keys}
    for i, held in enumerate(files):
        pieces = [LocalPiece(k, "F32", (ROWS, COLS), Box((lo, 0), (hi - lo, COLS)),
                             _full(k)[lo:hi].clone()) for k, lo, hi in held]
        name = data_name(SID, i)
        vote = write_file(storage, root, name, i, pieces)
        size, hlen, crc = vote["size"], vote["hlen"], vote["crc"]
        if legacy:
            size, hlen, crc = _strip_offsets(os.path.join(root, name))
        entries.append(mf.FileEntry(name, size, hlen, crc, i))
        for k, lo, hi in held:
            cells[k].append((lo, hi, i))
    tensors = {}
    for k in keys:
        cs = sorted(cells[k])
        grid = (tuple([c[0] for c in cs] + [ROWS]), (0, COLS))
        o, s = mf.grid_cells(grid)
        tensors[k] = mf.TensorEntry(k, "F32", (ROWS, COLS),
                                    mf.Chunks(o, s, np.array([c[2] for c in cs], np.int64), grid))
    m = mf.Manifest(SID, len(files), time.time(), entries, tensors, {}, {})
    storage.put_atomic(storage.join(root, mf.MANIFEST_NAME), mf.to_json(m))
    return [c[2] for c in sorted(cells[keys[0]])]


def forge(root: str, key: str, file_ids: list[int]) -> None:
    """Rewrite the manifest at ``root`` with ``key``'s cells assigned to ``file_ids``
    (a valid, resealed manifest: only the cell -> file arithmetic is wrong)."""
    path = os.path.join(root, mf.MANIFEST_NAME)
    m = mf.parse(open(path, "rb").read())
    t = m.tensors[key]
    c = mf.Chunks(t.chunks.offsets, t.chunks.sizes, np.array(file_ids, np.int64), t.chunks.grid)
    tensors = {**m.tensors, key: mf.TensorEntry(key, t.dtype, t.shape, c)}
    m = mf.Manifest(m.save_id, m.world_size, m.created, m.files, tensors, m.values, m.meta)
    with open(path, "wb") as f:
        f.write(mf.to_json(m))


def _refused(root: str, key: str, file_fragment: str) -> None:
    """Load, open and verify all refuse ``root``, naming ``key`` and the file."""
    for fn in (lambda: dckpt.load({key: torch.zeros(ROWS, COLS)}, root, strict=False),
               lambda: dckpt.open(root)[key]):
        with pytest.raises(IntegrityError) as e:
            fn()
        assert repr(key) in str(e.value) and file_fragment in str(e.value), str(e.value)
    report = verify_checkpoint(root)
    assert not report.ok
    assert any(repr(key) in p and file_fragment in p for p in report.problems), report.problems


def test_swapped_cells_of_two_files_are_refused(tmp_path):
    """Two writer files, one chunk of ``w`` each (the bare key): a manifest that swaps
    their cells read each file's rows into the other's place, and verify said OK."""
    root = str(tmp_path / "ck")
    files = build(root, [[("w", 0, 4)], [("w", 4, 8)]])
    assert files == [0, 1]
    got = {"w": torch.zeros(ROWS, COLS)}
    dckpt.load(got, root)
    assert torch.equal(got["w"], _full("w")) and verify_checkpoint(root).ok
    forge(root, "w", [1, 0])
    _refused(root, "w", data_name(SID, 1))


def test_swapped_cells_among_many_writers_and_keys(tmp_path):
    """Four writer files, two keys; one key's cells rotated: that key is refused, the
    other one (untouched) still loads."""
    root = str(tmp_path / "ck")
    build(root, [[("w", 2 * i, 2 * i + 2), ("b", 2 * i, 2 * i + 2)] for i in range(4)],
          keys=("w", "b"))
    forge(root, "b", [1, 2, 3, 0])
    _refused(root, "b", "data-")
    got = {"w": torch.zeros(ROWS, COLS)}
    dckpt.load(got, root, strict=False)
    assert torch.equal(got["w"], _full("w"))


def test_a_cell_pointed_at_another_file_with_several_chunks(tmp_path):
    """File 0 holds two chunks of ``w`` (``w@0,0`` and ``w@4,0``), file 1 one (bare):
    a manifest pointing file 0's second cell at file 1 is refused."""
    root = str(tmp_path / "ck")
    build(root, [[("w", 0, 2), ("w", 4, 6)], [("w", 2, 4), ("w", 6, 8)]])
    # cells in row order: [0:2]->0, [2:4]->1, [4:6]->0, [6:8]->1; swap the middle two
    forge(root, "w", [0, 0, 1, 1])
    _refused(root, "w", "data-")


def test_same_shape_scalar_like_chunks(tmp_path):
    """One row per file (8 files, every chunk the same shape and dtype): any
    permutation of the cells but the identity is refused."""
    root = str(tmp_path / "ck")
    build(root, [[("w", i, i + 1)] for i in range(ROWS)])
    forge(root, "w", [0, 1, 2, 3, 4, 5, 7, 6])
    _refused(root, "w", data_name(SID, 7))


def test_legacy_files_still_load(tmp_path):
    """Files without recorded offsets (dckpt before this change) load and verify."""
    root = str(tmp_path / "ck")
    build(root, [[("w", 0, 4)], [("w", 4, 8)]], legacy=True)
    head = open(os.path.join(root, data_name(SID, 0)), "rb").read(4096)
    assert b'"at:' not in head
    got = {"w": torch.zeros(ROWS, COLS)}
    dckpt.load(got, root)
    assert torch.equal(got["w"], _full("w"))
    assert torch.equal(dckpt.open(root)["w"], _full("w"))
    assert verify_checkpoint(root).ok


def test_legacy_file_assigned_two_cells_of_a_bare_key_is_refused(tmp_path):
    """The one case a file without offsets can refuse: the manifest assigns two cells
    of ``w`` to a file that holds one chunk of it under the bare key."""
    root = str(tmp_path / "ck")
    build(root, [[("w", 0, 4)], [("w", 4, 8)]], legacy=True)
    forge(root, "w", [0, 0])
    _refused(root, "w", data_name(SID, 0))


def test_legacy_files_with_several_named_chunks_still_load(tmp_path):
    """Files without offsets whose several chunks of a key are named ``key@offsets``
    (a strided layout) are unambiguous: they load as before."""
    root = str(tmp_path / "ck")
    build(root, [[("w", 0, 2), ("w", 4, 6)], [("w", 2, 4), ("w", 6, 8)]], legacy=True)
    got = {"w": torch.zeros(ROWS, COLS)}
    dckpt.load(got, root)
    assert torch.equal(got["w"], _full("w")) and verify_checkpoint(root).ok


def test_written_headers_record_every_chunk(tmp_path):
    """The writer records ``at:<name>`` for every stored tensor, the bare key's one
    chunk and each ``key@offsets`` alike; a plain safetensors reader ignores them."""
    root = str(tmp_path / "ck")
    build(root, [[("w", 0, 2), ("w", 4, 6), ("b", 0, 8)], [("w", 2, 4), ("w", 6, 8)]],
          keys=("w", "b"))
    raw = open(os.path.join(root, data_name(SID, 0)), "rb").read()
    (hlen,) = struct.unpack_from("<Q", raw)
    meta = json.loads(raw[8:8 + hlen])["__metadata__"]
    assert {k: v for k, v in meta.items() if k.startswith("at:")} == \
        {"at:w@0,0": "0,0", "at:w@4,0": "4,0", "at:b": "0,0"}
    from safetensors.torch import load_file

    got = load_file(os.path.join(root, data_name(SID, 0)))
    assert torch.equal(got["b"], _full("b"))


# ---------------------------------------------------------------- hostile recorded offsets

def _header(meta_extra: dict, drop: tuple[str, ...] = ()) -> bytes:
    """A one-tensor (``w``: F32 (2, 3) at offsets (4, 0)) shard header whose metadata
    is changed by ``meta_extra`` / ``drop``."""
    data = bytes(24)
    meta = {"format": "pt", "dckpt.block": "1024",
            "crc32:w": f"{crc32(data):08x}", "at:w": "4,0", **meta_extra}
    for k in drop:
        meta.pop(k)
    doc = {"__metadata__": meta, "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    head = json.dumps(doc).encode()
    return struct.pack("<Q", len(head)) + head


@pytest.mark.parametrize("value", [
    "4,", ",4", "04,0", "4,,0", "-1,0", "4.0,0", " 4,0", "4,0 ", "0x4,0", "a",
    "9223372036854775808,0", "99999999999999999999,0", ",".join(["1"] * 65),
    "1" * 5000, 4, None, ["4", "0"], {"a": 1}, "４,0"])
def test_malformed_recorded_offsets_are_integrity_errors(value):
    head = _header({"at:w": value})
    with pytest.raises(IntegrityError, match="unreadable header"):
        shards.parse_header(head, "f.safetensors", len(head) + 24)


def test_offsets_for_some_tensors_only_or_stray_names_are_refused():
    for extra in ({"at:x": "0"},):
        head = _header(extra)
        with pytest.raises(IntegrityError, match="some tensors only"):
            shards.parse_header(head, "f.safetensors", len(head) + 24)
    # two tensors, one of them with offsets
    data = bytes(24)
    meta = {"format": "pt", "dckpt.block": "1024", "crc32:w": f"{crc32(data):08x}",
            "crc32:v": f"{crc32(data):08x}", "at:w": "0,0"}
    doc = {"__metadata__": meta, "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
           "v": {"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 48]}}
    raw = json.dumps(doc).encode()
    head = struct.pack("<Q", len(raw)) + raw
    with pytest.raises(IntegrityError, match="some tensors only"):
        shards.parse_header(head, "f.safetensors", len(head) + 48)


def test_a_huge_offsets_value_is_refused_in_linear_time():
    """A 50 MB value (under the 100 MiB header cap) is refused by its length at once."""
    head = _header({"at:w": "1," * (25 << 20)})
    t0 = time.perf_counter()
    with pytest.raises(IntegrityError):
        shards.parse_header(head, "f.safetensors", len(head) + 24)
    assert time.perf_counter() - t0 < 5


def test_checked_stored_names_the_tensor_and_file():
    head = _header({})
    tensors, _ = shards.parse_header(head, "f.safetensors", len(head) + 24)
    assert tensors["w"].at == (4, 0)
    assert checked_stored(tensors, "w", (4, 0), "f.safetensors", 1) is tensors["w"]
    assert checked_stored(tensors, "x", (0, 0), "f.safetensors", 1) is None
    with pytest.raises(IntegrityError, match=r"f\.safetensors, tensor 'w'.*\[4, 0\].*\[0, 0\]"):
        checked_stored(tensors, "w", (0, 0), "f.safetensors", 1)
    legacy = _header({}, drop=("at:w",))
    tensors, _ = shards.parse_header(legacy, "f.safetensors", len(legacy) + 24)
    assert tensors["w"].at is None
    assert checked_stored(tensors, "w", (0, 0), "f", lambda: 1) is tensors["w"]
    with pytest.raises(IntegrityError, match="ambiguous"):
        checked_stored(tensors, "w", (0, 0), "f", lambda: 2)


# ----------------------------------------------------------------- the pure part, by property

offsets_st = st.lists(st.integers(0, (1 << 63) - 1), min_size=0, max_size=shards.MAX_DIMS)


@settings(max_examples=200, deadline=None)
@given(offsets_st)
def test_recorded_offsets_round_trip(offs):
    """What the writer records, the parser gives back, for any offsets dckpt allows."""
    entries = [("w", "U8", (0,), 0)]
    raw = shards.header_json(entries, [[0]], 1024, at={"w": tuple(offs)})
    meta = json.loads(raw)["__metadata__"]
    assert shards.parse_offsets(meta["at:w"], "w") == tuple(offs)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80) | st.text(alphabet="0123456789,-", max_size=80))
def test_parse_offsets_accepts_only_canonical_values(value):
    """Any string: either the canonical decimal list (and then it round-trips) or a
    ValueError; never another exception."""
    try:
        got = shards.parse_offsets(value, "w")
    except ValueError:
        return
    assert ",".join(str(x) for x in got) == value
    assert all(0 <= x < 1 << 63 for x in got) and len(got) <= shards.MAX_DIMS


@settings(max_examples=100, deadline=None)
@given(offsets_st, offsets_st)
def test_checked_stored_accepts_exactly_the_recorded_offsets(rec, want):
    stt = shards.StoredTensor("w", "U8", (0,), 0, 0, np.zeros(1, np.uint32), tuple(rec))
    tensors = {"w": stt}
    if tuple(rec) == tuple(want):
        assert checked_stored(tensors, "w", want, "f", 5) is stt
    else:
        with pytest.raises(IntegrityError):
            checked_stored(tensors, "w", want, "f", 1)
