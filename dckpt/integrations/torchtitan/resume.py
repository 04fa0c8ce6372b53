"""Which checkpoint a torchtitan job resumes from a folder holding both dckpt's steps and
the steps torchtitan's own DCP manager saved there (a run that switched managers, or
went back and forth), and the walk that resumes it, for
:class:`dckpt.integrations.torchtitan.DckptCheckpointManager`. Never imports torchtitan.

The rule is dckpt's Timelines rule (docs/GUARANTEES.md) with DCP's steps on the same
timeline. Every candidate is placed by when it was committed in the folder: a dckpt
step (either tier) by its time on the timeline, as :meth:`dckpt.CheckpointManager.restore`
reads it (the manifest's commit time, see :func:`dckpt.tiers.chooser.timeline_of`), a
DCP step by the modification time of its ``.metadata``, which DCP writes last (its
commit point). A step committed before a step of a lower number was, or before a newer
save of the same number (by either manager), belongs to an abandoned timeline (the job
was rewound with ``load_step`` and saved again) and is not resumed; the rest are tried
newest first (for them step order is commit order), each from the next only when it
fails with damage (:func:`dckpt.tiers.chooser.fallback_worthy`: a missing or corrupt
file, never a state that does not match it). So the newest commit wins, and a damaged
one falls back to the newest one committed before it, whichever manager wrote it.

Among DCP's own steps the step number decides, as DCP's manager itself resumes: their
times are raised to the running maximum in step order, so a DCP folder copied without
its modification times cannot reorder DCP's steps among themselves. Against dckpt's
steps the modification times count: a copy of a mixed folder must keep them (``cp -a``,
``rsync -a``). Steps of unknown time (an unreadable manifest, a store that reports no
modification time) are tried in their step's turn and abandon nothing. At a tie (one
step, one time) dckpt's own step (checksummed) is tried first.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import CheckpointError
from ...manager.restore import failure_causes
from ...protocol.collectives import Comm, on_rank0
from ...tiers.chooser import Candidate, fallback_worthy, live_timeline
from . import load

log = logging.getLogger(__name__)

DCKPT, DCP = "dckpt", "dcp"  # Choice.source; DCP is also the Candidate.tier of DCP's steps


@dataclass(frozen=True)
class Choice:
    """One checkpoint to try: ``source`` ``"dckpt"`` (a committed step of either of the
    manager's tiers: its ``restore(step=...)`` picks the save and the tier) or
    ``"dcp"`` (``kind`` ``"dcp"`` or ``"hf"``, from :func:`load.dcp_steps`)."""

    source: str
    step: int
    kind: str = ""

    def __str__(self) -> str:
        return f"DCP's step-{self.step}" if self.source == DCP else f"dckpt's step {self.step}"


def dcp_steps(folder: str) -> list[tuple[int, str, float | None]]:
    """:func:`load.dcp_steps` of ``folder`` on every rank. Collective: rank 0
    lists, every rank gets its result or its error."""
    found = on_rank0(Comm(None), lambda: load.dcp_steps(folder),
                     f"list torchtitan's DCP checkpoints under {folder}")
    return [(int(s), str(k), None if t is None else float(t)) for s, k, t in found]


def dcp_candidates(steps: list[tuple[int, str, float | None]]) -> list[Candidate]:
    """DCP's steps (``(step, kind, mtime)`` from :func:`load.dcp_steps`) as
    timeline candidates (tier ``"dcp"``, no save id), each time raised to the newest
    of the DCP steps up to it (DCP's own order is by step number). Pure."""
    out, high = [], -math.inf
    for step, _, t in sorted(steps, key=lambda s: s[0]):
        if t is not None:
            high = max(high, float(t))
            t = high
        out.append(Candidate(int(step), DCP, t))
    return out


def dckpt_candidates(manager: Any) -> list[Candidate]:
    """The committed steps of ``manager`` (a :class:`dckpt.CheckpointManager`) in each
    of its tiers with their times on the timeline, save ids and parents: what its
    restore lines up (durable steps; with a fast tier, the steps every rank holds, or
    with replicas every step the nodes can serve). Collective: rank 0 lists the
    folder and reads each manifest (broadcast); with a fast tier one all-gather. With
    a fast tier and the folder unreachable, the fast tier's steps alone (logged).
    Raises CheckpointError when the folder cannot be listed and there is no fast
    tier."""
    # The manager's own listing, so that both lines of a mixed folder are read by the
    # one rule its restore uses.
    cands, _ = manager._durable_candidates()
    tier = manager.tier
    if tier is not None and tier.peers is not None:
        cands += [Candidate(o.choice.step, "peer", o.choice.created, o.choice.save_id)
                  for o in tier.peer_options()]
    elif tier is not None:
        cands += [Candidate(s, "local", h.created, h.save_id, h.parent)
                  for s, h in tier.held_steps().items()]
    return cands


def order(dckpt: list[Candidate], dcp: list[Candidate],
          kinds: dict[int, str]) -> tuple[list[Choice], list[Candidate]]:
    """(what to try, newest first; the candidates of an abandoned timeline), from
    dckpt's candidates (:func:`dckpt_candidates`) and DCP's (:func:`dcp_candidates`,
    ``kinds`` their kinds by step), by :func:`dckpt.tiers.chooser.live_timeline`'s
    rule over both. One dckpt Choice per step (its restore tries that step's tiers);
    at one step and time, dckpt's first. Pure: O(n log n)."""
    live, abandoned = live_timeline([*dckpt, *dcp])

    def newest(c: Candidate) -> tuple:
        return (c.step, c.created if c.created is not None else -math.inf, c.tier != DCP)

    out: list[Choice] = []
    for c in sorted(live, key=newest, reverse=True):
        got = Choice(DCP, c.step, kinds.get(c.step, DCP)) if c.tier == DCP \
            else Choice(DCKPT, c.step)
        if got not in out:
            out.append(got)
    return out, abandoned


def warn_abandoned(abandoned: list[Candidate], folder: str, rank: int) -> None:
    """Log (rank 0) the steps left out as an abandoned timeline; nothing if none."""
    if not abandoned or rank != 0:
        return
    names = sorted({(c.step, c.tier) for c in abandoned})
    log.warning("not resumed from %s, committed before a lower step was (a job rewound "
                "past them: an abandoned timeline): %s", folder,
                ", ".join(f"DCP's step-{s}" if t == DCP else f"dckpt's step {s} ({t})"
                          for s, t in names))


def resume(choices: list[Choice], load: Callable[[Choice], Any], folder: str,
           rank: int) -> Choice:
    """Load the first of ``choices`` (newest first) that loads, through ``load`` (which
    raises on failure); returns it. A failure that :func:`fallback_worthy` calls damage
    is logged (rank 0 at warning level, the others at debug) and the next is tried;
    any other is raised at once (a state that does not match the checkpoint, an HF-only
    DCP step, a broken group). Collective as ``load`` is (every rank raises alike, so
    every rank takes the same path). Raises CheckpointError listing each try when
    none loads (the state may then hold part of a failed load)."""
    tried: list[str] = []
    for c in choices:
        try:
            load(c)
        except Exception as e:
            if not fallback_worthy(e):
                raise
            log.log(logging.WARNING if rank == 0 else logging.DEBUG,
                    "%s in %s could not be resumed, trying the next newest: %s",
                    c, folder, failure_causes(e))
            tried.append(f"{c}: {type(e).__name__}: {e}")
            continue
        return c
    raise CheckpointError(
        f"no checkpoint in {folder} could be resumed ({len(tried)} tried, newest first); "
        "the state may hold part of a failed load:\n  " + "\n  ".join(tried))


def resume_folder(manager: Any, mine: list[Candidate],
                  theirs: list[tuple[int, str, float | None]], folder: str,
                  wanted: Choice | None, load: Callable[[Choice], Any]) -> Choice:
    """Resume ``folder``, which holds DCP's steps ``theirs`` (:func:`load.dcp_steps`)
    and dckpt's ``mine`` (:func:`dckpt_candidates`): ``wanted`` exactly (a
    ``load_step``: no fallback), or (None) the newest commit that loads, by the rule
    of this module (abandoned steps logged), through ``load``; then
    :func:`continue_after` every step seen. Returns what was loaded. Collective as
    ``load`` is; raises as :func:`resume` (``wanted``: what ``load`` raises)."""
    rank = Comm(None).rank
    dcp = dcp_candidates(theirs)
    if wanted is None:
        choices, abandoned = order(mine, dcp, {s: k for s, k, _ in theirs})
        warn_abandoned(abandoned, folder, rank)
        got = resume(choices, load, folder, rank)
    else:
        got = wanted
        load(got)
    continue_after(manager, [*mine, *dcp])
    return got


def continue_after(manager: Any, seen: list[Candidate]) -> None:
    """Make ``manager``'s next commits order after every candidate ``seen`` (DCP's
    steps too), whatever its host's clock says. Its restore does so for dckpt's steps
    (the ``manager.after`` each commit records, see
    :func:`dckpt.tiers.chooser.timeline_of`); DCP's are outside what it sees. No I/O."""
    newest = max((c.created for c in seen if c.created is not None), default=None)
    if newest is None:
        return
    after = manager._after  # the newest commit time its last restore saw, + 1 ms
    manager._after = newest + 1e-3 if after is None else max(after, newest + 1e-3)
