"""Staging: copy a committed local checkpoint to the durable tier, with its own
two-phase commit.

Call order (collective over the group; rank 0 coordinates):
  1. rank 0 creates the durable step directory and takes the save's lease there (an
     intent file, as a direct save does), then tells every rank to go on, or why not;
  2. every rank uploads its own data file(s) of the local save, from its own node, to
     the durable directory, and votes (size, or its error);
  3. rank 0 checks that every file is there at its size and PUTs the global manifest
     it received at the local commit (THE durable commit point), removes the files of
     the durable checkpoint it replaced, and broadcasts the outcome.

The durable copy is an ordinary checkpoint: the same files, byte for byte, and the
manifest a direct save of the same state would have written. Replica files never leave
their node.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import _faults
from ..format import manifest as mf
from ..protocol.collectives import Comm, error_payload, rank0_bytes
from ..protocol.commit import CheckpointInfo, _raise_if_error
from ..protocol.coordinator import _Coordinator, _pack, _unpack
from ..storage.fsspec_storage import make_storage
from .local import LocalCommit

log = logging.getLogger(__name__)
COPY_BLOCK = 16 << 20  # bounded memory per upload; s3fs turns each block into parts


def copy_file(src_storage, src: str, dst_storage, dst: str, block: int = COPY_BLOCK) -> int:
    """Stream ``src`` to ``dst`` in ``block``-sized reads. Returns the bytes copied.
    Blocking I/O; memory: one block. Raises OSError naming neither: callers add the
    names. A failed copy leaves no ``dst`` (the writer is aborted: an object store's
    multipart upload is discarded, never completed)."""
    w = dst_storage.open_write(dst, size_hint=src_storage.size(src))
    n = 0
    try:
        with src_storage.open_read(src) as r:
            buf = bytearray(block)
            view = memoryview(buf)
            while True:
                got = r.readv(n, [view])
                if got <= 0:
                    break
                w.write(view[:got])
                n += got
                _faults.fault("upload", -1)  # crash tests: a kill in mid-upload
                if got < block:
                    break
        w.commit()
    except BaseException:
        w.abort()
        raise
    return n


class Staging:
    """One staging's durable side, as :func:`durable_copy` yields it: ``dst`` and
    ``root`` (the durable storage; None and ``path`` when it could not be opened:
    :meth:`check` raises why), ``coord`` (rank 0's coordinator, holding the lease; None
    on the other ranks) and ``first`` (what ``prepare`` returned on rank 0, on every
    rank)."""

    def __init__(self, path: str) -> None:
        self.dst: Any = None
        self.root = path
        self.coord: _Coordinator | None = None
        self.setup_err: Exception | None = None
        self.first = b""

    def check(self) -> None:
        """Raise why the durable storage could not be opened (inside a rank's vote)."""
        if self.setup_err is not None:
            raise self.setup_err

    def settle(self, comm: Comm, vote: dict, decide: Callable[[list[dict]], bytes]) -> dict:
        """Gather every rank's ``vote``; rank 0 turns them into the outcome with
        ``decide`` (an exception there is rank 0's error: it must still broadcast, or
        the others hang); returns the outcome on every rank. Collective: a gather and a
        broadcast."""
        votes = comm.gather_bytes(json.dumps(vote).encode())
        outcome = None
        if self.coord is not None:
            try:
                outcome = decide([json.loads(v) for v in votes])
            except Exception as e:
                outcome = _pack({"errors": {0: error_payload(e)}})
        return _unpack(comm.broadcast_bytes(outcome))[0]


@contextmanager
def durable_copy(commit: LocalCommit, path: str, comm: Comm, storage_options: dict | None,
                 prepare: Callable[[Any, str], bytes] | None = None) -> Iterator[Staging]:
    """The durable side of staging ``commit`` to ``path``: opens the storage, and on
    rank 0 takes the save's lease there (after ``prepare(dst, root)``, whose bytes every
    rank receives as :attr:`Staging.first`); at exit rank 0 ends it (not committed: the
    uploads are removed). Collective: one broadcast on entry. Raises on every rank
    alike when rank 0 cannot begin; a rank that could not open the storage raises in
    its vote (:meth:`Staging.check`)."""
    s = Staging(path)
    try:
        s.dst, s.root = make_storage(path, storage_options)
    except Exception as e:
        s.setup_err = e
    try:
        def begin() -> bytes:  # rank 0
            s.check()
            s.coord = _Coordinator(s.dst, s.root, True, comm.size)
            data = prepare(s.dst, s.root) if prepare is not None else b""
            s.coord.begin(commit.save_id)
            return data

        s.first = rank0_bytes(comm, begin, f"stage {commit.step_dir} to {path}")
        yield s
    finally:
        if s.coord is not None:
            s.coord.finish()  # not committed: remove the uploads; always: end the lease


def staged_info(result: dict, commit: LocalCommit, path: str, root: str,
                comm: Comm) -> CheckpointInfo:
    """The CheckpointInfo of a staging's outcome; raises its error on every rank alike."""
    _raise_if_error(result, f"stage of step {commit.step} to {path}")
    shown = path.rstrip("/") if "://" in path else root
    return CheckpointInfo(path=shown, bytes_written=result["bytes"], num_files=result["files"],
                          seconds=result["seconds"], world_size=comm.size,
                          save_id=commit.save_id)


def stage(commit: LocalCommit, local_storage, path: str, comm: Comm,
          storage_options: dict | None = None) -> CheckpointInfo:
    """Copy the local checkpoint ``commit`` to ``path`` (durable) and commit it there,
    replacing a checkpoint already at ``path``. Collective over ``comm`` (the ranks of
    the local save, in the same order); blocking network/disk I/O of this rank's data
    files. Raises on every rank alike: RankFailure naming the rank and object of a
    failed upload, IntegrityError (a file vanished before the commit),
    CommunicationError. On failure nothing is committed and the uploaded files are
    removed; the durable tier keeps what it had."""
    t0 = time.perf_counter()
    with durable_copy(commit, path, comm, storage_options) as s:
        vote: dict
        try:
            s.check()
            dst, root = s.dst, s.root
            sizes = {}
            for name in commit.files:
                _faults.fault("stage", comm.rank)
                try:
                    sizes[name] = copy_file(local_storage, local_storage.join(commit.step_dir, name),
                                            dst, dst.join(root, name))
                except OSError as e:
                    raise OSError(f"upload of {name} to {dst.join(root, name)} failed: {e}") from e
            vote = {"sizes": sizes}
        except Exception as e:
            vote = {"error": error_payload(e)}

        def decide(vs: list[dict]) -> bytes:
            errors = {r: v["error"] for r, v in enumerate(vs) if v.get("error")}
            if errors:
                return _pack({"errors": errors})
            return s.coord.commit_manifest(mf.parse(commit.manifest, f"{path} (staged)"), t0)

        result = s.settle(comm, vote, decide)
    info = staged_info(result, commit, path, s.root, comm)
    if comm.rank == 0:
        log.info("staged step %d to %s: %.1f MiB in %.2f s", commit.step, info.path,
                 info.bytes_written / 2**20, info.seconds)
    return info


@dataclass
class StageJob:
    """One queued durable copy, as this rank sees it (see :class:`StageQueue`)."""

    step: int
    forced: bool = False
    superseded: bool = False  # a newer copy was queued before this one began
    started: bool = False  # this rank claimed it: its files are being uploaded
    done: bool = False


class StageQueue:
    """The durable copies queued on this rank, bounded by coalescing.

    A copy is queued after each local commit meant for the durable tier, and the
    stagings run one at a time, in save order, on every rank. When the durable store is
    slower than the saves, a newer copy supersedes every older one that has not begun
    (:meth:`add`): those are skipped, so the fast tier holds at most ``keep_last_local``
    steps plus the one being uploaded, never a backlog. A forced copy (``force=True``,
    ``request_save()``, the final save on SIGTERM) is never superseded: it is what the
    user asked to survive the node.

    Skipping must be the same on every rank (a staging is collective): each staging
    begins with :meth:`claim`, this rank's vote (skip when superseded here; otherwise
    the job is marked started, and can no longer be superseded nor deleted), and the
    ranks skip when any rank votes so (one all-reduce, in the caller). A rank deletes a
    superseded step only after it was superseded, so it always votes to skip it.
    Thread-safe; pure bookkeeping, no I/O, no collective."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[StageJob] = []

    def add(self, step: int, forced: bool) -> StageJob:
        """Queue the copy of ``step``; supersede the queued ones not begun (but forced)."""
        job = StageJob(step, forced)
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done]
            for j in self._jobs:
                if not (j.started or j.forced):
                    j.superseded = True
            self._jobs.append(job)
        return job

    def claim(self, job: StageJob) -> bool:
        """At the start of ``job``'s staging: True to skip it (superseded on this rank),
        else mark it started (protected from now on) and return False."""
        with self._lock:
            if not job.superseded:
                job.started = True
            return job.superseded

    def finish(self, job: StageJob) -> None:
        """``job`` uploaded, failed or skipped: its step is no longer protected."""
        with self._lock:
            job.done, job.started = True, False

    def protected(self) -> set[int]:
        """Steps local cleanup must keep: being uploaded, or queued and not superseded."""
        with self._lock:
            return {j.step for j in self._jobs if not j.done and (j.started or not j.superseded)}

    def newest(self) -> int | None:
        """The newest step queued (for a log line), or None."""
        with self._lock:
            return self._jobs[-1].step if self._jobs else None
