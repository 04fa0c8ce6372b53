"""Finding checkpoints under a root, describing them and measuring them; gc lives in
:mod:`dckpt.catalog.gc` (re-exported here).

A root may hold durable checkpoints (``manifest.json``) and fast-tier steps (a
``local_root``'s ``step-<N>/`` with one ``manifest-<rank>.json`` view per rank of this
node, and ``peers/step-<N>/`` with the parts other nodes replicated here, see
:mod:`dckpt.catalog.local`): both are listed and measured."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from .local import PEERS, STEP_DIR, is_local_step, read_local_step
from ..errors import CheckpointError, NotCommittedError
from ..format import manifest as mf
from ..storage.fsspec_storage import FsspecStorage, Upload, make_storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointSummary:
    path: str  # as the user wrote the root (an fsspec URL keeps its scheme), so it loads
    committed: bool
    bytes: int
    files: int
    tensors: int
    world_size: int
    created: float
    problem: str = ""
    tier: str = "durable"  # or "local": a fast-tier step (committed: complete on this node)
    views: tuple[int, ...] = ()  # a fast-tier step's ranks whose view is here


def _shown_root(root: str, storage, base: str) -> str:
    """The root as paths are shown to the user: the user's own URL for fsspec (the
    storage path has lost its scheme: ``memory://b/x`` is ``/b/x`` there and would not
    load), the absolute path for local files."""
    if isinstance(storage, FsspecStorage):
        return root if root.endswith("://") else root.rstrip("/")
    return base


def _open_root(root: str, storage_options: dict | None, uploads_only: bool = False):
    """(storage, storage path, shown root) for a root that must be a directory. One or
    two metadata calls. Raises CheckpointError (missing, not a directory). With
    ``uploads_only``, an object-store prefix that holds no object but incomplete uploads
    (a killed save's, once the rest is gone) counts as an (empty) directory."""
    storage, base = make_storage(root, storage_options)
    if not storage.exists(base):
        if uploads_only and _uploads_or_none(storage, base, root):
            return storage, base, _shown_root(root, storage, base)
        raise CheckpointError(f"no such path: {root}")
    if not storage.is_dir(base):
        raise CheckpointError(f"{root} is not a directory")
    return storage, base, _shown_root(root, storage, base)


def _shown_join(shown: str, name: str) -> str:
    return shown + name if shown.endswith("://") else f"{shown}/{name}"


def _read(storage, path: str, shown: str | None = None):
    """(manifest or None, summary or None): None, None when ``path`` has no manifest."""
    from ..protocol.manifest_read import read_manifest

    try:
        m, _ = read_manifest(storage, path)
    except CheckpointError as e:
        if storage.exists(storage.join(path, mf.MANIFEST_NAME)):
            return None, CheckpointSummary(shown or path, False, 0, 0, 0, 0, 0.0, str(e))
        return None, None
    return m, CheckpointSummary(shown or path, True, m.total_bytes, len(m.files), len(m.tensors),
                                m.world_size, m.created)


def _summary(storage, path: str, shown: str) -> CheckpointSummary | None:
    """A durable checkpoint's summary, else a fast-tier step's (one more listing), else
    None."""
    s = _read(storage, path, shown)[1]
    if s is not None:
        return s
    try:
        names = {e.name: e.size for e in storage.listdir(path) if not e.is_dir}
    except FileNotFoundError:
        return None  # removed since the listing of its parent
    return _local_summary(storage, path, shown, names) if is_local_step(names) else None


def _local_summary(storage, path: str, shown: str, names: dict) -> CheckpointSummary:
    st = read_local_step(storage, path, shown, names)
    m = st.first
    return CheckpointSummary(shown, st.complete, st.bytes, st.files,
                             len(m.tensors) if m else 0, st.world_size,
                             m.created if m else 0.0, "" if st.complete else st.state(),
                             "local", tuple(sorted(st.views)))


def _step_order(name: str) -> tuple:
    m = STEP_DIR.match(name)
    return (0, int(m.group(1)), name) if m else (1, 0, name)


def expect_checkpoint(storage, base: str, given: str) -> str | None:
    """Say what is at ``base`` (typed as ``given``) when it holds no ``manifest.json``:
    returns ``"local"`` for a fast-tier step (its rank views), None for a directory that
    holds neither (a save that did not finish: the caller keeps its own message).
    Raises CheckpointError "no such path: X" when nothing is there, "X is a file, not
    a checkpoint directory", or, for a root of checkpoints, "X is a root holding
    step-10 ... step-40 (4 checkpoints): name one of them". I/O: one listing, plus one
    listing per subdirectory (only on this error path)."""
    if not storage.exists(base):
        raise CheckpointError(f"no such path: {given}")
    if not storage.is_dir(base):
        raise CheckpointError(f"{given} is a file, not a checkpoint directory")
    entries = storage.listdir(base)
    if is_local_step([e.name for e in entries if not e.is_dir]):
        return "local"
    held = []
    for e in entries:
        if not e.is_dir:
            continue
        try:
            names = [x.name for x in storage.listdir(storage.join(base, e.name)) if not x.is_dir]
        except OSError:
            continue
        if mf.MANIFEST_NAME in names or is_local_step(names):
            held.append(e.name)
    if not held:
        return None
    held.sort(key=_step_order)
    what = ", ".join(held) if len(held) <= 2 else f"{held[0]} ... {held[-1]}"
    n = f"{len(held)} checkpoint" + ("s" if len(held) > 1 else "")
    raise CheckpointError(f"{given} is a root holding {what} ({n}): name one of them")


LOCAL_STEP_HINT = ("is a fast-tier step (rank views manifest-<rank>.json, no "
                   "manifest.json): {what} a durable checkpoint; use its durable copy, or "
                   "restore this step with CheckpointManager (dckpt inspect and dckpt "
                   "verify read it as it is)")


def not_a_checkpoint(storage, base: str, given: str, err: Exception,
                     what: str = "dckpt.open and dckpt diff read") -> CheckpointError:
    """The error to raise when reading ``base`` (typed as ``given``) as one committed
    checkpoint failed with ``err`` (NotCommittedError: no manifest.json; or
    NotADirectoryError: ``base`` or a parent is a file): a NotCommittedError saying
    what is there, as :func:`expect_checkpoint` words it (a file, a root naming its
    checkpoints, a fast-tier step), else ``err`` itself (a save that did not finish,
    nothing there) or "no such path". Never raises. I/O: what expect_checkpoint does,
    on this error path only."""
    try:
        if expect_checkpoint(storage, base, given) == "local":
            return NotCommittedError(f"{given} " + LOCAL_STEP_HINT.format(what=what))
    except CheckpointError as e:
        if isinstance(err, NotCommittedError) and str(e).startswith("no such path"):
            return err  # nothing there: the words dckpt.load uses
        return NotCommittedError(str(e))
    except OSError:
        pass  # the listing failed: the original error says as much as we know
    if isinstance(err, CheckpointError):
        return err
    return NotCommittedError(f"{given} holds no committed checkpoint ({err})")


def list_checkpoints(root: str, storage_options: dict | None = None) -> list[CheckpointSummary]:
    """Committed checkpoints at ``root`` and in its direct subdirectories, sorted by
    path (``root`` as given, so an fsspec URL keeps its scheme), and fast-tier steps
    (``tier="local"``, complete on this node or not: ``problem`` says what is missing).
    One listing plus one manifest read per subdirectory (one more listing and a read
    per view where there is no manifest.json); no data file is read; links are not
    followed.
    Raises CheckpointError when ``root`` does not exist or is not a directory, or naming
    the object when the storage fails."""
    try:
        return _list_checkpoints(root, storage_options)
    except OSError as e:
        raise CheckpointError(f"listing {root} failed: {e}") from e


def _list_checkpoints(root: str, storage_options: dict | None) -> list[CheckpointSummary]:
    storage, base, shown = _open_root(root, storage_options)
    out = []
    own = _summary(storage, base, shown)
    if own:
        out.append(own)
    for e in sorted(storage.listdir(base), key=lambda e: e.name):
        if e.is_dir:
            s = _summary(storage, storage.join(base, e.name), _shown_join(shown, e.name))
            if s:
                out.append(s)
    return out


def _uploads_or_none(storage, base: str, shown: str) -> list[Upload]:
    """The incomplete uploads under ``base`` (only object stores have any), or none when
    they cannot be listed (a role without s3:ListBucketMultipartUploads): leaving them
    is always safe, so that is a warning, not a failed gc."""
    lister = getattr(storage, "incomplete_uploads", None)
    if lister is None:
        return []
    try:
        return lister(base)
    except OSError as e:
        log.warning("incomplete uploads under %s are left alone: %s", shown, e)
        return []


@dataclass(frozen=True)
class Usage:
    """One checkpoint's bytes: its own files, and the files of siblings it references.
    ``replica``: a step of a fast tier's ``peers/`` (parts other nodes replicated
    here), not a checkpoint of this node."""

    path: str
    own: int
    referenced: int
    replica: bool = False


def _measured(storage, base: str, shown: str) -> list[tuple[str, str, bool, list]]:
    """(directory, shown path, replica?, its listing) for ``base``, its direct
    subdirectories, and the ``step-<N>`` directories of a ``peers/`` among those: a
    fast tier keeps its replicas two levels down (``base`` may be that ``peers/``
    too). One listing per directory; links are not followed."""
    def below(d: str, sh: str, entries, replica: bool) -> list:
        return [(storage.join(d, e.name), _shown_join(sh, e.name), replica,
                 sorted(storage.listdir(storage.join(d, e.name)), key=lambda x: x.name))
                for e in entries if e.is_dir and not e.is_link
                and (not replica or STEP_DIR.match(e.name))]

    def is_peers(d: str) -> bool:
        return d.rstrip("/").rpartition("/")[2] == PEERS

    top = sorted(storage.listdir(base), key=lambda e: e.name)
    out = [(base, shown, False, top)] + below(base, shown, top, is_peers(base))
    for d, sh, replica, entries in list(out[1:]):
        if is_peers(d) and not replica:
            out += below(d, sh, entries, True)
    return out


def disk_usage(root: str, storage_options: dict | None = None) -> tuple[list[Usage], int]:
    """(per committed checkpoint under ``root``: bytes owned and bytes referenced in
    siblings; total bytes of every file under ``root`` and its direct subdirectories,
    each counted once). A fast-tier step counts the files of the ranks whose view is
    here as its own (it references nothing); in a ``local_root`` (or its ``peers/``)
    each replicated ``peers/step-<N>`` is measured too (a ``replica`` row), and the
    total counts its files and the views in transit under it (``.incoming``). One
    listing and one manifest read per directory (a view read per rank view). Raises
    CheckpointError as :func:`list_checkpoints`."""
    try:
        storage, base, shown = _open_root(root, storage_options)
        total, out = 0, []
        for d, sh, replica, entries in _measured(storage, base, shown):
            names = {e.name: e.size for e in entries if not e.is_dir}
            total += sum(names.values())
            if replica:  # views in transit (.incoming): one level further down
                total += sum(x.size for e in entries if e.is_dir and not e.is_link
                             for x in storage.listdir(storage.join(d, e.name)) if not x.is_dir)
                if is_local_step(names):
                    out.append(Usage(sh, read_local_step(storage, d, sh, names).bytes, 0, True))
                continue
            m, _ = _read(storage, d)
            if m is not None:
                out.append(Usage(sh, m.total_bytes, m.referenced_bytes))
            elif is_local_step(names):
                out.append(Usage(sh, read_local_step(storage, d, sh, names).bytes, 0))
        return out, total
    except OSError as e:
        raise CheckpointError(f"measuring {root} failed: {e}") from e
