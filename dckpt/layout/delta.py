"""Incremental saves, the pure part: which blocks of a chunk changed against a base
checkpoint, where the unchanged ones physically are, and the manifest that references
them. numpy only; no I/O, no torch.

Every reference is resolved to the physical place of the bytes when it is written: a
block unchanged since three saves ago points at the file that holds it, not at the
previous checkpoint, which points at the one before. And a delta (XOR) block's anchor is
always a full block, never another delta. So a load follows at most one reference per
block and one anchor, however long the chain of incremental saves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import StateMismatchError
from ..format import codec
from ..format import manifest as mf

OWN = -1  # file column of a vote's table: the writing rank's own file
NO_ANCHOR = (-1, -1, -1, -1)


@dataclass
class BaseChunk:
    """The base checkpoint's version of one chunk (same key, dtype, offsets, sizes and
    block size). ``rows[k]`` is block k's physical record in the base's file indexes."""

    hashes: bytes | None  # None: the base recorded none (a plain save)
    rows: np.ndarray  # (n, 8) int64
    plain_file: int | None = None  # the base file holding the chunk plain, if it is


def base_chunk(base: mf.Manifest, key: str, dtype: str, shape: tuple[int, ...],
               offsets: tuple[int, ...], sizes: tuple[int, ...],
               block: int = codec.HASH_BLOCK) -> BaseChunk | None:
    """The base's chunk of ``key`` at exactly this box, when it has block hashes of the
    same block size or none at all (a plain save's chunk: ``hashes`` is then None and
    the caller hashes the base's bytes, see dckpt.engine.encode); else None (the chunk
    is then written in full). O(chunks of key)."""
    t = base.tensors.get(key)
    if t is None or t.dtype != dtype or t.shape != tuple(shape):
        return None
    c = t.chunks
    hit = np.flatnonzero((c.offsets == np.asarray(offsets, np.int64)).all(1)
                         & (c.sizes == np.asarray(sizes, np.int64)).all(1))
    if not len(hit):
        return None
    ci = int(hit[0])
    b = t.blocks[ci] if t.blocks is not None else None
    if b is not None and b.size != block:
        return None
    if b is not None and b.table is not None:
        return BaseChunk(b.hashes, b.table)
    n = t.chunk_nbytes(ci)
    k = codec.nblocks(n, block)
    rows = np.full((k, mf.TABLE_COLS), -1, np.int64)
    rows[:, 0] = int(c.file[ci])
    rows[:, 1] = np.arange(k, dtype=np.int64) * block
    rows[:, 2] = np.minimum(block, n - rows[:, 1])
    rows[:, 3] = codec.RAW
    return BaseChunk(b.hashes if b is not None else None, rows, int(c.file[ci]))


def changed(new: bytes, old: bytes) -> np.ndarray:
    """Per block, whether its hash differs (bool array). Equal lengths required."""
    a = np.frombuffer(new, np.uint8).reshape(-1, codec.HASH_BYTES)
    b = np.frombuffer(old, np.uint8).reshape(-1, codec.HASH_BYTES)
    if a.shape != b.shape:
        return np.ones(len(a), bool)
    return (a != b).any(1)


def anchor(row: np.ndarray) -> tuple[int, int, int, int]:
    """The full (non-delta) block a new delta of this block is taken against: the row
    itself when it is not a delta, else the row's own anchor."""
    r = row.tolist()
    return tuple(r[4:8]) if r[3] & codec.XOR else tuple(r[0:4])


@dataclass
class ChunkReport:
    """What a rank reports about one chunk it wrote (or referenced) in its vote."""

    key: str
    offsets: list[int]
    hashes: bytes
    ref_file: int | None = None  # whole chunk unchanged and plain in base file i
    table: np.ndarray | None = None  # encoded: (n, 8), files OWN or base file indexes

    def to_json(self) -> list:
        import base64

        t = None if self.table is None else self.table.ravel().tolist()
        return [self.key, self.offsets, base64.b64encode(self.hashes).decode(), self.ref_file, t]

    @staticmethod
    def from_json(x: list) -> "ChunkReport":
        import base64

        t = None if x[4] is None else np.asarray(x[4], np.int64).reshape(-1, mf.TABLE_COLS)
        return ChunkReport(x[0], list(x[1]), base64.b64decode(x[2]), x[3], t)


@dataclass
class _Files:
    """The new manifest's file list: the ranks' own files, then referenced base files."""

    own: list[mf.FileEntry]
    base: mf.Manifest | None
    base_dir: str
    extra: list[mf.FileEntry] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)

    def of_base(self, i: int) -> int:
        if i not in self.index:
            f = self.base.files[i]
            self.index[i] = len(self.own) + len(self.extra)
            self.extra.append(mf.FileEntry(f.name, f.size, f.header_len, f.header_crc32,
                                           f.rank, f.dir or self.base_dir))
        return self.index[i]


def attach(m: mf.Manifest, reports: dict[int, list[ChunkReport]], base: mf.Manifest | None,
           base_dir: str) -> mf.Manifest:
    """The manifest ``m`` (chunks assigned to their writers' own files, -1 where a writer
    wrote no file) completed with every rank's chunk reports: block hashes for every
    chunk, whole-chunk references and block tables, and the base files they reference
    (named by ``base_dir``, the base's directory name, or the sibling they already
    live in). Pure, O(blocks). Raises StateMismatchError for a chunk no report covers
    that has no file."""
    own_index = {f.rank: i for i, f in enumerate(m.files)}
    files = _Files(list(m.files), base, base_dir)
    by_key: dict[str, dict[tuple[int, ...], tuple[int, ChunkReport]]] = {}
    for rank, reps in reports.items():
        for r in reps:
            by_key.setdefault(r.key, {})[tuple(r.offsets)] = (rank, r)
    tensors = {}
    for key, t in m.tensors.items():
        got = by_key.get(key, {})
        fidx = t.chunks.file.copy()
        hits = [got.get(tuple(int(x) for x in t.chunks.offsets[ci])) for ci in range(len(fidx))]
        blocks: list | None = []
        if None in hits:
            if any(h[1].table is not None or h[1].ref_file is not None for h in hits if h):
                # an encoded or referenced chunk beside one no report covers: the
                # tensor would lose the tables its readers need
                raise StateMismatchError(
                    f"tensor {key!r}: chunk {hits.index(None)} has no block report while "
                    "another chunk of it is encoded or references the base (ranks saved "
                    "with different compression, base or block_hashes)")
            blocks, hits = None, []
        for ci, hit in enumerate(hits):
            rank, r = hit
            table = None
            if r.ref_file is not None:
                fidx[ci] = files.of_base(r.ref_file)
            elif r.table is not None:
                table = r.table.copy()
                for col in (0, 4):
                    for j, f in enumerate(table[:, col].tolist()):
                        if col == 4 and not table[j, 3] & codec.XOR:
                            continue
                        table[j, col] = own_index[rank] if f == OWN else files.of_base(f)
                fidx[ci] = table[0, 0] if len(table) else own_index.get(rank, 0)
            blocks.append(mf.ChunkBlocks(codec.HASH_BLOCK, r.hashes, table))
        if (fidx < 0).any():
            raise StateMismatchError(f"tensor {key!r}: a chunk's writer reported no file")
        chunks = mf.Chunks(t.chunks.offsets, t.chunks.sizes, fidx, t.chunks.grid)
        tensors[key] = mf.TensorEntry(key, t.dtype, t.shape, chunks,
                                      tuple(blocks) if blocks is not None else None,
                                      t.bytes_value)
    return mf.Manifest(m.save_id, m.world_size, m.created, tuple(files.own + files.extra),
                       tensors, m.values, m.meta)

