"""``dckpt gc``: find and remove the leftovers of failed saves under a root.

What it may delete: dckpt's own file names, inside the root or a direct subdirectory,
old enough, that no committed manifest able to point at them references, of no save in
progress (a live intent). What it never touches: links, anything outside, and a fast
tier's ``local_root`` (rank views, ``peers/`` replicas, ``.dckpt/`` leases): its saves
and replications leave no intent file, so no file there can be told from one being
written; gc refuses it, and the CheckpointManager that uses it cleans it itself.

gc's clock is this module's ``_now`` (tests move it instead of aging files they cannot
touch); the manifest read is :mod:`dckpt.catalog.listing`'s ``_read``, looked up at
each call (tests replace it there)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from . import listing as _cat
from .listing import _open_root, _shown_join, _uploads_or_none
from .local import PEERS, STEP_DIR, is_local_step
from ..errors import CheckpointError
from ..format import manifest as mf
from ..protocol import intent as _intent
from ..protocol.intent import INTENT_FILE, live_save_ids
from ..storage.fsspec_storage import Upload, make_storage
from ..tiers.identity import META_DIR

log = logging.getLogger(__name__)
_now = time.time  # gc's clock (tests move it instead of aging files they cannot touch)


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
    from ..format.filenames import DATA_FILE, TEMP_MANIFEST

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
    from ..format.filenames import DATA_FILE
    from ..protocol.refcount import ALL_FILES

    # Read the manifest only after listing: a save removes its intent only once its
    # manifest is committed, so a listing without a save's intent is followed by a
    # manifest that lists that save's files (never neither).
    m, s = _cat._read(storage, d)
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
    CheckpointError when ``root`` does not exist or is not a directory, when it is (in)
    a fast tier's ``local_root`` (see :func:`fast_tier`: nothing is deleted there), or
    naming the object when the storage fails."""
    try:
        return _find_leftovers(root, min_age_s, storage_options)
    except OSError as e:
        raise CheckpointError(f"looking for leftovers under {root} failed: {e}") from e


def _find_leftovers(root: str, min_age_s: float, storage_options: dict | None) -> list[Leftover]:
    from ..protocol.refcount import manifest_dirs, references, references_beside

    storage, base, shown = _open_root(root, storage_options, uploads_only=True)
    top = storage.listdir(base)
    now = _now()
    out: list[Leftover] = []
    no_time: list[str] = []
    listed = {base: top}
    subdirs = []
    for e in sorted(top, key=lambda e: e.name):
        if e.is_dir and not e.is_link:
            d = storage.join(base, e.name)
            try:
                listed[d] = storage.listdir(d)
            except FileNotFoundError:
                continue  # removed since the listing of the root
            subdirs.append((e.name, d))
    why = fast_tier(storage, base, listed)
    if why:
        raise CheckpointError(
            f"{root} is {why}: dckpt gc deletes nothing there. A fast tier's saves and "
            "replications leave no intent gc could honour, so their files in progress "
            "cannot be told from leftovers; the CheckpointManager using this local_root "
            "removes its own failed saves, old steps and replicas. To reclaim a job's "
            "fast tier once the job is over, remove the directory")
    out += _dir_leftovers(storage, base, shown, top, min_age_s, now, no_time,
                          references_beside(storage, base, top))
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


def _base(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2]


def _files(entries) -> list[str]:
    return [e.name for e in entries if not e.is_dir]


def _is_peers(name: str, entries) -> bool:
    """Whether a directory ``name`` listed as ``entries`` is a fast tier's replica
    directory: ``peers/`` holding ``step-<N>/`` directories. Pure."""
    return name == PEERS and any(e.is_dir and STEP_DIR.match(e.name) for e in entries)


def fast_tier(storage, base: str, listed: dict) -> str | None:
    """Why ``base`` is, or is inside, a fast tier's ``local_root`` (words that complete
    "ROOT is ..."), or None. ``listed``: {directory: listing} of ``base`` and its direct
    subdirectories. Recognised: a step with rank views; ``peers/`` or a step under it;
    a root holding either, or the tier's ``.dckpt/`` (its jobs' leases: there from the
    first save on); a ``step-<N>`` with data files but no manifest.json nor view (a
    local save before its views, or a replica before its view arrives) beside any of
    those. I/O only in that last case: one listing of the parent and one per sibling
    named ``step-<N>`` or ``peers``. OSError from the storage
    propagates, except where a parent cannot be listed (None: the references check
    that follows then keeps every data file anyway)."""
    from ..format.filenames import DATA_FILE

    top, name = listed[base], _base(base)
    if is_local_step(_files(top)):
        return "a fast-tier step (rank views manifest-<rank>.json)"
    if _is_peers(name, top):
        return "a fast tier's replica directory (peers/)"
    for e in top:
        if e.is_dir and e.name == META_DIR:  # before any step has a view: the first save
            return f"a fast tier's local_root ({META_DIR}/ holds its jobs' leases)"
        sub = listed.get(storage.join(base, e.name))
        if sub is not None and is_local_step(_files(sub)):
            return f"a fast tier's local_root ({e.name} holds rank views)"
        if sub is not None and _is_peers(e.name, sub):
            return f"a fast tier's local_root ({e.name}/ holds replicas)"
    files = _files(top)
    if not STEP_DIR.match(name) or mf.MANIFEST_NAME in files or \
            not any(DATA_FILE.match(n) for n in files):
        return None
    parent = base.rstrip("/").rpartition("/")[0]
    if _base(parent) == PEERS:
        return "a step of a fast tier's replica directory (peers/)"
    try:
        siblings = storage.listdir(parent) if parent else []
    except OSError:
        return None
    for e in siblings:
        if e.is_dir and e.name == META_DIR:
            return f"a step of a fast tier's local_root ({META_DIR}/ beside it)"
        if not e.is_dir or e.is_link or e.name == name or not (
                e.name == PEERS or STEP_DIR.match(e.name)):
            continue
        try:
            sub = storage.listdir(storage.join(parent, e.name))
        except OSError:
            continue
        if is_local_step(_files(sub)) or _is_peers(e.name, sub):
            return f"a step of a fast tier's local_root ({e.name} beside it is the fast tier's)"
    return None
