"""Which checkpoints a ``total_limit`` removes: the oldest committed ones in commit
order, never the one just saved, decided after the new commit. Pure."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its path, commit time (the manifest's ``created``) and
    save id."""

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
    removed, and counts among those kept. ``limit`` None: none. O(n log n)."""
    if limit is None:
        return []
    if limit < 1:
        raise ValueError(f"total_limit must be at least 1, got {limit}")
    order = commit_order(entries)
    others = [c for c in order if c.path != keep]
    room = limit - (1 if len(others) < len(order) else 0)
    n_drop = max(0, len(others) - max(room, 0))
    return [c.path for c in others[:n_drop]]
