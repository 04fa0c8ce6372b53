"""Whose fast-tier steps these are: the durable root's run identity, its cache beside
each ``local_root``, and the lease that keeps a second job off a ``local_root``.

* The run id lives in ``root/.dckpt-run-id`` (made on first use); every fast-tier view
  records ``<root URL>#<run id>`` as its ``owner``, so a new run never restores the
  steps an earlier run left in a shared ``local_root``. Only a file that is really
  absent makes a new run: an unreadable or damaged one is an error naming the file,
  and nothing is deleted (a transient EIO must not turn the job into a new run whose
  first commit deletes the fast tier).
Their files live in ``local_root/.dckpt/`` (:data:`META_DIR`), beside the steps.

* Each rank caches the identity in its ``local_root`` (``.dckpt/owner-<hash of the
  root URL>``), so a job restarting while the durable store is down still knows which
  fast-tier steps are its own (rank 0 reads its node's cache).
* :class:`Lease`: every process of a job holds a shared ``flock`` on
  ``local_root/.dckpt/job-<job id>.lock`` for the tier's life; a job that finds
  another job's file locked refuses to start (two jobs on one ``local_root`` would
  delete each other's steps). A killed job's lock is released by the kernel.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import socket
import time
import uuid

from ..errors import CheckpointError
from ..protocol.collectives import Comm

log = logging.getLogger(__name__)

RUN_ID_FILE = ".dckpt-run-id"  # in the durable root
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_OWNER_CAP = 4096
META_DIR = ".dckpt"  # in local_root: the cached identity and the job leases
_MUTEX = "jobs.lock"
_JOB_LOCK = re.compile(r"^job-([0-9a-f]{32})\.lock$")


class RunIdError(CheckpointError):
    """The durable root's run-id file exists but cannot be read, or does not hold a
    run id. Nothing was changed; fix or remove the file (removing it starts a new run:
    the fast tier's steps of the old one are then not restored)."""


def shown_root(root: str, url: str) -> str:
    """The durable root as recorded in an owner: ``root`` (normalised) for a local
    path, ``scheme://root`` for a URL. Pure."""
    local = "://" not in url or url.startswith("file://")
    return root if local else f"{url.split('://', 1)[0]}://{root}"


def root_identity(storage, root: str, url: str) -> str:
    """Rank 0: the identity of the durable root, ``<root URL>#<run id>``, the run id
    read from ``root/.dckpt-run-id`` or, when that file is absent, made and written
    there (exclusively: two starters agree on one). Small I/O in the root. Raises
    RunIdError when the file exists but cannot be read (EIO, a timeout) or holds
    anything but a run id; OSError when the root cannot be reached or written."""
    path = storage.join(root, RUN_ID_FILE)
    for _ in range(3):
        try:
            text = storage.read_file(path, 64).decode("ascii", "replace").strip()
        except FileNotFoundError:
            text = None
        except (OSError, CheckpointError) as e:
            raise RunIdError(f"the run-id file {path} exists but cannot be read ({e}); "
                             "nothing was changed: retry when the storage recovers")
        if text is not None:
            if _RUN_ID.fullmatch(text):
                return f"{shown_root(root, url)}#{text}"
            raise RunIdError(f"{path} does not hold a run id ({text[:80]!r}); nothing was "
                             "changed: restore the file, or remove it to start a new run "
                             "(the fast tier's steps saved under the old id are then "
                             "not restored)")
        try:
            storage.put_atomic(path, uuid.uuid4().hex.encode(), exclusive=True)
        except FileExistsError:
            pass  # made meanwhile: read it
    raise CheckpointError(f"could not establish the run id in {path}")


def _cache_name(owner_root: str) -> str:
    return os.path.join(META_DIR, "owner-" + hashlib.sha256(owner_root.encode()).hexdigest()[:16])


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def cache_identity(local_root: str, owner: str) -> None:
    """Record ``owner`` in this node's ``local_root`` (atomic replace; ranks sharing the
    directory write the same bytes). Small local I/O; failures are logged, never
    raised (the cache only matters while the durable root is down)."""
    path = os.path.join(_local(local_root), _cache_name(owner.rsplit("#", 1)[0]))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "rb") as f:
            if f.read(_OWNER_CAP).decode("utf-8", "replace") == owner:
                return
    except OSError:
        pass
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(owner.encode())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the run identity in %s: %s", local_root, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def cached_identity(local_root: str, root: str, url: str) -> str | None:
    """The identity of the durable root ``root`` cached in ``local_root`` (None: none,
    or not one of this root). Small local read; never raises."""
    shown = shown_root(root, url)
    path = os.path.join(_local(local_root), _cache_name(shown))
    try:
        with open(path, "rb") as f:
            text = f.read(_OWNER_CAP).decode("utf-8", "replace")
    except OSError:
        return None
    head, _, run = text.rpartition("#")
    return text if head == shown and _RUN_ID.fullmatch(run) else None


# The lock files this process holds: path -> [count, owner]. A second manager made in
# the same process for the same durable root (a restart simulated in one process, a
# notebook re-run) is not another job; one for another root is.
_HELD: dict[str, list] = {}
# The lease descriptors open in this process: closed in a forked child (os.fork copies
# descriptors, and with them the lock: a child that outlives the manager, a DataLoader
# worker say, would hold the local_root after close()). Closing, not unlocking: the
# lock stays the parent's.
_FDS: set[int] = set()


def _close_in_child() -> None:
    for fd in list(_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _FDS.clear()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _holders(fd: int) -> str:
    """" (pid 12, 34)": the processes holding a lock on ``fd``'s file, from
    /proc/locks (Linux; "" elsewhere or when unknown). Small local read."""
    try:
        st = os.fstat(fd)
        ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            pids = sorted({int(x[4]) for x in (line.split() for line in f)
                           if len(x) > 5 and x[5] == ident and x[1] == "FLOCK"})
    except (OSError, ValueError):
        return ""
    return f" (pid {', '.join(map(str, pids))})" if pids else ""


class Lease:
    """This process's hold on ``local_root`` for job ``job_id`` (see the module
    docstring). :meth:`acquire` raises CheckpointError naming the other job's lock
    file when a live process of another job holds one; :meth:`release` drops the
    lock (idempotent). Local I/O on a few small files; no collective."""

    def __init__(self, local_root: str, job_id: str, owner: str | None = None) -> None:
        self.root, self.job_id = os.path.join(_local(local_root), META_DIR), job_id
        self.owner = owner or ""
        self.path = os.path.join(self.root, f"job-{job_id}.lock")
        self._fd: int | None = None

    def acquire(self, grace: float | None = None) -> None:
        """Hold this job's lease, after checking that no live process of another job
        holds one. A holder may be the previous incarnation of this job still exiting
        (a SIGKILLed process releases its locks only once the kernel has torn it down,
        which can take seconds on a loaded host): the check is retried for ``grace``
        seconds (``DCKPT_LEASE_WAIT_S``, default 10) before the error."""
        if grace is None:
            grace = float(os.environ.get("DCKPT_LEASE_WAIT_S", "10"))
        os.makedirs(self.root, exist_ok=True)
        end = time.monotonic() + grace
        while True:
            try:
                self._register()
                return
            except CheckpointError:
                if time.monotonic() >= end:
                    raise
            time.sleep(0.25)

    def _register(self) -> None:
        mutex = os.open(os.path.join(self.root, _MUTEX), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)  # one starter at a time checks and registers
            for name in os.listdir(self.root):
                m = _JOB_LOCK.match(name)
                path = os.path.join(self.root, name)
                if not m or m.group(1) == self.job_id:
                    continue
                mine = _HELD.get(path)
                if mine and mine[0] > 0:
                    if mine[1] != self.owner:  # this process, but for another root
                        raise CheckpointError(
                            f"another job is using this local_root: a manager of this "
                            f"process for another durable root ({mine[1] or 'none'}) "
                            f"holds {path}; close it first, or give each its own "
                            "local_root")
                    continue
                self._check_other(path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)  # ranks of this job on this node share it
            self._fd = fd
            _FDS.add(fd)
            held = _HELD.setdefault(self.path, [0, self.owner])
            held[0] += 1
        finally:
            os.close(mutex)

    @staticmethod
    def _check_other(path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckpointError(
                    f"another job is using this local_root: its processes{_holders(fd)} "
                    f"hold {path}. Two jobs on one local_root would delete each other's "
                    "steps; give each job its own local_root") from None
            os.unlink(path)  # a job that ended or was killed: its lock is stale
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if fd not in _FDS:
                return  # a forked child: the descriptor was closed at the fork
            if self.path in _HELD:
                _HELD[self.path][0] -= 1
            _FDS.discard(fd)
            os.close(fd)


def sharers(comm: Comm, root: str) -> set[int] | None:
    """The ranks that use the same directory as ``root`` (ranks of one node may share a
    ``local_root``): same machine (the kernel's boot id, shared by its containers),
    same device and inode. Collective: one all-gather of a few bytes. None when some
    rank cannot tell (then nobody removes another rank's files)."""
    try:
        st = os.stat(root)
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                machine = f.read().strip()
        except OSError:  # not Linux
            machine = socket.gethostname()
        me = f"{machine}:{st.st_dev}:{st.st_ino}"
    except OSError as e:
        log.debug("rank %d: cannot identify %s: %s", comm.rank, root, e)
        me = ""
    ids = [b.decode() for b in comm.all_gather_bytes(me.encode())]
    if not all(ids):
        return None
    return {r for r, i in enumerate(ids) if i == me}
