"""Reading verified chunks out of shard files into destination tensors."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import IntegrityError
from ..format import manifest as mf
from ..format import codec, shards
from ..format.checksum import crc32
from ..format.dtypes import ITEMSIZE, to_torch
from ..layout.reshard import ReadItem, byte_span, split_item, strides
from ..progress import Progress
from ..state.tensors import LocalPiece
# the names of several chunks of one tensor in one file; public here for the writers
from ..format.chunknames import find_stored, stored_name, stored_names  # noqa: F401
from ..format.chunknames import checked_stored
from .openfiles import OpenFiles as _Files
# what a load plans before its first read; public here, as before
from .readplan import plan_pieces, plan_reads  # noqa: F401

DEFAULT_READ_BUDGET = 256 << 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Region:
    """One read, planned once before any I/O: ``item`` of ``piece``, stored as ``st``.
    Bytes ``[a, b)`` of the stored tensor hold it; ``[lo, hi)``, the same widened to
    whole checksum blocks of ``block`` bytes, are what is read and verified."""

    piece: LocalPiece
    item: ReadItem
    st: shards.StoredTensor
    a: int
    b: int
    lo: int
    hi: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes read for this region."""
        return self.hi - self.lo


@dataclass(frozen=True)
class Encoded:
    """One read of an encoded chunk (compressed, delta or referencing blocks):
    ``item`` of ``piece``; ``nbytes`` raw bytes of the chunk it spans."""

    piece: LocalPiece
    entry: mf.TensorEntry
    item: ReadItem
    nbytes: int


def file_path(storage, root: str, f: mf.FileEntry) -> str:
    """Where file ``f`` of the checkpoint at ``root`` is: in ``root``, or for a
    referenced file in the sibling directory ``f.dir`` (same parent). No I/O."""
    if not f.dir:
        return storage.join(root, f.name)
    parent = root.rstrip("/").rpartition("/")[0]
    return storage.join(storage.join(parent, f.dir), f.name) if parent else \
        storage.join(f.dir, f.name)


def _shown(f: mf.FileEntry) -> str:
    return f"{f.dir}/{f.name}" if f.dir else f.name


class ChunkReader:
    """Reads chunks of one checkpoint; caches verified file headers. Not thread-safe."""

    def __init__(self, storage, root: str, manifest: mf.Manifest) -> None:
        self.storage, self.root, self.m = storage, root, manifest
        self.headers: dict[int, tuple[dict[str, shards.StoredTensor], int]] = {}
        self._cells: dict[tuple[int, str], int] = {}  # (file, key) -> chunks there

    def _path(self, f: mf.FileEntry) -> str:
        return file_path(self.storage, self.root, f)

    def header(self, fi: int) -> tuple[dict[str, shards.StoredTensor], int]:
        """The parsed header of file ``fi``, checked against the manifest's size and
        checksum. One small read (plus a stat). Raises IntegrityError naming the file."""
        if fi in self.headers:
            return self.headers[fi]
        f = self.m.files[fi]
        path = self._path(f)
        try:
            size = self.storage.size(path)
            if size != f.size:  # checked before reading: header_len is bounded by size
                raise IntegrityError(f"shard file {path} has {size} bytes, the manifest "
                                     f"recorded {f.size} (truncated or replaced)")
            head = self.storage.read(path, 0, 8 + f.header_len)
        except FileNotFoundError:
            raise IntegrityError(f"shard file {path} is missing") from None
        except OSError as e:
            raise IntegrityError(f"shard file {path}: cannot read its header ({e})") from None
        if len(head) != 8 + f.header_len or crc32(head) != f.header_crc32:
            raise IntegrityError(f"shard file {path}: header checksum mismatch (corrupt or "
                                 "replaced file)")
        self.headers[fi] = shards.parse_header(head, path, size)
        return self.headers[fi]

    def find(self, fi: int, key: str, offsets,
             entry: mf.TensorEntry | None = None) -> shards.StoredTensor | None:
        """The stored tensor of ``key``'s chunk at ``offsets`` in file ``fi`` (its
        header read and cached), checked to be that chunk (:func:`checked_stored`: the
        offsets its header records; for a file that records none, that the manifest
        puts one chunk of ``key`` there when the bare key holds it). None when the file
        holds no such name. ``entry``: the manifest's entry of ``key`` (looked up when
        not given). O(ndim); for a file without offsets, once per (file, key),
        ``Chunks.in_file``. Raises IntegrityError naming the file and key."""
        tensors, _ = self.header(fi)
        return checked_stored(tensors, key, offsets, _shown(self.m.files[fi]),
                              lambda: self._count(fi, key, entry))

    def _count(self, fi: int, key: str, entry: mf.TensorEntry | None) -> int:
        n = self._cells.get((fi, key))
        if n is None:
            t = entry if entry is not None else self.m.tensors.get(key)
            n = self._cells[(fi, key)] = 0 if t is None else len(t.chunks.in_file(fi))
        return n

    def stored_bytes(self, fi: int, key: str, off: int, n: int, files: "_Files",
                     offsets=()) -> memoryview:
        """Bytes ``[off, off + n)`` of the entry of ``key``'s chunk at ``offsets`` in
        file ``fi`` (see :func:`find_stored`), read with their checksum blocks and
        verified. Blocking I/O; raises IntegrityError naming the file and key."""
        _, block = self.header(fi)
        f = self.m.files[fi]
        st = self.find(fi, key, offsets)
        what = f"shard file {_shown(f)}, tensor {key!r}"
        if st is None or off + n > st.nbytes:
            raise IntegrityError(f"{what}: the file does not hold the block the manifest "
                                 f"names (bytes {off}..{off + n})")
        if n == 0:
            return memoryview(b"")
        lo, hi = off // block * block, min(-(-(off + n) // block) * block, st.nbytes)
        buf = bytearray(hi - lo)
        files.read_exact(self._path(f), st.start + lo, [buf], what)
        shards.verify(memoryview(buf), lo // block, st.crcs, block, what)
        return memoryview(buf)[off - lo:off - lo + n]

    def peek(self, fi: int, key: str, off: int, n: int, files: "_Files",
             offsets=()) -> memoryview:
        """Bytes ``[off, off + n)`` of the entry of ``key``'s chunk at ``offsets`` in
        file ``fi``, NOT verified: for decisions that a verified read confirms later
        (whether a delta may pay), never for data. Blocking I/O; raises IntegrityError
        when the file does not hold the range."""
        f = self.m.files[fi]
        st = self.find(fi, key, offsets)
        what = f"shard file {_shown(f)}, tensor {key!r}"
        if st is None or off + n > st.nbytes:
            raise IntegrityError(f"{what}: the file does not hold bytes {off}..{off + n}")
        buf = bytearray(n)
        files.read_exact(self._path(f), st.start + off, [buf], what)
        return memoryview(buf)

    def raw_block(self, entry: mf.TensorEntry, ci: int, k: int, files: "_Files",
                  spans: dict | None = None):
        """Block ``k`` of encoded chunk ``ci`` of ``entry``, decoded (its anchor read and
        decoded too for a delta) and checked against its content hash; its stored bytes
        come from ``spans`` (:meth:`encoded_spans`) when they hold them. Blocking I/O;
        raises IntegrityError naming the block and file."""
        b = entry.blocks[ci]
        row = b.table[k].tolist()
        size = min(b.size, entry.chunk_nbytes(ci) - k * b.size)
        isz = ITEMSIZE[entry.dtype]
        what = f"tensor {entry.key!r} chunk {ci} block {k} (in {_shown(self.m.files[row[0]])})"
        offs = entry.chunks.box(ci)[0]  # a referenced block: the base's chunk, same box
        try:
            anchor = None
            if row[3] & codec.XOR:
                anchor = codec.decode(row[7], self.stored_bytes(
                    row[4], entry.key, row[5], row[6], files, offs), size, isz)
            got = (spans or {}).get(row[0])
            if got is not None and got[0] <= row[1] and row[1] + row[2] <= got[0] + len(got[1]):
                stored = got[1][row[1] - got[0]:row[1] - got[0] + row[2]]
            else:
                stored = self.stored_bytes(row[0], entry.key, row[1], row[2], files, offs)
            data = codec.decode(row[3], stored, size, isz, anchor)
        except ValueError as e:
            raise IntegrityError(f"{what}: {e}") from None
        if codec.block_hashes(memoryview(data).cast("B"), b.size) != \
                b.hashes[k * codec.HASH_BYTES:(k + 1) * codec.HASH_BYTES]:
            raise IntegrityError(f"{what}: decoded bytes do not match the block's content "
                                 "hash (a damaged or replaced file)")
        return data

    def encoded_spans(self, entry: mf.TensorEntry, ci: int, k0: int, k1: int,
                      files: "_Files") -> dict[int, tuple[int, memoryview]]:
        """The stored bytes of blocks ``k0..k1`` of encoded chunk ``ci``, one verified
        read per file where they lie close together (an object store pays a round trip
        per read: a compressed chunk's 1 MiB blocks must not cost one each):
        {file index: (offset in the stored tensor, bytes)}. Files whose blocks are
        sparse (under half the span) or span more than COALESCE_MAX are left out: their
        blocks are read one by one. Blocking I/O; raises IntegrityError."""
        rows = entry.blocks[ci].table[k0:k1]
        out: dict[int, tuple[int, memoryview]] = {}
        for fi in sorted(set(rows[:, 0].tolist())):
            sel = rows[rows[:, 0] == fi]
            lo, hi = int(sel[:, 1].min()), int((sel[:, 1] + sel[:, 2]).max())
            if len(sel) > 1 and hi - lo <= COALESCE_MAX and 2 * int(sel[:, 2].sum()) >= hi - lo:
                out[fi] = (lo, self.stored_bytes(fi, entry.key, lo, hi - lo, files,
                                                 entry.chunks.box(ci)[0]))
        return out

    def copy_encoded(self, t: "Encoded", files: "_Files") -> int:
        """Decode the blocks of an encoded chunk that region ``t`` overlaps and copy the
        region into its destination. Memory: the blocks' raw bytes (bounded by the read
        budget, as regions are cut). Returns stored bytes read. Blocking I/O."""
        piece, entry, item = t.piece, t.entry, t.item
        ci, isz = item.chunk, ITEMSIZE[entry.dtype]
        sizes = list(entry.chunks.box(ci)[1])
        a, b = byte_span(sizes, item.src, isz)
        bs = entry.blocks[ci].size
        k0, k1 = a // bs, -(-b // bs)
        base = k0 * bs
        tmp = torch.empty(min(k1 * bs, entry.chunk_nbytes(ci)) - base, dtype=torch.uint8)
        raw = memoryview(tmp.numpy())
        spans = self.encoded_spans(entry, ci, k0, k1, files)
        for k in range(k0, k1):
            data = memoryview(self.raw_block(entry, ci, k, files, spans)).cast("B")
            raw[k * bs - base:k * bs - base + len(data)] = data
        src = torch.as_strided(tmp.view(to_torch(entry.dtype)), [s.stop - s.start for s in item.src],
                               strides(sizes), (a - base) // isz)
        with torch.no_grad():
            piece.local[item.dst].copy_(src)
        return t.nbytes

    def stored(self, key: str, entry: mf.TensorEntry, item: ReadItem) -> shards.StoredTensor:
        offsets, want = entry.chunks.box(item.chunk)
        st = self.find(item.file, key, offsets, entry)
        if st is None or st.dtype != entry.dtype or st.shape != want:
            raise IntegrityError(f"shard file {self.m.files[item.file].name} does not hold "
                                 f"chunk {item.chunk} of {key!r} as the manifest says")
        return st

    def copy_one(self, r: Region, files: "_Files") -> int:
        """Read region ``r``'s widened span, verify it, and put the region in
        ``r.piece.local``. When the region is contiguous in both the file and the
        destination, the span's middle is read straight into the destination and only
        the widening goes through scratch buffers; otherwise the span goes through one
        temporary (bounded by the read budget) and is copied. ``files`` are the calling
        thread's open files. Returns bytes read. Blocking I/O; raises IntegrityError
        naming the file and tensor."""
        dest, st, item = r.piece.local, r.st, r.item
        if st.nbytes == 0:
            return 0
        f = self.m.files[item.file]
        path, what = self._path(f), f"shard file {f.name}, tensor {r.piece.key!r}"
        isz = ITEMSIZE[st.dtype]
        view = dest[item.dst]
        if (dest.device.type == "cpu" and view.is_contiguous() and not view.is_conj()
                and not view.is_neg() and r.b - r.a == view.numel() * isz):
            head, tail = bytearray(r.a - r.lo), bytearray(r.hi - r.b)
            # as_strided, not reshape: a one-element view is "contiguous" whatever its
            # stride, and reshape keeps that stride, which a byte view refuses.
            flat = torch.as_strided(view.detach(), (view.numel(),), (1,))
            mid = memoryview(flat.view(torch.uint8).numpy())
            files.read_exact(path, st.start + r.lo, [head, mid, tail], what)  # one request
            shards.verify_segments([head, mid, tail], r.lo // r.block, st.crcs, r.block, what)
        else:
            tmp = torch.empty(r.nbytes // isz, dtype=to_torch(st.dtype))
            raw = memoryview(tmp.view(torch.uint8).numpy())
            files.read_exact(path, st.start + r.lo, [raw], what)
            shards.verify(raw, r.lo // r.block, st.crcs, r.block, what)
            src = torch.as_strided(tmp, [s.stop - s.start for s in item.src],
                                   strides(st.shape), (r.a - r.lo) // isz)
            with torch.no_grad():
                view.copy_(src)
        return r.nbytes

    def _region(self, piece: LocalPiece, item: ReadItem, st: shards.StoredTensor) -> Region:
        """``item`` of ``piece`` with its byte span and checksum-block widening."""
        _, block = self.header(item.file)
        a, b = byte_span(st.shape, item.src, ITEMSIZE[st.dtype])
        return Region(piece, item, st, a, b, a // block * block,
                      min(-(-b // block) * block, st.nbytes), block)

    def fill_all(self, pairs: list[tuple[LocalPiece, mf.TensorEntry]], workers: int = 4,
                 budget: int = DEFAULT_READ_BUDGET, what: str = "load") -> int:
        """Fill every piece from the chunks overlapping it; returns bytes read.

        Coverage is checked before any read. File headers are read first; then the
        regions, sorted in file order, are cut into ``workers`` runs of about equal bytes,
        and each thread reads, verifies and copies one run through its own open files
        (reads, CRCs and copies release the GIL). Regions are cut so that no temporary
        exceeds ``budget / workers`` bytes (plus checksum-block widening): extra memory
        stays bounded whatever the tensor sizes. Long reads log progress as ``what``
        (see dckpt.progress). Blocking I/O; no collective. Raises IntegrityError naming
        file and tensor."""
        workers = max(1, workers)
        planned = plan_pieces(pairs)
        encoded = [t for t in planned if t[1].encoded(t[2].chunk) is not None]
        planned = [t for t in planned if t[1].encoded(t[2].chunk) is None]
        for fi in sorted({t[2].file for t in planned} | {int(f) for _, e, i in encoded
                                                            for f in e.encoded(i.chunk)[:, 0]}):
            self.header(fi)  # sequential and cached: the workers only read it
        # Every region planned once (stored tensor, span, widening): planning is pure
        # Python per region and precedes every read, so it is the load's fixed latency.
        whole = [self._region(p, i, self.stored(p.key, e, i)) for p, e, i in planned]
        # Pieces small enough to balance the workers' runs, and to bound the temporaries
        # (encoded chunks count too: cut into 1 MiB blocks one by one, a compressed
        # checkpoint on an object store paid a request per block).
        spans = [byte_span(e.chunks.box(i.chunk)[1], i.src, ITEMSIZE[e.dtype])
                 for _, e, i in encoded]
        total = sum(r.nbytes for r in whole) + sum(b - a for a, b in spans)
        # Whole MiBs, so that cuts of a large chunk fall on checksum-block boundaries
        # (blocks are powers of two up to 1 MiB) and pieces read no widening bytes.
        per_item = max(1, min(budget // workers, total // (4 * workers)) >> 20) << 20
        tasks: list[Region] = []
        for r, (piece, entry, item) in zip(whole, planned):
            if r.nbytes <= per_item:  # the common case: no cut
                tasks.append(r)
                continue
            tasks += [self._region(piece, i, r.st) for i in split_item(
                item, entry.chunks.box(item.chunk)[1], ITEMSIZE[entry.dtype], per_item)]
        tasks.sort(key=lambda r: (r.item.file, r.st.start + r.lo))
        for (piece, entry, item), (a, b) in zip(encoded, spans):
            limit = max(per_item, entry.blocks[item.chunk].size)
            if b - a <= limit:  # the common case: no cut, its span already known
                tasks.append(Encoded(piece, entry, item, b - a))
                continue
            sizes = list(entry.chunks.box(item.chunk)[1])
            isz = ITEMSIZE[entry.dtype]
            for i in split_item(item, sizes, isz, limit):
                a, b = byte_span(sizes, i.src, isz)
                tasks.append(Encoded(piece, entry, i, b - a))
        # Each worker reads one run of consecutive regions through its own open files,
        # like a plain sequential reader: the kernel's readahead follows each run. Measured
        # on 568 MiB, 2 -> 1/3/4 ranks, cold: handing regions out one at a time (which
        # interleaves the workers) with WILLNEED hints for all of them was 1.2-1.4x
        # slower; adding a 16-64 MiB sliding WILLNEED window to the runs, 1.2-1.5x slower.
        sizes = [r.nbytes for r in tasks]
        runs = _runs(tasks, workers, sizes)
        stop = threading.Event()  # one failed region ends every run: fail fast
        progress = Progress(what, sum(sizes), log)
        if len(runs) <= 1:
            return sum(self._run(r, stop, progress) for r in runs)
        with ThreadPoolExecutor(len(runs), thread_name_prefix="dckpt-read") as pool:
            return sum(pool.map(lambda r: self._run(r, stop, progress), runs))

    def _run(self, run: list, stop: threading.Event, progress: Progress) -> int:
        done = 0
        coalesce = getattr(self.storage, "coalesce_reads", not self.storage.random_write)
        group_end = -1
        with _Files(self.storage) as files:
            for i, t in enumerate(run):
                if stop.is_set():
                    break  # another worker failed; its error is the one raised
                try:
                    if isinstance(t, Encoded):
                        n = self.copy_encoded(t, files)
                        done += n
                        progress.add(n)
                        continue
                    if coalesce and i > group_end:
                        group_end = self._prefetch(run, i, files)
                    n = self.copy_one(t, files)
                    done += n
                    progress.add(n)
                except BaseException:
                    stop.set()
                    raise
        return done


    def _prefetch(self, run: list, i: int, files: "_Files") -> int:
        """Object stores: one ranged GET for the regions of ``run`` from ``i`` on that
        lie in one file with gaps under COALESCE_GAP, up to COALESCE_MAX bytes; the
        regions are then served from it. A request costs a round trip (and, on some
        servers, work in proportion to the object), so many small tensors must not cost
        one each. Returns the index of the group's last region. Blocking I/O."""
        first = run[i]
        path = self._path(self.m.files[first.item.file])
        lo, hi, j = first.st.start + first.lo, first.st.start + first.hi, i
        while j + 1 < len(run) and isinstance(run[j + 1], Region):
            nxt = run[j + 1]
            a, b = nxt.st.start + nxt.lo, nxt.st.start + nxt.hi
            if nxt.item.file != first.item.file or a - hi > COALESCE_GAP or \
                    max(b, hi) - lo > COALESCE_MAX:
                break
            hi, j = max(hi, b), j + 1
        files.prefetched = None
        if j > i:
            buf = bytearray(hi - lo)
            files.read_exact(path, lo, [buf], f"shard file {self.m.files[first.item.file].name}")
            files.prefetched = (path, lo, memoryview(buf))
        return j


COALESCE_GAP = 1 << 20  # bytes an object-store read may skip over to join two regions
COALESCE_MAX = 32 << 20  # and the largest joined read (one per reader thread in memory)


def _runs(tasks: list, n: int, sizes: list[int]) -> list[list]:
    """Cut ``tasks`` (in file order) into at most ``n`` consecutive runs of about equal
    bytes. Pure."""
    total, runs, acc = sum(sizes), [[]], 0
    per = max(1, -(-total // n))
    for t, sz in zip(tasks, sizes):
        if acc >= per * len(runs) and len(runs) < n:
            runs.append([])
        runs[-1].append(t)
        acc += sz
    return [r for r in runs if r]
