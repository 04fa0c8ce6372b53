"""The votes: what each rank reports to rank 0 after writing its shard file.

A vote says which file the rank wrote (its size and its header's length and CRC32), that
it wrote none, or why it failed. Rank 0 gathers one per rank per save, so at 131,072
ranks decoding them as JSON (0.36 s) was a third of a cached save (issue 38). The
common vote is a fixed 20-byte record (:data:`RECORD`: a magic, size, header length,
header CRC32; all zero but the magic for "no file"), the file's name being the one the
save gives every rank (``data-<save_id>-<rank>.safetensors``); rank 0 decodes all of
them with one ``np.frombuffer``. Anything else (an error, a chunk report of an
incremental or compressed save, another name, a local tier's replica) travels as JSON,
as before, decoded one by one. Both are validated: a malformed vote is a CheckpointError
naming its rank, which the coordinator sends every rank as that rank's failure.

Pure: numpy and json, no torch.distributed, no I/O.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Sequence

import numpy as np

from ..errors import CheckpointError
from ..format.filenames import DATA_FILE, data_name, side_name
from ..format.filetable import FileTable, plain_name
from ..format.manifest import MANIFEST_NAME
from ..format.shards import MAX_HEADER

# Not "{" (a JSON vote's first byte), not ASCII: a record never reads as JSON.
MAGIC = b"\xd7v1\x00"
_STRUCT = struct.Struct("<4sQII")
RECORD = np.dtype([("magic", "<u4"), ("size", "<u8"), ("hlen", "<u4"), ("crc", "<u4")])
RECORD_LEN = _STRUCT.size  # 20
assert RECORD.itemsize == RECORD_LEN
_MAGIC_U32 = int.from_bytes(MAGIC, "little")
_NO_FILE = _STRUCT.pack(MAGIC, 0, 0, 0)
_I64_MAX = (1 << 63) - 1


def encode(vote: dict, save_id: str, rank: int) -> bytes:
    """This rank's vote as bytes for rank 0: the 20-byte record when ``vote`` is
    ``{"file": data_name(save_id, rank), "size", "hlen", "crc"}`` with integers in range
    or ``{"file": None}``, else its JSON. O(1), no I/O. Raises TypeError when the vote
    is not JSON (a bug)."""
    if len(vote) == 1 and "file" in vote and vote["file"] is None:
        return _NO_FILE
    if vote.keys() == {"file", "size", "hlen", "crc"} and vote["file"] == data_name(save_id, rank):
        s, h, c = vote["size"], vote["hlen"], vote["crc"]
        if type(s) is int and type(h) is int and type(c) is int and 1 <= h <= MAX_HEADER \
                and h + 8 <= s <= _I64_MAX and 0 <= c <= 0xFFFFFFFF:
            return _STRUCT.pack(MAGIC, s, h, c)
    return json.dumps(vote).encode()


@dataclass
class VoteTable:
    """Every rank's vote, decoded. ``has_file``, ``size``, ``hlen``, ``crc``: (world,)
    columns (zero where a rank wrote no file); ``names``: the ranks whose file is not
    ``data_name(save_id, rank)`` -> its name; ``docs``: the JSON votes by rank (chunk
    reports, replicas); ``errors``: rank -> error payload of the ranks that failed."""

    save_id: str
    has_file: np.ndarray
    size: np.ndarray
    hlen: np.ndarray
    crc: np.ndarray
    names: dict[int, str] = field(default_factory=dict)
    docs: dict[int, dict] = field(default_factory=dict)
    errors: dict[int, Any] = field(default_factory=dict)
    # rank -> (name, size, hlen, crc) of its side file (a save with a SideFile)
    side: dict[int, tuple[str, int, int, int]] = field(default_factory=dict)

    def files(self) -> FileTable:
        """The files the votes report, in rank order: a table with derived names unless
        a rank named another file. O(world) numpy (+ O(world) Python then). Raises
        CheckpointError naming the rank when two ranks report one file name."""
        ranks = np.flatnonzero(self.has_file)
        names = None
        if self.names:
            names = tuple(self.names.get(r) or data_name(self.save_id, r) for r in ranks.tolist())
            if len(set(names)) != len(names):  # a manifest listing a file twice is unreadable
                seen: dict = {}
                r = next(r for r, n in zip(ranks.tolist(), names) if seen.setdefault(n, r) != r)
                _refuse(r, f"its vote names {self.names[r]!r:.80}, the file rank {seen[self.names[r]]} "
                           "reported too")
        if not self.side:
            return FileTable(self.save_id, ranks, self.size[ranks], self.hlen[ranks],
                             self.crc[ranks], names=names)
        # the side files after the data files, in rank order (named: a side file's name
        # is never derived); to_manifest tells them apart with side_rows()
        extra = sorted(self.side)
        rows = [self.side[r] for r in extra]
        if names is None:
            names = tuple(data_name(self.save_id, r) for r in ranks.tolist())
        return FileTable(self.save_id, np.concatenate([ranks, np.asarray(extra, np.int64)]),
                         np.concatenate([self.size[ranks], [x[1] for x in rows]]),
                         np.concatenate([self.hlen[ranks], [x[2] for x in rows]]),
                         np.concatenate([self.crc[ranks], [x[3] for x in rows]]),
                         names=names + tuple(x[0] for x in rows))

    def side_rows(self) -> dict[int, int]:
        """{rank: index of its side file in :meth:`files`}. O(world)."""
        first = int(np.count_nonzero(self.has_file))
        return {r: first + i for i, r in enumerate(sorted(self.side))}

    @classmethod
    def from_dicts(cls, votes: Sequence[dict], save_id: str) -> "VoteTable":
        """The table of votes already decoded from JSON (a stager's, a local tier's).
        Raises CheckpointError naming the first rank whose vote is malformed."""
        t = _empty(len(votes), save_id)
        for r, v in enumerate(votes):
            _add_doc(t, r, v)
        return t


def decode(blobs: Sequence[bytes], save_id: str) -> VoteTable:
    """Decode the votes rank 0 gathered (rank ``r``'s is ``blobs[r]``). The records are
    decoded together (one join and one ``np.frombuffer``; O(world) numpy: 131,072 votes
    in about 10 ms), the JSON ones one by one.

    Raises:
        CheckpointError: naming the first rank whose vote is malformed (not a record
            nor a JSON object, a size or header length out of range, a name that is not
            a plain file name), with ``failures`` ``{rank: cause}``.
    """
    n = len(blobs)
    t = _empty(n, save_id)
    lens = np.fromiter(map(len, blobs), np.int64, n)
    rec = lens == RECORD_LEN
    if rec.all():
        raw = b"".join(blobs)
    else:
        raw = b"".join(compress(blobs, rec.tolist()))
    arr = np.frombuffer(raw, RECORD)
    ok = arr["magic"] == _MAGIC_U32  # a 20-byte JSON vote is not a record
    where = np.flatnonzero(rec)
    if not ok.all():
        rec[where[~ok]] = False
        where, arr = where[ok], arr[ok]
    size = arr["size"].astype(np.int64)  # > 2**63 wraps negative: refused below
    hlen, crc = arr["hlen"].astype(np.int64), arr["crc"].astype(np.int64)
    none = (size == 0) & (hlen == 0) & (crc == 0)
    bad = ~none & ((hlen < 1) | (hlen > MAX_HEADER) | (size < hlen + 8))
    if bad.any():
        r = int(where[np.argmax(bad)])
        _refuse(r, f"its vote reports a file of {int(arr['size'][np.argmax(bad)])} bytes with a "
                   f"{int(hlen[np.argmax(bad)])}-byte header (header in [1, {MAX_HEADER}] "
                   "and 8 bytes less than the size)")
    t.has_file[where] = ~none
    t.size[where], t.hlen[where], t.crc[where] = size, hlen, crc
    for r in np.flatnonzero(~rec).tolist():  # the JSON votes
        try:
            doc = json.loads(blobs[r])
        except (ValueError, UnicodeDecodeError, RecursionError):
            _refuse(r, f"its vote is neither a {RECORD_LEN}-byte record nor JSON "
                       f"({len(blobs[r])} bytes)")
        _add_doc(t, r, doc)
    return t


def _empty(n: int, save_id: str) -> VoteTable:
    z = np.zeros(n, np.int64)
    return VoteTable(save_id, np.zeros(n, bool), z, z.copy(), z.copy())


def _refuse(rank: int, why: str) -> None:
    why += "; nothing was committed"
    raise CheckpointError(f"rank {rank}: {why}", {rank: why})


def _add_doc(t: VoteTable, r: int, v: Any) -> None:
    """Validate one JSON vote into ``t``."""
    if not isinstance(v, dict):
        _refuse(r, "its vote is not a JSON object")
    t.docs[r] = v
    if v.get("error"):
        e = v["error"]
        if not (isinstance(e, dict) and isinstance(e.get("type"), str)
                and isinstance(e.get("message"), str)):
            _refuse(r, "its vote's error is not {\"type\": str, \"message\": str}")
        t.errors[r] = e
        return
    if "side" in v:
        sv = v["side"]
        if not isinstance(sv, dict):
            _refuse(r, "its vote's side file is not a JSON object")
        if not isinstance(sv.get("prefix", ""), str):
            _refuse(r, "its vote's side-file prefix is not a string")
        if sv.get("file") is not None:
            _check_file(r, sv)
            if sv["file"] != side_name(t.save_id, r):
                _refuse(r, f"its vote's side file {sv['file']!r:.80} is not its own "
                           f"({side_name(t.save_id, r)})")
            t.side[r] = (sv["file"], sv["size"], sv["hlen"], sv["crc"])
    name = v.get("file")
    if name is None:
        return
    _check_file(r, v)
    s, h, c = v["size"], v["hlen"], v["crc"]
    if name != data_name(t.save_id, r):
        # A name that is another rank's file of this save, or the commit point itself,
        # would commit a manifest that lists a file twice (unreadable) or names
        # manifest.json as data; the commit's size check passes when sizes agree.
        got = DATA_FILE.fullmatch(name)
        if name == MANIFEST_NAME or (got and got.group(1) == t.save_id):
            _refuse(r, f"its vote names {name!r:.80}, which is not its file "
                       f"({data_name(t.save_id, r)}): another rank's data file or the manifest")
        t.names[r] = name
    t.has_file[r] = True
    t.size[r], t.hlen[r], t.crc[r] = s, h, c


def _check_file(r: int, v: dict) -> None:
    """Refuse, naming rank ``r``, a vote's file record that is malformed."""
    name, s, h, c = v.get("file"), v.get("size"), v.get("hlen"), v.get("crc")
    if not (plain_name(name) and type(s) is int and type(h) is int and type(c) is int
            and 1 <= h <= MAX_HEADER and h + 8 <= s <= _I64_MAX and 0 <= c <= 0xFFFFFFFF):
        _refuse(r, f"its vote's file {name!r:.80} (size {s!r:.30}, header {h!r:.30}, crc "
                   f"{c!r:.30}) is malformed")


def check_writers(t: VoteTable, planned: np.ndarray) -> None:
    """Refuse, naming the rank, a vote of no file from a rank the plan gave bytes to
    write (``planned``: bytes per rank): its chunks would have no file. A rank whose
    vote carries chunk reports is left to them (an incremental save may reference all
    its chunks). O(world) numpy. Raises CheckpointError."""
    planned = np.asarray(planned)
    if len(planned) != len(t.has_file):
        return
    bad = ~t.has_file & (planned > 0)
    for r in np.flatnonzero(bad).tolist():
        if "chunks" not in t.docs.get(r, {}) and r not in t.side:
            _refuse(r, f"its vote reports no file, but it was to write {int(planned[r])} bytes")


def table(votes: Sequence[bytes] | Sequence[dict] | VoteTable, save_id: str) -> VoteTable:
    """A VoteTable of votes in any of the forms rank 0 holds them: gathered bytes
    (:func:`decode`), JSON-decoded dicts (:meth:`VoteTable.from_dicts`), or a table.
    Raises CheckpointError as :func:`decode`."""
    if isinstance(votes, VoteTable):
        return votes
    if len(votes) and isinstance(votes[0], dict):
        return VoteTable.from_dicts(votes, save_id)  # type: ignore[arg-type]
    return decode(votes, save_id)  # type: ignore[arg-type]


def check_side(t: VoteTable, prefix: str) -> None:
    """Refuse, naming each rank, a vote whose side-file prefix is not rank 0's
    ``prefix`` ("" when rank 0's save asked for no side file): the ranks passed
    different ``side`` settings, and a manifest from such votes would look for a key's
    chunks in the wrong file. O(world) Python when ``prefix`` is set (every vote is
    JSON then), else O(JSON votes). Raises CheckpointError."""
    bad = {}
    ranks = range(len(t.has_file)) if prefix else list(t.docs)
    for r in ranks:
        if r in t.errors:
            continue
        sv = t.docs.get(r, {}).get("side")
        got = sv.get("prefix", "") if isinstance(sv, dict) else ""
        if got != prefix:
            bad[r] = (f"saved with side-file prefix {got!r:.80} while rank 0 saved with "
                      f"{prefix!r:.80} (side differs between ranks): pass the same side on "
                      "every rank")
    if bad:
        r = min(bad)
        raise CheckpointError(f"rank {r}: {bad[r]}", bad)


def check_reports(table: VoteTable) -> None:
    """Raise CheckpointError naming each rank that wrote a file without chunk reports
    while other ranks sent them: the ranks saved with different ``compression``,
    ``base`` or ``block_hashes``, and a manifest from such votes would mix hashed and
    unhashed (or encoded and plain) chunks of one tensor. O(world). Pure."""
    reported = [r for r, d in table.docs.items() if "chunks" in d]
    if not reported:
        return
    plain = np.flatnonzero(table.has_file)
    plain = plain[~np.isin(plain, reported)].tolist()
    if plain:
        shown = ", ".join(map(str, plain[:8])) + (" ..." if len(plain) > 8 else "")
        msg = (f"ranks {shown} saved without block hashes while ranks "
               f"{', '.join(map(str, sorted(reported)[:8]))} recorded them (compression, base "
               "or block_hashes differ between ranks): pass the same values on every rank")
        raise CheckpointError(msg, {r: msg for r in plain})
