"""Finding checkpoints under a root, describing them, and removing leftovers (gc).

A root may hold durable checkpoints (``manifest.json``) and fast-tier steps (a
``local_root``'s ``step-<N>/`` with one ``manifest-<rank>.json`` view per rank of this
node, see :mod:`dckpt.catalog_local`): both are listed and measured."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .protocol import intent as _intent
from .protocol.intent import INTENT_FILE, live_save_ids
from .catalog_local import STEP_DIR, is_local_step, read_local_step
from .errors import CheckpointError
from .format import manifest as mf
from .storage.fsspec_storage import FsspecStorage, Upload, make_storage

# gc's names come from the save protocol, which imports torch: imported at gc's first
# use, so that ls, inspect and du (JSON only) do not pay for torch. They are
# re-exported (the manager imports remove_checkpoints from here).
_REFCOUNT = ("ALL_FILES", "manifest_dirs", "references", "references_beside",
             "remove_checkpoints")


def __getattr__(name: str):
    if name in _REFCOUNT:
        from . import refcount

        return getattr(refcount, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

log = logging.getLogger(__name__)
_now = time.time  # gc's clock (tests move it instead of aging files they cannot touch)


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
    from .protocol.manifest_read import read_manifest

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


@dataclass(frozen=True)
class Leftover:
    """A file ``dckpt gc`` would remove: ``path`` as the user wrote the root."""

    path: str
    bytes: int
    age_s: float
    where: str = ""  # the storage path (``path`` is as the user wrote the root)
    upload_id: str = ""  # set for an incomplete multipart upload (S3), not a file


def _leftover_kind(name: str) -> tuple[str, str | None] | None:
    """(kind, save id or None) for dckpt's own file names, None for anything else."""
    from .protocol.coordinator import DATA_FILE, TEMP_MANIFEST

    m = DATA_FILE.match(name)
    if m:
        return "data", m.group(1)
    m = INTENT_FILE.match(name)
    if m:
        return "intent", m.group(1)
    if TEMP_MANIFEST.match(name):
        return "temp", None  # its save is unknown: only a dir with no live save loses it
    return None


def _dir_leftovers(storage, d: str, shown: str, entries, min_age_s: float,
                   now: float, no_time: list[str], referenced: frozenset = frozenset()) -> list[Leftover]:
    """The leftovers among ``entries`` (the listing of ``d``, taken before this reads its
    manifest). Skips the directory when its manifest exists but cannot be read."""
    from .protocol.coordinator import DATA_FILE
    from .refcount import ALL_FILES

    # Read the manifest only after listing: a save removes its intent only once its
    # manifest is committed, so a listing without a save's intent is followed by a
    # manifest that lists that save's files (never neither).
    m, s = _read(storage, d)
    if s is not None and not s.committed:
        log.warning("skipping %s: unreadable manifest (%s)", shown, s.problem)
        return []
    # Its own files, and those a sibling's incremental checkpoint references.
    keep = ({f.name for f in m.files if not f.dir} if m is not None else set()) | referenced
    if ALL_FILES in referenced:
        keep |= {e.name for e in entries if DATA_FILE.match(e.name)}
    live = live_save_ids(entries, now)
    out = []
    for e in entries:
        kind = _leftover_kind(e.name)
        # A link is never a leftover: removing it is not ours to do, and what it points
        # at may be outside the root.
        if kind is None or e.is_dir or e.is_link or e.name in keep:
            continue
        if live and (kind[0] == "temp" or kind[1] in live):
            continue  # a save in progress, whatever min_age_s says
        if e.mtime is None:
            no_time.append(_shown_join(shown, e.name))
            continue
        age = now - e.mtime
        if age >= min_age_s:
            out.append(Leftover(_shown_join(shown, e.name), e.size, age, storage.join(d, e.name)))
    return out


def find_leftovers(root: str, min_age_s: float = 3600.0,
                   storage_options: dict | None = None) -> list[Leftover]:
    """Files that no committed manifest references, left by failed or interrupted
    saves, at ``root`` and in its direct subdirectories (never through a link): only
    dckpt's own names (``data-<id>-<rank>.safetensors``, temp manifests, save intents
    whose lease ran out), older than ``min_age_s``, and never a file of a save whose
    intent is live. ``root`` may be a root of checkpoints or one checkpoint directory:
    a file is referenced when any manifest that can point at it names it, i.e. that of
    its own directory or of any sibling of that directory (incremental saves reference
    their siblings, and a checkpoint overwritten with a base may reference its own old
    files), so the files at ``root`` itself are checked against every manifest beside
    ``root`` in its parent too, links to directories included. A file whose backend
    reports no modification time is never a leftover (logged). On S3, also the
    incomplete multipart uploads of dckpt's names there (a killed save's half-sent
    file: invisible, but billed), under the same rules and started longer ago than the
    save lease (``upload_id`` set). I/O: one listing and one manifest read per
    directory, one listing of the uploads (S3); when ``root`` itself holds data files,
    one listing of its parent and one manifest read per directory there. Raises
    CheckpointError when ``root`` does not exist or is not a directory, or naming the
    object when the storage fails."""
    try:
        return _find_leftovers(root, min_age_s, storage_options)
    except OSError as e:
        raise CheckpointError(f"looking for leftovers under {root} failed: {e}") from e


def _find_leftovers(root: str, min_age_s: float, storage_options: dict | None) -> list[Leftover]:
    from .refcount import manifest_dirs, references, references_beside

    storage, base, shown = _open_root(root, storage_options, uploads_only=True)
    top = storage.listdir(base)
    now = _now()
    out: list[Leftover] = []
    no_time: list[str] = []
    listed = {base: top}
    out += _dir_leftovers(storage, base, shown, top, min_age_s, now, no_time,
                          references_beside(storage, base, top))
    subdirs = []
    for e in sorted(top, key=lambda e: e.name):
        if e.is_dir and not e.is_link:
            d = storage.join(base, e.name)
            try:
                listed[d] = storage.listdir(d)
            except FileNotFoundError:
                continue  # removed since the listing of the root
            subdirs.append((e.name, d))
    # Every manifest that can reference into a subdirectory: its siblings' and its own
    # (an overwrite with a base can reference its own old files), links included.
    listed_dirs = {d for _, d in subdirs}
    refs = references(storage, [d for _, d in subdirs] + [
        d for d in manifest_dirs(storage, base, [e for e in top if e.is_link])
        if d not in listed_dirs])
    for name, d in subdirs:
        out += _dir_leftovers(storage, d, _shown_join(shown, name), listed[d],
                              min_age_s, now, no_time, frozenset(refs.get(name, ())))
    out += _upload_leftovers(storage, base, shown, listed, min_age_s, now, no_time)
    if no_time:
        log.warning("kept %d file(s) whose storage reports no modification time (their age "
                    "is unknown, so they may belong to a save in progress), e.g. %s",
                    len(no_time), no_time[0])
    return out


def _upload_leftovers(storage, base: str, shown: str, listed: dict, min_age_s: float,
                      now: float, no_time: list[str]) -> list[Leftover]:
    """The incomplete multipart uploads under ``base`` that gc may abort: the key is one
    of dckpt's names at ``base`` or in a direct subdirectory, no live save lease in that
    directory claims it, and it started more than max(``min_age_s``, the lease) ago.

    The uploads are listed after the directories (``listed``): an upload of a save
    whose lease was not in those listings began after them (a save takes its lease
    before it writes anything), so it is younger than the lease and stays, even when
    gc's clock and the store's differ by up to a lease."""
    uploads = _uploads_or_none(storage, base, shown)
    if not uploads:
        return []
    out = []
    floor = max(min_age_s, _intent.LEASE_S)
    live_by_dir: dict[str, set[str]] = {}
    prefix = base.rstrip("/") + "/"
    for up in uploads:
        if not up.path.startswith(prefix):
            continue
        rel = up.path[len(prefix):].split("/")
        if len(rel) > 2 or not all(rel):
            continue  # deeper than gc looks, or not a plain key
        name = rel[-1]
        d = base if len(rel) == 1 else storage.join(base, rel[0])
        kind = _leftover_kind(name) or (("temp", None) if name == mf.MANIFEST_NAME else None)
        if kind is None or kind[0] == "intent":
            continue  # not dckpt's, or never uploaded in parts
        if d not in live_by_dir:
            live_by_dir[d] = live_save_ids(listed.get(d, []), now)
        live = live_by_dir[d]
        if live and (kind[1] is None or kind[1] in live):
            continue  # a save in progress, whatever min_age_s says
        where = shown if len(rel) == 1 else _shown_join(shown, rel[0])
        path = _shown_join(where, name)
        if up.initiated is None:
            no_time.append(path)
            continue
        age = now - up.initiated
        if age >= floor:
            out.append(Leftover(path, up.size, age, up.path, up.upload_id))
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


def collect_garbage(root: str, *, dry_run: bool = False, min_age_s: float = 3600.0,
                    storage_options: dict | None = None) -> list[Leftover]:
    """Remove (or with ``dry_run`` only list) :func:`find_leftovers`: files are deleted,
    incomplete uploads aborted. Returns them. One that cannot be removed is logged and
    skipped. Raises as find_leftovers."""
    storage, _ = make_storage(root, storage_options)  # no I/O: the same kind of storage
    found = find_leftovers(root, min_age_s, storage_options)
    if not dry_run:
        for lo in found:
            try:
                if lo.upload_id:
                    storage.abort_upload(Upload(lo.where, lo.upload_id, None, lo.bytes))
                else:
                    storage.remove(lo.where)
            except OSError as e:
                log.warning("could not remove %s: %s", lo.path, e)
    return found


@dataclass(frozen=True)
class Usage:
    """One checkpoint's bytes: its own files, and the files of siblings it references."""

    path: str
    own: int
    referenced: int


def disk_usage(root: str, storage_options: dict | None = None) -> tuple[list[Usage], int]:
    """(per committed checkpoint under ``root``: bytes owned and bytes referenced in
    siblings; total bytes of every file under ``root`` and its direct subdirectories,
    each counted once). One listing and one manifest read per directory; a fast-tier
    step counts the files of the ranks whose view is here as its own (it references
    nothing). Raises CheckpointError as :func:`list_checkpoints`."""
    try:
        storage, base, shown = _open_root(root, storage_options)
        total, out = 0, []
        dirs = [(base, shown)] + [(storage.join(base, e.name), _shown_join(shown, e.name))
                                  for e in sorted(storage.listdir(base), key=lambda e: e.name)
                                  if e.is_dir and not e.is_link]
        for d, sh in dirs:
            names = {e.name: e.size for e in storage.listdir(d) if not e.is_dir}
            total += sum(names.values())
            m, _ = _read(storage, d)
            if m is not None:
                out.append(Usage(sh, m.total_bytes, m.referenced_bytes))
            elif is_local_step(names):
                out.append(Usage(sh, read_local_step(storage, d, sh, names).bytes, 0))
        return out, total
    except OSError as e:
        raise CheckpointError(f"measuring {root} failed: {e}") from e
