"""What ``ckpt_path="last"`` resumes under dckpt's Lightning strategy: the newest
complete checkpoint among Lightning's ``last*.ckpt`` names (links followed), the fast
tier's ``last`` names of ModelCheckpoint's directories and, when none of those is
complete, among every checkpoint of those directories. Collective (broadcasts and one
all-gather per lookup); rank 0 does the listings and manifest reads.
"""
from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from ..protocol.collectives import Comm, on_rank0
from .lightning_place import (checkpoints_in, durable_name, durable_stamp, join, kind,
                              link_target)

if TYPE_CHECKING:
    from .lightning_tier import LocalTier

log = logging.getLogger(__name__)
# ModelCheckpoint's "last" names: last.ckpt, last-v1.ckpt (its version counter)
LAST_NAME = re.compile(r"^last(-v?\d+)?\.ckpt$")


def resolve_last(comm: Comm, tier: "LocalTier | None", opts: dict | None,
                 candidates: list[str], dirs: list[str]) -> str | None:
    """The name ``ckpt_path="last"`` resumes: the newest complete checkpoint among
    ``candidates`` (rank 0's; Lightning's ``last*.ckpt`` names, a link standing
    for the name it points at) and the ``last`` names the fast tier holds in
    ``dirs`` (ModelCheckpoint's directories with ``save_last``); when none is
    complete (a link to a save that never committed, a first save of ``last``
    killed), the newest complete checkpoint of ``dirs``. None: nothing complete
    (a fresh start). Newest: by commit time (a stock checkpoint's modification
    time). Collective over ``comm`` (broadcasts, one all-gather per lookup; call it after
    the saves in flight are drained); blocking I/O on rank 0 (listings, a manifest per
    name). Raises on every rank alike."""
    def lasts() -> list[str]:
        names = {durable_name(link_target(c) or c) for c in candidates}
        for d in dirs:
            names.add(durable_name(join(d, "last.ckpt")))
            if tier is not None:
                names |= {n for n in tier.names_in(durable_name(d), 0)
                          if LAST_NAME.match(n.rsplit("/", 1)[-1])}
        return sorted(names)

    best = newest(comm, tier, opts, on_rank0(comm, lasts, "list the last checkpoints"))
    if best is None and dirs:
        def every() -> list[str]:
            names = set()
            for d in dirs:
                names |= set(checkpoints_in(d, opts))
                if tier is not None:
                    names |= set(tier.names_in(durable_name(d), 0))
            return sorted(names)

        best = newest(comm, tier, opts, on_rank0(comm, every, "list the checkpoints"))
        if best is not None and comm.rank == 0:
            log.warning("no complete last checkpoint in %s (a link to a save that "
                        "never committed, or a save of it killed): resuming from the "
                        "newest complete checkpoint, %s", ", ".join(dirs), best)
    return best


def newest(comm: Comm, tier: "LocalTier | None", opts: dict | None,
           names: list[str]) -> str | None:
    """The name of ``names`` (the same on every rank) whose complete copy (the fast
    tier's when every rank holds it and it is not older than the durable one, else
    the durable one) committed last; None when none is complete. Collective."""
    def durable() -> list:
        out = []
        for n in names:
            try:
                found = kind(n, opts)
                out.append(durable_stamp(n, found, opts))
            except Exception as e:  # a damaged name is not a candidate
                log.warning("checkpoint %s cannot be read, not a candidate: %s", n, e)
                out.append(None)
        return out

    stamps = on_rank0(comm, durable, "look up the checkpoints")
    helds = tier.held_many(names, comm) if tier else [None] * len(names)
    best: tuple[float, str] | None = None
    for name, st, held in zip(names, stamps, helds):
        if held is not None and held.newer_than(st):
            t = held.created
        elif st is not None:
            t = st[1]
        else:
            continue
        if best is None or t > best[0]:
            best = (t, name)
    return None if best is None else best[1]
