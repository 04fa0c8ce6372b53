"""Save history: one self-checking JSON line per committed save, in the manager's root.

``ROOT/.dckpt-saves.jsonl`` holds one record per committed save of a
:class:`~dckpt.CheckpointManager` (see docs/HISTORY.md): step, commit time, bytes,
blocking and total seconds, world size, tier, how it ran, epoch, save id. Each line is
a JSON object whose last member, ``"crc32"``, is the CRC-32 (zlib) of the line's bytes
with that member removed, so a reader checks every line on its own: a torn or damaged
line is skipped with a warning and never hides the others.

Writing, by the manager's rank 0 only, from one background thread per manager (so a
slow store never holds up training):

* local file system: ``O_APPEND`` writes and an fsync. Earlier bytes are never
  rewritten by an append, so a crash (a SIGKILL, a power loss) can only leave a torn
  last line; the next append first ends that line with a newline, so the damage stays
  in one line. Past :data:`COMPACT_BYTES` the file is rewritten with its last
  :data:`MAX_RECORDS` records through ``put_atomic`` (temp file, fsync, rename): a
  crash then leaves the old file or the new one.
* object stores and other fsspec file systems have no append: each write reads the
  file (at most :data:`READ_CAP` bytes, about 2.5 MB at 10,000 records), adds the new
  lines and writes it back with ``put_atomic`` (one PUT, atomic on object stores).
  Readers see the old file or the new one, never a part; the cost is a read and a
  write of the whole file per save. A store with no atomic replace keeps no history
  (one warning).

A failure to write the history is logged and never fails a save.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import os
import re
import stat
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .. import _faults
from ..storage.base import NotRegularFileError
from ..storage.local import LocalStorage, _fsync_dir

log = logging.getLogger(__name__)

HISTORY_FILE = ".dckpt-saves.jsonl"
VERSION = 1
MAX_RECORDS = 10_000
READ_CAP = 16 << 20  # a reader reads at most the file's last 16 MiB
COMPACT_BYTES = 4 << 20  # a local file over this is rewritten to its last MAX_RECORDS
BLOCKING_WAIT_S = 600.0  # how long a commit's record waits for its call's blocking time
_CRC = re.compile(rb',"crc32":"([0-9a-f]{8})"\}\s*$')


@dataclass(frozen=True)
class SaveRecord:
    """One committed save. ``time``: Unix seconds when the commit was known.
    ``tier``: "durable" (under the manager's root) or "local" (the fast tier).
    ``mode``: "sync" or "async" (how the save call ran), "staged" (the durable copy of
    a fast-tier save, made in the background) or "recovered" (rebuilt at a restore from
    the manifest of a committed step whose record a crash prevented; no timings).
    ``bytes``: bytes this save wrote, all ranks (an incremental save: only its new
    bytes). ``blocking_s``: seconds the save call held up training. ``total_s``:
    seconds from the call to this commit. ``epoch``: the last epoch passed to
    ``save(..., epoch=)`` at or before this save (None: never given)."""

    step: int
    time: float
    tier: str
    mode: str
    bytes: int
    blocking_s: float | None
    total_s: float | None
    world_size: int
    epoch: int | None = None
    save_id: str = ""

    @property
    def throughput(self) -> float | None:
        """Bytes per second over the whole save (``bytes / total_s``); None unknown."""
        return self.bytes / self.total_s if self.total_s else None

    def encode(self) -> bytes:
        """The record's line, newline included. Pure. Raises ValueError for a
        non-finite time (JSON has no NaN)."""
        body = json.dumps({"v": VERSION, **asdict(self)}, separators=(",", ":"),
                          allow_nan=False).encode()
        return body[:-1] + b',"crc32":"%08x"}\n' % zlib.crc32(body)


def decode(line: bytes) -> SaveRecord:
    """The record on ``line`` (with or without its newline). Pure. Raises ValueError
    when the checksum does not match or a field is missing or of the wrong type.
    Unknown members (a newer writer's) are ignored."""
    m = _CRC.search(line)
    if m is None:
        raise ValueError("no crc32 member at the end of the line (torn?)")
    body = line[:m.start()] + b"}"
    if zlib.crc32(body) != int(m.group(1), 16):
        raise ValueError("crc32 mismatch")
    try:
        doc = json.loads(body)
    except RecursionError:  # a valid CRC does not make the line readable
        raise ValueError("nested too deeply to decode") from None
    if not isinstance(doc, dict) or not _is_int(doc.get("v"), 1):
        raise ValueError("not a version >= 1 record")

    def num(k: str, optional: bool = False) -> float | None:
        v = doc.get(k)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{k} is not a number")
        return float(v)

    for k, lo in (("step", 0), ("bytes", 0), ("world_size", 1)):
        if not _is_int(doc.get(k), lo):
            raise ValueError(f"{k} is not an int >= {lo}")
    if doc.get("epoch") is not None and not _is_int(doc["epoch"], 0):
        raise ValueError("epoch is not an int >= 0")
    for k in ("tier", "mode"):
        if not isinstance(doc.get(k), str):
            raise ValueError(f"{k} is not a string")
    return SaveRecord(step=doc["step"], time=num("time"), tier=doc["tier"], mode=doc["mode"],
                      bytes=doc["bytes"], blocking_s=num("blocking_s", True),
                      total_s=num("total_s", True), world_size=doc["world_size"],
                      epoch=doc.get("epoch"), save_id=str(doc.get("save_id") or ""))


def _is_int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def parse(data: bytes) -> tuple[list[SaveRecord], int]:
    """(the records in ``data``, in file order; how many non-empty lines were skipped
    as torn or corrupt). Pure; never raises."""
    out, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            out.append(decode(line))
        except ValueError:  # json's errors are ValueErrors too
            bad += 1
    return out, bad


def _read_tail(storage, path: str, cap: int) -> bytes:
    """The whole lines among the last ``cap`` bytes of ``path``. One stat and one read;
    raises FileNotFoundError, OSError."""
    size = storage.size(path)
    start = max(0, size - cap)
    data = storage.read(path, start)
    if start:  # the first line is cut: it starts before the part read
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else b""
    return data


def read_history(storage, root: str, cap: int = READ_CAP) -> tuple[list[SaveRecord], int]:
    """The records of ``root``'s history in file order (appends: about commit order),
    and how many torn or corrupt lines were skipped (logged as a warning). Cost: one
    stat and one read of at most ``cap`` bytes (the newest records). Raises
    FileNotFoundError when there is no history, OSError when it cannot be read."""
    path = storage.join(root, HISTORY_FILE)
    recs, bad = parse(_read_tail(storage, path, cap))
    if bad:
        log.warning("save history %s: skipped %d torn or corrupt line(s); the other %d "
                    "record(s) are intact", path, bad, len(recs))
    return recs, bad


def _append_local(path: str, data: bytes) -> int:
    """Append ``data`` (whole lines) to the local file ``path`` and fsync it; returns
    the file's new size. A last line left torn by a crash is ended first, so ``data``
    starts a line of its own. Raises OSError (NotRegularFileError for a FIFO or a
    device named like the history)."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK,
                 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"{path} is not a regular file")
        if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
            data = b"\n" + data
        if "history:" in os.environ.get("DCKPT_FAULT", ""):
            # crash tests: die half-way through the line, as a SIGKILL can
            half = len(data) // 2
            os.write(fd, data[:half])
            os.fsync(fd)
            _faults.fault("history", 0)
            data = data[half:]
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if st.st_size == 0:  # a new file: make its directory entry durable too
        _fsync_dir(os.path.dirname(path) or ".")
    return st.st_size + len(data)


class SaveHistory:
    """The save history of one root, written by one process (the manager's rank 0).

    :meth:`submit` runs writes in one background thread, in order; :meth:`append` is
    the blocking write itself. Only one writer per root is supported (one manager per
    root, as the manager requires)."""

    def __init__(self, storage, root: str, *, max_records: int = MAX_RECORDS,
                 compact_bytes: int = COMPACT_BYTES) -> None:
        if max_records < 1:
            raise ValueError("max_records must be >= 1")
        self.storage, self.root = storage, root
        self.path = storage.join(root, HISTORY_FILE)
        self.max_records, self.compact_bytes = max_records, compact_bytes
        self._local = isinstance(storage, LocalStorage)
        self._disabled = not self._local and not getattr(storage, "atomic_replace", False)
        if self._disabled:
            log.warning("%s has no atomic replace: no save history is kept there", root)
        self._lock = threading.Lock()  # one write at a time (the thread, or inline ones)
        self._submit_lock = threading.Lock()  # commits are seen from several threads
        self._compacted = 0  # size after the last rewrite: compaction stays amortised
        self._exec: cf.ThreadPoolExecutor | None = None
        self._last: cf.Future | None = None

    # ------------------------------------------------------------------ writing
    def append(self, records: list[SaveRecord]) -> None:
        """Add ``records`` at the end, keeping the last ``max_records``. Blocking I/O:
        locally an append and an fsync (a rewrite of the file now and then);
        elsewhere a read and an atomic rewrite of the whole file. Raises OSError,
        ValueError (a record that cannot be encoded)."""
        if self._disabled or not records:
            return
        data = b"".join(r.encode() for r in records)
        with self._lock:
            if self._local:
                size = _append_local(self.path, data)
                if size > max(self.compact_bytes, 2 * self._compacted):
                    self._rewrite(b"")
            else:
                self._rewrite(data)

    def _rewrite(self, data: bytes) -> None:
        """The last ``max_records`` of the file plus ``data``, written atomically.
        Corrupt lines are dropped (they were skipped by every reader anyway). An
        unreadable file raises rather than being replaced by the new lines alone."""
        try:
            old = _read_tail(self.storage, self.path, READ_CAP)
        except FileNotFoundError:
            old = b""
        recs, bad = parse(old + b"\n" + data)
        if bad:
            log.warning("save history %s: dropping %d torn or corrupt line(s) while "
                        "rewriting it", self.path, bad)
        out = b"".join(r.encode() for r in recs[-self.max_records:])
        if self._local:
            self._remove_stale_temps()
        self.storage.put_atomic(self.path, out)
        self._compacted = len(out)

    def _remove_stale_temps(self) -> None:
        """Remove the temp files of a rewrite a crash interrupted (``put_atomic``'s
        ``.<name>.tmp-<id>``; gc does not know them). With one writer per root, any
        such file is stale. One listing of the root; failures ignored."""
        prefix = f".{HISTORY_FILE}.tmp-"
        try:
            for e in self.storage.listdir(self.root):
                if e.name.startswith(prefix) and not e.is_dir:
                    self.storage.remove(self.storage.join(self.root, e.name))
        except OSError as e:
            log.debug("could not remove stale history temp files: %s", e)

    def submit(self, fn: Callable[[], None], wait: bool = False) -> None:
        """Run ``fn`` (a write) in the history thread, after the writes before it;
        with ``wait``, return once it has run. ``fn``'s errors are logged, never
        raised: the history must not fail a save."""
        if self._disabled:
            return

        def guarded() -> None:
            try:
                fn()
            except Exception as e:
                log.warning("could not record the save history in %s: %s", self.path, e)

        try:
            with self._submit_lock:
                if self._exec is None:
                    self._exec = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-history")
                self._last = fut = self._exec.submit(guarded)
        except RuntimeError:  # after close() (or at interpreter exit): write inline
            guarded()
            return
        if wait:
            fut.result()

    def flush(self, timeout: float | None = None) -> None:
        """Block until every write submitted so far has run (up to ``timeout`` s)."""
        last = self._last
        if last is not None:
            try:
                last.result(timeout)
            except cf.TimeoutError:
                log.warning("save history %s: writes still pending after %.0f s",
                            self.path, timeout)

    def close(self) -> None:
        """:meth:`flush`, then stop the thread; later writes run in the caller."""
        self.flush()
        if self._exec is not None:
            self._exec.shutdown(wait=True)

    # ------------------------------------------------------------------ recovering
    def reconcile(self, committed: dict[str, SaveRecord]) -> int:
        """Add the records of committed durable checkpoints that have none (keyed by
        save id; a crash between a commit and its record): ``committed`` maps each
        save id to its recovered record. Waits for the history thread; returns how
        many were added. Cost: one read of the history and one write when some are
        missing. Never raises (logged)."""
        added = [0]

        def job() -> None:
            try:
                have = {r.save_id for r in read_history(self.storage, self.root)[0]
                        if r.tier == "durable"}
            except FileNotFoundError:
                have = set()
            missing = sorted((r for sid, r in committed.items() if sid not in have),
                             key=lambda r: r.time)
            if missing:
                self.append(missing)
                added[0] = len(missing)
                log.info("save history %s: recovered the record(s) of step(s) %s from "
                         "their manifests", self.path, [r.step for r in missing])

        self.submit(job, wait=True)
        return added[0]


def recovered_record(step: int, manifest: Any) -> SaveRecord:
    """The record of a committed durable checkpoint, rebuilt from its manifest: time
    of the commit, its own bytes, world size, epoch; no timings. Pure."""
    epoch = manifest.values.get("manager.epoch")
    return SaveRecord(step=step, time=float(manifest.created), tier="durable",
                      mode="recovered", bytes=int(manifest.total_bytes), blocking_s=None,
                      total_s=None, world_size=int(manifest.world_size),
                      epoch=epoch if _is_int(epoch, 0) else None, save_id=manifest.save_id)


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


class PendingSave:
    """The record(s) of one save call, on rank 0. Its blocking time is known in the
    calling thread once the call returns; each commit (a tier) is known in whichever
    thread sees it, possibly before (a synchronous fast-tier save commits inside the
    call). A commit's record is written by the history thread once both are known."""

    def __init__(self, history: SaveHistory, step: int, epoch: int | None, mode: str) -> None:
        self.history, self.step, self.epoch, self.mode = history, step, epoch, mode
        self.t0 = time.perf_counter()
        self.blocking_s: float | None = None
        self._blocked = threading.Event()

    def blocked(self, seconds: float) -> None:
        """The call returned after ``seconds``. No I/O; call it even when it failed."""
        self.blocking_s = seconds
        self._blocked.set()

    def committed(self, tier: str, nbytes: int, world_size: int, save_id: str,
                  mode: str | None = None, wait: bool = False) -> None:
        """A commit in ``tier``, now: queue its record (``wait``: until written). Never
        raises."""
        total, when = time.perf_counter() - self.t0, time.time()

        def job() -> None:
            if not self._blocked.wait(BLOCKING_WAIT_S):
                log.warning("save of step %d: its call never returned; recorded without "
                            "its blocking time", self.step)
            blocking = self.blocking_s
            # A synchronous save's commit can be seen a moment before its call returns.
            total_s = total if blocking is None else max(total, blocking)
            rec = SaveRecord(step=self.step, time=round(when, 3), tier=tier,
                             mode=mode or self.mode, bytes=int(nbytes),
                             blocking_s=_rounded(blocking), total_s=_rounded(total_s),
                             world_size=int(world_size), epoch=self.epoch, save_id=save_id)
            self.history.append([rec])

        self.history.submit(job, wait=wait)


def load_history(root: str, storage_options: dict | None = None) -> list[SaveRecord]:
    """The save records under the manager root ``root`` (a path or an fsspec URL), in
    file order, torn or corrupt lines skipped (logged). Cost and errors as
    :func:`read_history`: one read of at most :data:`READ_CAP` bytes;
    FileNotFoundError when there is no history."""
    from ..storage.fsspec_storage import make_storage

    storage, base = make_storage(root, storage_options)
    return read_history(storage, base)[0]
