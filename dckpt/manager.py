"""CheckpointManager: when to save, what to keep, and a restore that heals itself."""
from __future__ import annotations

import json
import logging
import re
import signal
import time
from typing import Any

from .dist.collectives import Comm
from .dist.commit import save as _save
from .dist.restore import load as _load
from .dist.restore import read_manifest
from .engine.async_save import SaveHandle
from .engine.async_save import async_save as _async_save
from .errors import CheckpointError, IntegrityError, NotCommittedError
from .format import manifest as mf
from .policy import RetentionPolicy, SavePolicy
from .state import rng
from .storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointManager:
    """Saves a training state under ``root/step-<N>`` on a policy, keeps what the
    retention policy says, and restores the newest checkpoint that loads.

    Every method is collective (call it on every rank, in the same order) except
    :meth:`path`. ``every_steps`` (an int, or ``"auto"`` with ``mtbf_hours``: Young/Daly's
    interval from the measured save blocking time, see :mod:`dckpt.policy`) and
    ``every_seconds`` decide when :meth:`save` saves; time decisions are taken on rank 0
    and broadcast, so every rank saves the same step. ``keep_last`` / ``keep_every``
    decide what is kept; the newest committed checkpoint and one in flight are never
    deleted, and deletions happen only after a newer checkpoint has committed.
    ``capture_rng`` saves and restores each rank's Python, NumPy, torch CPU and CUDA RNG
    states: at the same world size each rank gets its own back; when the world size
    changed, rank r gets the state saved by rank r mod N (N saved ranks), and ranks
    r >= N are then reseeded from it and r, so no two ranks share a stream.

    ``save_on_sigterm`` (preemption): a SIGTERM handler notes the signal; the next
    :meth:`save` call on every rank agrees on it (one small all-gather per call while
    enabled), finishes the save in flight, writes a final synchronous checkpoint of
    that step, and exits the process with status 0 (``SystemExit``).
    """

    def __init__(self, root: str, *, every_steps: int | str | None = None,
                 every_seconds: float | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, async_save: bool = False,
                 process_group: Any = None, storage_options: dict | None = None,
                 capture_rng: bool = True, mtbf_hours: float | None = None,
                 save_on_sigterm: bool = False) -> None:
        self.policy = SavePolicy(every_steps, every_seconds, mtbf_hours)
        self.retention = RetentionPolicy(keep_last, keep_every)
        self.async_save, self.capture_rng = async_save, capture_rng
        self.group, self.storage_options = process_group, storage_options
        self.comm = Comm(process_group)
        self.storage, self.root = make_storage(root, storage_options)
        self._root_arg = root
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self._calls: tuple[int, float] | None = None  # (step, time) of the previous save() call
        self.save_seconds: float | None = None  # blocking time of the last save
        self.step_seconds: float | None = None
        self._inflight: tuple[int, SaveHandle] | None = None
        self._error: BaseException | None = None
        self.save_on_sigterm = save_on_sigterm
        self._sigterm = False
        if save_on_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)  # main thread only, as Python requires
        if self.comm.rank == 0:
            self.storage.makedirs(self.root)

    # ------------------------------------------------------------------ paths, listing
    def path(self, step: int) -> str:
        """Where ``step``'s checkpoint lives or would live. No I/O."""
        return self.storage.join(self._root_arg.rstrip("/"), f"step-{int(step):08d}")

    def _local_steps(self) -> tuple[list[int], list[int]]:
        committed, partial = [], []
        try:
            entries = self.storage.listdir(self.root)
        except FileNotFoundError:
            return [], []
        for e in entries:
            m = STEP_DIR.match(e.name)
            if e.is_dir and m:
                done = self.storage.exists(self.storage.join(self.root, e.name, mf.MANIFEST_NAME))
                (committed if done else partial).append(int(m.group(1)))
        return sorted(committed), sorted(partial)

    def steps(self) -> list[int]:
        """Committed steps, ascending. Collective: rank 0 lists, every rank gets its list."""
        mine = json.dumps(self._local_steps()[0]).encode() if self.comm.rank == 0 else None
        return json.loads(self.comm.broadcast_bytes(mine))

    # ------------------------------------------------------------------ saving
    def _decide(self, step: int, force: bool) -> bool:
        now = time.monotonic()
        if self._calls is not None and step > self._calls[0]:
            dt = (now - self._calls[1]) / (step - self._calls[0])
            self.step_seconds = dt if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * dt
        self._calls = (step, now)
        due = force or self.policy.due(step, self._last_step, now - self._last_time,
                                       self.save_seconds, self.step_seconds)
        if self.policy.every_seconds is None and not force and self.policy.every_steps != "auto":
            return due  # a pure function of the step: the same on every rank, no collective
        # Clocks and measured times differ per rank: rank 0 decides for everyone.
        return self.comm.broadcast_bytes(b"1" if due else b"0") == b"1"

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _preempted(self) -> bool:
        votes = self.comm.all_gather_bytes(b"1" if self._sigterm else b"0")
        return b"1" in votes

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save ``state`` as ``step`` when the policy says so (or ``force``); returns
        whether a save started. Synchronous mode returns after the commit; async mode
        after the snapshot. Waits for a previous async save first. A failed async
        save is logged here and raised by :meth:`wait`."""
        if self.save_on_sigterm and self._preempted():
            log.warning("preempted (SIGTERM): writing a final checkpoint of step %d", step)
            self._finish_inflight(raise_error=False)
            self.save_on_sigterm = self.async_save = False  # one final, synchronous save
            if self._last_step != step:
                self.save(step, state, force=True)
            raise SystemExit(0)
        if not self._decide(step, force):
            return False
        self._finish_inflight(raise_error=False)
        full: dict[str, Any] = {"state": state}
        if self.capture_rng:
            full["rng"] = {f"rank{self.comm.rank}": rng.capture()}
        t0 = time.perf_counter()
        path = self.path(step)
        if self.async_save:
            h = _async_save(full, path, process_group=self.group,
                            storage_options=self.storage_options, overwrite=True)
            self._inflight = (step, h)
            blocked = h.blocking_seconds
        else:
            _save(full, path, process_group=self.group, storage_options=self.storage_options,
                  overwrite=True)
            blocked = time.perf_counter() - t0
            self._after_commit(step)
        self.save_seconds = blocked
        self._last_step, self._last_time = step, time.monotonic()
        return True

    def _finish_inflight(self, raise_error: bool) -> None:
        if self._inflight is not None:
            step, h = self._inflight
            self._inflight = None
            try:
                h.result()
                self._after_commit(step)
            except Exception as e:
                log.error("checkpoint of step %d failed: %s", step, e)
                self._error = e
        if raise_error and self._error is not None:
            err, self._error = self._error, None
            raise err

    def _after_commit(self, step: int) -> None:
        """Rank 0: apply retention now that ``step`` is committed, and remove leftovers
        of failed saves of earlier steps. Failures are logged, never raised."""
        if self.comm.rank != 0:
            return
        committed, partial = self._local_steps()
        doomed = self.retention.to_delete(committed, protected={step})
        doomed += [s for s in partial if s < step]
        for s in doomed:
            try:
                self.storage.remove_tree(self.storage.join(self.root, f"step-{s:08d}"))
                log.info("removed checkpoint step %d under %s", s, self.root)
            except OSError as e:
                log.warning("could not remove checkpoint step %d: %s", s, e)

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed; raise its error."""
        self._finish_inflight(raise_error=True)

    def close(self) -> None:
        self.wait()

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

    # ------------------------------------------------------------------ restoring
    def restore(self, state: Any, step: int | None = None) -> int | None:
        """Restore the newest committed checkpoint that loads and verifies (or exactly
        ``step``) into ``state`` in place; returns its step, or None when there is none.
        A checkpoint whose manifest or data fails its checks is skipped with a warning
        naming the problem, and the next newest is tried. Waits for a save in flight."""
        self._finish_inflight(raise_error=False)
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        for s in candidates:
            try:
                self._load(s, state)
            except (IntegrityError, NotCommittedError) as e:
                if step is not None:
                    raise
                log.warning("checkpoint step %d under %s is unusable, trying an older one: %s",
                            s, self.root, e)
                continue
            self._last_step, self._last_time = s, time.monotonic()
            return s
        return None

    def _load(self, step: int, state: Any) -> None:
        path = self.path(step)
        target: dict[str, Any] = {"state": state}
        saved_world = self._saved_world(path) if self.capture_rng else 0
        rank = self.comm.rank
        src = rank % saved_world if saved_world else 0
        if self.capture_rng and saved_world:
            target["rng"] = {f"rank{src}": rng.capture()}
        _load(target, path, process_group=self.group, storage_options=self.storage_options,
              ignore_prefixes=("rng.",))
        if "rng" in target:
            if rank < saved_world:
                rng.restore(target["rng"][f"rank{src}"])
            else:
                rng.reseed(rank, target["rng"][f"rank{src}"])

    def _saved_world(self, path: str) -> int:
        """World size recorded in ``path``'s manifest, read on rank 0 (0 when it has
        no RNG state). Collective."""
        data = None
        if self.comm.rank == 0:
            try:
                storage, root = make_storage(path, self.storage_options)
                m, _ = read_manifest(storage, root)
                has_rng = any(k.startswith("rng.") for k in (*m.tensors, *m.values))
                data = str(m.world_size if has_rng else 0).encode()
            except CheckpointError:
                data = b"0"  # the load that follows reports the problem on every rank
        return int(self.comm.broadcast_bytes(data) or b"0")
