"""CheckpointManager's durable-tier housekeeping: which step directories are committed,
and what to remove once a step commits (a mixin of :class:`dckpt.CheckpointManager`,
whose attributes it uses: ``storage``, ``root``, ``comm``, ``retention``)."""
from __future__ import annotations

import logging

from ..protocol.refcount import remove_checkpoints
from ..format import manifest as mf
from ..protocol.intent import live_save_ids
from ..tiers.local import STEP_DIR, step_name

log = logging.getLogger("dckpt.manager.core")  # one logger for the manager's messages


class RetentionMixin:
    """Listing of the durable root and cleanup after a commit. No collectives."""

    def _local_steps(self) -> tuple[list[int], list[int]]:
        committed, partial = [], []
        try:
            entries = self.storage.listdir(self.root)
        except FileNotFoundError:
            return [], []
        for e in entries:
            m = STEP_DIR.match(e.name)
            # only this manager's own names (zero-padded): another tool's step-N in the
            # root (torchtitan's DCP steps beside a job that moved to dckpt) is neither a
            # commit nor a failed save to clean up, and step-4 would otherwise remove
            # step-00000004
            if e.is_dir and m and e.name == step_name(int(m.group(1))):
                done = self.storage.exists(self.storage.join(self.root, e.name, mf.MANIFEST_NAME))
                (committed if done else partial).append(int(m.group(1)))
        return sorted(committed), sorted(partial)

    def _after_commit(self, step: int) -> None:
        """Rank 0: now that ``step`` is committed, remove the committed steps newer than
        it (an abandoned timeline), apply retention, and remove leftovers of failed
        saves of earlier steps (never a directory whose save is still in progress).
        Local to rank 0, no collective; failures are logged, never raised."""
        if self.comm.rank != 0:
            return
        try:
            committed, partial = self._local_steps()
            abandoned = self._before_restore([s for s in committed if s > step])
            if abandoned:
                log.warning("step %d committed under %s: removing step(s) %s of the "
                            "abandoned timeline (saved before the job was rewound)",
                            step, self.root, abandoned)
            kept = [s for s in committed if s <= step]
            doomed = abandoned + self.retention.to_delete(kept, protected={step})
            doomed += [s for s in partial if s < step and not self._in_progress(s)]
        except Exception as e:
            log.warning("cleanup after step %d skipped: %s", step, e)
            return
        if not doomed:
            return
        # Manifests first, then only the files no kept step references: a newer
        # incremental step may use an older step's data.
        try:
            remove_checkpoints(self.storage, self.root, [step_name(s) for s in doomed])
            log.info("removed checkpoint step(s) %s under %s", sorted(doomed), self.root)
        except Exception as e:
            log.warning("could not remove checkpoint step(s) %s: %s", sorted(doomed), e)

    def _in_progress(self, step: int) -> bool:
        """Whether a save of ``step`` holds a live lease (another process saving it)."""
        try:
            entries = self.storage.listdir(self.storage.join(self.root, step_name(step)))
        except OSError:
            return False
        return bool(live_save_ids(entries))
