"""The committed checkpoints of a folder in commit order, and the load of the newest
one that loads, falling back past damaged ones with a warning (as
:meth:`dckpt.CheckpointManager.restore`)."""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, TypeVar

from ...errors import CheckpointError
from ...manager.restore import failure_causes
from ...protocol.collectives import Comm, on_rank0
from ...tiers.chooser import fallback_worthy
from ...view.open import MissingKeyError
from .place import fresh_fs, is_url, kind, local_path, stamp
from .rotation import UNKNOWN, Committed, commit_order

log = logging.getLogger(__name__)
T = TypeVar("T")


def committed_in(directory: str, pattern: "re.Pattern[str]",
                 storage_options: dict | None = None) -> list[Committed]:
    """The committed dckpt checkpoints among ``directory``'s entries whose name
    ``pattern`` fullmatches (hidden ones never: staging and removals), oldest commit
    first. A manifest that cannot be read is read once more (a transient error); if it
    still cannot, its commit time is :data:`.rotation.UNKNOWN` (ordered newest: the load
    then reports its damage and falls back past it with a warning; retention keeps it).
    Blocking I/O: a listing and one manifest read per match; [] when the folder is
    missing."""
    names = _listing(directory, storage_options)
    out = []
    for base, path in names:
        if base.startswith(".") or not pattern.fullmatch(base):
            continue
        if kind(path, storage_options) != "dckpt":
            continue
        sid, created = "", UNKNOWN
        for attempt in range(2):
            try:
                sid, created = stamp(path, storage_options)
                break
            except (CheckpointError, OSError, TypeError, ValueError) as e:
                if attempt:
                    log.warning("cannot read the manifest of %s (%s): its commit time is "
                                "unknown, so it is taken as the newest", path, e)
                    sid, created = "", UNKNOWN
        out.append(Committed(path, float(created), str(sid)))
    return commit_order(out)


def _listing(directory: str, storage_options: dict | None) -> list[tuple[str, str]]:
    """(base name, path) of ``directory``'s entries, spelled as the caller spells the
    folder. Blocking I/O: one listing; [] when the folder is missing."""
    names: list[tuple[str, str]] = []
    if is_url(directory):
        fs, p = fresh_fs(directory, storage_options)
        try:
            listed = fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        for n in listed:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            # spelled as the caller spells the folder, not as the file system lists it
            # (memory's ls answers '/p/x' for 'memory://p'): a path compared with a
            # save's own name (rotation's "never the one just saved") must match it
            names.append((base, f"{directory.rstrip('/')}/{base}"))
    else:
        d = os.path.abspath(local_path(directory))
        try:
            names = [(n, os.path.join(d, n)) for n in os.listdir(d)]
        except OSError:
            return []
    return names


def checkpoint_names(directory: str, pattern: "re.Pattern[str]",
                     storage_options: dict | None = None) -> list[str]:
    """Every entry of ``directory`` whose name ``pattern`` fullmatches (committed or
    not, dckpt's or a framework's; hidden ones never). Blocking I/O: one listing."""
    return [p for b, p in _listing(directory, storage_options)
            if not b.startswith(".") and pattern.fullmatch(b)]


def newest_time(directory: str, pattern: "re.Pattern[str]",
                storage_options: dict | None = None) -> float | None:
    """The newest time on the run's timeline of the committed checkpoints of
    ``directory`` (None: none, or the folder cannot be listed: logged). After a load, a
    run's next commit is ordered after it (:meth:`.commit.Committer.saw`): a rewind on
    a host whose clock is behind never leaves the abandoned branch "newest". Not
    collective; blocking I/O: a listing and a manifest read per checkpoint."""
    try:
        got = committed_in(directory, pattern, storage_options)
    except Exception as e:  # the durable store is down (a fast-tier load): go on
        log.warning("cannot list %s after the load (%s)", directory, e)
        return None
    return max((c.created for c in got if c.created != UNKNOWN), default=None)


def stock_in(directory: str, pattern: "re.Pattern[str]") -> list[str]:
    """The local folders of ``directory`` matching ``pattern`` that are not dckpt
    checkpoints (a framework's own, for migration). Blocking I/O: a listing."""
    if is_url(directory):
        return []
    d = os.path.abspath(local_path(directory))
    try:
        entries = os.listdir(d)
    except OSError:
        return []
    return sorted(os.path.join(d, n) for n in entries if not n.startswith(".")
                  and pattern.fullmatch(n) and os.path.isdir(os.path.join(d, n))
                  and kind(os.path.join(d, n)) != "dckpt")


def load_newest(candidates: list[str], load: Callable[[str], T],
                what: str = "checkpoint") -> tuple[str, T]:
    """Try ``load(path)`` (a collective that raises the same error on every rank) on
    ``candidates`` (every rank's same list, oldest first) from the newest: the first
    that loads is returned as (path, its result). A damaged one (an integrity error, a
    missing or unreadable file: :func:`dckpt.tiers.chooser.fallback_worthy`) is
    skipped with a warning naming the cause; any other error (the state does not match,
    a rank died) is raised at once. Collective. Raises CheckpointError listing each
    tried when none loads."""
    tried: list[str] = []
    last: BaseException | None = None
    for path in reversed(candidates):
        try:
            return path, load(path)
        except CheckpointError as e:
            # a key the checkpoint lacks is the caller's mismatch, not damage: an older
            # checkpoint must not load silently in its place
            if not fallback_worthy(e) or isinstance(e, MissingKeyError):
                raise
            cause = failure_causes(e)
            tried.append(f"{path}: {cause}")
            last = e
            if Comm().rank == 0:
                log.warning("%s %s could not be loaded (%s); trying the one before it",
                            what, path, cause)
    raise CheckpointError(f"no {what} could be loaded; tried, newest first:\n  "
                          + "\n  ".join(tried)) from last


def listed(fn: Callable[[], Any], what: str) -> Any:
    """Rank 0's JSON-able ``fn()`` (a listing) on every rank, or its error on every
    rank. Collective (a broadcast)."""
    return on_rank0(Comm(), fn, what)
