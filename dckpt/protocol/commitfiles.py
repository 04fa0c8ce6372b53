"""The files around a commit, on rank 0: checking that every file a manifest will name
is there with its size, the files of the checkpoint a save replaces, the leftovers it
removes, and the files sibling checkpoints reference (kept). Moved out of
:mod:`dckpt.protocol.coordinator`. Blocking I/O (listings, manifest reads); no collective.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..errors import IntegrityError
from ..format import manifest as mf
from ..format.filenames import DATA_FILE, TEMP_MANIFEST
from ..engine.reader import file_path

log = logging.getLogger(__name__)


def _check_files(storage, root: str, files: Sequence[mf.FileEntry]) -> None:
    """Every file the manifest will name is there with the size its rank reported (one
    listing per directory; the own files compared in one numpy pass). Raises
    IntegrityError naming the file and rank: something removed or rewrote it after it
    was written (a concurrent gc or save)."""
    table = files if isinstance(files, mf.FileTable) else mf.FileTable.from_entries(files)
    own = table.own_mask()
    if own.any():
        try:
            sizes = {e.name: e.size for e in storage.listdir(root)}
        except FileNotFoundError:
            sizes = {}
        idx = np.flatnonzero(own)
        names = table.names
        got = np.fromiter((-1 if (n := sizes.get(names[i])) is None else n
                           for i in idx.tolist()), np.int64, len(idx))
        bad = idx[got != table.size[idx]]
        if len(bad):
            _check_one(storage, root, table[int(bad[0])], sizes)
    listings: dict[str, dict[str, int]] = {}
    for i in np.flatnonzero(~own).tolist():
        f = table[i]
        d = file_path(storage, root, f).rpartition("/")[0] if f.dir else root
        if d not in listings:
            try:
                listings[d] = {e.name: e.size for e in storage.listdir(d)}
            except FileNotFoundError:
                listings[d] = {}
        _check_one(storage, root, f, listings[d])


def _check_one(storage, root: str, f: mf.FileEntry, sizes: dict[str, int]) -> None:
    """Raise IntegrityError unless ``f`` is listed in ``sizes`` with its size."""
    if sizes.get(f.name) != f.size:
        whose = f"referenced in {f.dir}" if f.dir else f"rank {f.rank}"
        what = "is missing" if f.name not in sizes else (
            f"holds {sizes[f.name]} bytes, not the {f.size} expected")
        raise IntegrityError(
            f"{file_path(storage, root, f)} ({whose}) {what} at commit time: "
            "another process removed or rewrote it (a concurrent dckpt gc or save?); "
            "nothing was committed")


def _current_files(storage, root: str) -> set[str]:
    """Data files of the checkpoint committed at ``root`` now (empty when there is none
    or its manifest cannot be read: then its files are left for ``dckpt gc``)."""
    from .restore import read_manifest

    try:
        m, _ = read_manifest(storage, root)
    except Exception as e:
        if storage.exists(storage.join(root, mf.MANIFEST_NAME)):
            log.warning("replacing %s, whose manifest cannot be read (%s): its data files "
                        "are left for dckpt gc", root, e)
        return set()
    return set(m.files.names)


def _remove_files(storage, root: str, select) -> int:
    """Remove dckpt data files and temp manifests in ``root`` for which ``select(name)``.
    Failures are logged, never raised: leftovers only cost space (``dckpt gc``)."""
    removed = 0
    try:
        entries = storage.listdir(root)
    except OSError as e:
        log.warning("could not list %s to clean leftovers: %s", root, e)
        return 0
    for e in entries:
        if (DATA_FILE.match(e.name) or TEMP_MANIFEST.match(e.name)) and select(e.name):
            try:
                storage.remove(storage.join(root, e.name))
                removed += 1
            except OSError as err:
                log.warning("could not remove leftover %s: %s", e.name, err)
    return removed


def referenced_by_siblings(storage, root: str) -> set[str]:
    """Names of ``root``'s files that a committed checkpoint in a sibling directory
    references (incremental saves). One listing of the parent and one manifest read per
    sibling (links to directories included, one stat each: gc's rule, see
    :func:`dckpt.protocol.refcount.manifest_dirs`). A sibling whose manifest cannot be read may
    reference anything: then every file is reported referenced (kept for ``dckpt gc``
    to decide later)."""
    from .refcount import ALL_FILES, manifest_dirs, references

    parent, _, name = root.rstrip("/").rpartition("/")
    try:
        siblings = manifest_dirs(storage, parent, [e for e in storage.listdir(parent)
                                                   if e.name != name]) if parent else []
        refs = references(storage, siblings).get(name, set())
        return {e.name for e in storage.listdir(root)} if ALL_FILES in refs else refs
    except OSError as e:
        log.warning("cannot look for references into %s (%s): keeping its files", root, e)
        return {e2.name for e2 in storage.listdir(root)}
