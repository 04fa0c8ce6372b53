"""CheckpointManager's restore: the newest checkpoint that loads, from the fastest tier
that has it, falling back past damaged ones (a mixin of :class:`dckpt.CheckpointManager`,
whose attributes it uses)."""
from __future__ import annotations

import logging
import time
from typing import Any

from . import failures, history
from .errors import CheckpointError, IntegrityError, NotCommittedError
from .format import manifest as mf
from .protocol.collectives import on_rank0
from .protocol.restore import load as _load
from .protocol.restore import read_manifest
from .state import rng
from .storage.fsspec_storage import make_storage
from .tiers.fast import fallback_worthy

log = logging.getLogger("dckpt.manager")  # one logger for the manager's messages


class RestoreMixin:
    """:meth:`restore` and what it needs. Every public method is collective."""

    def restore(self, state: Any, step: int | None = None) -> int | None:
        """Restore the newest committed checkpoint that loads and verifies (or exactly
        ``step``) into ``state`` in place; returns its step. Collective.

        With a fast tier, the newest step every rank holds locally (from one save, at
        this world size) is tried first, unless the durable tier has a newer one; if
        that load fails anywhere (a file missing or corrupt on some node, a changed
        layout), every rank falls back to the durable tier. :attr:`restored_from` says
        which tier was used (``"local"`` or ``"durable"``).

        In the durable tier, a checkpoint whose manifest or data fails its checks is
        skipped with a warning naming the problem, and the next newest is tried; steps
        of an abandoned timeline are never tried (see the class docstring). Returns None
        only when there is no committed checkpoint at all; when there are some and none
        loads, it raises CheckpointError listing each step tried and why (``state`` is
        then undefined: a failed load may have overwritten part of it). Waits for the
        saves in flight first."""
        self._finish_inflight(raise_error=False)
        if self.tier is not None:
            self.tier.wait(raise_error=False)
        self.restored_from = None
        self.restored_epoch = None
        durable = on_rank0(self.comm, self._candidates, f"list checkpoints under {self._root_arg}")
        if step is not None:
            durable = [s for s in durable if s == step] or [step]
        tried: list[str] = []
        if self.tier is not None:
            local = [s for s in self.tier.common_steps() if step is None or s == step]
            if local and (not durable or local[-1] >= durable[0]):
                s = local[-1]
                try:
                    self.tier.load(s, lambda p, name, n: self._load(s, state, p, name, n))
                    return self._restored(s, "local", state)
                except Exception as e:
                    if not fallback_worthy(e):
                        raise
                    log.warning("step %d in the fast tier could not be restored, using the "
                                "durable tier: %s", s, e)
                    tried.append(f"step {s} (local): {type(e).__name__}: {e}")
        if step is not None:
            self._load(step, state)
            return self._restored(step, "durable", state)
        for s in durable:
            try:
                self._load(s, state)
            except (IntegrityError, NotCommittedError) as e:
                log.warning("checkpoint step %d under %s is unusable, trying an older one: %s",
                            s, self._root_arg, e)
                tried.append(f"step {s}: {type(e).__name__}: {e}")
                continue
            return self._restored(s, "durable", state)
        if tried:
            raise CheckpointError(
                f"no checkpoint under {self._root_arg} could be restored ({len(tried)} "
                "tried, newest first); the state may hold part of a failed load:\n  "
                + "\n  ".join(tried))
        self._observe_failures(False)
        self._prepare(state, loaded=False)  # leaves the state exactly as it was
        return None

    def _observe_failures(self, restored: bool) -> None:
        """``every_steps="auto"`` without ``mtbf_hours``: update the MTBF estimate from
        the failures observed (see :mod:`dckpt.failures`). Collective (rank 0 reads and
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
        if self.tier is not None:
            self.tier.last_durable = step
        if self.comm.rank == 0:
            log.info("restored step %d from the %s tier", step, tier)
        return step

    def _candidates(self) -> list[int]:
        """Rank 0: committed steps newest first, without those of an abandoned timeline
        (committed before some lower step was). Reads every committed manifest."""
        committed = self._local_steps()[0]
        created: dict[int, float] = {}
        recovered: dict[str, history.SaveRecord] = {}
        for s in committed:
            try:
                storage, root = make_storage(self.path(s), self.storage_options)
                m = read_manifest(storage, root)[0]
                created[s] = m.created
                recovered[m.save_id] = history.recovered_record(s, m)
            except CheckpointError:
                pass  # unreadable: tried in its turn, and its load reports why
        if self.history is not None and recovered:  # records a crash after a commit prevented
            self.history.reconcile(recovered)
        out, newest_lower = [], float("-inf")
        for s in committed:  # ascending
            c = created.get(s)
            if c is not None and c < newest_lower:
                log.warning("step %d under %s was committed before a lower step: it belongs "
                            "to an abandoned timeline and is not restored", s, self._root_arg)
                continue
            if c is not None:
                newest_lower = max(newest_lower, c)
            out.append(s)
        return out[::-1]

    def _load(self, step: int, state: Any, path: str | None = None,
              manifest_name: str | None = None, read_workers: int = 4) -> None:
        path = path or self.path(step)
        rank = self.comm.rank
        target: dict[str, Any] = {"state": state}
        found: dict[str, Any] = {}
        self._loaded_epoch = None

        def extra(m: mf.Manifest) -> dict[str, Any]:
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

        _load(target, path, process_group=self.group,
              storage_options=None if manifest_name else self.storage_options,
              ignore_prefixes=("rng.", "manager."), extra=extra,
              manifest_name=manifest_name, read_workers=read_workers)
        if "sd" in found:
            if rank < found["world"]:
                rng.restore(found["sd"])
            else:
                rng.reseed(rank, found["sd"])
