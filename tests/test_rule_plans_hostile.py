"""Adversarial review of issue 38 (plans by rule, the version-4 file table, votes as
records), one process: hostile manifest bytes that declare more than they pay for,
hostile votes, and a table manifest through every tool that walks ``Manifest.files``."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import dckpt
from dckpt.errors import CheckpointError
from dckpt.format import filetable
from dckpt.format import manifest as mf
from dckpt.format.filenames import data_name
from dckpt.protocol import votes

SID = "0123456789abcdef"

# A 400-byte manifest: a table of 4M files (one run per column, world_size 4M), and
# tensors whose chunk arrays are runs expanding to billions of values.
_BOMB = textwrap.dedent('''
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    from dckpt.format import manifest as mf
    from dckpt.format.sealed import seal
    N = 1 << 22
    which, ntensors = sys.argv[1], int(sys.argv[2])
    files = {"names": "data", "rank": {"runs": [[0, 1, N]]}, "size": {"runs": [[100, 0, N]]},
             "header_len": {"runs": [[10, 0, N]]}, "header_crc32": {"runs": [[0, 0, N]]}}
    big = 3_000_000_000
    if which == "flat":  # one box, three billion file indexes
        t = {"dtype": "F32", "shape": [4], "chunks": {"offsets": [[0]], "sizes": [[4]],
             "file": {"runs": [[0, 0, big]]}}}
    elif which == "grid":  # three billion breakpoints
        t = {"dtype": "F32", "shape": [1 << 40], "chunks": {"grid": [{"runs": [[0, 1, big]]}],
             "file": [0]}}
    else:  # many tensors of 6M cells each, every one under the per-tensor cap; the
        # manifest's total budget lowered 16x so that the test stays small
        mf.MAX_CHUNKS_TOTAL = 1 << 24
        n = 6_000_000
        t = {"dtype": "F32", "shape": [1 << 40], "chunks": {
             "grid": [{"runs": [[0, 1, n], [1 << 40, 0, 1]]}], "file": {"runs": [[0, 0, n]]}}}
    doc = {"format": "dckpt", "version": 4, "save_id": "0123456789abcdef", "world_size": N,
           "created": 0.0, "meta": {}, "files": files,
           "tensors": {f"t{i}": t for i in range(ntensors)}, "values": {}}
    data = seal(doc)
    assert len(data) < 4000, len(data)
    try:
        mf.parse(data)
        print("PARSED")
    except MemoryError as e:
        print("MemoryError", e)
    except mf.ManifestError as e:
        print("ManifestError", e)
''')


@pytest.mark.parametrize("which,ntensors", [("flat", 1), ("grid", 1), ("many", 20)])
def test_a_table_manifest_cannot_make_a_reader_allocate_gigabytes(which, ntensors):
    """A few hundred bytes of runs must be refused as a ManifestError with bounded
    memory (here: under a 4 GiB address-space limit), not a MemoryError or the OOM
    killer."""
    out = subprocess.run([sys.executable, "-c", _BOMB, which, str(ntensors)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ManifestError"), out.stdout[-500:]


def test_a_writer_refuses_what_no_reader_parses(monkeypatch):
    monkeypatch.setattr(mf, "MAX_CHUNKS_TOTAL", 3)
    t = mf.TensorEntry("w", "F32", (4,), mf.Chunks(None, None, torch.zeros(4, dtype=torch.int64)
                                                   .numpy(), ((0, 1, 2, 3, 4),)))
    m = mf.Manifest(SID, 1, 0.0, [mf.FileEntry(data_name(SID, 0), 100, 10, 0, 0)], {"w": t}, {})
    with pytest.raises(ValueError, match="at most 3"):
        mf.to_json(m)


def _file_vote(r: int, name: str | None = None, size: int = 100) -> bytes:
    return json.dumps({"file": name or data_name(SID, r), "size": size, "hlen": 10,
                       "crc": 1}).encode()


@pytest.mark.parametrize("name", [data_name(SID, 0), "manifest.json",
                                  "data-0123456789abcdef-000000.safetensors"])
def test_a_vote_naming_a_file_not_its_own_names_its_rank(name):
    blobs = [votes.encode({"file": data_name(SID, 0), "size": 100, "hlen": 10, "crc": 1},
                          SID, 0), _file_vote(1, name)]
    with pytest.raises(CheckpointError, match="rank 1") as e:
        votes.decode(blobs, SID).files()
    assert list(e.value.failures) == [1]


def test_two_votes_naming_one_file_name_the_second_rank():
    blobs = [_file_vote(0), _file_vote(1, "other.safetensors"), _file_vote(2),
             _file_vote(3, "other.safetensors")]
    with pytest.raises(CheckpointError, match="rank 3") as e:
        votes.decode(blobs, SID).files()
    assert list(e.value.failures) == [3]
    # distinct other names stay legal
    ok = votes.decode(blobs[:3], SID).files()
    assert ok.names[1] == "other.safetensors"


def test_no_file_from_a_rank_that_had_bytes_to_write_names_it():
    blobs = [_file_vote(0), votes._NO_FILE, votes._NO_FILE]
    t = votes.decode(blobs, SID)
    votes.check_writers(t, [100, 0, 0])  # rank 1 and 2 had nothing to write
    with pytest.raises(CheckpointError, match="rank 1: its vote reports no file") as e:
        votes.check_writers(t, [100, 50, 0])
    assert list(e.value.failures) == [1]


def test_a_plain_save_votes_with_a_record(tmp_path, monkeypatch):
    """Issue 38's gap (found by its review, fixed since): a plain save records no block
    hashes, so its vote is the 20-byte record the scale bench assumes."""
    from dckpt.protocol import commit

    sent = []
    real = commit.vote_bytes
    monkeypatch.setattr(commit, "vote_bytes", lambda v, s, r: sent.append(real(v, s, r))
                        or sent[-1])
    dckpt.save({"w": torch.ones(4)}, str(tmp_path / "a"))
    assert len(sent[0]) == votes.RECORD_LEN


def test_a_table_manifest_through_every_tool(tmp_path, monkeypatch, capsys):
    """A version-4 manifest (threshold lowered to 1 file) through incremental and
    compressed saves on it, overwrite, load, open, verify, gc, and the CLI."""
    from dckpt.catalog.gc import collect_garbage
    from dckpt.catalog.verify import verify_checkpoint
    from dckpt.cli.main import main

    monkeypatch.setattr(filetable, "TABLE_MIN_FILES", 1)
    root = tmp_path
    st = {"w": torch.arange(12.).reshape(3, 4), "b": torch.ones(5), "step": 3}
    st2 = {"w": st["w"] + 1, "b": torch.ones(5), "step": 4}
    dckpt.save(st, str(root / "a"))
    raw = (root / "a" / "manifest.json").read_bytes()
    assert json.loads(raw[raw.index(b"{"):])["version"] == 4
    dckpt.save(st2, str(root / "b"), base=str(root / "a"))
    dckpt.save(st2, str(root / "c"), compression="zstd")
    dckpt.save(st2, str(root / "d"), base=str(root / "b"))
    dckpt.save(st2, str(root / "a2"))
    dckpt.save(st, str(root / "a2"), overwrite=True)
    for name, want in (("a", st), ("b", st2), ("c", st2), ("d", st2), ("a2", st)):
        got = {"w": torch.zeros(3, 4), "b": torch.zeros(5), "step": None}
        dckpt.load(got, str(root / name))
        assert got["step"] == want["step"] and torch.equal(got["w"], want["w"]), name
        assert torch.equal(dckpt.open(str(root / name))["w"], want["w"])
        assert verify_checkpoint(str(root / name)).ok
    assert collect_garbage(str(root), min_age_s=0) == []
    for args in (["ls", str(root)], ["inspect", str(root / "a")], ["du", str(root)],
                 ["verify", str(root / "d")]):
        assert main(args) == 0, args
    assert main(["diff", str(root / "a"), str(root / "c")]) == 1


def test_a_save_never_commits_a_manifest_over_the_readers_cap(tmp_path, monkeypatch):
    """Every manifest carries block hashes (16 bytes a chunk, base64): at 131,072 ranks x
    500 tensors about 1.4 GB, over the 1 GiB a reader parses. The writer refuses it (the
    save fails, an overwritten checkpoint stays) instead of committing a checkpoint that
    no load can read. Shown here with the cap lowered."""
    path = str(tmp_path / "ck")
    old = {"w": torch.arange(8.0), "step": 1}
    dckpt.save(old, path)
    size = len((tmp_path / "ck" / "manifest.json").read_bytes())
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", size + 100)
    with pytest.raises(CheckpointError, match="a reader accepts at most"):
        dckpt.save({**old, "more": torch.ones(4), "other": torch.zeros(3)}, path,
                   overwrite=True)
    monkeypatch.undo()
    got = {"w": torch.zeros(8), "step": None}
    dckpt.load(got, path)
    assert got["step"] == 1 and torch.equal(got["w"], old["w"])
