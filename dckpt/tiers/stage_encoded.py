"""Incremental and compressed durable copies of the fast tier's steps.

With ``CheckpointManager(..., local_root=..., incremental=True | compression=...)`` the
fast tier stays as it is (full, raw, one host copy); only its staging to the durable
tier changes. Instead of copying each data file byte for byte (:func:`stager.stage`),
every rank writes its file again through the save path's encoder
(:func:`dckpt.protocol.commit.write_file` with an :class:`Encoding`), reading its own
local file through a memory map (no copy of the state):

* every stored tensor of ``data-<id>-<rank>`` is one piece (key, dtype, global shape
  and box from the global manifest the local commit produced); its CRCs are checked as
  it is read, so a local file damaged since its commit is never uploaded as good;
* its blocks are hashed while they stream by; against a base (the last durable step
  this job committed), a block whose hash equals the base's is not uploaded but
  referenced where the base's manifest says its bytes are; changed ones are written
  (compressed with ``compression``). Only the base's *manifest* is read: never its data
  (no XOR deltas, which would need the base's blocks: an upload costs no download);
* rank 0 builds the manifest as a direct incremental save's coordinator does (the same
  :meth:`_Coordinator.commit`, from a plan made of the global manifest's chunks and the
  votes' chunk reports) and commits it.

Every encoded copy records block hashes (a full one too), so the next can be
incremental. A base that is missing or damaged on the durable tier (its manifest
unreadable, one of its files, or of the files it references, missing or of the wrong
size) is not used: that copy is full, with a warning. It is never a step that
references a missing file (the commit checks every referenced file again).
"""
from __future__ import annotations

import logging
import mmap
import time
from typing import Any

import numpy as np
import torch

from .. import _faults
from ..format import codec, shards
from ..format import manifest as mf
from ..format.chunknames import checked_stored
from ..engine.encode import Encoding
from ..errors import CheckpointError
from ..layout import plan as gplan
from ..layout.chunks import Box
from ..protocol.collectives import Comm, error_payload
from ..protocol.commit import CheckpointInfo, write_file
from ..protocol.commitfiles import _check_files
from ..protocol.coordinator import check_base
from ..format.filenames import data_name
from ..protocol.restore import read_manifest_bytes
from ..state.tensors import LocalPiece
from .local import LocalCommit
from .stager import durable_copy, staged_info

log = logging.getLogger(__name__)


class Chain:
    """Which durable copy is incremental, against what: the manager's ``incremental``,
    ``full_every`` and ``compression`` applied to the staged copies. The base is the
    last durable step this job committed; the first copy after the manager is made or
    restores, every ``full_every``-th, and the one after a failed copy are full. Used
    from the staging thread only (copies run one at a time, in save order, with the
    same outcome on every rank, so every rank picks the same base); no I/O."""

    def __init__(self, incremental: bool, full_every: int, compression: str | None,
                 path_of) -> None:
        self.incremental, self.full_every = incremental, full_every
        self.compression, self.path_of = compression, path_of
        self.base: int | None = None
        self.since_full = 0

    def reset(self) -> None:
        """After a restore: the next copy is full."""
        self.base, self.since_full = None, 0

    def next_base(self, step: int) -> str | None:
        """The base path of the copy of ``step`` (None: full), counted as made."""
        base = None
        if (self.incremental and self.base is not None and self.base < step
                and self.since_full + 1 < self.full_every):
            base = self.path_of(self.base)
        self.since_full = self.since_full + 1 if base is not None else 0
        return base

    def stage(self, commit: LocalCommit, local_storage, path: str, comm: Comm,
              storage_options: dict | None = None) -> CheckpointInfo:
        """:func:`stage` of ``commit`` against the chain's base; the chain moves on to
        it when it commits, and restarts (full) after a failure. Raises as
        :func:`stage`."""
        try:
            info = stage(commit, local_storage, path, comm, storage_options,
                         self.next_base(commit.step), self.compression)
        except BaseException:
            self.reset()
            raise
        self.base = commit.step
        return info


def usable_base(storage, root: str, base: str, storage_options: dict | None) -> bytes:
    """Rank 0: the manifest bytes of ``base`` when it can serve as the base of a save at
    ``root``: readable, with block hashes, and every file it names (its own and those it
    references) present at its recorded size; else b"" with a warning (the copy is then
    full). I/O: one manifest read and one listing per directory involved."""
    try:
        bstorage, broot = check_base(storage, root, base, storage_options)
        data = read_manifest_bytes(bstorage, broot)
        m = mf.parse(data, bstorage.join(broot, mf.MANIFEST_NAME))
        if not any(t.blocks is not None for t in m.tensors.values()) and m.tensors:
            raise CheckpointError("it records no block hashes")
        _check_files(bstorage, broot, list(m.files))
        return data
    except Exception as e:  # noqa: BLE001 - any doubt: a full copy, never a broken chain
        log.warning("the base %s of the durable copy to %s cannot be used (%s): this copy "
                    "is full", base, root, e)
        return b""


class LocalPieces:
    """The pieces of this rank's data file of a local step, as zero-copy tensors over a
    memory map of the file (private, copy-on-write: never written). A context manager:
    the map is closed at exit. Reads: the header, then pages as the writer asks for
    them; every tensor's CRCs are checked against the file's header first (one pass
    over the page cache or tmpfs). Raises IntegrityError naming the file and tensor."""

    def __init__(self, storage, step_dir: str, m: mf.Manifest, rank: int) -> None:
        self.pieces: list[LocalPiece] = []
        self._f = self._mm = None
        mine = [i for i, f in enumerate(m.files) if f.rank == rank and not f.dir]
        if not mine:
            return
        fi = mine[0]
        entry = m.files[fi]
        path = storage.join(step_dir, entry.name)
        self._f = open(path, "rb")
        if entry.size:
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_COPY)
        head = bytes(self._mm[:8 + entry.header_len]) if self._mm is not None else b""
        tensors, block = shards.parse_header(head, path, entry.size)
        for key, t in m.tensors.items():
            c = t.chunks
            held = c.in_file(fi).tolist()  # by rule: no rank expands every chunk
            for ci in held:
                offsets, sizes = c.box(ci)
                st = checked_stored(tensors, key, offsets, path, len(held))
                if st is None or st.nbytes != t.chunk_nbytes(ci):
                    raise CheckpointError(f"{path}: no stored tensor for {key!r} at {offsets} "
                                          "(the local file and its manifest disagree)")
                if st.nbytes:
                    view = memoryview(self._mm)[st.start:st.start + st.nbytes]
                    shards.verify(view, 0, st.crcs, block, f"{key!r} in {path}")
                    view.release()
                    local = torch.frombuffer(self._mm, dtype=torch.uint8, count=st.nbytes,
                                             offset=st.start)
                else:
                    local = torch.empty(0, dtype=torch.uint8)
                self.pieces.append(LocalPiece(key, t.dtype, t.shape,
                                              Box(offsets, sizes),
                                              local))

    def __enter__(self) -> list[LocalPiece]:
        return self.pieces

    def __exit__(self, *exc) -> None:
        self.pieces = []
        try:
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # a view still alive somewhere: the GC closes it
            pass
        if self._f is not None:
            self._f.close()


def plan_of(m: mf.Manifest) -> gplan.GlobalPlan:
    """The global plan a manifest's chunks imply (each chunk written by its file's
    rank): what :meth:`_Coordinator.commit` builds the durable manifest from. Pure."""
    rank_of = np.asarray([f.rank for f in m.files] or [0], np.int64)
    tensors = {k: gplan.PlannedTensor(k, t.dtype, t.shape, t.chunks.offsets, t.chunks.sizes,
                                      rank_of[t.chunks.file], t.chunks.grid)
               for k, t in m.tensors.items()}
    return gplan.GlobalPlan(tensors, dict(m.values), [], np.zeros(m.world_size, np.int64),
                            int_keys=list(m.meta.get("int_keys") or []),
                            bytes_keys=[k for k, t in m.tensors.items() if t.bytes_value])


def stage(commit: LocalCommit, local_storage, path: str, comm: Comm,
          storage_options: dict | None, base: str | None,
          compression: str | None) -> CheckpointInfo:
    """Write the local checkpoint ``commit`` to ``path`` (durable) encoded: hashed,
    against ``base`` (a durable sibling, or None: full) and compressed with
    ``compression``; commit it there, replacing a checkpoint already at ``path``.
    Collective over ``comm`` (the ranks of the local save); blocking I/O: this rank
    reads its own local data file and uploads what changed; rank 0 reads the base's
    manifest (never its data). Raises on every rank alike as :func:`stager.stage`.
    On failure nothing is committed and the uploads are removed."""
    t0 = time.perf_counter()

    def prepare(dst, root: str) -> bytes:  # rank 0, before the lease
        return usable_base(dst, root, base, storage_options) if base else b""

    with durable_copy(commit, path, comm, storage_options, prepare) as s:
        base_bytes = s.first
        m0 = bm = None
        vote: dict[str, Any]
        try:
            s.check()
            m0 = mf.parse(commit.manifest, f"{path} (staged)")
            bm = mf.parse(base_bytes, f"{base} (base)") if base_bytes else None
            enc = Encoding(codec.compression_flag(compression), bm, None, deltas=False)
            _faults.fault("stage", comm.rank)
            with LocalPieces(local_storage, commit.step_dir, m0, comm.rank) as pieces:
                vote = write_file(_faults.upload_storage(s.dst), s.root,
                                  data_name(commit.save_id, comm.rank), comm.rank,
                                  pieces, enc)
        except Exception as e:
            vote = {"error": error_payload(e)}
            log.debug("rank %d: encoded upload failed", comm.rank, exc_info=True)

        def decide(votes: list[dict]) -> bytes:
            coord = s.coord
            coord.gp = plan_of(m0) if m0 is not None else None
            if bm is not None:
                coord.base, coord.base_dir = bm, root_name(base)
            meta = {"step": m0.meta["step"]} if m0 is not None and "step" in m0.meta else {}
            # the local commit's time: one save in both tiers (see chooser.live_timeline)
            return coord.commit(votes, t0, meta, m0.created if m0 is not None else None)

        result = s.settle(comm, vote, decide)
    info = staged_info(result, commit, path, s.root, comm)
    if comm.rank == 0:
        log.info("staged step %d to %s (%s): %.1f MiB in %.2f s", commit.step, info.path,
                 f"incremental on {root_name(base)}" if base_bytes else "full",
                 info.bytes_written / 2**20, info.seconds)
    return info


def root_name(path: str | None) -> str:
    """The last component of a checkpoint path (its directory name)."""
    return (path or "").rstrip("/").rpartition("/")[2]
