"""The replicated fast tier's restore (issue 28): which steps the surviving nodes hold
whole, and restoring one of them from the peers' memory, at the same world size or
another, then putting the lost node's replicas back.

Every function here is collective over the replication group (``rep.group``, gloo) and
is called by :class:`dckpt.tiers.fast.FastTier` between saves (the replication thread
is idle: the restore waited for it). Transfers are point to point, scheduled in rounds
(:func:`dckpt.tiers.peers.plan.schedule`), at most one 8 MiB piece in flight per rank,
every file verified on arrival. A transfer that fails marks that holder's copy bad;
another holder is used when there is one, else the restore of this step raises and the
manager tries the next step, then the durable tier: never a mix of steps.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from ...errors import CheckpointError
from ...format import manifest as mf
from ...protocol.collectives import Comm, agree
from ...protocol.restore import MAX_MANIFEST
from . import part as peerpart, plan as peerplan
from ..localnames import step_name, view_name
from .plan import Choice
from .replication import Replicator, node_of, ranks_at

log = logging.getLogger(__name__)
_ATTEMPTS = 3  # holders tried per part before the step is given up


@dataclass(frozen=True)
class Option:
    """A step the job can restore from the fast tier: ``choice`` (its parts' holders,
    by place) and whether it is ``local``: the same world size, every rank holding its
    own part in its own step directory (the plain fast-tier restore, no peer)."""

    choice: Choice
    local: bool


def options(rep: Replicator) -> list[Option]:
    """Every step the surviving places hold whole, newest first (abandoned timelines
    left out). Collective: one all-gather of each place's small holdings table (its
    lowest rank scans the directory; the views only), or none right after the tier's
    construction (:meth:`Replicator.holdings`). Never raises but CommunicationError."""
    comm = Comm(rep.group)
    reports, own = rep.holdings(comm)
    out = []
    for c in peerplan.complete_steps(reports, set(rep.place_of.values())):
        local = c.world == comm.size and all(
            (c.step, c.save_id, rep.place_of[p], p) in own for p in range(c.world))
        out.append(Option(c, local))
    return out


def restore(rep: Replicator, opt: Option, step_dir: Callable[[int], str],
            load: Callable[[str, str], None],
            needs: Callable[[mf.Manifest], dict[int, set]]) -> str:
    """Restore ``opt``'s step: fetch what this rank lacks from holders, then
    ``load(path, manifest_name)`` (every rank), then queue the re-creation of the
    replicas the lost node held (:func:`rereplicate`, in the replication thread; the
    caller, :meth:`FastTier.peer_restore`, waits for it). Returns ``"local"`` when no
    rank needed a peer's bytes, else ``"peer"``. ``needs(manifest)``: {file index: {(key, chunk offsets)}} this rank's
    load reads (another world size only). Collective; blocking transfers. Raises
    CheckpointError (on every rank alike) when some part cannot be had verified from
    any holder, or the load fails: the caller tries the next step."""
    rep.fetched = 0
    if opt.local:
        load(step_dir(opt.choice.step), view_name(rep.comm.rank))
        return "local"
    t0 = time.perf_counter()
    choice, bad = opt.choice, set()
    for _ in range(_ATTEMPTS):
        choice = _without(opt.choice, bad)
        if choice.world == Comm(rep.group).size:
            failed = _fetch_same_world(rep, choice, step_dir(choice.step))
        else:
            failed = _fetch_ranges(rep, choice, needs)
        if not failed:
            break
        bad |= failed
    else:
        raise CheckpointError(f"step {choice.step}: its parts failed their transfers from "
                              f"{_ATTEMPTS} sets of holders")
    t1 = time.perf_counter()
    if choice.world == Comm(rep.group).size:
        load(step_dir(choice.step), view_name(rep.comm.rank))
        homes = {p: node_of(rep.place_of[p]) for p in range(choice.world)}
    else:
        where = _restore_dir(rep, choice.step)
        try:
            load(where, _MANIFEST)
        finally:
            shutil.rmtree(where, ignore_errors=True)
        homes = {}
    if rep.comm.rank == 0:
        log.info("step %d restored from peers (saved by %d ranks): fetch %.2f s (%.1f MiB on "
                 "rank 0), load %.2f s", choice.step, choice.world, t1 - t0,
                 rep.fetched / 2**20, time.perf_counter() - t1)
    rep.after_restore(choice, homes, rereplicate)  # the lost node's replicas, in the background
    return "peer"


def _without(choice: Choice, bad: set[tuple[int, str]]) -> Choice:
    """``choice`` less the (part, place) copies that failed. Raises CheckpointError
    naming the step and part when a part is then held nowhere."""
    holders = []
    for p, hs in enumerate(choice.holders):
        left = tuple(h for h in hs if (p, h) not in bad)
        if not left:
            raise CheckpointError(f"step {choice.step}: part {p} failed its checks on every "
                                  f"node holding it ({', '.join(hs)})")
        holders.append(left)
    return dataclasses.replace(choice, holders=tuple(holders))


def _gather_failures(comm: Comm, failed: set[tuple[int, str]], err: BaseException | None,
                     what: str) -> set[tuple[int, str]]:
    """Every rank's failed (part, place) copies, on every rank; an error no copy
    explains raises on every rank. One all-gather."""
    doc = {"failed": sorted(failed), "error": None}
    if err is not None and not failed:
        doc["error"] = f"{type(err).__name__}: {err}"
    docs = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(doc).encode())]
    errors = {r: d["error"] for r, d in enumerate(docs) if d["error"]}
    if errors:
        raise CheckpointError(f"{what} failed: " + "; ".join(
            f"rank {r}: {m}" for r, m in sorted(errors.items())), errors)
    out = {(int(p), str(h)) for d in docs for p, h in d["failed"]}
    if out and comm.rank == 0:
        log.warning("%s: copies that failed their transfer (part, node#dir): %s; trying "
                    "other holders", what, sorted(out))
    return out


def _fetch_same_world(rep: Replicator, choice: Choice, where: str) -> set[tuple[int, str]]:
    """Same world size: every rank ends with its own part in its own step directory
    ``where``, received whole from a holder (or linked from this node's replicas).
    Returns the failed (part, place) copies, agreed."""
    comm, me = Comm(rep.group), rep.comm.rank
    fetches = peerplan.fetch_plan(choice, rep.place_of)
    failed: set[tuple[int, str]] = set()
    err = None
    held = None
    mine = next(f for f in fetches if f.dest == me)
    try:
        if mine.local:
            held = peerpart.scan(rep.storage, rep.root, rep.owner)
            x = peerpart.find(held, choice.step, choice.save_id, me)
            if x is None:
                raise CheckpointError(f"rank {me}: part {me} of step {choice.step} vanished "
                                      "from this node")
            if x.where != where:
                peerpart.link_into(rep.storage, x, where)
    except Exception as e:
        err = e
    by_pair = {(f.sender, f.dest): f for f in fetches if not f.local}
    for s, d in peerplan.schedule(list(by_pair)):
        if me not in (s, d):
            continue
        f = by_pair[(s, d)]
        try:
            if me == s:
                if held is None:
                    held = peerpart.scan(rep.storage, rep.root, rep.owner)
                peerpart.send_part(rep.group, rep.storage, _held(held, choice, f.part, where),
                                   d)
            else:
                rep.fetched += peerpart.recv_part(rep.group, rep.storage, where, f.part, s,
                                                  choice.save_id, rep.owner)
        except Exception as e:
            log.info("rank %d: part %d of step %d from %s: %s", me, f.part, choice.step,
                     f.source, e)
            failed.add((f.part, f.source))
    return _gather_failures(comm, failed, err, f"restore of step {choice.step} from peers")


def _held(parts: list, choice: Choice, part: int, where: str) -> peerpart.Part:
    """The held part ``part`` of ``choice``, or a stand-in whose send fails on both
    sides, naming the missing view."""
    x = peerpart.find(parts, choice.step, choice.save_id, part)
    return x if x is not None else peerpart.Missing(choice.step, part, where, None)


_MANIFEST = "manifest-restore.json"


def _restore_dir(rep: Replicator, step: int) -> str:
    return os.path.join(rep.root, f".restore-{step_name(step)}-{rep.comm.rank:05d}")


def _fetch_ranges(rep: Replicator, choice: Choice,
                  needs: Callable[[mf.Manifest], dict[int, set]]) -> set[tuple[int, str]]:
    """Another world size: this rank's restore directory gets the step's manifest (part
    0's view), a link to every file its own node holds, and a sparse copy of every
    other file it reads, holding that file's header and the chunks it needs, fetched
    from a holder and verified. Returns the failed (part, place) copies, agreed."""
    from .ranges import recv_ranges, send_ranges

    comm, me = Comm(rep.group), rep.comm.rank
    where = _restore_dir(rep, choice.step)
    shutil.rmtree(where, ignore_errors=True)
    held = peerpart.scan(rep.storage, rep.root, rep.owner)
    # The manifest: part 0's view, read by the lowest rank of its first holder.
    src = rep.ranks_of[choice.holders[0][0]][0]
    blob, err = b"", None
    if me == src:
        try:
            x = peerpart.find(held, choice.step, choice.save_id, 0)
            if x is None:
                raise CheckpointError(f"part 0 of step {choice.step} vanished from {rep.root}")
            blob = rep.storage.read_file(rep.storage.join(x.where, view_name(0)), MAX_MANIFEST)
        except Exception as e:
            err = e
    agree(comm, err, f"restore of step {choice.step} from peers: read its manifest")
    blob = comm.all_gather_bytes(blob)[src]
    wanted: dict[str, list] = {}
    try:
        m = mf.parse(blob, f"step {choice.step} (part 0's view)")
        os.makedirs(where)
        with open(os.path.join(where, _MANIFEST), "wb") as fh:
            fh.write(blob)
        mine_place = rep.place_of[me]
        for fi, chunks in sorted(needs(m).items()):
            f = m.files[fi]
            x = peerpart.find(held, choice.step, choice.save_id, f.rank) \
                if mine_place in choice.holders[f.rank] else None
            if x is not None:
                os.symlink(os.path.join(x.where, f.name), os.path.join(where, f.name))
            else:
                wanted[f.name] = [f.rank, sorted([k, list(o)] for k, o in chunks)]
    except Exception as e:
        err = e
    agree(comm, err, f"restore of step {choice.step} from peers: plan the reads")
    asks = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(wanted).encode())]
    entries = {f.name: f for f in m.files}
    jobs = _serve_plan(rep, choice, asks)
    failed: set[tuple[int, str]] = set()
    for s, q in peerplan.schedule(list(jobs)):
        if me not in (s, q):
            continue
        for name in jobs[(s, q)]:
            part, chunks = asks[q][name]
            chunks = [(k, tuple(o)) for k, o in chunks]
            try:
                if me == s:
                    x = _held(held, choice, part, rep.root)
                    send_ranges(rep.group, rep.storage, os.path.join(x.where, name), chunks, q)
                else:
                    rep.fetched += recv_ranges(rep.group, os.path.join(where, name),
                                               entries[name], chunks, s)
            except Exception as e:
                log.info("rank %d: %s of step %d from %s: %s", me, name, choice.step,
                         rep.place_of[s], e)
                failed.add((part, rep.place_of[s]))
                # Both sides saw it fail (every step of a transfer has a reply): both
                # drop the rest of this pair's files; the next attempt uses another holder.
                break
    return _gather_failures(comm, failed, None, f"restore of step {choice.step} from peers")


def _serve_plan(rep: Replicator, choice: Choice, asks: list[dict]) -> dict[tuple, list[str]]:
    """{(server rank, asking rank): file names}: each file a rank asks for is served by
    a rank of one of its part's holders, the one with the fewest files to serve so far
    (ties: lowest rank), never the asking rank. Pure, the same on every rank (so a
    CheckpointError for a file no other rank holds is raised by all alike)."""
    load: dict[int, int] = {}
    jobs: dict[tuple, list[str]] = {}
    for q, ask in enumerate(asks):
        for name in sorted(ask):
            part = ask[name][0]
            # never the asking rank itself: its own node's copy was gone when it looked
            options = [r for h in choice.holders[part] for r in rep.ranks_of.get(h, []) if r != q]
            if not options:
                raise CheckpointError(f"step {choice.step}: rank {q} needs {name} (part "
                                      f"{part}), which no other rank holds")
            s = min(options, key=lambda r: (load.get(r, 0), r))
            load[s] = load.get(s, 0) + 1
            jobs.setdefault((s, q), []).append(name)
    return jobs


def rereplicate(rep: Replicator, choice: Choice, homes: dict[int, str]) -> None:
    """After restoring ``choice``: copy its parts so that each is held again on its home
    node and the home's ring successors (the replicas the lost node held for the
    others). ``homes``: {part: node} (same world size: rank p's node). Collective
    over the replication group (run in its thread, queued by :func:`restore`);
    blocking transfers. A failure is logged (once) and never raised: the restore
    succeeded, and the next save replicates again."""
    comm, me = Comm(rep.group), rep.comm.rank
    node_holders = tuple(tuple(sorted({node_of(h) for h in hs} | ({homes[p]} if p in homes
                                                                  else set())))
                         for p, hs in enumerate(choice.holders))
    by_node = dataclasses.replace(choice, holders=node_holders)
    ring, _ = peerplan.ring(rep.nodes.values(), rep.replicas)
    copies = peerplan.rereplicate(by_node, ring, homes)
    ranks_of = ranks_at(rep.nodes)  # {node: its ranks}
    jobs: dict[tuple, list[int]] = {}
    for dest, cs in sorted(copies.items()):
        for c in cs:
            src = _sender(rep, choice, c.part, c.source, homes)
            there = ranks_of[dest]
            jobs.setdefault((src, there[c.part % len(there)]), []).append(c.part)
    held, err = None, None
    for s, d in peerplan.schedule(list(jobs)):
        if me not in (s, d):
            continue
        for part in jobs[(s, d)]:
            try:
                if me == s:
                    held = held or peerpart.scan(rep.storage, rep.root, rep.owner)
                    peerpart.send_part(rep.group, rep.storage,
                                       _held(held, choice, part, rep.root), d)
                else:
                    peerpart.recv_part(rep.group, rep.storage,
                                       peerpart.peers_dir(rep.storage, rep.root, choice.step),
                                       part, s, choice.save_id, rep.owner)
            except Exception as e:
                err = err or e
    try:
        agree(comm, err, f"re-replication of step {choice.step}")
        rep.replicated = choice.step  # held on its home and successors: kept as such
        if comm.rank == 0 and copies:
            log.info("step %d: %d replica(s) re-created after the restore", choice.step,
                     sum(len(v) for v in copies.values()))
    except CheckpointError as e:
        if comm.rank == 0:
            log.warning("the replicas of step %d could not all be re-created (the next save "
                        "replicates again): %s", choice.step, e)


def _sender(rep: Replicator, choice: Choice, part: int, node: str,
            homes: dict[int, str]) -> int:
    """The rank of ``node`` that sends ``part``: one whose directory holds it (rank
    ``part`` itself when the node is its home after a same-world restore)."""
    if homes.get(part) == node and part in rep.place_of:
        return part
    for h in choice.holders[part]:
        if node_of(h) == node:
            return rep.ranks_of[h][0]
    raise CheckpointError(f"step {choice.step}: node {node} does not hold part {part}")
