"""Save intents: a lease file that marks a save in progress, so gc leaves it alone.

Rank 0 creates ``.dckpt-save-<save_id>.intent`` in the checkpoint directory before any
rank writes a data file of that save, renews its modification time every
:data:`HEARTBEAT_S` seconds from a background thread while the save runs, and removes it
only after the save has committed (or rolled back). A reader that lists a directory and
then reads its manifest (gc, the manager's cleanup) therefore always sees either the
intent or the manifest that references the files, never neither.

An intent whose modification time is older than :data:`LEASE_S` belongs to a save that
died (SIGKILL, a lost node): its files, and it, are leftovers.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time

log = logging.getLogger(__name__)

HEARTBEAT_S = float(os.environ.get("DCKPT_INTENT_HEARTBEAT_S", "10"))
LEASE_S = float(os.environ.get("DCKPT_INTENT_LEASE_S", "120"))
INTENT_FILE = re.compile(r"^\.dckpt-save-([0-9a-f]{16})\.intent$")


def intent_name(save_id: str) -> str:
    return f".dckpt-save-{save_id}.intent"


def live_save_ids(entries, now: float | None = None, lease_s: float | None = None) -> set[str]:
    """Save ids with an intent in ``entries`` (a directory listing) renewed within the
    lease. An intent without a modification time counts as live (never assume old).
    Pure."""
    now = time.time() if now is None else now
    lease = LEASE_S if lease_s is None else lease_s
    out = set()
    for e in entries:
        m = INTENT_FILE.match(e.name)
        if m and (e.mtime is None or now - e.mtime < lease):
            out.add(m.group(1))
    return out


class Intent:
    """The lease of one save (rank 0 only). ``start`` writes it and starts the heartbeat;
    ``end`` stops the heartbeat and removes it. Blocking I/O; ``start`` raises OSError,
    ``end`` only logs."""

    def __init__(self, storage, root: str, save_id: str) -> None:
        self.storage, self.path = storage, storage.join(root, intent_name(save_id))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.doc = json.dumps({"save_id": save_id, "host": socket.gethostname(),
                               "pid": os.getpid(), "started": time.time()}).encode()

    def start(self) -> "Intent":
        self.storage.touch(self.path, self.doc)
        self._thread = threading.Thread(target=self._beat, name="dckpt-intent", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.storage.touch(self.path, self.doc)
            except Exception as e:  # the save itself reports storage trouble
                log.warning("could not renew save intent %s: %s", self.path, e)

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.storage.remove(self.path)
        except FileNotFoundError:
            pass
        except Exception as e:
            log.warning("could not remove save intent %s (dckpt gc removes it once its "
                        "lease has run out): %s", self.path, e)
