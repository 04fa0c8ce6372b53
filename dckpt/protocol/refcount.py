"""Which files committed manifests reference, and removal that respects it (gc and
retention). Incremental checkpoints reference files of their siblings (same parent
directory), and a checkpoint overwritten with a base may reference its own old files
through that base, so the manifests that can point into a directory are its own and its
siblings', links to directories included. Pure reference counting over manifests; the
only I/O is listings and manifest reads, named per function."""
from __future__ import annotations

import logging

from ..errors import CheckpointError
from ..format import manifest as mf
from ..format.filenames import DATA_FILE

log = logging.getLogger(__name__)


def _manifest(storage, d: str) -> tuple[mf.Manifest | None, bool]:
    """(manifest or None, unreadable): (None, False) when ``d`` has no manifest. One
    read."""
    from ..protocol.restore import read_manifest

    try:
        return read_manifest(storage, d)[0], False
    except CheckpointError:
        return None, storage.exists(storage.join(d, mf.MANIFEST_NAME))


ALL_FILES = "*"  # in a referenced set: every file (references unknown)


def references(storage, dirs: list[str]) -> dict[str, set[str]]:
    """{sibling directory name: its file names that a committed manifest among ``dirs``
    references} (incremental checkpoints). One manifest read per directory."""
    out: dict[str, set[str]] = {}
    for d in dirs:
        m, unreadable = _manifest(storage, d)
        if unreadable:  # it may reference anything
            log.warning("%s has an unreadable manifest: gc keeps every data file it could "
                        "reference (fix or remove it to let gc clean)", d)
            return {d2.rstrip("/").rpartition("/")[2]: {ALL_FILES} for d2 in dirs}
        for f in (m.files if m is not None else ()):
            if f.dir:
                out.setdefault(f.dir, set()).add(f.name)
    return out


def _parent(base: str) -> str | None:
    """The directory that holds ``base`` (its siblings' parent), or None for a top-level
    name with no parent to list (an object store's bucket). No I/O."""
    parent = base.rstrip("/").rpartition("/")[0]
    if parent:
        return parent
    return "/" if base.startswith("/") else None


def manifest_dirs(storage, parent: str, entries) -> list[str]:
    """The directories among ``entries`` (the listing of ``parent``) whose manifests may
    reference their siblings: subdirectories, and links to directories too. gc never
    deletes through a link, but a checkpoint loaded through one resolves its
    references beside the link, so its manifest counts. One stat per link."""
    out = []
    for e in entries:
        d = storage.join(parent, e.name)
        if e.is_dir or (e.is_link and storage.is_dir(d)):
            out.append(d)
    return out


def references_beside(storage, base: str, top) -> frozenset:
    """Names of the files at the top of ``base`` (listed as ``top``) that a committed
    manifest referencing into ``base`` names: ``base``'s own (a checkpoint overwritten
    with a base can reference its own old files through that base) and its siblings'
    (``base`` may be a checkpoint that a newer incremental step, or one whose manifest
    retention removed, is the base of). Whatever directory gc is given, these are the
    only manifests whose references resolve into it. I/O only when ``top`` holds a
    data file: one listing of the parent and one manifest read per sibling. A parent
    that cannot be listed keeps every data file (``ALL_FILES``), logged."""
    if not any(DATA_FILE.match(e.name) for e in top if not e.is_dir):
        return frozenset()  # nothing a reference could protect: no I/O
    name = base.rstrip("/").rpartition("/")[2]
    parent = _parent(base)
    try:
        dirs = [base] if parent is None else manifest_dirs(storage, parent,
                                                           storage.listdir(parent))
    except OSError as e:
        log.warning("cannot list %s to find the checkpoints beside %s that may reference "
                    "its files (%s): gc keeps its data files", parent, base, e)
        return frozenset({ALL_FILES})
    if not any(d.rstrip("/").rpartition("/")[2] == name for d in dirs):
        dirs.append(base)  # listed under another spelling (or a link): still its own refs
    return frozenset(references(storage, dirs).get(name, ()))


def remove_checkpoints(storage, base: str, names: list[str]) -> None:
    """Remove the checkpoints (or failed saves) ``names`` in ``base`` and every file of
    theirs that no other committed checkpoint in ``base`` references (incremental
    saves). Each one's manifest goes first, so no step is ever seen committed with
    files missing; a directory that still holds referenced files keeps only those (gc
    and later calls keep them while they are referenced, and remove them after). I/O:
    one listing of ``base``, one manifest read per other directory, one listing and the
    removals per name. Raises OSError from the storage; a crash half-way leaves
    leftovers that ``dckpt gc`` removes, never a referenced file missing."""
    doomed = set(names)
    for name in names:
        try:
            storage.remove(storage.join(base, name, mf.MANIFEST_NAME))
        except FileNotFoundError:
            pass  # a failed save's directory: it never had one
    others = manifest_dirs(storage, base, [e for e in storage.listdir(base)
                                            if e.name not in doomed])
    refs = references(storage, others)
    for name in names:
        d = storage.join(base, name)
        keep = refs.get(name, set())
        try:
            entries = storage.listdir(d)
        except FileNotFoundError:
            continue
        if ALL_FILES in keep:
            keep = {e.name for e in entries if DATA_FILE.match(e.name)}
        if not keep:
            storage.remove_tree(d)
            continue
        for e in entries:
            if e.name not in keep:
                (storage.remove_tree if e.is_dir else storage.remove)(storage.join(d, e.name))
        log.info("%s: kept %d file(s) that newer checkpoints reference", d, len(keep))


