"""The failures a job has seen, for the failure-aware save interval.

``every_steps="auto"`` without ``mtbf_hours``: the manager estimates the mean time
between failures from what it observes (:func:`dckpt.manager.policy.estimate_mtbf_hours`):

* torchelastic's restart count of this incarnation (``TORCHELASTIC_RESTART_COUNT``);
* the restores recorded in the durable root, ``root/.dckpt-history.json``: the time of
  the job's first start there and of every restore that found a checkpoint (each is a
  restart; a planned resume counts too, which errs on the side of saving more often).

The history is small JSON, bounded (the last 1000 restores), written by rank 0 only.
"""
from __future__ import annotations

import json
import logging
import os
import time

from .policy import estimate_mtbf_hours

log = logging.getLogger(__name__)
HISTORY = ".dckpt-history.json"
MAX_RESTORES = 1000
_MAX_BYTES = 1 << 20


def restart_count() -> int:
    """torchelastic's restart count of this incarnation (0 outside torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def observe(storage, root: str, restored: bool, now: float | None = None) -> float:
    """Rank 0: record this start (and this restore, when one happened) in the root's
    history and return the MTBF estimate in hours. Blocking I/O of a small file; a
    history that cannot be read or written is started afresh or left as it is, with a
    warning: it only tunes the interval, so this never raises."""
    now = time.time() if now is None else now
    path = storage.join(root, HISTORY)
    hist = {"first_start": now, "restores": []}
    try:
        doc = json.loads(storage.read_file(path, _MAX_BYTES))
        if (isinstance(doc, dict) and isinstance(doc.get("first_start"), (int, float))
                and isinstance(doc.get("restores"), list)):
            hist = {"first_start": float(doc["first_start"]),
                    "restores": [float(t) for t in doc["restores"] if isinstance(t, (int, float))]}
    except FileNotFoundError:
        pass
    except Exception as e:
        log.warning("failure history %s unreadable (%s): starting it afresh", path, e)
    if restored:
        hist["restores"] = (hist["restores"] + [now])[-MAX_RESTORES:]
    try:
        storage.put_atomic(path, json.dumps(hist).encode())
    except Exception as e:
        log.warning("could not record the failure history in %s: %s", path, e)
    failures = max(len(hist["restores"]), restart_count())
    hours = max(0.0, now - hist["first_start"]) / 3600.0
    est = estimate_mtbf_hours(failures, hours)
    log.info("failure-aware interval: %d failure(s) in %.1f h observed, MTBF estimate %.1f h",
             failures, hours, est)
    return est
