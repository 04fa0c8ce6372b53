"""Where a Lightning/Fabric dckpt checkpoint lives on disk: its placement under the name
Lightning chose (written under a hidden sibling, renamed into place after the commit),
its whole removal, and what a name holds. Rank 0's jobs; blocking file-system I/O, no
collective.

Lightning takes a folder for a checkpoint as soon as its name exists
(``ModelCheckpoint._find_last_checkpoints`` picks the newest ``last*.ckpt`` by mtime and
checks only that it exists), so a name must never exist before its checkpoint is
complete. Object stores have no rename: there the manifest is the commit.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid

from ...format.manifest import MANIFEST_NAME
from ...storage.local import _fsync_dir  # fsync of a directory entry (the rename is durable)

log = logging.getLogger(__name__)
PARTIAL = ".dckpt-partial-"
# transformers' JIT checkpoint marks a folder "save in progress" with this file before it
# calls the save; a placed checkpoint is complete, so the marker is never kept in it
JIT_MARKER = "checkpoint-is-incomplete.txt"
REPLACED = ".dckpt-replaced"  # in the folder a placement replaces (see place)
REMOVING = ".dckpt-removing-"


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """Linux renameat2(2): True when done, False when the call or flag is unsupported
    (then the caller falls back). Raises OSError otherwise."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _rm(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def sweep(parent: str, name: str) -> None:
    """Remove what killed saves and removals left in ``parent`` (of any name: a name
    never saved again keeps no leftover), but a partial folder a save may still be
    writing (:func:`_in_use`: another job or strategy saving into the same folder).
    Blocking I/O: a listing, and a few small reads per partial folder."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return
    for e in entries:
        if e.startswith(".") and (REMOVING in e or (PARTIAL in e and not _in_use(
                os.path.join(parent, e)))):
            folder = os.path.join(parent, e)
            if os.path.isfile(os.path.join(folder, REPLACED)):
                # what stood at a name when a placement died before adopting its files
                owner = os.path.join(parent, e[1:].split(REMOVING)[0].split(PARTIAL)[0])
                if not os.path.isdir(owner) or os.path.islink(owner):
                    log.warning("kept %s: it holds files of %s, which is gone", folder, owner)
                    continue
                adopt_entries(folder, owner)
            _rm(folder)


def _in_use(path: str) -> bool:
    """Whether a save may still be writing the folder ``path``: it holds a save intent
    (:mod:`dckpt.protocol.intent`) renewed within the lease, unless the intent names a
    process of this host that is gone (SIGKILLed: its leftovers go at once). An
    intent that cannot be read counts as live. No intent: a dead save's (the lease is
    taken before any data file is written, and ended after the commit)."""
    from ...protocol.intent import INTENT_FILE, LEASE_S

    try:
        names = [n for n in os.listdir(path) if INTENT_FILE.match(n)]
    except OSError:
        return False
    for n in names:
        p = os.path.join(path, n)
        try:
            age = time.time() - os.stat(p).st_mtime
            with open(p, "rb") as f:
                doc = json.loads(f.read(4096))
        except (OSError, ValueError):
            return True
        if age >= LEASE_S:
            continue
        if not isinstance(doc, dict):
            return True
        pid = doc.get("pid")
        if doc.get("host") == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            continue
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def place(tmp: str, final: str, adopt: tuple[str, ...] | None = None) -> None:
    """Move the committed checkpoint ``tmp`` to ``final`` in one step: a rename when
    nothing is there, an atomic exchange (renameat2) with what is there (a stock
    checkpoint, a file) and then its removal. ``adopt`` (the Hugging Face adapters: the
    names never to keep, a framework's "save in progress" markers): every entry of the
    folder that stood at ``final`` that dckpt did not write (a
    subclass's or callback's files written into the name before the save, or after an
    asynchronous save returned) is moved into the placed checkpoint first, unless the
    new one holds that name (the save's own file wins): nothing dckpt did not write is
    deleted. Local paths; blocking I/O (one rename and a directory fsync, a listing and
    a rename per adopted entry, plus the removal of what was replaced)."""
    parent = os.path.dirname(final) or "."
    if adopt is not None and os.path.isdir(final) and not os.path.islink(final):
        # marks the folder that stood at the name: if this process dies between the
        # exchange and the adoption, the sweep finds the marker in the hidden folder
        # and moves what dckpt did not write into the name (:func:`sweep`)
        with open(os.path.join(final, REPLACED), "w"):
            pass
    if not os.path.lexists(final):
        if not _renameat2(tmp, final, 1):  # RENAME_NOREPLACE
            os.rename(tmp, final)
    elif _renameat2(tmp, final, 2):  # RENAME_EXCHANGE: the old one is now at tmp
        if adopt is not None:
            adopt_entries(tmp, final, adopt)
        _rm(tmp)
    else:
        trash = os.path.join(parent, f".{os.path.basename(final)}{REMOVING}{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        if adopt is not None:
            adopt_entries(trash, final, adopt)
        _rm(trash)
    _fsync_dir(parent)


# A replaced checkpoint's model folder (its weights and their index: the side files'
# index, a background export's shards, a plain copy): the old save's weights, never
# "files a script wrote" (a new checkpoint carrying them would load the old weights)
_MODEL_FOLDER = re.compile(r"^model(?:\.safetensors(?:\.index\.json)?|-\d{5,}-of-\d{5,}"
                           r"\.safetensors)$")


def written_by_dckpt(name: str) -> bool:
    """Whether an entry of a checkpoint folder is dckpt's own (a data file, an intent,
    a manifest, a hidden dckpt leftover): never adopted from a replaced folder. Pure."""
    return is_dckpt_file(name) or name == MANIFEST_NAME or (
        name.startswith(".") and "dckpt" in name)


def adopt_entries(old: str, new: str, drop: tuple[str, ...] = ()) -> list[str]:
    """Move each entry of the folder ``old`` that dckpt did not write, that is not one
    of ``drop`` and that ``new`` lacks into ``new``; return their names. When ``old``
    is a committed checkpoint, its model folder (weights, index) is not moved: the old
    save's weights. ``old`` not a folder: nothing. An entry
    that cannot be moved is logged and left in ``old`` (then removed with it: the
    caller's choice); never raises for one entry. Local I/O: a listing, a rename each
    (same file system)."""
    if not os.path.isdir(old) or os.path.islink(old):
        return []
    moved = []
    # a replaced committed checkpoint: its model folder is the old save's weights
    was_checkpoint = os.path.isfile(os.path.join(old, MANIFEST_NAME))
    for n in sorted(os.listdir(old)):
        if (written_by_dckpt(n) or n in drop or n == JIT_MARKER
                or (was_checkpoint and _MODEL_FOLDER.match(n))
                or os.path.lexists(os.path.join(new, n))):
            continue
        try:
            os.rename(os.path.join(old, n), os.path.join(new, n))
            moved.append(n)
        except OSError as e:
            log.error("could not keep %s in the new checkpoint %s: %s", n, new, e)
    if moved:
        log.info("kept %s, written into %s outside dckpt's save, in the new checkpoint",
                 moved, new)
    return moved


def remove_whole(path: str, storage_options: dict | None = None) -> None:
    """Remove the checkpoint at ``path`` whole (rank 0's job). Local: renamed to a
    hidden name first (one step: no half-removed folder ever carries the name), then
    deleted. Object stores: the manifest first (the rest is then an uncommitted
    leftover no load takes), then the prefix. Missing: nothing. Blocking I/O."""
    if is_url(path):
        fs, p = fresh_fs(path, storage_options)
        man = p.rstrip("/") + "/" + MANIFEST_NAME
        if fs.exists(man):
            fs.rm(man)
        if fs.exists(p):
            fs.rm(p, recursive=True)
        return
    path = local_path(path)
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        parent, name = os.path.split(os.path.abspath(path))
        trash = os.path.join(parent, f".{name}{REMOVING}{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.remove(path)
    log.debug("removed checkpoint %s", path)


_DATA_FILE = re.compile(r"^(?:data|model)-[0-9a-f]{16}-\d{5,}\.safetensors$")


def is_dckpt_file(name: str) -> bool:
    """Whether a file name is one dckpt writes in a checkpoint folder before its
    manifest: a data file or a save intent. Pure."""
    from ...protocol.intent import INTENT_FILE

    return bool(_DATA_FILE.match(name) or INTENT_FILE.match(name))


def dckpt_leftover(folder: str) -> bool:
    """Whether the local ``folder`` holds dckpt data files or a save intent without a
    manifest: a save that never committed, or one whose manifest was lost (so no
    framework's own checkpoint to hand to its stock load). Local I/O: one listing."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return MANIFEST_NAME not in names and any(is_dckpt_file(n) for n in names)


def fresh_fs(url: str, storage_options: dict | None = None):
    """(file system, path) for ``url`` with its cached listings of ``path`` and its
    parents dropped: fsspec caches listings per process (s3fs's dircache), and a
    checkpoint folder changes under it (this process's own saves, rotation, other
    jobs), so a cached listing would hide new checkpoints or keep removed ones. No I/O."""
    from fsspec.core import url_to_fs

    fs, p = url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache(p.rstrip("/"))
    return fs, p


def kind(path: str, storage_options: dict | None = None) -> str:
    """"dckpt" (a committed dckpt checkpoint), "other" (a file, or a folder holding
    Lightning's ``meta.pt``: a stock checkpoint) or "none" (nothing complete: missing,
    or a dckpt save that never committed). Blocking I/O (a few stats)."""
    if is_url(path):
        fs, p = fresh_fs(path, storage_options)
        p = p.rstrip("/")
        if fs.exists(p + "/" + MANIFEST_NAME):
            return "dckpt"
        return "other" if fs.isfile(p) or fs.exists(p + "/meta.pt") else "none"
    path = local_path(path)
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return "dckpt"
    return "other" if os.path.isfile(path) or os.path.isfile(os.path.join(path, "meta.pt")) \
        else "none"


def durable_name(path: str) -> str:
    """The name a checkpoint is known by: an absolute local path, or the URL without
    a trailing slash. Pure (but for the working directory)."""
    return path.rstrip("/") if is_url(path) else os.path.abspath(local_path(path))


def stamp(path: str, storage_options: dict | None = None) -> list | None:
    """[save id, time on the run's timeline] of the committed dckpt checkpoint at
    ``path`` (its commit time, raised to the ``manager.after`` it records:
    :func:`dckpt.tiers.chooser.timeline_of`; a host whose clock is behind changes no
    order), None when none is committed there. Blocking I/O: reads and parses its manifest. Raises its
    CheckpointError (an unreadable or invalid manifest) or OSError."""
    if kind(path, storage_options) != "dckpt":
        return None
    from ...tiers.chooser import timeline_of

    m = read_manifest(path, storage_options)
    return [m.save_id, timeline_of(m)[0]]


def read_manifest(path: str, storage_options: dict | None = None):
    """The parsed manifest of the committed dckpt checkpoint at ``path``. Blocking
    I/O: one read. Raises its CheckpointError (missing, unreadable or invalid) or
    OSError."""
    from ...format import manifest as mf
    from ...protocol.restore import read_manifest_bytes
    from ...storage.fsspec_storage import make_storage

    storage, root = make_storage(path, storage_options)
    return mf.parse(read_manifest_bytes(storage, root, MANIFEST_NAME), f"{path}/{MANIFEST_NAME}")


def place_agreed(comm, target: str, final: str, staged: bool,
                 adopt: tuple[str, ...] | None = None) -> None:
    """After a commit at ``target``: rank 0 moves it to ``final`` when ``staged``
    (:func:`place`), and every rank raises its error alike. Collective (one small
    all-gather); blocking I/O on rank 0."""
    from ...protocol.collectives import agree

    err = None
    if comm.rank == 0 and staged:
        try:
            place(target, final, adopt)
        except Exception as e:
            err = e
    agree(comm, err, f"move {target} to {final}")


def join(directory: str, name: str) -> str:
    """``directory/name`` for a local path or a URL. Pure."""
    return directory.rstrip("/") + "/" + name if is_url(directory) else os.path.join(
        local_path(directory), name)


def link_target(path: str) -> str | None:
    """The name a symbolic link ``path`` points at (ModelCheckpoint's
    ``save_last="link"``), absolute; None when ``path`` is not a link (or a URL).
    Local I/O: one readlink."""
    if is_url(path):
        return None
    path = local_path(path)
    try:
        target = os.readlink(path)
    except OSError:
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), target))


def modified(path: str, storage_options: dict | None = None) -> float | None:
    """The modification time of ``path`` (a stock checkpoint: its file, or its
    ``meta.pt``, written last), None when unknown. Blocking I/O: a stat."""
    try:
        if is_url(path):
            from fsspec.core import url_to_fs

            fs, p = url_to_fs(path, **(storage_options or {}))
            p = p.rstrip("/")
            p = p if fs.isfile(p) else p + "/meta.pt"
            m = fs.modified(p)
            return m.timestamp() if hasattr(m, "timestamp") else float(m)
        path = local_path(path)
        meta = os.path.join(path, "meta.pt")
        return os.stat(meta if os.path.isdir(path) else path).st_mtime
    except (OSError, NotImplementedError, ValueError):
        return None


def durable_stamp(path: str, found: str, storage_options: dict | None = None) -> list | None:
    """[save id, time] of what ``path`` holds, as :func:`kind` found it: a dckpt
    checkpoint's save id and commit time (:func:`stamp`), a stock checkpoint's
    [None, modification time]; None for nothing complete. Blocking I/O; raises what
    :func:`stamp` raises."""
    if found == "dckpt":
        return stamp(path, storage_options)
    if found == "other":
        t = modified(path, storage_options)
        return None if t is None else [None, t]
    return None


def checkpoints_in(directory: str, storage_options: dict | None = None) -> list[str]:
    """The ``*.ckpt`` names in ``directory`` (not hidden ones: partial and removed
    saves), as durable names. Blocking I/O: one listing; [] when it is missing."""
    if is_url(directory):
        fs, p = fresh_fs(directory, storage_options)
        scheme = directory.split("://", 1)[0]
        try:
            names = fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        return [f"{scheme}://{n.rstrip('/')}" for n in names
                if n.rstrip("/").endswith(".ckpt")
                and not n.rstrip("/").rsplit("/", 1)[-1].startswith(".")]
    directory = os.path.abspath(local_path(directory))
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names
            if n.endswith(".ckpt") and not n.startswith(".")]
