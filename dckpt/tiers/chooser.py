"""The restore chooser: which local steps every rank can serve from its own node, and in
which order a restore tries the steps of both tiers.

A local checkpoint is useless unless every rank holds its part, so the choice is a
collective, never a listing: each rank reports the steps it holds (with their save ids
and commit times, see :func:`dckpt.tiers.local.own_steps`), and all take the steps that
every rank holds from the same save. The rules themselves are pure
(:func:`common_steps`, :func:`live_timeline`).

Commit order, not step numbers, decides across tiers: a rewound job (``restore(step=50)``
then saves of 60, 70, ...) leaves steps above 50 committed before 60 was, in either tier.
Every checkpoint carries its commit time (the global manifest's ``created``, rank 0's
clock at the local commit; a staged durable copy keeps it), so the steps of both tiers
line up on one timeline.

The timeline is explicit too, so that neither a deletion that did not happen nor a
clock that differs between the hosts of two restarts can bring an abandoned step back.
A manager's commit records (as the values ``manager.parent`` and ``manager.after``,
see :func:`timeline_of`) the save id of the commit it continues (the one it restored,
then each one it committed) and the newest commit time it had seen when it restored:
its commits order after everything it saw, whatever its host's clock says. A restore
then follows the newest commit's ancestry (:func:`live_timeline`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

from ..format import manifest as mf
from ..errors import (CheckpointError, CommunicationError, StateMismatchError,
                      UnsupportedValueError)
from ..protocol.collectives import Comm


PARENT, AFTER = mf.PARENT_VALUE, mf.AFTER_VALUE  # the manifest values of the timeline


@dataclass(frozen=True)
class Held:
    """A local step this rank holds: its save id, its time on the timeline (Unix
    seconds, see :func:`timeline_of`) and the save id of the commit it continues."""

    save_id: str
    created: float
    parent: str | None = None


@dataclass(frozen=True)
class Candidate:
    """A committed step of one tier (``"local"``, ``"peer"`` or ``"durable"``), its time
    on the timeline (None: unknown, e.g. an unreadable manifest; such a step is tried in
    its turn), its save id and the save id of the commit it continues (None: unknown)."""

    step: int
    tier: str
    created: float | None
    save_id: str | None = None
    parent: str | None = None


def timeline_of(m: Any) -> tuple[float, str | None]:
    """(time on the timeline, parent save id) of a manifest: its commit time, raised to
    the ``manager.after`` it records (the newest commit the saving manager had seen:
    a host whose clock is behind still orders its commits after those), and the
    ``manager.parent`` it records (None: not saved by a manager that knew it). Pure;
    values of the wrong type are ignored (the manifest's own ``created`` stands)."""
    t = float(m.created)
    after = m.values.get(AFTER)
    if type(after) in (int, float) and math.isfinite(after):
        t = max(t, float(after))
    parent = m.values.get(PARENT)
    return t, parent if isinstance(parent, str) and parent else None


def common_steps(views: list[Mapping[int, Hashable]]) -> list[int]:
    """The steps present in every view with one value (a save id), ascending. Pure:
    O(total entries). A step two ranks hold from different saves (a save that crashed
    between their commits, or a node that kept an older copy) is not common."""
    if not views:
        return []
    steps = set(views[0])
    for v in views[1:]:
        steps &= set(v)
    return sorted(s for s in steps if len({v[s] for v in views}) == 1)


def agree_local_steps(comm: Comm, mine: Mapping[int, Held]) -> dict[int, Held]:
    """Collective (one all-gather of each rank's small step table): the steps every
    rank can restore from its own fast tier, ascending, as rank 0 holds them (every
    rank holds them from the same save)."""
    blobs = comm.all_gather_bytes(json.dumps(
        {str(k): [v.save_id, v.created, v.parent] for k, v in mine.items()}).encode())
    views = [{int(k): tuple(v) for k, v in json.loads(b).items()} for b in blobs]
    return {s: Held(views[0][s][0], float(views[0][s][1]), views[0][s][2])
            for s in common_steps(views)}


def live_timeline(cands: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates to try, newest first; those of an abandoned timeline). Pure:
    O(n log n).

    A candidate is abandoned when a candidate of a lower step, in either tier, was
    committed after it (the job was rewound past it, or started over), or a newer save
    of the same step was (it was saved again on the new timeline). Then the ancestry:
    the newest commit (the tip) names the commit it continues, that one its own, and
    so on while they are known (retention deletes old ones); every candidate committed
    after the oldest ancestor reached that is not one of them (by save id, in any
    tier) is on another branch, abandoned even when nothing of a lower step committed
    after it survives. The rest are
    ordered by step, then commit time, newest first; one save held by both tiers is
    tried from the fast tier first (``"local"`` or ``"peer"``: the durable copy is its
    fallback). Candidates of
    unknown commit time are never abandoned and abandon nothing."""
    live, abandoned = _commit_order(cands)
    off = _off_ancestry(cands, live)
    if off:
        abandoned += [c for c in live if id(c) in off]
        live = [c for c in live if id(c) not in off]

    def rank(c: Candidate) -> tuple:
        t = c.created if c.created is not None else float("-inf")
        return (c.step, t, c.tier != "durable")

    return sorted(live, key=rank, reverse=True), abandoned


def _off_ancestry(cands: list[Candidate], live: list[Candidate]) -> set[int]:
    """ids of the ``live`` candidates committed after the tip's oldest known ancestor
    and not among its ancestors (see :func:`live_timeline`). Pure: O(n)."""
    times: dict[str, float] = {}
    parents: dict[str, str] = {}
    for c in cands:
        if c.save_id is None or c.created is None:
            continue
        times[c.save_id] = max(times.get(c.save_id, c.created), c.created)
        if c.parent is not None:
            parents[c.save_id] = c.parent
    timed = [c for c in live if c.save_id is not None and c.created is not None]
    if not timed:
        return set()
    tip = max(timed, key=lambda c: (c.created, c.step))
    ancestors = {tip.save_id}
    cur = tip.save_id
    while parents.get(cur) in times and parents[cur] not in ancestors:
        cur = parents[cur]
        ancestors.add(cur)
    floor = times[cur]
    return {id(c) for c in timed if c.created > floor and c.save_id not in ancestors}


def _commit_order(cands: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(live, abandoned) by commit order alone (a lower step committed later, or a
    newer save of the same step). Pure: O(n log n)."""
    order = sorted(cands, key=lambda c: c.step)
    abandoned: list[Candidate] = []
    live: list[Candidate] = []
    newest_below = float("-inf")  # the newest commit among strictly lower steps
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and order[j].step == order[i].step:
            j += 1
        group = order[i:j]
        newest_here = max((c.created for c in group if c.created is not None),
                          default=float("-inf"))
        for c in group:
            if c.created is not None and (c.created < newest_below or c.created < newest_here):
                abandoned.append(c)
            else:
                live.append(c)
        newest_below = max(newest_below, newest_here)
        i = j
    return live, abandoned


def fallback_worthy(e: BaseException) -> bool:
    """Whether a failed fast-tier restore should fall back to an older step or the
    durable tier: damage only (a file missing, corrupt or unreadable on some node, a
    failed transfer from a peer). Not a state that does not match the checkpoint
    (missing or unexpected keys, shapes, dtypes, a value that cannot be loaded): that
    is the caller's error on every tier, and an older step would load silently in its
    place. Not a broken group either (a dead rank breaks the durable load too)."""
    return isinstance(e, CheckpointError) and not isinstance(
        e, (CommunicationError, StateMismatchError, UnsupportedValueError))
