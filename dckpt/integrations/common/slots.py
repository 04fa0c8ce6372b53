"""The Lightning/Fabric fast tier's slots on one node: which job a slot belongs to (a
hash of the directory its checkpoint name lives in), what a rank holds (its view of a
slot), and retention (:func:`cleanup`: only this job's slots; never one whose only
copy is local). Rank-local file I/O; no collective.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import CheckpointError
from ...format import manifest as mf
from ...protocol.collectives import Comm
from ...protocol.restore import MAX_MANIFEST
from ...tiers import local as tlocal
from ...tiers.chooser import timeline_of
from .place import stamp

log = logging.getLogger(__name__)
# ``tier`` arguments below are a tier.LocalTier (not imported: it imports
# this module).
SLOT_PREFIX = "lightning-"
PARENT_KEY = "__dckpt_parent__"  # a value of rank 0's local commits (see Held.parent)


def job_prefix(final: str) -> str:
    """``lightning-<12 hex>-``: the slot prefix of the job saving ``final`` (a hash of
    the directory ``final`` lives in). Pure."""
    parent = final.rstrip("/").rsplit("/", 1)[0]
    return f"{SLOT_PREFIX}{hashlib.sha256(parent.encode()).hexdigest()[:12]}-"


@dataclass(frozen=True)
class Held:
    """A local commit every rank holds: the slot, its global save id and time, and
    ``parent``: the save id the name's durable copy had when this commit was made, as
    the saving process knew it (None: it did not know)."""

    slot: str
    save_id: str
    created: float
    parent: str | None = None

    def newer_than(self, durable: list | None) -> bool:
        """Whether this commit is the one to load rather than the durable copy
        ``durable`` ([save id, commit time]; [None, modification time] for a stock
        checkpoint; None: nothing complete). Pure. The durable copy is this
        commit's own, or the one this commit was saved over (its parent): the local one
        is as new or newer. The durable copy is another: someone saved the name since
        (a run on other nodes), so it wins, whatever the two hosts' clocks say. Only a
        commit whose parent was not known falls back to comparing commit times."""
        if durable is None or durable[0] == self.save_id:
            return True
        if self.parent is not None:
            return durable[0] == self.parent
        return self.created > durable[1]


def _parent(view: Any) -> str | None:
    """The durable save id a local commit was made over (see :class:`Held`)."""
    parent = view.values.get(PARENT_KEY)
    return parent if isinstance(parent, str) else None


def mine(storage, slot: str, final: str, comm: Comm) -> list | None:
    """[save id, commit time, parent] of this rank's usable view of ``final``'s
    ``slot`` (it records ``final``, this world size, this rank's files at their
    sizes), or None. Local I/O; never raises."""
    try:
        path = storage.join(slot, tlocal.view_name(comm.rank))
        try:
            raw = storage.read_file(path, MAX_MANIFEST)
        except FileNotFoundError:
            raise
        except OSError as e:  # once more: a transient error must not hide the commit
            log.warning("rank %d: reading %s failed (%s): trying once more", comm.rank,
                        path, e)
            raw = storage.read_file(path, MAX_MANIFEST)
        view = mf.parse(raw, path)
        sizes = {x.name: x.size for x in storage.listdir(slot)}
        if view.meta.get("owner") != final:
            return None
        if view.world_size != comm.size:
            # a commit of another world size: its views and files are laid out per rank
            # of that world, this one cannot read it; never skipped in silence
            log.warning("rank %d: the fast tier holds a commit of %s saved at %d ranks "
                        "(save %s); this run has %d, so it is not read: the durable "
                        "copy is loaded instead, which is older if that commit was never "
                        "copied", comm.rank, final, view.world_size, view.save_id,
                        comm.size)
            return None
        if all(sizes.get(f.name) == f.size for f in view.files if f.rank == comm.rank):
            return [view.save_id, timeline_of(view)[0], _parent(view)]
    except FileNotFoundError:
        pass
    except (OSError, CheckpointError) as e:
        log.warning("rank %d: the fast tier's copy of %s is not usable: %s", comm.rank,
                    final, e)
    return None


def names_in(storage, root: str, slot_of: Callable[[str], str], directory: str,
             rank: int, accept: Callable[[Any], bool] | None = None) -> list[str]:
    """The durable names of the slots of ``directory`` (in the fast tier ``root``,
    ``slot_of`` naming a name's slot) this rank holds a view of (their views'
    ``owner``), those whose view ``accept`` accepts when given. Local I/O: a listing
    and a small read per slot; never raises (an unreadable slot is skipped)."""
    prefix = job_prefix(directory.rstrip("/") + "/x")
    out = []
    try:
        entries = storage.listdir(root)
    except OSError:
        return out
    for e in entries:
        if not (e.is_dir and e.name.startswith(prefix)):
            continue
        path = storage.join(root, e.name, tlocal.view_name(rank))
        try:
            view = mf.parse(storage.read_file(path, MAX_MANIFEST), path)
        except (OSError, CheckpointError):
            continue
        owner = view.meta.get("owner")
        if isinstance(owner, str) and slot_of(owner) == storage.join(root, e.name) and (
                accept is None or accept(view)):
            out.append(owner)
    return sorted(out)


def cleanup(tier: Any, rank: int) -> None:
    """Remove this rank's part of ``tier``'s job's slots beyond ``keep`` (by commit time) whose
    durable copy is in place, and of its slots without this rank's view, except
    those being written or queued. Another job's slots (another directory's
    prefix) are never looked at. No collective; never raises. I/O: a listing, a
    view per slot, and for a slot beyond ``keep`` its durable name's manifest."""
    try:
        with tier._lock:
            protected = set(tier._busy) | {tier.slot(j.final) for j in tier._jobs}
            owned = tuple(sorted(tier._owned))
        if not owned:
            return
        held, partial = [], []
        for e in tier.storage.listdir(tier.root):
            if not (e.is_dir and e.name.startswith(owned)):
                continue
            d = tier.storage.join(tier.root, e.name)
            if d in protected:
                continue
            try:
                view = mf.parse(tier.storage.read_file(
                    tier.storage.join(d, tlocal.view_name(rank)), MAX_MANIFEST), d)
                held.append((timeline_of(view)[0], d, view))
            except FileNotFoundError:
                partial.append(d)
            except (OSError, CheckpointError) as err:
                log.info("rank %d: fast-tier slot %s is not usable (%s): removed",
                         rank, d, err)
                partial.append(d)
        keep = tier.keep - len({d for d in protected if tier.storage.exists(d)})
        held.sort(key=lambda x: x[0], reverse=True)
        beyond = [d for _, d, view in held[max(0, keep):] if copied(tier, view, rank)]
        for d in partial + beyond:
            # Decided again under the lock a save marks its slot busy with (before it
            # makes the directory): a save begun since ``protected`` was read would
            # otherwise look like a dead partial slot and lose its files mid-write.
            with tier._lock:
                if d in tier._busy or d in {tier.slot(j.final) for j in tier._jobs}:
                    continue
                tlocal.drop_step(tier.storage, d, rank)
    except Exception as e:
        log.warning("rank %d: fast-tier cleanup skipped: %s", rank, e)


def copied(tier: Any, view: Any, rank: int) -> bool:
    """Whether the durable name of the local commit ``view`` holds that save or one
    made after it, so the local copy may go. False when the store cannot tell (down,
    or the name holds nothing): the local copy is then the only one. Blocking I/O:
    the name's manifest."""
    owner = view.meta.get("owner")
    if not isinstance(owner, str):
        return True  # not a slot this strategy wrote: nothing of a name to keep
    try:
        durable = stamp(owner, tier.storage_options)
    except Exception as e:
        durable, why = None, f"its durable copy cannot be read ({e})"
    else:
        why = "it has no durable copy yet"
    # the same rule as a load's choice (Held.newer_than): the durable copy is this save,
    # or one saved since over it (a durable id other than the recorded parent); commit
    # times of two hosts are compared only for a commit without a parent
    if durable is not None and (durable[0] == view.save_id or not Held(
            "", view.save_id, timeline_of(view)[0], _parent(view)).newer_than(durable)):
        return True
    if owner not in tier._kept:
        tier._kept.add(owner)
        log.warning("rank %d: the fast-tier copy of %s is kept beyond keep_last_local: "
                    "%s, so it is the only copy", rank, owner, why)
    return False
