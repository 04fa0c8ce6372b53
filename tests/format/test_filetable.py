"""The manifest's file table (format version 4, issue 38): round trips, the row list
still read and written where it must be, the table's golden bytes, and hostile tables
(bounded before anything is allocated, ManifestError naming the field). Pure."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dckpt.errors import ManifestError
from dckpt.format import filetable, intarray
from dckpt.format import manifest as mf
from dckpt.format.filenames import DATA_FILE, data_name
from dckpt.format.shards import MAX_HEADER

from .test_format import golden_manifest

GOLDEN_V4 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "manifest_v4.json")
SID = "0123456789abcdef"
WHERE = "ckpt/manifest.json"


def _n(k: int) -> int:
    return k * int(os.environ.get("DCKPT_TEST_EXAMPLES", "1"))


def table_manifest(n: int, world: int | None = None, seed: int = 0) -> mf.Manifest:
    """A manifest of ``n`` regular files (ranks 0..n-1 unless ``world`` spreads them) and
    one tensor whose chunks lie in every file."""
    rng = np.random.default_rng(seed)
    world = world or n
    ranks = np.sort(rng.choice(world, n, replace=False)) if world > n else np.arange(n)
    hlen = rng.integers(1, 70000, n)
    files = mf.FileTable(SID, ranks, hlen + 8 + rng.integers(0, 1 << 40, n), hlen,
                         rng.integers(0, 1 << 32, n))
    grid = ((0, *range(1, n + 1)),)
    o, s = mf.grid_cells(grid)
    t = mf.TensorEntry("w", "F32", (n,), mf.Chunks(o, s, np.arange(n, dtype=np.int64), grid))
    return mf.Manifest(SID, world, 1.5, files, {"w": t}, {"step": 3}, {"dckpt_version": "x"})


def resealed(doc: dict) -> bytes:
    return mf.seal(doc)


def bad(data: bytes, *fragments: str) -> str:
    with pytest.raises(ManifestError) as e:
        mf.parse(data, where=WHERE)
    msg = str(e.value)
    assert msg.startswith(WHERE), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    return msg


@pytest.fixture
def small_tables(monkeypatch):
    """Tables from 4 files on, so that small manifests exercise the table form."""
    monkeypatch.setattr(filetable, "TABLE_MIN_FILES", 4)


def table_doc(n: int = 6, world: int | None = None) -> dict:
    """A version-4 document (no checksum key) of ``n`` files in a table."""
    old, filetable.TABLE_MIN_FILES = filetable.TABLE_MIN_FILES, 1
    try:
        doc = json.loads(mf.to_json(table_manifest(n, world)))
    finally:
        filetable.TABLE_MIN_FILES = old
    doc.pop("checksum")
    assert doc["version"] == 4 and isinstance(doc["files"], dict)
    return doc


# ----------------------------------------------------------------------------- round trips

@settings(max_examples=_n(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 40), spread=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_table_round_trip(small_tables, n, spread, seed):
    m = table_manifest(n, n * (1 + spread), seed)
    raw = mf.to_json(m)
    doc = json.loads(raw)
    p = mf.parse(raw)
    assert p.files == m.files and list(p.files) == list(m.files)
    assert p.files.names == [data_name(SID, r) for r in m.files.rank.tolist()]
    assert all(DATA_FILE.fullmatch(x) for x in p.files.names)
    if n >= 4:
        assert doc["version"] == mf.TABLE_VERSION and isinstance(doc["files"], dict)
        assert list(doc["files"]) == list(filetable.TABLE_KEYS)
        assert p.files.regular
    else:
        assert doc["version"] == 2 and isinstance(doc["files"], list)
    assert mf.to_json(p) == raw  # parse . to_json is the identity
    assert p.total_bytes == int(m.files.size.sum())


def test_large_manifest_writes_the_table_small_ones_rows():
    big = mf.to_json(table_manifest(filetable.TABLE_MIN_FILES))
    assert json.loads(big)["version"] == 4 and isinstance(json.loads(big)["files"], dict)
    few = mf.to_json(table_manifest(filetable.TABLE_MIN_FILES - 1))
    assert json.loads(few)["version"] == 2 and isinstance(json.loads(few)["files"], list)


def test_irregular_files_stay_rows(small_tables):
    m = table_manifest(6)
    rows = list(m.files)
    cases = {
        "a foreign name": [rows[0].__class__("x.safetensors", *[getattr(rows[0], a) for a in
                                                                ("size", "header_len",
                                                                 "header_crc32", "rank")])]
        + rows[1:],
        "a referenced file": rows[:5] + [mf.FileEntry(rows[5].name, rows[5].size, rows[5].header_len,
                                                      rows[5].header_crc32, 5, "s0")],
        "ranks not rising": [rows[1], rows[0]] + rows[2:],
    }
    for why, files in cases.items():
        m2 = mf.Manifest(SID, 6, 1.5, tuple(files), m.tensors, m.values, m.meta)
        doc = json.loads(mf.to_json(m2))
        assert isinstance(doc["files"], list), why
        assert mf.parse(mf.to_json(m2)).files == tuple(files), why
    # another save id than the manifest's: names would change, so rows
    m3 = mf.Manifest("fedcba9876543210", 6, 1.5, m.files, m.tensors, m.values, m.meta)
    doc = json.loads(mf.to_json(m3))
    assert isinstance(doc["files"], list) and doc["files"][0][0] == data_name(SID, 0)
    # ranks at or over world_size (an import's files of a world of 1): rows
    m4 = mf.Manifest(SID, 1, 1.5, m.files, m.tensors, m.values, m.meta)
    assert isinstance(json.loads(mf.to_json(m4))["files"], list)


def test_old_row_manifest_of_many_files_still_parses():
    """A manifest written before the table (version 2 rows) with more files than the
    table's threshold reads as the same files; written again, it takes the table."""
    m = table_manifest(filetable.TABLE_MIN_FILES + 7)
    doc = json.loads(mf.to_json(m))
    doc.pop("checksum")
    doc["version"] = 2
    doc["files"] = [[f.name, f.size, f.header_len, f.header_crc32, f.rank] for f in m.files]
    old = resealed(doc)
    p = mf.parse(old)
    assert p.files == m.files and p.files.regular
    assert json.loads(mf.to_json(p))["version"] == 4


def test_golden_v4_bytes_and_content(small_tables):
    """The golden manifest (8 files) with its files as a table: the format, pinned."""
    got = mf.to_json(golden_manifest(non_finite=True))
    with open(GOLDEN_V4, "rb") as f:
        want = f.read()
    assert got == want, "the manifest format changed: bump the version or fix the writer"
    head, rest = want[:29], want[29:]
    assert head == b'{"checksum":"crc32:%08x",' % zlib.crc32(rest)
    doc = json.loads(want)
    assert doc["version"] == 4
    assert doc["files"] == {"names": "data", "rank": {"runs": [[0, 1, 8]]},
                            "size": {"runs": [[4096, -256, 8]]},
                            "header_len": {"runs": [[512, -8, 8]]},
                            "header_crc32": {"runs": [[0x1234ABCD, 1, 8]]}}
    assert mf.parse(want).files == golden_manifest().files


def test_filetable_is_a_sequence_of_entries():
    m = table_manifest(5)
    t = m.files
    assert len(t) == 5 and t[0] == list(t)[0] and t[-1] == t[4]
    assert t[1:3] == (t[1], t[2]) and t[::2] == (t[0], t[2], t[4])
    assert t == tuple(t) and t == list(t) and t != tuple(t)[:4]
    assert t[2].name == data_name(SID, 2) and t[2].rank == 2 and t[2].dir == ""
    with pytest.raises(IndexError):
        t[5]
    assert t.owned_by(3) == [3] and t.owned_by(9) == []
    ref = mf.FileTable.from_entries([*t, mf.FileEntry("data-aaaaaaaaaaaaaaaa-00000.safetensors",
                                                      100, 10, 1, 0, "s0")], SID)
    assert ref.own_bytes() == int(t.size.sum()) and ref.referenced_bytes() == 100
    assert ref.names[-1] == "data-aaaaaaaaaaaaaaaa-00000.safetensors" and ref.references
    assert ref.owned_by(0) == [0]
    assert not t.size.flags.writeable


# ----------------------------------------------------------------------------- hostile

def test_hostile_tables():
    doc = table_doc(6)
    doc["version"] = 4
    cases = [
        (lambda f: f.pop("size"), "exactly the keys"),
        (lambda f: f.update(extra=1), "exactly the keys"),
        (lambda f: f.update(names="../x"), "files.names"),
        (lambda f: f.update(names=None), "files.names"),
        (lambda f: f.update(size=[1, 2]), "differ in length"),
        (lambda f: f.update(rank=[0, 1, 2, 3, 4, 6]), "file 5 (rank 6): rank must be in [0, 6)"),
        (lambda f: f.update(rank=[0, 1, 2, 2, 4, 5]), "file 3 (rank 2): rank must rise strictly"),
        (lambda f: f.update(rank=[-1, 1, 2, 3, 4, 5]), "rank must be in"),
        (lambda f: f["size"].__setitem__(2, -5) if isinstance(f["size"], list) else None, "size"),
        (lambda f: f.update(header_len=[0] * 6), "file 0 (rank 0): header_len must be in"),
        (lambda f: f.update(header_len=[MAX_HEADER + 1] * 6), "header_len must be in"),
        (lambda f: f.update(header_len=[1 << 40] * 6, size=[1 << 41] * 6), "header_len must be in"),
        (lambda f: f.update(size=[9] * 6, header_len=[2] * 6), "header_len exceeds size"),
        (lambda f: f.update(header_crc32=[1 << 32] * 6), "header_crc32 must be in"),
        (lambda f: f.update(header_crc32=[-1] * 6), "header_crc32 must be in"),
        (lambda f: f.update(size=[True] * 6), "files.size"),
        (lambda f: f.update(size=[1.5] * 6), "files.size"),
        (lambda f: f.update(size=[1 << 63] * 6), "files.size"),
        (lambda f: f.update(size="x"), "files.size"),
        # runs that would expand past world_size: refused before the expansion
        (lambda f: f.update(rank={"runs": [[0, 1, 1 << 40]]}), "files.rank", "world_size 6"),
    ]
    for mutate, *frags in cases:
        d = json.loads(json.dumps(doc))
        d["files"]["size"] = intarray.decode(d["files"]["size"], "s").tolist()
        mutate(d["files"])
        bad(resealed(d), *frags)


def test_hostile_table_fields_outside_files():
    doc = table_doc(6)
    for sid in ("../../etc", "0123456789ABCDEF", "0123", 7, None):
        bad(resealed(dict(doc, save_id=sid)), "save_id")
    bad(resealed(dict(doc, version=3)), "'files'", "wrong JSON type")
    bad(resealed(dict(doc, world_size=0)), "world_size")
    # a huge world_size does not lift the cap on what the runs make a reader allocate
    d = dict(doc, world_size=1 << 60)
    d["files"] = dict(d["files"], rank={"runs": [[0, 1, filetable.MAX_TABLE_FILES + 1]]})
    bad(resealed(d), "files.rank")
    # chunk file indexes are checked against the table's length
    d = json.loads(json.dumps(doc))
    d["tensors"]["w"]["chunks"]["file"] = [0, 1, 2, 3, 4, 6]
    bad(resealed(d), "chunk file index out of range")


@settings(max_examples=_n(150), deadline=None)
@given(data=st.data())
def test_random_table_damage_is_refused_or_parses(data):
    """Any value anywhere in the table: parse succeeds (and then the files are valid)
    or raises ManifestError, never another exception."""
    doc = table_doc(5, world=9)
    values = st.one_of(st.integers(-2**70, 2**70), st.booleans(), st.none(), st.text(max_size=4),
                       st.lists(st.integers(-3, 2**40), max_size=7),
                       st.fixed_dictionaries({"runs": st.lists(st.lists(
                           st.integers(-2**64, 2**64), min_size=3, max_size=3), max_size=3)}))
    key = data.draw(st.sampled_from([*filetable.TABLE_KEYS, "world_size", "save_id"]))
    v = data.draw(values)
    if key in ("world_size", "save_id"):
        doc[key] = v
    else:
        doc["files"][key] = v
    try:
        m = mf.parse(resealed(doc))
    except ManifestError:
        return
    f = m.files
    assert (f.header_len >= 1).all() and (f.header_len + 8 <= f.size).all()
    assert (f.rank >= 0).all() and (f.rank < m.world_size).all()


@settings(max_examples=_n(100), deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-2**63, 2**63 - 1), st.integers(-2**40, 2**40),
                               st.integers(1, 50)), min_size=1, max_size=20))
def test_intarray_few_runs_path_agrees(runs):
    """Decoding a few runs (one arange each) gives what the repeat path gives, wrapping
    included (the few-runs path leaves wrapping runs to it)."""
    obj = {"runs": [list(r) for r in runs]}
    c = np.asarray([r[2] for r in runs])
    f = np.asarray([r[0] for r in runs], np.int64)
    s = np.asarray([r[1] for r in runs], np.int64)
    pos = np.arange(c.sum()) - np.repeat(np.cumsum(c) - c, c)
    with np.errstate(over="ignore"):
        want = np.repeat(f, c) + np.repeat(s, c) * pos
    assert intarray._decode_general(obj, "x").tolist() == want.tolist()
