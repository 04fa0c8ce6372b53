"""Every rank reached a collective save, checked before its first collective: a save
called on one process only (diffusers' ``if accelerator.is_main_process:
accelerator.save_state(...)``) fails on that rank within ``timeout`` seconds with a
CheckpointError naming the fix, instead of waiting in the save's first collective
until the process group's 30-minute timeout."""
from __future__ import annotations

import datetime
import itertools
import logging

from ...errors import CheckpointError

log = logging.getLogger(__name__)
_instances = itertools.count()  # created in the same order on every rank (a script)


class Arrival:
    """Per object that saves (an accelerator): :meth:`check` before each save."""

    def __init__(self, what: str, timeout: float) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise CheckpointError(f"{what}: the arrival timeout must be a number of seconds "
                                  f"> 0, got {timeout!r}")
        self.what, self.timeout = what, float(timeout)
        self._id = next(_instances)
        self._n = 0

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def check(self, call: str) -> None:
        """Wait until every rank of the default process group has entered the ``n``-th
        ``call`` of this object (one key set and one wait on the group's store per
        rank). Not a collective of the group (nothing hangs there). No process group,
        or one rank: nothing. Raises CheckpointError on this rank after ``timeout`` s
        without every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception as e:  # no store to use: the save's own collectives decide
            log.debug("no default store for the arrival check: %s", e)
            return
        n, self._n = self._n, self._n + 1
        prefix = f"dckpt/arrival/{self._id}/"
        world = dist.get_world_size()
        # O(1) store requests per rank: a counter, and a key the last one to arrive sets
        if store.add(f"{prefix}{n}/count", 1) == world:
            store.set(f"{prefix}{n}/all", b"1")
        try:
            store.wait([f"{prefix}{n}/all"], datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            here = store.add(f"{prefix}{n}/count", 0)
            raise CheckpointError(
                f"{self.what}: {call} was called on rank {dist.get_rank()}, but only "
                f"{here} of the {world} ranks called it within {self.timeout:.0f} s: it "
                f"is a collective, call it on every process (not under `if "
                f"accelerator.is_main_process:`); a slower rank may need a larger "
                f"arrival timeout ({type(e).__name__})") from None
        if n > 0 and dist.get_rank() == 0:  # every rank is past the one before: drop it
            for k in (f"{prefix}{n - 1}/count", f"{prefix}{n - 1}/all"):
                try:
                    store.delete_key(k)
                except Exception:
                    pass
