"""CheckpointManager: when to save, what to keep, and a restore that heals itself."""
from __future__ import annotations

import logging
import signal
import time
from typing import Any

from ..protocol.collectives import Comm, on_rank0
from ..protocol.commit import save as _save
from ..protocol.async_save import SaveHandle
from ..protocol.async_save import _fence_targets
from ..protocol.async_save import release_buffers as _release_buffers
from ..protocol.async_save import async_save as _async_save
from ..errors import CheckpointError
from ..catalog.retention import RetentionPolicy
from .policy import SavePolicy, check_epoch, estimate_mtbf_hours
from . import failures, history
from ..state.training import fence_targets
from ..tiers.fast import FastTier
from ..tiers.stage_encoded import Chain
from ..tiers.local import step_name
from .inflight import InflightMixin
from .restore import RestoreMixin
from .retention import RetentionMixin
from .setup import check_settings, durable_owner
from .triggers import TriggerMixin
from ..storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)


class CheckpointManager(TriggerMixin, InflightMixin, RetentionMixin, RestoreMixin):
    """Saves a training state under ``root/step-<N>`` on a policy, keeps what the
    retention policy says, and restores the newest checkpoint that loads.

    Every method is collective (call it on every rank, in the same order) except
    :meth:`path`. ``every_steps`` (an int, or ``"auto"``: Young/Daly's interval from the
    measured save blocking time and ``mtbf_hours``, or without it an MTBF estimated from
    the restarts observed, see :mod:`dckpt.manager.policy` and :mod:`dckpt.manager.failures`) and
    ``every_seconds`` decide when :meth:`save` saves; time decisions are taken on rank 0
    and broadcast, so every rank saves the same step. ``every_epochs=N`` saves at the end
    of every N-th epoch: pass ``epoch=e`` (counting from 0) to the :meth:`save` call of
    epoch e's last step, and epochs N-1, 2N-1, ... are saved; a pure function of the
    epoch, so no collective (every rank must pass the same epoch). The policies compose:
    a step is saved when any of them is due. Each save records the last epoch passed
    (in its manifest, under the value ``manager.epoch``); :meth:`restore` sets
    :attr:`restored_epoch` from it, and replaying the end of an epoch that the restored
    checkpoint already holds does not save it again (see
    :meth:`dckpt.manager.policy.SavePolicy.epoch_due`). ``keep_last`` / ``keep_every``
    decide what is kept; the newest committed checkpoint and one in flight are never
    deleted, and deletions happen only after a newer checkpoint has committed.
    ``capture_rng`` saves and restores each rank's Python, NumPy, torch CPU and CUDA RNG
    states: at the same world size each rank gets its own back; when the world size
    changed, rank r gets the state saved by rank r mod N (N saved ranks), and ranks
    r >= N are then reseeded from it and r, so no two ranks share a stream.

    Timelines: when a save of step s commits, committed steps newer than s under the
    root belong to an abandoned timeline (the job was rewound with ``restore(step=...)``,
    e.g. past a loss spike): they are removed after the commit, with a warning, and
    :meth:`restore` never picks a step that was committed before an older step was
    (read from the manifests' commit times), even if its removal did not happen. With
    ``local_root`` this holds across tiers (commit order decides, not step numbers),
    and a local commit removes the durable steps above it too; a fast-tier step saved
    for another root (another run id in ``root/.dckpt-run-id``) is never restored.
    See docs/GUARANTEES.md, Timelines.

    One manager (one job) per root: two jobs saving under one root is not supported.

    ``incremental=True``: each save stores only the chunks that changed since the step
    this manager last committed and references that step's files for the rest (see
    :func:`dckpt.save`'s ``base``); every ``full_every``-th save, the first save after
    the manager is made or restores, and the save after a failed one are full.
    Retention then removes a step's manifest and only the files no kept step
    references, so deleting old steps never breaks newer ones. ``compression``
    (None, "zstd", "lz4") applies to every save. With ``local_root`` both apply to the
    durable copies only (the fast tier stays full and raw): each is incremental against
    the last durable step this manager committed, from the block hashes in that step's
    manifest (its data is never read back), see :mod:`dckpt.tiers.stage_encoded`.

    Save history: rank 0 appends a record of every committed save (step, commit time,
    bytes, blocking and total seconds, world size, tier "durable" or "local", epoch) to
    ``root/.dckpt-saves.jsonl``, one self-checking JSON line each (the last 10,000
    kept), from a background thread; a synchronous save's record is written before
    :meth:`save` returns, an asynchronous or staged one when its commit is known.
    :meth:`restore` adds the records a crash prevented (from the manifests, without
    timings). A history failure is logged, never raised. ``dckpt history ROOT`` shows
    it (``--plot`` draws it); format and costs: docs/HISTORY.md, :mod:`dckpt.manager.history`.

    ``async_save=True`` saving a :class:`dckpt.TrainingState` with an optimizer
    (anywhere in the state) returns before the snapshot copy: the state's optimizers
    wait for it at their next ``step()`` and its model at its next forward (of any
    module: a forward may write saved tensors in place), see :func:`dckpt.async_save`'s
    ``fence``. Anything else in the state that the training loop changes before that
    must not be changed in place until :meth:`wait_snapshot` returns (an in-place
    write fails the save, naming the tensor). With
    ``local_root`` and CPU tensors there is no snapshot copy at all: the fast tier's
    files are written from the live tensors in the background and are the one host
    copy of the state (the optimizers wait until this rank's files are written).

    ``save_on_sigterm`` (preemption): a SIGTERM handler notes the signal; the next
    :meth:`save` call on every rank agrees on it (with :meth:`request_save`'s flag: one
    all-reduce of two ints per call), finishes the save in flight, writes a final synchronous checkpoint of
    that step, and exits the process with status 0 (``SystemExit``).
    """

    def __init__(self, root: str, *, every_steps: int | str | None = None,
                 every_seconds: float | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, async_save: bool = False,
                 process_group: Any = None, storage_options: dict | None = None,
                 capture_rng: bool = True, mtbf_hours: float | None = None,
                 save_on_sigterm: bool = False, local_root: str | None = None,
                 keep_last_local: int = 1, durable_every_steps: int | None = None,
                 incremental: bool = False, full_every: int = 10,
                 compression: str | None = None, every_epochs: int | None = None,
                 replicas: int = 0, node: Any = None) -> None:
        self.comm = Comm(process_group)
        check_settings(self.comm, root=root, every_steps=every_steps,
                       every_seconds=every_seconds, every_epochs=every_epochs,
                       async_save=async_save, local_root=local_root,
                       keep_last_local=keep_last_local,
                       durable_every_steps=durable_every_steps, incremental=incremental,
                       full_every=full_every, compression=compression, replicas=replicas,
                       capture_rng=capture_rng)
        self.incremental, self.full_every, self.compression = incremental, full_every, compression
        # The step this process last committed and how many saves since the last full
        # one: the base of the next incremental save (None: the next save is full).
        self._base: int | None = None
        self._since_full = 0
        self.policy = SavePolicy(every_steps, every_seconds, mtbf_hours,
                                 every_epochs=every_epochs)
        # The last epoch passed to save(epoch=) or held by the restored checkpoint:
        # recorded with every save, and the epoch policy never saves it twice.
        self._epoch: int | None = None
        self._loaded_epoch: int | None = None
        self.restored_epoch: int | None = None  # the restored checkpoint's epoch, if any
        if failures.restart_count():  # before any restore: torchelastic's count
            self.policy.estimated_mtbf_hours = estimate_mtbf_hours(failures.restart_count(), 0.0)
        self.retention = RetentionPolicy(keep_last, keep_every)
        self.async_save, self.capture_rng = async_save, capture_rng
        self.group, self.storage_options = process_group, storage_options
        self.storage, self.root = make_storage(root, storage_options)
        self._root_arg = root
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._calls: tuple[int, float] | None = None  # (step, time) of the previous save() call
        self.save_seconds: float | None = None  # blocking time of the last save
        self._lost: SaveHandle | None = None  # the last async save, until the next call
        self.step_seconds: float | None = None
        self._inflight: tuple[int, SaveHandle] | None = None
        self._error: BaseException | None = None
        self.save_on_sigterm = save_on_sigterm
        self._sigterm = False
        if save_on_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)  # main thread only, as Python requires
        self._requested = False
        self.restored_from: str | None = None  # "local" or "durable" after a restore
        # The highest durable step that may lie above, or at, this manager's next local
        # commit from an earlier timeline (rank 0; unknown until the first restore or
        # local commit: see _drop_abandoned).
        self._durable_ceiling: float = float("inf")
        # The explicit timeline (tiers.chooser.timeline_of), the same on every rank: the
        # save id the next commit continues (the restored one, then each commit) and
        # the newest commit time seen by the last restore.
        self._parent: str | None = None
        self._after: float | None = None

        owner = durable_owner(self.comm, self.storage, self.root, root, local_root)
        # Rank 0 alone writes the save history (no I/O until the first record).
        self.history = history.SaveHistory(self.storage, self.root) if self.comm.rank == 0 else None
        self.tier: FastTier | None = None
        if local_root is not None:
            self.tier = FastTier(local_root, keep_last_local=keep_last_local,
                                 durable_every=durable_every_steps, group=process_group,
                                 comm=self.comm, durable_path=self.path,
                                 storage_options=storage_options, on_durable=self._after_commit,
                                 owner=owner, replicas=replicas, node=node)
            if incremental or compression:  # the fast tier stays raw; its durable copies not
                self.tier.chain = Chain(incremental, full_every, compression, self.path)

    # ------------------------------------------------------------------ paths, listing
    def path(self, step: int) -> str:
        """Where ``step``'s checkpoint lives or would live. No I/O."""
        return self.storage.join(self._root_arg.rstrip("/"), step_name(step))

    def steps(self, tier: str = "durable") -> list[int]:
        """Committed steps, ascending. Collective. ``tier="durable"`` (the default): the
        steps under ``root``; rank 0 lists, every rank gets its list (or the same error,
        whatever rank 0 met: an OSError such as EACCES too). ``tier="local"``: the steps
        every rank holds in its own fast tier, from one save (each rank reads only its
        own ``local_root``; one all-gather)."""
        if tier == "local":
            return self.tier.common_steps() if self.tier is not None else []
        if tier != "durable":
            raise CheckpointError(f"unknown tier {tier!r}: use 'durable' or 'local'")
        return on_rank0(self.comm, lambda: self._local_steps()[0],
                        f"list checkpoints under {self._root_arg}")

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, *, epoch: int | None = None,
             force: bool = False, fence: Any = None, force_durable: bool = True) -> bool:
        """Save ``state`` as ``step`` when the policy says so (or ``force``); returns
        whether a save started. Synchronous mode returns after the commit (and its
        history record); async mode after the snapshot. Waits for a previous async save
        first. A failed async save is logged here and raised by :meth:`wait`.

        ``epoch``: pass it in the call made at the end of an epoch, the epoch that just
        ended counting from 0 (the same on every rank); ``every_epochs`` saves on it,
        and it is recorded with this save and the later ones. A separate call after the
        epoch's last step works too, but when that step was already saved by the call
        before, it is not saved again and that checkpoint records the previous epoch.
        Raises ValueError when ``epoch`` is not an int >= 0 (before any collective).

        ``fence`` (async mode; optimizers or modules, as :func:`dckpt.async_save`'s):
        more to fence on than the state's TrainingStates, e.g. the optimizer of a state
        passed as a plain dict. Raises CheckpointError for anything else.

        ``force_durable`` (with ``local_root``): whether ``force`` also makes this save
        durable (copied to ``root``, and never skipped for a newer copy), as by default.
        False: ``force`` only decides that the step is saved, and ``durable_every_steps``
        decides whether its fast-tier commit is copied, as for a save the policy chose;
        for a caller with its own save schedule that forces every save it makes (the
        torchtitan adapter). A requested save (``request_save``, SIGTERM) stays durable."""
        epoch = check_epoch(epoch)
        fences = _fence_targets(fence)  # a bad one raises before any collective, as epoch
        if self._lost is not None:
            # The last async save's cost to training, its fence's wait included (that
            # wait came at the optimizer step after it): what the "auto" policy weighs.
            self.save_seconds, self._lost = self._lost.blocking_seconds, None
        preempted, requested = self._votes()
        if preempted:
            log.warning("preempted (SIGTERM): writing a final checkpoint of step %d", step)
            self._finish_inflight(raise_error=False)
            self.save_on_sigterm = self.async_save = False  # one final, synchronous save
            if self._last_step != step:
                self.save(step, state, epoch=epoch, force=True)
            if self.tier is not None:
                self.tier.wait(raise_error=False)  # the final save is durable before exit
            raise SystemExit(0)
        if requested:
            log.info("a save was requested: saving step %d", step)
        due = self._decide(step, force or requested, epoch)
        # what makes this save's copy durable and unskippable besides the tier's rule
        pinned = (force and bool(force_durable)) or requested
        if epoch is not None:
            self._epoch = epoch  # after the decision: it compares with the previous one
        if not due:
            return False
        self._finish_inflight(raise_error=False)
        if self.tier is not None:  # the previous local commit is the next one's parent
            self.tier.wait_local()
            if self.tier.last_commit is not None:
                self._parent = self.tier.last_commit.save_id
        full = self._full(state)
        if self.async_save:
            fences = fence_targets(state) + fences
        t0 = time.perf_counter()
        path = self.path(step)
        pending = (history.PendingSave(self.history, step, self._epoch,
                                       "async" if self.async_save else "sync")
                   if self.history is not None else None)
        blocked: float | None = None
        info = None
        try:
            if self.tier is not None:
                durable = self.tier.durable_due(step, pinned)
                # With a TrainingState on CPU, the tier's files are written straight
                # from the live tensors while training goes on (one host copy); the
                # optimizers' next step waits until they are written.
                self._lost = self.tier.save(step, full, durable=durable, async_=self.async_save,
                                            on_commit=self._tier_recorder(pending), fence=fences,
                                            forced=pinned)
                blocked = time.perf_counter() - t0
            elif self.async_save:
                # The copy runs in the background; the state's optimizers and models
                # (TrainingState) wait for it at their next step and forward.
                h = _async_save(full, path, process_group=self.group,
                                storage_options=self.storage_options, overwrite=True,
                                fence=fences or None, **self._delta_args(step))
                self._inflight = (step, h)
                self._lost = h
                blocked = h.blocking_seconds
                if pending is not None:  # recorded once committed, even if never waited for
                    h.add_done_callback(lambda h: self._record_async(pending, h))
            else:
                try:
                    info = _save(full, path, process_group=self.group,
                                 storage_options=self.storage_options, overwrite=True,
                                 **self._delta_args(step))
                except BaseException:
                    self._base = None  # the next save is full: nothing half-known to build on
                    raise
                blocked = time.perf_counter() - t0
        finally:
            if pending is not None:  # even on failure: a commit's record never waits forever
                pending.blocked(time.perf_counter() - t0 if blocked is None else blocked)
        if info is not None:
            if pending is not None:  # on disk before save() returns
                pending.committed("durable", info.bytes_written, info.world_size,
                                  info.save_id, wait=True)
            self._committed(step, info.save_id)
        self.save_seconds = blocked
        self._last_step, self._last_time = step, time.monotonic()
        return True

    def _delta_args(self, step: int) -> dict[str, Any]:
        """``base``/``compression``/``block_hashes`` for the save of ``step``. No I/O, no
        collective: the same on every rank (every rank commits or fails the same saves)."""
        base = None
        if (self.incremental and self._base is not None and self._base != step
                and self._since_full + 1 < self.full_every):
            base = self.path(self._base)
        self._since_full = self._since_full + 1 if base is not None else 0
        # a full save of an incremental manager records block hashes: the next ones
        # compare with them instead of reading its bytes back
        return {"base": base, "compression": self.compression,
                "block_hashes": self.incremental}

    def _committed(self, step: int, save_id: str) -> None:
        """Every rank: ``step`` committed as ``save_id``; it is the next incremental
        save's base and the next commit's parent."""
        self._base = step
        self._parent = save_id
        self._after_commit(step)

    def _tier_recorder(self, pending: history.PendingSave | None):
        """The fast tier's ``on_commit`` hook (rank 0): records each tier's commit, and
        after a local one removes the durable steps it abandoned."""
        if self.comm.rank != 0:
            return None

        def on_commit(tier: str, commit, info) -> None:
            if tier == "durable":  # the staged copy: its own bytes, world size, save id
                if pending is not None:
                    pending.committed("durable", info.bytes_written, info.world_size,
                                      info.save_id, mode="staged")
                return
            # rank 0's local commit means every rank's (they agreed on it)
            if pending is not None:
                pending.committed("local", commit.total_bytes, self.comm.size, commit.save_id)
            self._drop_abandoned(commit.step, commit.save_id)

        return on_commit

    def wait(self) -> None:
        """Block until every save so far has committed in every tier it is meant for (a
        durable copy that could not keep up with the saves is skipped for a newer one,
        see docs/TIERS.md); raise the first error (a failed durable copy included)."""
        try:
            self._finish_inflight(raise_error=True)
        finally:
            try:
                if self.tier is not None:
                    self.tier.wait()
            finally:
                if self.history is not None:
                    self.history.flush()  # their records written too

    def close(self) -> None:
        """:meth:`wait`, then stop the background threads and free the staging buffers
        (async mode: a whole host copy of the state, kept between saves for reuse; a
        later save allocates them again)."""
        try:
            self.wait()
        finally:
            try:
                if self.tier is not None:
                    self.tier.close()  # frees its pool
                elif self.async_save and self._inflight is None:
                    _release_buffers(self.group)
            finally:
                if self.history is not None:
                    self.history.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:  # do not hide the original error behind a checkpoint one
            try:
                self.close()
            except Exception as e:
                log.error("while closing after an error: %s", e)
