"""The fast tier (:mod:`.tier`) under a framework's checkpoint names, as the Accelerate
and Trainer adapters use it (``local_root=...``).

A save commits in every node's ``local_root`` and returns (asynchronously: after the
snapshot); its copy to the checkpoint's name (Accelerate's ``checkpoint_<i>``, the
Trainer's ``checkpoint-N``) runs in the background, one at a time, and appears there whole (staged
under a hidden sibling and renamed, as a direct save). ``total_limit`` removes the
oldest committed names, durable copy and local slot together, after the new local
commit; the new one counts among those kept. A failing durable store never costs the
fast tier: the copy's failure is logged and the name stays local only (a load reads it
there), and retention never trims a slot whose durable copy is not confirmed.

A load takes, per name, the node-local commit when every rank holds it and it is not
older than the name's durable copy (the same rule as the Lightning strategies), else
the durable copy; when the local one cannot be read (a file damaged or missing on some
node: the objects saved by rank 0 are on rank 0's node only), its durable copy is tried
next, then the names before it.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from ...protocol.collectives import Comm, on_rank0
from ...tiers.chooser import timeline_of
from ...tiers.local import view_name
from . import resolve
from .place import durable_name, remove_whole
from .rotation import UNKNOWN, Committed, commit_order, to_remove
from .slots import job_prefix
from .tier import LocalTier

log = logging.getLogger(__name__)
EXTRAS = ".extras"  # the save hooks' folder beside a slot (see extras_dir)


@dataclass(frozen=True)
class Choice:
    """One way to load a name: ``path`` and the manifest each rank reads (None: the
    durable ``manifest.json``; else this rank's fast-tier view), and the name (what the
    load hooks are given and the iteration is counted from)."""

    name: str
    path: str
    manifest_name: str | None
    created: float

    def shown(self) -> str:
        return f"{self.name} (fast tier)" if self.manifest_name else self.name


def extras_dir(tier: LocalTier, final: str) -> str:
    """The folder beside ``final``'s slot where a framework's save hooks write their
    files (diffusers: ``model.save_pretrained(output_dir + "/unet")``): they travel
    with the durable copy and are what the load hooks read when the fast tier's commit
    is loaded. Pure."""
    return tier.slot(durable_name(final)) + EXTRAS


def prepare_extras(tier: LocalTier, final: str) -> str:
    """Before a save's hooks run: an empty :func:`extras_dir` of ``final`` on every
    node (a copy of the name in flight is waited for first: it may be reading the
    folder), and the folders of names whose slot is gone removed. Collective (a
    broadcast after rank 0's cleaning); local I/O. Returns the folder."""
    comm = Comm()
    final = durable_name(final)
    tier._make_room(final)
    folder = extras_dir(tier, final)
    _sweep_extras(tier, job_prefix(final))

    def clean() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
    on_rank0(comm, clean, f"prepare {folder}")
    os.makedirs(folder, exist_ok=True)  # the other nodes' (their hooks write there)
    return folder


def _sweep_extras(tier: LocalTier, prefix: str) -> None:
    """Remove this job's hook folders (slot names under ``prefix``, the job's
    directory: :func:`.slots.job_prefix`) whose slot no longer exists (retention or
    rotation took it). Another job's on the same local root are never touched (one
    in progress has no slot yet). Local I/O; never raises."""
    try:
        names = set(os.listdir(tier.root))
    except OSError:
        return
    for n in names:
        if n.startswith(prefix) and n.endswith(EXTRAS) and n[:-len(EXTRAS)] not in names:
            shutil.rmtree(os.path.join(tier.root, n), ignore_errors=True)


def check_name(committer: Any, final: str) -> None:
    """Before a fast-tier save of the local name ``final``: what is there may be
    replaced by its copy (else the CheckpointError the copy would only log, on every
    rank now). Collective (a broadcast); a stat on rank 0; object stores: nothing."""
    from .commit import _check_replaceable

    if "://" in final:
        return
    on_rank0(Comm(), lambda: _check_replaceable(durable_name(final)), f"look at {final}")


def save(tier: LocalTier, committer: Any, built: dict, final: str, step: int,
         files: dict[str, str] | None = None, extras: str | None = None) -> str:
    """Commit ``built`` in the fast tier as ``final`` and queue its durable copy: its
    staging folder is planned when the copy begins, and rank 0 writes into it
    ``files`` ({name: text}, e.g. the Trainer's trainer_state.json) and the contents of
    ``extras`` (the save hooks' folder, :func:`prepare_extras`). Returns the durable
    name. Collective; blocking (synchronous: the local commit; asynchronous: the
    snapshot). Raises the local commit's CheckpointError on every rank alike."""
    final = durable_name(final)
    built = committer.stamp(built, Comm().rank)

    def planner() -> list:
        made = committer.decide(final)
        if len(made) > 3 and made[3] is not None:  # the copy's own intent takes over
            os.remove(made[3])
        if made[2]:
            for name, text in (files or {}).items():
                with open(os.path.join(made[1], name), "w", encoding="utf-8") as f:
                    f.write(text)
            if extras is not None and os.path.isdir(extras):
                shutil.copytree(extras, made[1], dirs_exist_ok=True)
        elif extras is not None and os.listdir(extras):
            log.warning("the save hooks' files of %s are not copied to an object store "
                        "(they stay in %s)", final, extras)
        return made[:3]
    tier.save(built, final, step, planner, async_=committer.async_save,
              storage_options=committer.storage_options)
    committer._committed(None)  # on the timeline at the latest now (local commit)
    return final


def rotate(tier: LocalTier, parent: str, pattern: Any, final: str, limit: int,
           opts: dict | None, protect: str | None = None) -> None:
    """``total_limit`` after a fast-tier commit of ``final``: rank 0 lists the
    committed names of ``parent`` (``final`` counted even before its copy lands) and
    every rank queues the removal of the oldest beyond ``limit`` (its local slot part;
    rank 0 the durable copy), after the copies queued before. Collective (a
    broadcast); blocking I/O on rank 0 (a listing, a manifest read per name).
    ``protect``: a name never removed (the Trainer's best checkpoint: kept beside the
    newest ``limit - 1``, as stock)."""
    comm = Comm()
    parent = durable_name(parent)

    def decide() -> list[str]:
        entries = _durable(parent, pattern, opts)
        durable = {c.path for c in entries or []}
        if entries is None:  # the store is down: the limit still bounds the fast tier
            entries = []
        # names committed locally whose copy has not landed yet count by their local
        # commit (else a copy landing after this decision would outlive the limit)
        entries += [c for c in local_commits(tier, parent, pattern) if c.path not in durable]
        if all(c.path != final for c in entries):
            entries.append(Committed(final, UNKNOWN))
        keep = protect is not None and protect != final and any(
            c.path == protect for c in entries)
        pool = [c for c in entries if not (keep and c.path == protect)]
        return to_remove(pool, max(1, limit - int(keep)), final)

    def dropper(p: str) -> Callable[[], None]:
        def drop() -> None:
            remove_whole(p, opts)
            log.info("total_limit=%d: removed %s", limit, p)
        return drop

    for path in on_rank0(comm, decide, f"list {parent}"):
        tier.remove(path, dropper(path) if comm.rank == 0 else None)


class Rotation:
    """``total_limit`` after fast-tier saves (:func:`rotate`): at once after a
    synchronous save; after an asynchronous one, deferred to the adapter's next call
    (:meth:`flush`), once that save's local commit is complete (never before: until
    then the checkpoints it would remove are the newest complete ones). Dropped after a
    failure of the training (nothing removed)."""

    def __init__(self) -> None:
        self._pending: tuple | None = None

    def after_save(self, async_save: bool, *args: Any) -> None:
        """``args`` as :func:`rotate`'s. Collective when it runs now."""
        if async_save:
            self._pending = args
        else:
            rotate(*args)

    def flush(self) -> None:
        """Run the deferred rotation, if any. Collective then; raises the awaited local
        commit's error on every rank."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].wait_local()
            rotate(*pending)


def local_commits(tier: LocalTier, parent: str, pattern: Any) -> list[Committed]:
    """The names of ``parent`` matching ``pattern`` that rank 0's fast tier holds, with
    their local commit time and save id (rank 0's view). Rank 0 only; local I/O."""
    found: dict[str, Committed] = {}

    def accept(view: Any) -> bool:
        owner = str(view.meta.get("owner", ""))
        if pattern.fullmatch(owner.rstrip("/").rsplit("/", 1)[-1]) is None:
            return False
        found[owner] = Committed(owner, timeline_of(view)[0], view.save_id)
        return True

    return [found[n] for n in tier.names_in(parent, 0, accept)]


def choices(tier: LocalTier, names: list[str], durable: dict[str, Committed]) -> list[Choice]:
    """The ways to load ``names`` (every rank's same list), oldest commit first; for a
    name, its durable copy before its local commit (a load tries the local one first).
    Collective: one all-gather (:meth:`LocalTier.held_many`). Local I/O."""
    comm = Comm()
    held = tier.held_many(names, comm)
    out: list[Choice] = []
    for name, h in zip(names, held):
        d = durable.get(name)
        if d is not None and d.save_id:
            tier.seen[name] = d.save_id  # the parent of the next local commit of it
        stamp = None if d is None else [d.save_id, d.created]
        if d is not None:
            out.append(Choice(name, name, None, d.created))
        if h is not None and h.newer_than(stamp):
            out.append(Choice(name, h.slot, view_name(comm.rank),
                              max(h.created, d.created if d is not None else 0.0)))
    return sorted(out, key=lambda c: (c.created, c.manifest_name is not None, c.name))


def candidates(tier: LocalTier, parent: str, pattern: Any,
               opts: dict | None) -> tuple[list[Choice], list[str]]:
    """Every committed ``checkpoint_<i>`` of ``parent``, durable or in this job's fast
    tier, oldest first (:func:`choices`), and every name either holds (a fast-tier
    commit of another world size too: a next name must pass them all). A name in the
    fast tier that cannot be loaded from it and has no durable copy is warned about.
    Waits for the copies queued first. Collective; blocking I/O."""
    comm = Comm()
    tier.drain()
    parent = durable_name(parent)  # as the saves spelled their names (slots hash them)

    def look() -> list:
        durable = _durable(parent, pattern, opts) or []
        local = tier.names_in(parent, comm.rank, lambda v: pattern.fullmatch(
            str(v.meta.get("owner", "")).rstrip("/").rsplit("/", 1)[-1]) is not None)
        return [[[c.path, c.created, c.save_id] for c in durable], local]

    durable, local = on_rank0(comm, look, f"list {parent}")
    by_name = {p: Committed(p, float(t), s) for p, t, s in durable}
    names = [c.path for c in commit_order(list(by_name.values()))]
    names += [n for n in local if n not in by_name]
    got = choices(tier, names, by_name)
    usable = {c.name for c in got}
    lost = [n for n in names if n not in usable]
    if lost and comm.rank == 0:
        log.warning("the fast tier holds %s, but not on every rank or not at this world "
                    "size (%d ranks), and no durable copy exists: not loadable, passed "
                    "over", lost, comm.size)
    return got, names


def one(tier: LocalTier, path: str, opts: dict | None) -> list[Choice]:
    """The ways to load the name ``path`` (durable, fast tier). Collective; blocking."""
    comm = Comm()
    tier.drain()
    name = durable_name(path)

    def look() -> list:
        got = _durable(name.rsplit("/", 1)[0], _exact(name.rsplit("/", 1)[-1]), opts) or []
        return [[c.path, c.created, c.save_id] for c in got if c.path == name]

    found = on_rank0(comm, look, f"look up {path}")
    durable = {p: Committed(p, float(t), s) for p, t, s in found}
    return choices(tier, [name], durable)


def _durable(parent: str, pattern: Any, opts: dict | None) -> list[Committed] | None:
    """:func:`resolve.committed_in`, or None with a warning when the durable store
    cannot be listed (down: the fast tier goes on without it). Blocking I/O."""
    try:
        return resolve.committed_in(parent, pattern, opts)
    except Exception as e:
        log.warning("cannot list %s (%s): going on with the fast tier alone", parent, e)
        return None


def _exact(base: str) -> Any:
    import re

    return re.compile(re.escape(base))
