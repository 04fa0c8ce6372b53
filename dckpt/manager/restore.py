"""CheckpointManager's restore: the newest checkpoint that loads, from the fastest tier
that has it, falling back past damaged ones (a mixin of :class:`dckpt.CheckpointManager`,
whose attributes it uses)."""
from __future__ import annotations

import logging
import time
from typing import Any

from . import failures, history
from ..errors import CheckpointError, CommunicationError, IntegrityError, NotCommittedError
from ..format import manifest as mf
from ..protocol.collectives import on_rank0
from ..protocol.restore import load as _load
from ..protocol.restore import needed_chunks, read_manifest
from ..protocol.rename import Rename, nested
from ..state import rng
from ..storage.fsspec_storage import make_storage
from ..protocol.refcount import remove_checkpoints
from ..tiers.chooser import Candidate, fallback_worthy, live_timeline, timeline_of
from ..tiers.local import step_name

log = logging.getLogger("dckpt.manager.core")  # one logger for the manager's messages


def failure_causes(e: BaseException) -> str:
    """``e``'s failing ranks and each one's cause ("failed on ranks 1, 2: rank 1: ...;
    rank 2: ..."), from its ``failures`` when it was gathered from several ranks, else
    its type and message. Pure."""
    failures = getattr(e, "failures", None)
    if not failures:
        return f"{type(e).__name__}: {e}"
    ranks = sorted(failures)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"failed on {who}: " + "; ".join(f"rank {r}: {failures[r]}" for r in ranks)


class RestoreMixin:
    """:meth:`restore` and what it needs. Every public method is collective."""

    # The current restore's allow_missing/rename, as every load and read plan of it
    # uses them (rebound by each restore, never mutated).
    _load_how: dict[str, Any] = {}
    _strict = True  # the current restore's strict (dckpt.load's: unexpected keys raise)
    _loaded_save_id: str | None = None  # the save id of the manifest the last load read

    def restore(self, state: Any, step: int | None = None, *, allow_missing: bool = False,
                rename: Rename = None, strict: bool = True) -> int | None:
        """Restore the newest committed checkpoint that loads and verifies (or exactly
        ``step``) into ``state`` in place; returns its step. Collective.

        "Newest" is in commit order, across tiers: the steps of both tiers (with a fast
        tier, the steps every rank holds locally from one save, at this world size,
        saved for this root) line up on one timeline by their commit times, steps of
        an abandoned timeline are left out (see the class docstring), and the newest
        remaining step is tried first, from the fast tier when it holds it. A failed
        try (a file missing or corrupt on some node, a changed layout, a durable
        checkpoint that fails its checks) is skipped with a warning naming the
        problem, and every rank goes on with the next newest. :attr:`restored_from`
        says which tier was used (``"local"``, ``"durable"``, or with ``replicas``
        ``"peer"``: some rank's files came from another node's replicas, see
        docs/TIERS.md).

        Returns None only when there is no committed checkpoint at all, and then leaves
        ``state`` exactly as it was; when there are some and none loads, it raises
        CheckpointError listing each step tried and why (``state`` is then undefined: a
        failed load may have overwritten part of it). ``step`` given: that step, from
        its newest save (the fast tier's, then the durable one), whatever its timeline.
        Waits for the saves in flight first.

        ``allow_missing`` and ``rename`` are :func:`dckpt.load`'s, applied to every
        step tried (from any tier). ``rename`` maps the keys as they are in ``state``
        (its flattened keys, e.g. "model.fc.weight" for a TrainingState, "net.w" for
        ``{"net": {"w": ...}}``), not under the manager's own "state." prefix; the
        manager's "rng."/"manager." entries are never renamed. Without
        ``allow_missing``, keys the checkpoints lack make the restore raise (they are
        not skipped as damaged). ``strict=False``: keys of the checkpoint that ``state``
        does not ask for are ignored (a partial restore, as DCP's load does: one
        component left out, per-rank keys of ranks that no longer exist)."""
        how = {"allow_missing": bool(allow_missing), "rename": nested("state.", rename)}
        self._strict = bool(strict)
        self._finish_inflight(raise_error=False)
        if self.tier is not None:
            self.tier.wait(raise_error=False)
        self._load_how = how
        self.restored_from = None
        self.restored_epoch = None
        cands, durable_down = self._durable_candidates()
        opts: dict[tuple, Any] = {}  # with replicas: the fast tier's options by (step, time)
        if self.tier is not None and self.tier.peers is not None:
            for o in self.tier.peer_options():
                opts[(o.choice.step, o.choice.created)] = o
                cands.append(Candidate(o.choice.step, "peer", o.choice.created,
                                       o.choice.save_id))
        elif self.tier is not None:
            cands += [Candidate(s, "local", h.created, h.save_id, h.parent)
                      for s, h in self.tier.held_steps().items()]
        # Commits made after this restore order after everything seen now, whatever
        # this host's clock says (tiers.chooser.timeline_of).
        newest = max((c.created for c in cands if c.created is not None), default=None)
        self._after = None if newest is None else newest + 1e-3  # strictly after
        tried: list[str] = []
        if step is not None:
            def newest(c: Candidate) -> tuple:
                return (c.created if c.created is not None else float("-inf"),
                        c.tier != "durable")

            for c in sorted((c for c in cands if c.step == step), key=newest, reverse=True):
                if c.tier == "durable":
                    break  # the durable save of the step is the newer one
                used = self._try_fast(c, opts, state, tried)
                if used:
                    return self._restored(step, used, state)
            if durable_down is not None:
                raise durable_down
            self._load(step, state)  # raises why when it cannot
            return self._restored(step, "durable", state)
        order, abandoned = live_timeline(cands)
        if abandoned and self.comm.rank == 0:
            log.warning("step(s) %s under %s (%s) were committed before a lower step: they "
                        "belong to an abandoned timeline and are not restored",
                        sorted({c.step for c in abandoned}), self._root_arg,
                        ", ".join(f"{c.step} {c.tier}" for c in abandoned))
        for c in order:
            if c.tier != "durable":
                used = self._try_fast(c, opts, state, tried)
                if used:
                    return self._restored(c.step, used, state)
                continue
            try:
                self._load(c.step, state)
            except (IntegrityError, NotCommittedError) as e:
                self._warn_once("checkpoint step %d under %s is unusable, trying an older "
                                "one: %s", c.step, self._root_arg, failure_causes(e))
                tried.append(f"step {c.step}: {type(e).__name__}: {e}")
                continue
            return self._restored(c.step, "durable", state)
        if durable_down is not None:  # nothing could be restored without it
            if tried:
                raise CheckpointError(f"{durable_down} (and the fast tier's steps failed: "
                                      + "; ".join(tried) + ")", durable_down.failures)
            raise durable_down
        if tried:
            raise CheckpointError(
                f"no checkpoint under {self._root_arg} could be restored ({len(tried)} "
                "tried, newest first); the state may hold part of a failed load:\n  "
                + "\n  ".join(tried))
        self._observe_failures(False)
        self._prepare(state, loaded=False)  # leaves the state exactly as it was
        return None

    def _durable_candidates(self) -> tuple[list[Candidate], CheckpointError | None]:
        """(the durable tier's committed steps as candidates, None), or with a fast tier
        and the durable root unreachable ([], the error): the restore goes on with the
        fast tier, the reason it exists (a durable outage must not block it), and
        raises the error only if that finds nothing. Collective: rank 0 lists and
        reads the manifests, every rank gets the list or the error."""
        try:
            durable = on_rank0(self.comm, self._candidates,
                               f"list checkpoints under {self._root_arg}")
        except CommunicationError:
            raise
        except CheckpointError as e:
            if self.tier is None:
                raise
            self._warn_once("the durable root %s cannot be listed (%s): restoring from the "
                            "fast tier only", self._root_arg, e)
            return [], e
        return [Candidate(s, "durable", t, sid, parent)
                for s, t, sid, parent in durable], None

    def _try_fast(self, c: Candidate, opts: dict, state: Any, tried: list[str]) -> str | None:
        """Load ``c`` from the fast tier: the tier used (``"local"``, or ``"peer"`` when
        some bytes came from another node's replicas), or None (noted in ``tried``)
        when that fails in a way the durable tier may not (any CheckpointError but a
        broken group). Collective."""
        step = c.step

        def loader(p: str, name: str, n: int) -> None:
            self._load(step, state, p, name, n)

        try:
            if c.tier == "peer":
                return self.tier.peer_restore(
                    opts[(c.step, c.created)], loader,
                    lambda m: self._needs(state, m))
            self.tier.load(step, loader)
            return "local"
        except Exception as e:
            if not fallback_worthy(e):
                raise
            # Each rank read its own local_root: name the failing ranks and their causes,
            # not the directory of the rank that logs.
            self._warn_once("step %d in the fast tier could not be restored, trying the next "
                            "newest: %s", step, failure_causes(e))
            tried.append(f"step {step} ({c.tier}): {type(e).__name__}: {e}")
            return None

    def _warn_once(self, msg: str, *args: Any) -> None:
        """Log a warning about an error every rank raised alike (a gathered one): rank 0
        logs it, the other ranks at debug level, so a job's log holds it once."""
        log.log(logging.WARNING if self.comm.rank == 0 else logging.DEBUG, msg, *args)

    def _observe_failures(self, restored: bool) -> None:
        """``every_steps="auto"`` without ``mtbf_hours``: update the MTBF estimate from
        the failures observed (see :mod:`dckpt.manager.failures`). Collective (rank 0 reads and
        writes the small history file, every rank gets the estimate)."""
        if self.policy.every_steps != "auto" or self.policy.mtbf_hours is not None:
            return
        self.policy.estimated_mtbf_hours = on_rank0(
            self.comm, lambda: failures.observe(self.storage, self.root, restored),
            "update the failure history")

    def _restored(self, step: int, tier: str, state: Any) -> int:
        self._observe_failures(True)
        self._prepare(state)
        self.restored_from = tier
        self._epoch = self.restored_epoch = self._loaded_epoch
        self._last_step, self._last_time = step, time.monotonic()
        self._base = None  # a chain starts with a full save in every process's life
        self._parent = self._loaded_save_id  # the next commit continues this one
        if self.tier is not None:
            self.tier.last_commit = None
            self.tier.last_durable = step
            if self.tier.chain is not None:
                self.tier.chain.reset()  # and the staged copies' chain too
        if self.comm.rank == 0:
            log.info("restored step %d from the %s tier", step, tier)
        return step

    def _candidates(self) -> list[tuple[int, float | None, str | None, str | None]]:
        """Rank 0: every committed durable step, ascending, with its time on the
        timeline, save id and parent (None: its manifest could not be read; its load
        reports why). Reads every committed manifest; adds the history records a
        crash prevented. Notes the highest step for :meth:`_drop_abandoned`."""
        committed = self._local_steps()[0]
        known: dict[int, tuple] = {}
        recovered: dict[str, history.SaveRecord] = {}
        for s in committed:
            try:
                storage, root = make_storage(self.path(s), self.storage_options)
                m = read_manifest(storage, root)[0]
                t, parent = timeline_of(m)
                known[s] = (t, m.save_id, parent)
                recovered[m.save_id] = history.recovered_record(s, m)
            except CheckpointError:
                pass  # unreadable: tried in its turn, and its load reports why
        if self.history is not None and recovered:  # records a crash after a commit prevented
            self.history.reconcile(recovered)
        self._durable_ceiling = committed[-1] if committed else float("-inf")
        return [(s, *known.get(s, (None, None, None))) for s in committed]

    def _drop_abandoned(self, step: int, save_id: str) -> None:
        """Rank 0, after ``step`` committed in the fast tier as ``save_id``: the
        committed durable steps above it, and a durable copy of ``step`` from another
        save, belong to an abandoned timeline (the job was rewound); remove them, with
        a warning, as a durable commit does. Without this, a restart whose fast tier is
        gone (a reboot, a lost node) would take such a step, newer than anything on
        the live timeline in the durable tier. The steps of the live timeline are
        never touched: their durable copies are older than ``step``, and after a
        restore only durable steps committed before it (on the timeline, see
        :meth:`_abandoned_before_restore`) go: one this manager never saw (the durable
        root was down at its restore) is kept.
        Lists the root only when a durable step at or above ``step`` may exist from an
        earlier timeline (the first local commit of this manager, or after a restore);
        a failure (the durable root down) is logged and a later local commit tries
        again from the first step that failed, at most once a minute. No collective;
        never raises."""
        if self.comm.rank != 0:
            return
        if self._drop_from is None and step > self._durable_ceiling:
            return
        start = step if self._drop_from is None else min(step, self._drop_from[0])
        own = save_id if self._drop_from is None or step <= self._drop_from[0] \
            else self._drop_from[1]
        if time.monotonic() < self._drop_retry_at:
            self._drop_from = (start, own)
            return
        try:
            doomed = self._abandoned_before_restore(start, own)
            if doomed:
                log.warning("step %d committed in the fast tier: removing step(s) %s under "
                            "%s of the abandoned timeline (saved before the job was "
                            "rewound)", start, doomed, self._root_arg)
                remove_checkpoints(self.storage, self.root, [step_name(s) for s in doomed])
        except Exception as e:
            self._drop_retry_at = time.monotonic() + 60.0
            self._drop_from = (start, own)
            log.warning("could not remove the abandoned step(s) from %d on under %s (a later "
                        "local commit tries again; a restore never takes them: "
                        "docs/GUARANTEES.md, Timelines): %s", start, self._root_arg, e)
            return
        self._drop_from = None
        self._durable_ceiling = step - 1  # later commits of this timeline: nothing to do

    _drop_retry_at = 0.0  # monotonic time before which _drop_abandoned does not retry
    # (first step, its save id) of a removal that failed: retried from there
    _drop_from: tuple[int, str] | None = None

    def _abandoned_before_restore(self, step: int, save_id: str | None) -> list[int]:
        """Rank 0: the committed durable steps above ``step``, and ``step`` itself when
        its save is not ``save_id``, that were committed before this manager's restore
        (on the timeline: before ``_after``; after no restore, all of them). A step
        committed later (by a run this manager never saw: the durable root was down at
        its restore) or whose manifest cannot be read is kept. Lists the root, reads
        the manifests of those steps. Raises what the listing raises."""
        steps = [s for s in self._local_steps()[0] if s >= step]
        read: dict[int, mf.Manifest | None] = {}
        if step in steps:
            m = read[step] = self._durable_manifest(step)
            if m is not None and m.save_id == save_id:
                steps.remove(step)  # this very commit's durable copy
        return self._before_restore(steps, read)

    def _before_restore(self, steps: list[int],
                        read: dict[int, mf.Manifest | None] | None = None) -> list[int]:
        """Rank 0: those of the durable ``steps`` committed before this manager's last
        restore (all of them when it restored nothing: a run that started over).
        One committed after it, which the restore did not see (the durable root was
        unreachable then), is kept, with a warning; so is one whose manifest cannot
        be read. Reads those steps' manifests (only when it restored; ``read``: those
        already read)."""
        if self._after is None or not steps:
            return list(steps)
        out = []
        for s in steps:
            m = read[s] if read and s in read else self._durable_manifest(s)
            if m is not None and timeline_of(m)[0] < self._after:
                out.append(s)
            else:
                log.warning("durable step %d under %s was not seen by this job's restore (the "
                            "durable root was unreachable then?): kept, not removed as an "
                            "abandoned step; restore(state, step=%d) restores it", s,
                            self._root_arg, s)
        return out

    def _durable_manifest(self, step: int) -> mf.Manifest | None:
        """Rank 0: the manifest of the durable copy of ``step`` (None: unreadable)."""
        try:
            storage, root = make_storage(self.path(step), self.storage_options)
            return read_manifest(storage, root)[0]
        except CheckpointError:
            return None

    def _load(self, step: int, state: Any, path: str | None = None,
              manifest_name: str | None = None, read_workers: int = 4) -> None:
        path = path or self.path(step)
        rank = self.comm.rank
        found: dict[str, Any] = {}
        self._loaded_epoch = None
        self._loaded_save_id = None
        target, extra = self._load_target(state, found)
        _load(target, path, process_group=self.group,
              storage_options=None if manifest_name else self.storage_options,
              ignore_prefixes=("rng.", "manager."), extra=extra,
              manifest_name=manifest_name, read_workers=read_workers, strict=self._strict,
              **self._load_how)
        if "sd" in found:
            if rank < found["world"]:
                rng.restore(found["sd"])
            else:
                rng.reseed(rank, found["sd"])

    def _needs(self, state: Any, m: mf.Manifest) -> dict[int, set]:
        """{file index: {(key, chunk offsets)}}: what this rank's load of ``m`` into
        ``state`` reads (a restore from peers at another world size fetches only
        that). No I/O; raises what the load's matching raises."""
        target, extra = self._load_target(state, {})
        return needed_chunks(target, m, extra, **self._load_how)

    def _load_target(self, state: Any, found: dict[str, Any]) -> tuple[dict, Any]:
        """(the load's target, its ``extra``): ``state`` under "state", and the RNG
        state this rank restores, shaped after the manifest (noted in ``found``). No
        I/O."""
        rank = self.comm.rank
        target: dict[str, Any] = {"state": state}

        def extra(m: mf.Manifest) -> dict[str, Any]:
            self._loaded_save_id = m.save_id  # the restored commit: the next one's parent
            e = m.values.get("manager.epoch")  # read here: no target needed for it
            valid = isinstance(e, int) and not isinstance(e, bool) and e >= 0
            self._loaded_epoch = e if valid else None
            return rng_target(m) if self.capture_rng else {}

        def rng_target(m: mf.Manifest) -> dict[str, Any]:
            # Shaped after what the checkpoint holds, not after this process's devices.
            if not any(k.startswith("rng.") for k in (*m.tensors, *m.values)):
                return {}
            found["world"] = m.world_size
            found["src"] = src = rank % m.world_size
            found["sd"] = rng.saved_target(m, src)
            return {"rng": {f"rank{src}": found["sd"]}}

        return target, extra
