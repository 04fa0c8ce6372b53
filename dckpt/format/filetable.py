"""The manifest's files, held as columns: :class:`FileTable`, and its two JSON forms.

A manifest saved by 131,072 ranks names 131,072 data files. As 131,072 JSON rows and
131,072 :class:`FileEntry` objects, the file list was most of a cached save's time at
rank 0 and of a manifest's parse (issue 38). A FileTable keeps ranks, sizes, header
lengths and header checksums as int64 arrays and, when every name is the one a save
gives its files (``data-<save_id>-<rank>.safetensors``, :func:`.filenames.data_name`),
no names at all: they are derived on demand. It is a ``Sequence[FileEntry]``, so code
that indexes or iterates ``Manifest.files`` is unchanged; an entry is built per access
(O(1)), and iterating every entry costs O(files) in Python, as the tuple did.

JSON forms (docs/FORMAT.md): the list of ``[name, size, header_len, crc, rank(, dir)]``
rows that versions 1-3 write and read, and, from version 4, the table
``{"names": "data", "rank": <ints>, "size": <ints>, "header_len": <ints>,
"header_crc32": <ints>}`` (integer arrays as :mod:`.intarray` writes them), written for
a regular table of at least :data:`TABLE_MIN_FILES` files. Pure: numpy, no I/O.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ..errors import ManifestError
from . import intarray, sealed
from .filenames import data_name
from .shards import MAX_HEADER

# A file reference is one plain name inside the checkpoint directory: no separators,
# no "..", no scheme, no leading dot.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
# The save ids dckpt writes (uuid4 hex, 16 digits): the only ones a table derives names
# from, so a derived name is always a plain name that gc recognises as dckpt's own.
SAVE_ID = re.compile(r"^[0-9a-f]{16}$")
# Below this many files the row list is written (version 2 or 3, which older dckpt
# reads); from it on, the table (version 4). 1,024 rows parse in about 10 ms.
TABLE_MIN_FILES = 1024
# The most files a table may declare: bounds what a hostile manifest's runs can make a
# reader allocate (4 arrays of 8 bytes a file: 128 MiB), whatever its world_size says.
MAX_TABLE_FILES = 1 << 22
TABLE_KEYS = ("names", "rank", "size", "header_len", "header_crc32")
_I64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class FileEntry:
    """One data file: its name (relative to the checkpoint), total size, and the length
    and CRC32 of its safetensors header (which holds the chunk checksums)."""

    name: str
    size: int
    header_len: int
    header_crc32: int
    rank: int
    # "" for a file of this checkpoint; else the sibling checkpoint directory (same
    # parent) holding it: an incremental save references its base's files.
    dir: str = ""


class FileTable(Sequence):
    """A manifest's data files as columns (see the module doc). Immutable by contract:
    its arrays are read-only.

    ``names`` None: file ``i`` is ``data_name(save_id, rank[i])`` (a *regular* table
    when also ``dirs`` is None and ranks strictly rise; only a regular table is written
    as the JSON table). ``dirs`` None: every file belongs to this checkpoint."""

    __slots__ = ("save_id", "rank", "size", "header_len", "header_crc32", "_names", "_dirs",
                 "_entries")

    def __init__(self, save_id: str, rank: Any, size: Any, header_len: Any, header_crc32: Any,
                 names: tuple[str, ...] | None = None, dirs: tuple[str, ...] | None = None) -> None:
        cols = [np.asarray(c, np.int64).reshape(-1) for c in (rank, size, header_len, header_crc32)]
        n = len(cols[0])
        if any(len(c) != n for c in cols) or (names is not None and len(names) != n) \
                or (dirs is not None and len(dirs) != n):
            raise ValueError("a file table's columns must have one value per file")
        for c in cols:
            c.flags.writeable = False
        self.save_id = save_id
        self.rank, self.size, self.header_len, self.header_crc32 = cols
        self._names = names
        self._dirs = dirs if dirs is not None and any(dirs) else None
        self._entries: dict[int, FileEntry] = {}

    @classmethod
    def from_entries(cls, entries: Sequence[FileEntry], save_id: str = "") -> "FileTable":
        """The table of ``entries`` (in order); names are dropped (derived) when every
        one is ``data_name(save_id, rank)``. O(files) Python. Raises OverflowError for
        an integer outside int64."""
        if isinstance(entries, FileTable):
            return entries
        es = list(entries)
        n = len(es)
        cols = [np.fromiter((getattr(f, a) for f in es), np.int64, n)
                for a in ("rank", "size", "header_len", "header_crc32")]
        names = tuple(f.name for f in es)
        if SAVE_ID.fullmatch(save_id) and all(nm == data_name(save_id, f.rank)
                                              for nm, f in zip(names, es)):
            names = None
        return cls(save_id, *cols, names=names, dirs=tuple(f.dir for f in es))

    # --------------------------------------------------------------- Sequence[FileEntry]
    def __len__(self) -> int:
        return len(self.rank)

    def __getitem__(self, i):  # int -> FileEntry; slice -> tuple of FileEntry
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"file index {i} out of range ({n} files)")
        got = self._entries.get(j)
        if got is None:  # a dict item is set atomically: threads may both build one
            got = self._entries[j] = FileEntry(
                self.name(j), int(self.size[j]), int(self.header_len[j]),
                int(self.header_crc32[j]), int(self.rank[j]), self.dir(j))
        return got

    def __iter__(self) -> Iterator[FileEntry]:
        return (self[j] for j in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileTable):
            return (len(self) == len(other) and all(
                np.array_equal(a, b) for a, b in zip(self._cols(), other._cols()))
                and self.names == other.names and self.dirs == other.dirs)
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (equal to tuples; mutable-looking)

    def __repr__(self) -> str:
        return f"FileTable({len(self)} files, save_id={self.save_id!r}, regular={self.regular})"

    # ----------------------------------------------------------------------- columns
    def _cols(self) -> tuple[np.ndarray, ...]:
        return self.rank, self.size, self.header_len, self.header_crc32

    def name(self, i: int) -> str:
        """File ``i``'s name. O(1)."""
        return self._names[i] if self._names is not None else data_name(self.save_id,
                                                                         int(self.rank[i]))

    def dir(self, i: int) -> str:
        """File ``i``'s sibling directory ("" for this checkpoint's own). O(1)."""
        return self._dirs[i] if self._dirs is not None else ""

    @property
    def names(self) -> list[str]:
        """Every file's name, in order. O(files) (derived names are formatted)."""
        if self._names is not None:
            return list(self._names)
        sid = self.save_id
        return [f"data-{sid}-{r:05d}.safetensors" for r in self.rank.tolist()]

    @property
    def dirs(self) -> list[str]:
        """Every file's directory ("" for own files). O(files)."""
        return list(self._dirs) if self._dirs is not None else [""] * len(self)

    @property
    def references(self) -> bool:
        """Whether some file lies in a sibling checkpoint (an incremental save's). O(1)."""
        return self._dirs is not None

    @property
    def regular(self) -> bool:
        """Names derived, no referenced files, ranks strictly rising: the JSON table
        describes it. O(files) numpy."""
        return self._names is None and self._dirs is None and SAVE_ID.fullmatch(self.save_id) \
            is not None and not (np.diff(self.rank) <= 0).any()

    def own_mask(self) -> np.ndarray:
        """(files,) bool: the files of this checkpoint (not referenced). O(files)."""
        if self._dirs is None:
            return np.ones(len(self), bool)
        return np.fromiter((not d for d in self._dirs), bool, len(self))

    def own_bytes(self) -> int:
        """Bytes of this checkpoint's own files. O(files) numpy."""
        return int(self.size[self.own_mask()].sum())

    def referenced_bytes(self) -> int:
        """Bytes of the sibling checkpoints' files this table references."""
        return int(self.size[~self.own_mask()].sum())

    def owned_by(self, rank: int) -> list[int]:
        """Indexes of the own files ``rank`` wrote. O(files) numpy."""
        return np.flatnonzero((self.rank == rank) & self.own_mask()).tolist()


# ----------------------------------------------------------------------------- JSON

def to_json_obj(files: FileTable, save_id: str, world_size: int) -> Any:
    """The JSON form of ``files`` in a manifest of ``save_id`` and ``world_size``: the
    table when :func:`use_table` says so, else the row list. O(files), numpy for the
    table."""
    if use_table(files, save_id, world_size):
        return {"names": "data", "rank": intarray.encode(files.rank),
                "size": intarray.encode(files.size),
                "header_len": intarray.encode(files.header_len),
                "header_crc32": intarray.encode(files.header_crc32)}
    rows = zip(files.names, files.size.tolist(), files.header_len.tolist(),
               files.header_crc32.tolist(), files.rank.tolist(), files.dirs)
    return [[n, s, h, c, r, d] if d else [n, s, h, c, r] for n, s, h, c, r, d in rows]


def use_table(files: FileTable, save_id: str, world_size: int) -> bool:
    """Whether :func:`to_json_obj` writes ``files`` as the (version 4) table: it is
    regular, derives its names from ``save_id``, its ranks are below ``world_size`` (an
    import writes several files as rank 0..n of a world of 1: rows) and it has at least
    :data:`TABLE_MIN_FILES` files."""
    return len(files) >= TABLE_MIN_FILES and files.save_id == save_id and files.regular \
        and int(files.rank[-1]) < world_size


def _int(x: Any, what: str, lo: int = 0, hi: int = _I64_MAX) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise ManifestError(f"{what} must be an integer in [{lo}, {hi}], got {sealed.short(x)}")
    return x


def plain_name(x: Any) -> bool:
    """Whether ``x`` is a plain file name inside a checkpoint (:data:`SAFE_NAME`, no "..")."""
    return isinstance(x, str) and bool(SAFE_NAME.fullmatch(x)) and ".." not in x


def _parse_row(i: int, f: Any, version: int) -> FileEntry:
    if not (isinstance(f, list) and (len(f) == 5 or (len(f) == 6 and version >= 3))):
        raise ManifestError(f"files[{i}] must be [name, size, header_len, crc, rank] "
                            "(and, from version 3, a sibling directory)")
    name = f[0]
    if not plain_name(name):
        raise ManifestError(
            f"files[{i}] name {sealed.short(name)} is not a plain file name inside the "
            "checkpoint (absolute paths, '..', separators and URLs are refused)")
    d = f[5] if len(f) == 6 else ""
    if len(f) == 6 and not plain_name(d):
        raise ManifestError(
            f"files[{i}] {name}: directory {sealed.short(d)} is not a sibling checkpoint "
            "in the same parent (only a plain directory name is allowed: absolute paths, "
            "'..', separators, URLs and other roots are refused)")
    size = _int(f[1], f"files[{i}].size")
    hlen = _int(f[2], f"files[{i}].header_len", 1)
    if hlen + 8 > size:
        raise ManifestError(f"files[{i}] {name}: header_len {hlen} exceeds size {size}")
    if hlen > MAX_HEADER:  # refused before any reader allocates a buffer that large
        raise ManifestError(f"files[{i}] {name}: header_len {hlen} is over the "
                            f"{MAX_HEADER}-byte limit for shard headers")
    return FileEntry(name, size, hlen, _int(f[3], f"files[{i}].header_crc32", 0, 0xFFFFFFFF),
                     _int(f[4], f"files[{i}].rank"), d)


def parse(obj: Any, version: int, save_id: Any, world_size: int, at: list[str]) -> FileTable:
    """Validate a manifest's ``files`` (either form; the table from version 4) into a
    FileTable. ``at[0]`` names the part being read (for parse's last-resort message).
    The row list costs O(files) Python; the table O(files) numpy, its sizes bounded
    (:data:`MAX_TABLE_FILES`, ``world_size``) before anything is allocated.

    Raises:
        ManifestError: naming the field (and the file's index and rank) that is wrong.
    """
    if isinstance(obj, dict) and version >= 4:
        at[0] = "files"
        return _parse_table(obj, save_id, world_size)
    if not isinstance(obj, list):
        kind = "list or (version 4) object" if version >= 4 else "list"
        raise ManifestError(f"field 'files' has the wrong JSON type ({kind} expected)")
    rows = []
    for i, f in enumerate(obj):
        at[0] = f"files[{i}]"
        rows.append(_parse_row(i, f, version))
    if len({(f.dir, f.name) for f in rows}) != len(rows):
        raise ManifestError("a file is listed twice")
    return FileTable.from_entries(rows, save_id if isinstance(save_id, str) else "")


def _parse_table(obj: dict, save_id: Any, world_size: int) -> FileTable:
    if set(obj) != set(TABLE_KEYS):
        raise ManifestError(f"files: a file table has exactly the keys {list(TABLE_KEYS)}, "
                            f"got {sealed.short(sorted(map(str, obj)))}")
    if obj["names"] != "data":
        raise ManifestError(f'files.names {sealed.short(obj["names"])} is unknown (only "data": '
                            "data-<save_id>-<rank>.safetensors)")
    if not (isinstance(save_id, str) and SAVE_ID.fullmatch(save_id)):
        raise ManifestError(f"save_id {sealed.short(save_id)} must be 16 lower-case hex digits "
                            "in a manifest whose file names derive from it")
    limit = min(world_size, MAX_TABLE_FILES)
    cols = []
    for k in TABLE_KEYS[1:]:
        try:
            cols.append(intarray.decode(obj[k], f"files.{k}", limit))
        except (ValueError, TypeError) as e:
            raise ManifestError(f"{e} (at most one file per rank: world_size {world_size})") \
                from None
    rank, size, hlen, crc = cols
    n = len(rank)
    if any(len(c) != n for c in cols):
        raise ManifestError(f"files: the columns differ in length ({[len(c) for c in cols]})")

    def first(bad: np.ndarray, what: str) -> None:
        if bad.any():
            i = int(np.argmax(bad))
            raise ManifestError(f"files: file {i} (rank {int(rank[i])}): {what}")

    first((rank < 0) | (rank >= world_size), f"rank must be in [0, {world_size})")
    if n > 1:
        first(np.concatenate(([False], np.diff(rank) <= 0)), "rank must rise strictly")
    first(size < 0, "size must be non-negative")
    first((hlen < 1) | (hlen > MAX_HEADER),
          f"header_len must be in [1, {MAX_HEADER}] (the limit for shard headers)")
    first(hlen + 8 > size, "header_len exceeds size")
    first((crc < 0) | (crc > 0xFFFFFFFF), "header_crc32 must be in [0, 2**32)")
    return FileTable(save_id, rank, size, hlen, crc)
