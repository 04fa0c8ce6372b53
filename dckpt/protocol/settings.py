"""Settings that every rank must share, checked together before anything is saved.

A manager whose ranks disagree on a setting that shapes the files or the collectives
(compression, incremental saves, the save policy, the fast tier's options) fails
later, and badly: ranks that decide differently whether a step is saved, or staged,
enter different collectives and hang, or a durable copy never commits with an error
blaming a concurrent job. So the construction checks them in one all-gather and every
rank raises the same CheckpointError naming the setting and each rank's value. A value
that is invalid on one rank is reported the same way (no rank raises alone before a
collective the others wait in).
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import CheckpointError
from .collectives import Comm


def _canon(v: Any) -> Any:
    """A JSON-able form of a setting's value that compares as the value does."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):  # 10.0 and 10 are the same setting; the JSON keeps floats
        return int(v) if v.is_integer() else v
    if hasattr(v, "item") and callable(v.item):  # a numpy or torch scalar
        try:
            return _canon(v.item())
        except (TypeError, ValueError):
            pass
    return f"{type(v).__name__}:{v!r}"


def disagreements(docs: list[dict]) -> list[str]:
    """One line per setting whose value is not the same on every rank
    ("compression='zstd' on ranks 0, 1; compression=None on rank 2"), in the order of
    rank 0's settings. Pure: O(ranks x settings)."""
    out = []
    for name in docs[0]:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(docs):
            groups.setdefault(json.dumps(d.get(name, "<missing>")), []).append(r)
        if len(groups) > 1:
            parts = []
            for val, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
                who = "rank " if len(ranks) == 1 else "ranks "
                shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
                parts.append(f"{name}={json.loads(val)!r} on {who}{shown}")
            out.append("; ".join(parts))
    return out


def agree_settings(comm: Comm, settings: dict[str, Any], bad: str | None, what: str) -> None:
    """Collective (one all-gather of a few hundred bytes): raise the same
    CheckpointError on every rank when some rank's ``bad`` (its own validation error)
    is set, naming each such rank, or when ``settings`` differ between ranks, naming
    each differing setting and the ranks' values. No-op on one process without a
    group beyond raising ``bad``."""
    mine = {"bad": bad, "settings": {k: _canon(v) for k, v in settings.items()}}
    if comm.size == 1:
        if bad:
            raise CheckpointError(f"{what}: {bad}")
        return
    docs = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    errors = {r: d["bad"] for r, d in enumerate(docs) if d["bad"]}
    if errors:
        raise CheckpointError(f"{what}: " + "; ".join(
            f"rank {r}: {m}" for r, m in sorted(errors.items())),
            {r: m for r, m in errors.items()})
    lines = disagreements([d["settings"] for d in docs])
    if lines:
        raise CheckpointError(f"{what}: the ranks disagree on settings that every rank must "
                              "share (pass the same values on every rank):\n  "
                              + "\n  ".join(lines))
