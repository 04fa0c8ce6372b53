"""Which checkpoints a ``total_limit`` removes: the oldest committed ones in commit
order, never the one just saved, decided after the new commit. Pure."""
from __future__ import annotations

import math
from dataclasses import dataclass

# the commit time of a checkpoint whose manifest could not be read (a transient error,
# or damage): unknown, so it is ordered as the newest (a resume tries it first and falls
# back past it with a warning if it is damaged, never silently past it) and retention
# never removes it (it may be the newest)
UNKNOWN = math.inf


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its path, commit time (the manifest's ``created``;
    :data:`UNKNOWN` when it could not be read) and save id."""

    path: str
    created: float
    save_id: str = ""


def commit_order(entries: list[Committed]) -> list[Committed]:
    """``entries`` oldest commit first (ties: by save id, then path: a stable order on
    every rank). Never by name number or mtime. O(n log n)."""
    return sorted(entries, key=lambda c: (c.created, c.save_id, c.path))


def to_remove(entries: list[Committed], limit: int | None, keep: str | None) -> list[str]:
    """The paths to remove so that at most ``limit`` committed checkpoints remain
    (the newest ones in commit order); ``keep`` (the one just saved) is never
    removed, and counts among those kept; nor is one whose commit time is
    :data:`UNKNOWN` (it counts as kept too). ``limit`` None: none. O(n log n)."""
    if limit is None:
        return []
    if limit < 1:
        raise ValueError(f"total_limit must be at least 1, got {limit}")
    order = commit_order(entries)
    others = [c for c in order if c.path != keep and c.created != UNKNOWN]
    room = limit - (len(order) - len(others))
    n_drop = max(0, len(others) - max(room, 0))
    return [c.path for c in others[:n_drop]]
