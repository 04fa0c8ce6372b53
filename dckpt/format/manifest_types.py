"""The manifest's data model: the validated, immutable entries a parsed manifest holds.

Pure (numpy, no torch.distributed). :mod:`.manifest` writes and parses these (and
re-exports them: import them from there); see docs/FORMAT.md for the JSON schema.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import ITEMSIZE
from .runs import Runs  # noqa: F401  (a parsed manifest's long grid dims and file lists)
# The files' model lives in .filetable (with its JSON forms); public here, as before.
from .filetable import FileEntry, FileTable  # noqa: F401

# A value of Manifest.values: a JSON scalar, or a bytes value kept as its
# {"$bytes": "<base64>"} tag, as the manifest and the save plans hold it (decode with
# dckpt.format.sealed.user_value; dckpt.load and dckpt.open hand the user bytes).
JsonLeaf = None | bool | int | float | str | dict[str, str]


@dataclass(frozen=True, eq=False)
class Chunks:
    """The saved boxes of one tensor: ``offsets`` and ``sizes`` are (n, ndim) int64,
    ``file`` is (n,) int64 indexes into ``Manifest.files``. ``grid`` is the per-dim
    breakpoints when the boxes are the cells of a grid (C order), else None.

    A parsed manifest keeps a long grid dim and file list as :class:`.runs.Runs` (issue
    47: as int64 arrays, 500 FSDP tensors at 131,072 ranks took 1 GB on every rank).
    ``offsets``, ``sizes`` and ``file`` expand them, O(chunks), on first use; what a
    load needs per chunk (:meth:`box`, :meth:`file_of`, ``file_ids``) does not."""

    _offsets: np.ndarray | None
    _sizes: np.ndarray | None
    # (n,) int64, or the Runs of a parsed manifest: read through file / file_of
    file_ids: "np.ndarray | Runs"
    # per dim: a tuple of ints, an int64 array, or Runs (a long dim: 131,072 Python ints
    # per tensor cost more memory and time than the whole rest of a manifest)
    grid: tuple | None = None

    def __len__(self) -> int:
        return len(self.file_ids)

    @property
    def file(self) -> np.ndarray:
        """Every chunk's file index, (n,) int64 (expanded from runs on first use and
        kept by them: O(chunks))."""
        f = self.file_ids
        return f if isinstance(f, np.ndarray) else np.asarray(f)

    def file_of(self, idx: np.ndarray) -> np.ndarray:
        """The file indexes of chunks ``idx`` (in range). O(len(idx) log runs)."""
        f = self.file_ids
        return f[idx] if isinstance(f, np.ndarray) else f.take(idx)

    def in_file(self, fi: int) -> np.ndarray:
        """The indexes of the chunks stored in file ``fi``, rising. O(runs) plus the
        hits for a run-form file list, else O(chunks) numpy."""
        f = self.file_ids
        return np.flatnonzero(f == fi) if isinstance(f, np.ndarray) else f.where(fi)

    def box(self, ci: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Chunk ``ci``'s (offsets, sizes) as Python ints; for a grid, by arithmetic on
        its breakpoints (O(ndim log runs)), whether or not its cells were built."""
        if self.grid is None or self._offsets is not None:
            return tuple(self.offsets[ci].tolist()), tuple(self.sizes[ci].tolist())
        offs, sizes, rest = [], [], int(ci)
        for b in reversed(self.grid):
            rest, i = divmod(rest, len(b) - 1)
            lo, hi = int(b[i]), int(b[i + 1])
            offs.append(lo)
            sizes.append(hi - lo)
        return tuple(reversed(offs)), tuple(reversed(sizes))

    # A grid's cells are built on first use (None at construction): a parse or a derived
    # plan at 131,072 ranks x 500 tensors would otherwise build 2 GB of boxes that a
    # load reads a few of. Both are set at once; two threads may both build them.
    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._cells()
        return self._offsets

    @property
    def sizes(self) -> np.ndarray:
        if self._sizes is None:
            self._cells()
        return self._sizes

    def find(self, offsets, sizes) -> np.ndarray:
        """The indexes of the chunks whose box is exactly ``offsets``/``sizes`` (at
        most one in a valid manifest): for a grid by arithmetic on its breakpoints,
        O(ndim log cuts); else a scan, O(chunks)."""
        if self.grid is not None and self._offsets is None:
            from .grid import find_cell

            i = find_cell(self.grid, offsets, sizes)
            return np.zeros(0, np.int64) if i is None else np.array([i], np.int64)
        o, s = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        return np.flatnonzero((self.offsets == o).all(1) & (self.sizes == s).all(1))

    def _cells(self) -> None:
        from .grid import cells

        if self.grid is None:
            raise ValueError("chunks without boxes nor a grid")
        o, s = cells(self.grid, [b if isinstance(b, np.ndarray) else None for b in self.grid])
        object.__setattr__(self, "_offsets", o)
        object.__setattr__(self, "_sizes", s)


TABLE_COLS = 8  # file, offset, length, codec, anchor file, offset, length, codec


@dataclass(frozen=True, eq=False)
class ChunkBlocks:
    """One chunk cut into blocks of ``size`` raw bytes: ``hashes`` (16 bytes per block,
    XXH3-128 of the raw block) and, for an encoded chunk, ``table`` (n, 8) int64: per
    block the file index, offset inside that file's entry of this tensor's key, stored
    length and codec flags, then the same four for its XOR anchor (-1 when none). A
    chunk without a table is stored plain in ``chunks.file``."""

    size: int
    hashes: bytes
    table: np.ndarray | None = None


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Chunks
    blocks: tuple[ChunkBlocks, ...] | None = None  # per chunk; None: no hashes (plain)
    # a bytes value too large for the manifest, stored as this 1-D U8 entry (version 5):
    # a load and dckpt.open hand it back as bytes, never as a tensor
    bytes_value: bool = False

    def encoded(self, chunk: int) -> np.ndarray | None:
        """The block table of ``chunk`` when it is encoded, else None."""
        return self.blocks[chunk].table if self.blocks is not None else None

    def chunk_nbytes(self, chunk: int) -> int:
        return math.prod(self.chunks.box(chunk)[1]) * ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest. Construct with :func:`parse` or :func:`build`.
    ``values``: key -> :data:`JsonLeaf` (bytes values as their {"$bytes"} tag; one too
    large for the manifest is a :class:`TensorEntry` with ``bytes_value``).
    ``files``: a :class:`FileTable` (a ``Sequence[FileEntry]``); any other sequence of
    FileEntry given here is converted to one (O(files) Python)."""

    save_id: str
    world_size: int
    created: float
    files: FileTable
    tensors: dict[str, TensorEntry]
    values: dict[str, JsonLeaf]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.files, FileTable):
            object.__setattr__(self, "files", FileTable.from_entries(self.files, self.save_id))

    @property
    def total_bytes(self) -> int:
        """Bytes of this checkpoint's own files (not those it references). O(files) numpy."""
        return self.files.own_bytes()

    @property
    def referenced_bytes(self) -> int:
        """Bytes of the sibling checkpoints' files this one references."""
        return self.files.referenced_bytes()
