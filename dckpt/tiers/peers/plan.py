"""The pure planning layer of the replicated fast tier (issue 28): who replicates to
whom, which step a job that lost nodes can restore from its peers' memory, who serves
each part, and which copies put the replicas back after the restore.

Nothing here touches torch.distributed, storage or a clock: the caller gathers every
rank's reports in one all-gather, and every rank then computes the same plan from the
same inputs. Every function is deterministic whatever the order of its inputs, so no
rank can plan differently from another (a difference would hang a transfer).

Vocabulary. A *node* is a failure domain (the ranks of a host). A *part* of a step is
one saving rank's files of that step (``data-``, ``replica-`` files and its view), named
by that saving rank; a step saved by W ranks has parts 0..W-1, all of one save id. A
node *holds* a part when its ``local_root`` has it, as its own files or as a replica
another node sent; it counts only once verified against its CRCs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from ...errors import CheckpointError
from ..chooser import Candidate, live_timeline


def ring(nodes: Iterable[str], replicas: int) -> tuple[dict[str, list[str]], bool]:
    """({node: the nodes that hold its replicas}, reduced). Pure: O(n log n + n*r).

    The ring runs over the sorted distinct node ids; each node's replicas go to the
    next ``replicas`` nodes. With fewer than ``replicas + 1`` nodes (a job that shrank
    to its survivors), each node replicates to every other node and ``reduced`` is
    True: the caller logs one warning and goes on, it is never an error.
    Raises CheckpointError when ``replicas`` is negative or no node is given."""
    if replicas < 0:
        raise CheckpointError(f"replicas must be >= 0, got {replicas}")
    order = sorted(set(nodes))
    if not order:
        raise CheckpointError("ring: no nodes")
    n = len(order)
    k = min(replicas, n - 1)
    return ({v: [order[(i + j) % n] for j in range(1, k + 1)] for i, v in enumerate(order)},
            k < replicas)


@dataclass(frozen=True)
class Settings:
    """One rank's replication settings, as it reports them in the settings all-gather."""

    rank: int
    replicas: int
    node: str


@dataclass(frozen=True)
class Agreed:
    """The settings every rank agreed on: the replica count and each rank's node."""

    replicas: int
    nodes: Mapping[int, str]


def check_settings(reports: Sequence[Settings]) -> Agreed:
    """The agreed settings from every rank's report. Pure: O(n log n).

    Every rank calls it on the same all-gathered reports, so a disagreement raises on
    every rank at once (never a hang of the ranks that agree).
    Raises CheckpointError naming each rank and its value when the ranks disagree on
    ``replicas``, when a rank reported twice, or a node id is empty; its ``failures``
    maps each rank to its ``replicas=`` value on a disagreement."""
    if not reports:
        raise CheckpointError("no settings reported")
    seen: dict[int, Settings] = {}
    for s in sorted(reports, key=lambda s: s.rank):
        if s.rank in seen:
            raise CheckpointError(f"rank {s.rank} reported its settings twice")
        if not s.node:
            raise CheckpointError(f"rank {s.rank} reported an empty node id")
        seen[s.rank] = s
    by_value: dict[int, list[int]] = {}
    for s in seen.values():
        by_value.setdefault(s.replicas, []).append(s.rank)
    if len(by_value) > 1:
        parts = "; ".join(f"replicas={v} on rank{'s' if len(rs) > 1 else ''} "
                          f"{', '.join(map(str, rs))}" for v, rs in sorted(by_value.items()))
        raise CheckpointError(f"the ranks disagree on replicas: {parts}",
                              {r: f"replicas={s.replicas}" for r, s in seen.items()})
    replicas = next(iter(by_value))
    if replicas < 0:
        raise CheckpointError(f"replicas must be >= 0, got {replicas} on every rank")
    return Agreed(replicas, {r: s.node for r, s in seen.items()})


@dataclass(frozen=True)
class StepHolding:
    """One step a node holds (some of) the parts of: its save id, commit time, the
    saving world size, and (saving rank, verified) for each part held there."""

    step: int
    save_id: str
    created: float
    world: int
    parts: tuple[tuple[int, bool], ...]


@dataclass(frozen=True)
class HoldReport:
    """What one rank reports its node holds (own files and replicas), per step. Ranks
    of one node may report the same parts: the node's holdings are their union."""

    rank: int
    node: str
    steps: tuple[StepHolding, ...]


@dataclass(frozen=True)
class Choice:
    """A step every part of which some surviving node holds, verified, from one save:
    ``holders[p]`` are the surviving nodes holding part p, sorted."""

    step: int
    save_id: str
    created: float
    world: int
    holders: tuple[tuple[str, ...], ...]

    def candidate(self) -> Candidate:
        """This choice as a chooser candidate (tier ``"peer"``), to order it against
        the durable tier's steps with :func:`~dckpt.tiers.chooser.live_timeline`."""
        return Candidate(self.step, "peer", self.created)


def complete_steps(reports: Sequence[HoldReport], alive: Iterable[str]) -> list[Choice]:
    """Every save whose every part a node of ``alive`` holds verified, newest first, the
    saves of an abandoned timeline left out (chooser's rule: a lower step committed
    later, or a newer save of the same step). Pure: O(total parts + k log k).

    A save is keyed by (step, save id, world, commit time): a step held from two saves
    is two keys, never mixed. A part is usable on a node only when some report says it
    is verified there and none says its check failed (the same files, seen by two
    ranks of the node: the failure wins). Reports of nodes not in ``alive`` and parts
    outside 0..world-1 are ignored. Never raises."""
    live_nodes = set(alive)
    keys: set[tuple] = set()
    ok: dict[tuple, set[str]] = {}        # (key, part) -> nodes reporting it verified
    bad: set[tuple] = set()               # (key, part, node) reported failed
    for rep in reports:
        if rep.node not in live_nodes:
            continue
        for h in rep.steps:
            key = (h.step, h.save_id, h.world, h.created)
            keys.add(key)
            for p, verified in h.parts:
                if 0 <= p < h.world:
                    if verified:
                        ok.setdefault((key, p), set()).add(rep.node)
                    else:
                        bad.add((key, p, rep.node))
    # The timeline rule sees every save held, complete or not: a rewind is a fact
    # even when its newer saves cannot be restored.
    _, abandoned = live_timeline([Candidate(k[0], "peer", k[3]) for k in sorted(keys)])
    dead = {(c.step, c.created) for c in abandoned}
    out: list[Choice] = []
    for key in sorted(keys, key=lambda k: (k[0], k[3], k[1], k[2]), reverse=True):
        if (key[0], key[3]) in dead or key[2] <= 0:
            continue
        holders = [tuple(sorted(n for n in ok.get((key, p), ()) if (key, p, n) not in bad))
                   for p in range(key[2])]
        if all(holders):
            out.append(Choice(key[0], key[1], key[3], key[2], tuple(holders)))
    return out


def choose(reports: Sequence[HoldReport], alive: Iterable[str]) -> Choice | None:
    """The newest complete save (see :func:`complete_steps`), or None: no step is
    whole among the survivors, and the caller falls back to the durable tier.
    Pure: as :func:`complete_steps`. Never raises."""
    steps = complete_steps(reports, alive)
    return steps[0] if steps else None


@dataclass(frozen=True)
class Fetch:
    """Part ``part`` is read from node ``source`` by its rank ``sender`` for rank
    ``dest`` (None: no rank of this world owns it, at another world size; the reader
    asks ``sender`` for the byte ranges it needs). ``local``: dest's own node holds it,
    no bytes cross the network."""

    part: int
    source: str
    sender: int
    dest: int | None
    local: bool


def _least(options: Iterable, load: dict) -> object:
    """The option of least load, ties to the smallest id (deterministic)."""
    return min(options, key=lambda o: (load.get(o, 0), o))


def fetch_plan(choice: Choice, nodes: Mapping[int, str]) -> list[Fetch]:
    """One fetch per part of ``choice``, by part. Pure: O(W * (h + ranks per node)).

    ``nodes`` maps each rank of the restoring world to its node. Part p goes to rank p
    when that rank exists; it is read from the rank's own node when that node holds it,
    otherwise from the holder with the fewest parts to serve so far (ties: smallest id),
    by its rank with the fewest sends so far, so the load spreads over holders and
    over their ranks. Raises CheckpointError when a holder has no rank in ``nodes``
    (the choice was made with another set of alive nodes)."""
    ranks_of: dict[str, list[int]] = {}
    for r, n in sorted(nodes.items()):
        ranks_of.setdefault(n, []).append(r)
    node_load: dict[str, int] = {}
    rank_load: dict[int, int] = {}
    out: list[Fetch] = []
    for p, holders in enumerate(choice.holders):
        missing = [h for h in holders if h not in ranks_of]
        if missing:
            raise CheckpointError(f"step {choice.step}: part {p} is held on node(s) "
                                  f"{', '.join(missing)}, which have no rank in this job")
        dest = p if p in nodes else None
        if dest is not None and nodes[dest] in holders:
            out.append(Fetch(p, nodes[dest], dest, dest, True))
            continue
        src = _least(holders, node_load)
        node_load[src] = node_load.get(src, 0) + 1
        sender = _least(ranks_of[src], rank_load)
        rank_load[sender] = rank_load.get(sender, 0) + 1
        out.append(Fetch(p, src, sender, dest, False))
    return out


@dataclass(frozen=True)
class Copy:
    """After a restore, node ``source`` sends part ``part`` to node ``dest``."""

    part: int
    source: str
    dest: str


def rereplicate(choice: Choice, ring_after_loss: Mapping[str, Sequence[str]],
                homes: Mapping[int, str] | None = None) -> dict[str, list[Copy]]:
    """{destination node: the copies it must receive}, so that every part of ``choice``
    is again held on its home and the home's ring successors (``replicas + 1`` nodes,
    or as many as exist). Pure: O(W * r * h).

    A part's home is ``homes[p]`` (the node of rank p after the restore, which then
    holds it: the fetch wrote it back there); a part no rank owns (another world size)
    lives on its smallest surviving holder. Each copy comes from the holder with the
    fewest sends so far (ties: smallest id). Nodes with no copy to receive are absent.
    Raises CheckpointError when a home or a holder is not in ``ring_after_loss``."""
    homes = homes or {}
    load: dict[str, int] = {}
    out: dict[str, list[Copy]] = {}
    for p, holders in enumerate(choice.holders):
        home = homes.get(p, holders[0] if holders else None)
        have = sorted(set(holders) | ({home} if home else set()))
        stray = [n for n in have if n not in ring_after_loss]
        if home is None or stray:
            raise CheckpointError(f"step {choice.step}: part {p} has node(s) "
                                  f"{', '.join(stray) or '(none)'} outside the ring")
        for dest in ring_after_loss[home]:
            if dest in have:
                continue
            src = _least(have, load)
            load[src] = load.get(src, 0) + 1
            out.setdefault(dest, []).append(Copy(p, src, dest))
    return out


def replication_plan(nodes: Mapping[int, str], replicas: int) -> list[tuple[int, int]]:
    """[(source rank, destination rank)]: where each rank's own part of a step goes, in
    the order every rank runs them (see :func:`schedule`). Pure: O(W * r).

    Rank p's part goes to one rank of each of the ``replicas`` ring successors of its
    node (fewer when the job has fewer nodes): the successor's rank at p's position
    among its node's ranks, modulo that node's size, so every receiving rank gets about
    the same number of parts. Raises CheckpointError as :func:`ring` does."""
    succ, _ = ring(nodes.values(), replicas)
    ranks_of: dict[str, list[int]] = {}
    for r, n in sorted(nodes.items()):
        ranks_of.setdefault(n, []).append(r)
    pairs = []
    for p, n in sorted(nodes.items()):
        i = ranks_of[n].index(p)
        for dest in succ[n]:
            there = ranks_of[dest]
            pairs.append((p, there[i % len(there)]))
    return schedule(pairs)


def schedule(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``pairs`` of (sender, receiver) ranks in rounds: each pair goes into the first
    round where neither of its ranks is busy yet; the result lists round 0's pairs,
    then round 1's, ... Pure: O(n * rounds).

    Every rank runs the pairs it is in, in this order, one at a time. That cannot
    deadlock (the earliest pair not done always has both its ranks at it), and the
    pairs of one round, disjoint, run at the same time on different ranks."""
    busy: list[set[int]] = []
    placed: list[tuple[int, int, int]] = []
    for i, (a, b) in enumerate(pairs):
        k = 0
        while k < len(busy) and (a in busy[k] or b in busy[k]):
            k += 1
        if k == len(busy):
            busy.append(set())
        busy[k] |= {a, b}
        placed.append((k, i, a))
    return [pairs[i] for _, i, _ in sorted(placed)]


def newest_replicated(choices: Sequence[Choice], node_of: Callable[[str], str],
                      copies: int) -> int | None:
    """The step of the first of ``choices`` (newest first, as :func:`complete_steps`
    gives them) every part of which is held on at least ``copies`` distinct nodes
    (``node_of`` maps a holder to its node): the newest step that survives the loss of
    any ``copies - 1`` nodes, i.e. the one replicated everywhere. None when no step is.
    Pure: O(total holders)."""
    for c in choices:
        if all(len({node_of(h) for h in hs}) >= copies for hs in c.holders):
            return c.step
    return None
