"""The restore chooser: which local steps every rank can serve from its own node.

A local checkpoint is useless unless every rank holds its part, so the choice is a
collective, never a listing: each rank reports the steps it holds (with their save ids,
see :func:`dckpt.tiers.local.own_steps`), and all take the steps that every rank holds
from the same save. The rule itself is pure (:func:`common_steps`).
"""
from __future__ import annotations

import json

from ..protocol.collectives import Comm


def common_steps(views: list[dict[int, str]]) -> list[int]:
    """The steps present in every view with one save id, ascending. Pure: O(total
    entries). A step two ranks hold from different saves (a save that crashed between
    their commits, or a node that kept an older copy) is not common."""
    if not views:
        return []
    steps = set(views[0])
    for v in views[1:]:
        steps &= set(v)
    return sorted(s for s in steps if len({v[s] for v in views}) == 1)


def agree_local_steps(comm: Comm, mine: dict[int, str]) -> list[int]:
    """Collective (one all-gather of each rank's small step table): the steps every
    rank can restore from its own fast tier, ascending."""
    blobs = comm.all_gather_bytes(json.dumps({str(k): v for k, v in mine.items()}).encode())
    return common_steps([{int(k): v for k, v in json.loads(b).items()} for b in blobs])
