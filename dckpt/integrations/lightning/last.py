"""What ``ckpt_path="last"`` resumes under dckpt's Lightning strategy: the newest
complete checkpoint among Lightning's ``last*.ckpt`` names (links followed), the fast
tier's ``last`` names of ModelCheckpoint's directories, and every other checkpoint of
those directories that holds a whole training state. Collective (broadcasts and one
all-gather per lookup); rank 0 does the listings and manifest reads.
"""
from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from ...protocol.collectives import Comm, on_rank0
from .meta import resumable
from ..common.place import (checkpoints_in, durable_name, durable_stamp, join, kind,
                              link_target)

if TYPE_CHECKING:
    from ..common.tier import LocalTier

log = logging.getLogger(__name__)
# ModelCheckpoint's "last" names: last.ckpt, last-v1.ckpt (its version counter)
LAST_NAME = re.compile(r"^last(-v?\d+)?\.ckpt$")


def resolve_last(comm: Comm, tier: "LocalTier | None", opts: dict | None,
                 candidates: list[str], dirs: list[str]) -> str | None:
    """The name ``ckpt_path="last"`` resumes: the newest complete checkpoint among
    ``candidates`` (rank 0's; Lightning's ``last*.ckpt`` names, a link standing for
    the name it points at), the ``last`` names the fast tier holds in ``dirs``
    (ModelCheckpoint's directories with ``save_last``), and every other dckpt
    checkpoint of ``dirs`` (either tier) that holds a whole training state (not
    ``save_weights_only``): a save of ``last.ckpt`` killed after the top-k save of
    the same step, a ``save_last="link"`` link to a save that never committed, a
    first save of ``last`` killed. None: nothing complete (a fresh start). Newest: by
    commit time (a stock checkpoint's modification time; stock checkpoints count
    only under a last name, as Lightning's lookup). Collective over ``comm``
    (broadcasts, one all-gather; call it after the saves in flight are drained);
    blocking I/O on rank 0 (listings, a manifest per dckpt checkpoint of ``dirs``).
    Raises on every rank alike."""
    def lasts() -> list[str]:
        names = {durable_name(link_target(c) or c) for c in candidates}
        for d in dirs:
            names.add(durable_name(join(d, "last.ckpt")))
            if tier is not None:
                names |= {n for n in tier.names_in(durable_name(d), 0)
                          if LAST_NAME.match(n.rsplit("/", 1)[-1])}
        return sorted(names)

    def others(known: set[str]) -> list[str]:
        names: set[str] = set()
        for d in dirs:
            for n in checkpoints_in(d, opts):
                if n in known or LAST_NAME.match(n.rsplit("/", 1)[-1]):
                    continue
                try:
                    if kind(n, opts) == "dckpt" and resumable(read_manifest(n, opts)):
                        names.add(n)
                except Exception as e:  # a damaged checkpoint is not a candidate
                    log.warning("checkpoint %s cannot be read, not a candidate: %s", n, e)
            if tier is not None:
                names |= {n for n in tier.names_in(durable_name(d), 0, accept=resumable)
                          if n not in known}
        return sorted(names)

    lasts_ = on_rank0(comm, lasts, "list the last checkpoints")
    rest = on_rank0(comm, lambda: others(set(lasts_)), "list the checkpoints") if dirs else []
    best = newest(comm, tier, opts, lasts_ + rest)
    if best is not None and best in rest and comm.rank == 0:
        log.warning("resuming %s: it committed after every complete last checkpoint of "
                    "%s (a save of last killed, or a link to a save that never "
                    "committed)", best, ", ".join(dirs))
    return best


def read_manifest(path: str, opts: dict | None) -> Any:
    """The parsed manifest of the dckpt checkpoint at ``path``. Blocking I/O; raises
    CheckpointError or OSError."""
    from ...format import manifest as mf
    from ...protocol.restore import read_manifest_bytes
    from ...storage.fsspec_storage import make_storage

    storage, root = make_storage(path, opts)
    return mf.parse(read_manifest_bytes(storage, root, mf.MANIFEST_NAME),
                    f"{path}/{mf.MANIFEST_NAME}")


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
