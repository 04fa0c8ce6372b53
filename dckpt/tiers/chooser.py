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
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Hashable, Mapping

from ..protocol.collectives import Comm


@dataclass(frozen=True)
class Held:
    """A local step this rank holds: its save id and its commit time (Unix seconds)."""

    save_id: str
    created: float


@dataclass(frozen=True)
class Candidate:
    """A committed step of one tier (``"local"`` or ``"durable"``) and its commit time
    (None: unknown, e.g. an unreadable manifest; such a step is tried in its turn)."""

    step: int
    tier: str
    created: float | None


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


def agree_local_steps(comm: Comm, mine: Mapping[int, Held]) -> dict[int, float]:
    """Collective (one all-gather of each rank's small step table): the steps every
    rank can restore from its own fast tier, ascending, with their commit times."""
    blobs = comm.all_gather_bytes(json.dumps(
        {str(k): [v.save_id, v.created] for k, v in mine.items()}).encode())
    views = [{int(k): tuple(v) for k, v in json.loads(b).items()} for b in blobs]
    return {s: float(views[0][s][1]) for s in common_steps(views)}


def live_timeline(cands: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates to try, newest first; those of an abandoned timeline). Pure:
    O(n log n).

    A candidate is abandoned when a candidate of a lower step, in either tier, was
    committed after it (the job was rewound past it, or started over), or a newer save
    of the same step was (it was saved again on the new timeline). The rest are
    ordered by step, then commit time, newest first; one save held by both tiers is
    tried from the fast tier first (``"local"`` or ``"peer"``: the durable copy is its
    fallback). Candidates of
    unknown commit time are never abandoned and abandon nothing."""
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

    def rank(c: Candidate) -> tuple:
        t = c.created if c.created is not None else float("-inf")
        return (c.step, t, c.tier != "durable")

    return sorted(live, key=rank, reverse=True), abandoned
