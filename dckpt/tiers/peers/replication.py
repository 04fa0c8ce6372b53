"""The replicated fast tier's background side (issue 28): the settings every rank agrees
on, and the copy of each locally committed step to the next ``replicas`` nodes of the
ring, so that a lost node is restored from its peers' memory (see
:mod:`dckpt.tiers.peers.restore` for the restore, :mod:`dckpt.tiers.peers.plan` for the
pure plans, :mod:`dckpt.tiers.peers.part` for the files and one part's transfer).

Replication runs in its own thread on its own gloo group, one step at a time, in save
order on every rank. The training thread never waits for it; a step committed while
the previous one is still being copied supersedes every older copy not begun (the
StageQueue rule, agreed by one all-reduce). Each rank sends its own part to one rank
of each successor node and receives the parts its node keeps for others, one 8 MiB
piece in flight at a time. A failed replication is logged, raised by ``wait()``, and
the next save replicates again; it never fails training.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import socket
import time
from typing import Any, Callable

from ...errors import CheckpointError
from ...catalog.retention import RetentionPolicy
from ...protocol.collectives import Comm, agree
from .. import chooser, stager
from . import part as peerpart, plan as peerplan
from ..local import LocalCommit

log = logging.getLogger(__name__)


def agree_settings(comm: Comm, replicas: Any, node: Any) -> peerplan.Agreed:
    """Every rank's ``replicas`` and ``node`` (None: the host name), checked together.
    Collective: one all-gather of a few bytes. A bad value on one rank or a
    disagreement on ``replicas`` raises the same CheckpointError on every rank (naming
    each rank's value), never a hang of the ranks that agree."""
    node = socket.gethostname() if node is None else node
    ok = isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 0
    ok_node = isinstance(node, (str, int)) and not isinstance(node, bool) and str(node) != ""
    mine = {"replicas": replicas if ok else repr(replicas), "node": str(node) if ok_node
            else "", "bad": None if ok and ok_node else
            (f"replicas must be an int >= 0, not {replicas!r}" if not ok
             else f"node must be a non-empty str or int, not {node!r}")}
    docs = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    bad = {r: d["bad"] for r, d in enumerate(docs) if d["bad"]}
    if bad:
        raise CheckpointError("fast tier settings: " + "; ".join(
            f"rank {r}: {m}" for r, m in sorted(bad.items())), bad)
    agreed = peerplan.check_settings([peerplan.Settings(r, d["replicas"], d["node"])
                                      for r, d in enumerate(docs)])
    return agreed


def places(nodes: dict[int, str], lows: list[int]) -> dict[int, str]:
    """{rank: its place}: the directory a rank's fast tier lives in, named by its node
    and ``lows[rank]``, the lowest rank sharing it (ranks of one node usually share
    ``local_root``; ranks that do not, or cannot tell, give their own rank: each is a
    place of its own). Pure."""
    return {r: f"{n}#{lows[r]}" for r, n in nodes.items()}


def ranks_at(where: dict[int, str]) -> dict[str, list[int]]:
    """{place or node: its ranks, ascending} from {rank: place or node}. Pure."""
    out: dict[str, list[int]] = {}
    for r, p in sorted(where.items()):
        out.setdefault(p, []).append(r)
    return out


def node_of(place: str) -> str:
    return place.rsplit("#", 1)[0]


class Replicator:
    """The replication of one fast tier. Construct on every rank together after the
    settings were agreed (``agreed.replicas > 0``): collective over ``comm``, one
    all-gather of what each place holds (its lowest rank reads its views), which also
    tells the newest step replicated everywhere. ``group`` is the tier's gloo group for
    transfers (an OwnGroup), used by this class's thread and, between saves, by the
    restore."""

    def __init__(self, storage, root: str, comm: Comm, group: Any, agreed: peerplan.Agreed,
                 place_of: dict[int, str], owner: str | None, keep_last: int) -> None:
        self.storage, self.root, self.comm, self.group = storage, root, comm, group
        self.replicas, self.nodes, self.place_of = agreed.replicas, dict(agreed.nodes), place_of
        self.owner = owner
        self.ranks_of = ranks_at(place_of)  # {place: its ranks, ascending}
        self.retention = RetentionPolicy(keep_last)
        self.queue = stager.StageQueue()  # the replications queued (coalesced)
        # The newest step replicated everywhere: its own files and replicas are kept
        # until a newer step is (a node loss needs them). Set at the end of __init__.
        self.replicated: int | None = None
        self._start: tuple | None = None  # the holdings gathered at construction
        self._jobs: list[cf.Future] = []
        self._exec = cf.ThreadPoolExecutor(1, thread_name_prefix="dckpt-peer")
        self._warned_space = False
        self.fetched = 0  # bytes this rank received from peers in the last restore
        succ, reduced = peerplan.ring(self.nodes.values(), self.replicas)
        if reduced and comm.rank == 0:
            log.warning("replicas=%d but the job has %d node(s): each step is replicated to "
                        "the %d other node(s) there are", self.replicas, len(succ),
                        len(succ) - 1)
        if comm.rank == 0:
            log.info("fast tier replication: %d replica(s) per step over %d node(s)",
                     min(self.replicas, len(succ) - 1), len(succ))
        me = comm.rank
        if self.ranks_of[place_of[me]][0] == me:  # the lowest rank of its place
            n = peerpart.sweep(root)  # nothing transfers yet: construction is collective
            if n:
                log.info("rank %d: removed %d file(s) of transfers cut short in %s", me, n, root)
        # Which step is replicated is learnt from what the nodes hold, not from the own
        # step directories: the newest own step may never have been replicated (a
        # receiver failed), and taking it for replicated would let the cleanup drop the
        # own files of the step the peers' replicas really back up.
        self._start = self.holdings(comm)
        copies = min(self.replicas, len(succ) - 1) + 1
        self.replicated = peerplan.newest_replicated(
            peerplan.complete_steps(self._start[0], set(place_of.values())), node_of, copies)
        if self.replicated is not None and me == 0:
            log.info("fast tier: step %d is the newest replicated on %d node(s)",
                     self.replicated, copies)

    def holdings(self, comm: Comm) -> tuple[list[peerplan.HoldReport], set[tuple]]:
        """(every rank's report of the parts its place holds, own and replicas; the
        (step, save id, place, part) held as own files). Collective over ``comm``: one
        all-gather of each place's small table (its lowest rank scans the directory,
        reading the views). The first call after construction with no save since
        returns what construction gathered (nothing changed since), without I/O or a
        collective: every rank takes that path alike. Never raises but
        CommunicationError."""
        if self._start is not None:
            out, self._start = self._start, None
            return out
        held: dict[tuple, dict[str, list[int]]] = {}
        if self.ranks_of[self.place_of[comm.rank]][0] == comm.rank:
            for x in peerpart.scan(self.storage, self.root, self.owner):
                key = (x.step, x.view.save_id, chooser.timeline_of(x.view)[0], x.view.world_size)
                kind = "peer" if peerpart.PEERS in x.where.split("/") else "own"
                held.setdefault(key, {"own": [], "peer": []})[kind].append(x.part)
        mine = [[list(k), v["own"], v["peer"]] for k, v in held.items()]
        docs = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
        reports, own = [], set()
        for r, doc in enumerate(docs):
            steps = []
            for (step, sid, created, world), mine_own, peer in doc:
                steps.append(peerplan.StepHolding(
                    step, sid, created, world,
                    tuple((p, True) for p in sorted(set(mine_own + peer)))))
                own |= {(step, sid, self.place_of[r], p) for p in mine_own}
            reports.append(peerplan.HoldReport(r, self.place_of[r], tuple(steps)))
        return reports, own

    # ------------------------------------------------------------------ replicating
    def submit(self, commit: LocalCommit, on_done: Callable[[int], None]) -> None:
        """Queue the replication of ``commit`` (every rank, after the same local
        commit, in save order). ``on_done(step)`` runs in the replication thread once
        the step is replicated everywhere (the fast tier's cleanup). Not blocking."""
        self._check_space(commit)
        self._start = None  # the directory changes from here: holdings() scans again
        job = self.queue.add(commit.step, False)  # older copies not begun are skipped
        self._jobs.append(self._exec.submit(self._run, commit, job, on_done))

    def after_restore(self, choice, homes: dict[int, str],
                      rereplicate: Callable[["Replicator", Any, dict], None]) -> None:
        """Queue ``rereplicate(self, choice, homes)``, the re-creation of the replicas
        of the restored step ``choice`` (the restore passes
        :func:`dckpt.tiers.peers.restore.rereplicate`, which builds on this module), in
        the replication thread: every rank, at the end of the same restore. It runs
        before the next save's replication (which supersedes it when it has not
        begun); its step's files stay protected until it ends. Not blocking."""
        job = self.queue.add(choice.step, False)
        self._jobs.append(self._exec.submit(self._rereplicate, choice, homes, job,
                                            rereplicate))

    def _rereplicate(self, choice, homes: dict[int, str], job: stager.StageJob,
                     rereplicate: Callable[["Replicator", Any, dict], None]) -> None:
        comm = Comm(self.group)
        try:
            if comm.any_of([self.queue.claim(job)])[0]:
                log.debug("re-replication of step %d skipped for a newer step", choice.step)
                return
            rereplicate(self, choice, homes)
        finally:
            self.queue.finish(job)

    def protected(self) -> set[int]:
        """Steps the fast tier's cleanup must keep: being replicated or queued, and the
        newest replicated one (a node's own part of it is the copy its peers' replicas
        back up, until a newer step is replicated)."""
        out = self.queue.protected()
        if self.replicated is not None:
            out.add(self.replicated)
        return out

    def _run(self, commit: LocalCommit, job: stager.StageJob,
             on_done: Callable[[int], None]) -> None:
        comm = Comm(self.group)
        try:
            if comm.any_of([self.queue.claim(job)])[0]:
                log.debug("replication of step %d skipped for a newer step", commit.step)
                return
            t0 = time.perf_counter()
            try:
                nbytes = self.copy_out(commit.step, commit.save_id, comm)
            except Exception:
                # Old replicas go whether or not this copy succeeded: a receiver that
                # keeps failing must not make peers/ grow by a step per save.
                self._drop_old_replicas(commit.step)
                raise
            self.replicated = commit.step
            self._drop_old_replicas(commit.step)
            if comm.rank == 0:
                log.info("step %d replicated to %d peer node(s) in %.2f s (%.1f MiB from "
                         "rank 0)", commit.step, min(self.replicas, len(set(self.nodes.values()))
                                                     - 1), time.perf_counter() - t0,
                         nbytes / 2**20)
            on_done(commit.step)
        except Exception as e:
            log.error("rank %d: replication of step %d failed (training goes on; the next "
                      "save replicates again): %s", comm.rank, commit.step, e)
            raise
        finally:
            self.queue.finish(job)

    def copy_out(self, step: int, save_id: str, comm: Comm) -> int:
        """Send this rank's own part of ``step`` to its ring successors and receive the
        parts this node keeps for others, then agree. Collective over ``comm`` (the
        replication group); blocking. Returns the bytes this rank moved. Raises the
        same CheckpointError on every rank when any transfer failed."""
        me, nbytes, err = comm.rank, 0, None
        own = None
        # Every transfer is run even after one failed: its peer is waiting for it, and
        # a failed transfer fails on both sides at once (no wait for a timeout).
        for src, dst in peerplan.replication_plan(self.nodes, self.replicas):
            if me not in (src, dst):
                continue
            try:
                if me == src:
                    if own is None:
                        own = self._own_part(step, save_id)
                    nbytes += peerpart.send_part(self.group, self.storage, own, dst)
                else:
                    nbytes += peerpart.recv_part(
                        self.group, self.storage, peerpart.peers_dir(self.storage, self.root,
                                                                     step),
                        src, src, save_id, self.owner, me=me)
            except Exception as e:
                err = err or e
        agree(comm, err, f"replication of step {step}")
        return nbytes

    def _own_part(self, step: int, save_id: str) -> peerpart.Part:
        """This rank's own part of ``step`` (a stand-in naming the missing view when it
        is gone: its send then fails on both sides, naming it)."""
        where = self.storage.join(self.root, peerpart.step_name(step))
        try:
            view = peerpart.read_part(self.storage, where, self.comm.rank, self.owner)
            if view.save_id == save_id:
                return peerpart.Part(step, self.comm.rank, where, view)
        except (OSError, CheckpointError) as e:
            log.debug("own part of step %d: %s", step, e)
        return peerpart.Missing(step, self.comm.rank, where, None)

    def _drop_old_replicas(self, step: int) -> None:
        """After the replication of ``step``, succeeded or failed (every rank, past the
        transfers: none runs into ``peers/`` now): keep the replicas of the
        ``keep_last_local`` newest steps up to the newest replicated one (counting the
        steps this node holds no replica of, so replicas left by a node that is no
        longer a sender here, after a shrink, go too) and of ``step``; drop the rest
        (earlier failed copies, steps of an abandoned timeline). So ``peers/`` holds at
        most ``keep_last_local`` + 1 steps. Local I/O (two listings, removals); never
        raises."""
        held = peerpart.peer_steps(self.root)
        top = self.replicated
        known = sorted(set(held) | set(_own_steps(self.storage, self.root)) | {step})
        upto = [s for s in known if top is not None and s <= top]
        keep = {step} | (set(upto) - set(self.retention.to_delete(upto, {top})))
        if self.retention.keep_last is None:  # keep everything up to this step
            keep |= {s for s in held if s <= step}
        peerpart.drop_peer_steps(self.root, [s for s in held if s not in keep])

    def _check_space(self, commit: LocalCommit) -> None:
        """Warn once when ``local_root`` cannot hold another step like ``commit`` with
        its replicas: this node's share of it times (replicas + 1). One statvfs."""
        if self._warned_space:
            return
        try:
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize
            here = sum(1 for p in self.place_of.values() if p == self.place_of[self.comm.rank])
            need = commit.total_bytes * here // max(1, len(self.place_of)) * (self.replicas + 1)
        except OSError:
            return
        if free < need:
            self._warned_space = True
            log.warning("rank %d: local_root %s has %.1f GiB free; the next step and its %d "
                        "replica(s) need about %.1f GiB here (keep_last_local and replicas "
                        "multiply the fast tier's size: docs/TIERS.md)", self.comm.rank,
                        self.root, free / 2**30, self.replicas, need / 2**30)

    # ------------------------------------------------------------------ waiting
    def wait(self) -> list[BaseException]:
        """Block until every replication queued so far is done; their errors."""
        jobs, self._jobs = self._jobs, []
        return [e for e in (j.exception() for j in jobs) if e is not None]

    def close(self) -> None:
        self._exec.shutdown(wait=False)


def _own_steps(storage, root: str) -> list[int]:
    """The steps with an own step directory under ``root``. Never raises."""
    try:
        return [int(m.group(1)) for m in (peerpart.STEP_DIR.match(e.name)
                                          for e in storage.listdir(root) if e.is_dir) if m]
    except OSError:
        return []


def reclaim(root: str, sharers: set[int] | None, rank: int) -> int:
    """Remove ``root/peers/`` (every replica held there) when this job keeps none
    (``replicas=0``, or one process): nothing reads or renews them, and in ``/dev/shm``
    they would hold memory for the rest of the job. Run by the lowest rank of
    ``sharers`` (every rank when that is unknown), at the tier's construction,
    before any save. Returns the number of steps removed. Local I/O; never raises."""
    if sharers and min(sharers) != rank:
        return 0
    steps = peerpart.peer_steps(root)
    peerpart.drop_peer_steps(root, steps)
    try:
        os.rmdir(os.path.join(root, peerpart.PEERS))
    except OSError:
        pass  # absent, or not empty (a file that is no step's): left as it is
    if steps:
        log.info("rank %d: removed the replicas of step(s) %s from %s: this job keeps none",
                 rank, steps, root)
    return len(steps)
