"""Which committed steps to keep: the retention rule shared by the durable root (the
manager's) and the fast tier (each node's steps and replicas). Pure."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RetentionPolicy:
    """Keep the last ``keep_last`` committed checkpoints and every step divisible by
    ``keep_every`` (milestones); None keeps everything of that kind."""

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError("keep_last must be >= 1 (the newest checkpoint is always kept)")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError("keep_every must be >= 1")

    def to_delete(self, committed: list[int], protected: set[int] = frozenset()) -> list[int]:
        """Committed steps to remove. The newest committed step and ``protected`` ones
        (in flight) are never removed; with keep_last None nothing is."""
        if self.keep_last is None or not committed:
            return []
        steps = sorted(committed)
        keep = set(steps[-self.keep_last:]) | {steps[-1]} | set(protected)
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        return [s for s in steps if s not in keep]
