"""Finding checkpoints under a root, describing them, and removing leftovers (gc)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .dist.commit import DATA_FILE, TEMP_MANIFEST
from .errors import CheckpointError
from .format import manifest as mf
from .storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointSummary:
    path: str
    committed: bool
    bytes: int
    files: int
    tensors: int
    world_size: int
    created: float
    problem: str = ""


def _read(storage, path: str):
    """(manifest or None, summary or None): None, None when ``path`` has no manifest."""
    from .dist.restore import read_manifest

    try:
        m, _ = read_manifest(storage, path)
    except CheckpointError as e:
        if storage.exists(storage.join(path, mf.MANIFEST_NAME)):
            return None, CheckpointSummary(path, False, 0, 0, 0, 0, 0.0, str(e))
        return None, None
    return m, CheckpointSummary(path, True, m.total_bytes, len(m.files), len(m.tensors),
                                m.world_size, m.created)


def _summary(storage, path: str) -> CheckpointSummary | None:
    return _read(storage, path)[1]


def list_checkpoints(root: str, storage_options: dict | None = None) -> list[CheckpointSummary]:
    """Committed checkpoints at ``root`` and in its direct subdirectories, sorted by
    path. One listing plus one manifest read per subdirectory; no data file is read.
    Raises CheckpointError when ``root`` does not exist."""
    storage, base = make_storage(root, storage_options)
    if not storage.exists(base):
        raise CheckpointError(f"{root} does not exist")
    out = []
    own = _summary(storage, base)
    if own:
        out.append(own)
    for e in sorted(storage.listdir(base), key=lambda e: e.name):
        if e.is_dir:
            s = _summary(storage, storage.join(base, e.name))
            if s:
                out.append(s)
    return out


def sharding(t: mf.TensorEntry) -> str:
    """A short description of how a tensor's chunks cut it, e.g. ``4 x dim0``."""
    n = len(t.chunks)
    if n <= 1:
        return "whole"
    if t.chunks.grid is not None:
        cuts = [f"{len(b) - 1} x dim{d}" for d, b in enumerate(t.chunks.grid) if len(b) > 2]
        return ", ".join(cuts)
    return f"{n} chunks"


@dataclass(frozen=True)
class Leftover:
    path: str
    bytes: int
    age_s: float


def find_leftovers(root: str, min_age_s: float = 3600.0,
                   storage_options: dict | None = None) -> list[Leftover]:
    """Files that no committed manifest references, left by failed or interrupted
    saves, at ``root`` and in its direct subdirectories; only dckpt's own file names
    (``data-<id>-<rank>.safetensors``, temp manifests) older than ``min_age_s`` (so a
    save in progress is never touched). I/O: listings and manifest reads."""
    storage, base = make_storage(root, storage_options)
    now = time.time()
    dirs = [base] + [storage.join(base, e.name) for e in storage.listdir(base) if e.is_dir]
    out = []
    for d in dirs:
        m, s = _read(storage, d)
        if s is not None and not s.committed:
            log.warning("skipping %s: unreadable manifest (%s)", d, s.problem)
            continue
        keep = {f.name for f in m.files} if m is not None else set()
        for e in storage.listdir(d):
            if e.is_dir or e.name in keep:
                continue
            if (DATA_FILE.match(e.name) or TEMP_MANIFEST.match(e.name)) and now - e.mtime >= min_age_s:
                out.append(Leftover(storage.join(d, e.name), e.size, now - e.mtime))
    return out


def collect_garbage(root: str, *, dry_run: bool = False, min_age_s: float = 3600.0,
                    storage_options: dict | None = None) -> list[Leftover]:
    """Remove (or with ``dry_run`` only list) :func:`find_leftovers`. Returns them.
    A file that cannot be removed is logged and skipped."""
    storage, _ = make_storage(root, storage_options)
    found = find_leftovers(root, min_age_s, storage_options)
    if not dry_run:
        for lo in found:
            try:
                storage.remove(lo.path)
            except OSError as e:
                log.warning("could not remove %s: %s", lo.path, e)
    return found
