"""Reading verified chunks out of shard files into destination tensors."""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import IntegrityError
from .format import manifest as mf
from .format import shards
from .format.dtypes import to_torch
from .layout.chunks import Box
from .layout.reshard import ReadItem
from .layout.reshard import plan_reads as _plan
from .state.tensors import LocalPiece


def plan_reads(piece: LocalPiece, entry: mf.TensorEntry) -> list[ReadItem]:
    """The chunks of ``entry`` that overlap what ``piece`` holds."""
    if piece.local is None:
        return []
    c = entry.chunks
    return _plan(piece.box, c.offsets, c.sizes, c.file)


class ChunkReader:
    """Reads chunks of one checkpoint; caches verified file headers. Not thread-safe."""

    def __init__(self, storage, root: str, manifest: mf.Manifest) -> None:
        self.storage, self.root, self.m = storage, root, manifest
        self.headers: dict[int, tuple[dict[str, shards.StoredTensor], int]] = {}

    def _path(self, f: mf.FileEntry) -> str:
        return self.storage.join(self.root, f.name)

    def header(self, fi: int) -> tuple[dict[str, shards.StoredTensor], int]:
        """The parsed header of file ``fi``, checked against the manifest's size and
        checksum. One small read (plus a stat). Raises IntegrityError naming the file."""
        if fi in self.headers:
            return self.headers[fi]
        f = self.m.files[fi]
        path = self._path(f)
        try:
            size = self.storage.size(path)
            head = self.storage.read(path, 0, 8 + f.header_len)
        except FileNotFoundError:
            raise IntegrityError(f"shard file {path} is missing") from None
        if size != f.size:
            raise IntegrityError(f"shard file {path} has {size} bytes, the manifest recorded "
                                 f"{f.size} (truncated or replaced)")
        if len(head) != 8 + f.header_len or zlib.crc32(head) != f.header_crc32:
            raise IntegrityError(f"shard file {path}: header checksum mismatch (corrupt or "
                                 "replaced file)")
        self.headers[fi] = shards.parse_header(head, path, size)
        return self.headers[fi]

    def stored(self, key: str, entry: mf.TensorEntry, item: ReadItem) -> shards.StoredTensor:
        tensors, _ = self.header(item.file)
        st = tensors.get(key)
        want = tuple(int(x) for x in entry.chunks.sizes[item.chunk])
        if st is None or st.dtype != entry.dtype or st.shape != want:
            raise IntegrityError(f"shard file {self.m.files[item.file].name} does not hold "
                                 f"chunk {item.chunk} of {key!r} as the manifest says")
        return st

    def read_chunk(self, key: str, st: shards.StoredTensor, item: ReadItem,
                   out: memoryview) -> None:
        """Read a whole stored chunk into ``out`` and verify every block."""
        f = self.m.files[item.file]
        n = self.storage.readinto(self._path(f), st.start, out)
        if n != st.nbytes:
            raise IntegrityError(f"shard file {f.name}: short read of {key!r} "
                                 f"({n} of {st.nbytes} bytes; truncated)")
        _, block = self.header(item.file)
        shards.verify(out, 0, st.crcs, block, f"shard file {f.name}, tensor {key!r}")

    def copy_one(self, piece: LocalPiece, entry: mf.TensorEntry, item: ReadItem) -> int:
        """Read one chunk, verify it, and copy the overlap into ``piece.local``: straight
        into the destination when the chunk is exactly it and it is contiguous on the
        CPU, else through a temporary. Returns bytes read. Blocking I/O."""
        dest = piece.local
        st = self.stored(piece.key, entry, item)
        if st.nbytes == 0:
            return 0
        if item.whole_chunk and item.whole_target and dest.device.type == "cpu" \
                and dest.is_contiguous():
            raw = dest.detach().reshape(-1).view(torch.uint8).numpy()
            self.read_chunk(piece.key, st, item, memoryview(raw))
        else:
            tmp = torch.empty(st.shape, dtype=to_torch(st.dtype))
            self.read_chunk(piece.key, st, item, memoryview(tmp.reshape(-1).view(torch.uint8).numpy()))
            with torch.no_grad():
                dest[item.dst].copy_(tmp[item.src])
        return st.nbytes

    def fill_all(self, pairs: list[tuple[LocalPiece, mf.TensorEntry]], workers: int = 4) -> int:
        """Fill every piece from its overlapping chunks; returns bytes read.

        Coverage is checked before any read. File headers are read first, then chunks
        are read, verified and copied by ``workers`` threads (reads, CRCs and copies
        release the GIL), in file order. Raises IntegrityError naming file and tensor."""
        tasks = []
        for piece, entry in pairs:
            reads = plan_reads(piece, entry)
            covered = sum(Box(tuple(s.start for s in r.dst),
                              tuple(s.stop - s.start for s in r.dst)).numel for r in reads)
            if piece.local is not None and covered != piece.box.numel:
                raise IntegrityError(f"tensor {piece.key!r}: the checkpoint's chunks cover "
                                     f"{covered} of the {piece.box.numel} elements this rank needs")
            tasks += [(piece, entry, r) for r in reads]
        for fi in sorted({r.file for _, _, r in tasks}):
            self.header(fi)  # sequential and cached: the workers only read it
        tasks.sort(key=lambda t: (t[2].file, self.stored(t[0].key, t[1], t[2]).start))
        if workers <= 1 or len(tasks) <= 1:
            return sum(self.copy_one(*t) for t in tasks)
        with ThreadPoolExecutor(workers, thread_name_prefix="dckpt-read") as pool:
            return sum(pool.map(lambda t: self.copy_one(*t), tasks))
