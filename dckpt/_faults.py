"""Fault injection for dckpt's own crash tests.

``DCKPT_FAULT="point:rank:action[;point:rank:action...]"`` makes ``rank`` fail at
``point`` (one of plan, write, vote, commit, committed, load; stage and upload in the
tiers' staging, where upload fires after the first block of a file is sent and its rank
is -1: use ``*``; history half-way through a line of the save history, rank 0; replicate on a rank
receiving a replica, after each of its data files, before the part is held; place
before a framework adapter renames a committed checkpoint into its name, rank 0; rotate
before an adapter removes the checkpoints its retention drops, rank 0; latest before
the DeepSpeed adapter writes ``latest`` for a placed tag, rank 0).
``action`` is ``raise``
(an OSError), ``kill`` (SIGKILL of the process) or ``sleep=SECONDS``. ``rank`` may be
``*``. Unset in normal use; the check is one environment lookup.
"""
from __future__ import annotations

import os
import signal
import time

POINTS = ("plan", "write", "vote", "commit", "committed", "load", "stage", "upload", "history",
          "replicate", "place", "rotate", "latest")


def fault(point: str, rank: int) -> None:
    spec = os.environ.get("DCKPT_FAULT")
    if not spec:
        return
    for part in spec.split(";"):
        try:
            p, r, action = part.split(":", 2)
        except ValueError:
            continue
        if p != point or (r != "*" and int(r) != rank):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))
        else:
            raise OSError(f"injected fault at {point} on rank {rank}")


class _MidWriteFault:
    """Wraps a storage Writer: fires the ``point`` fault (``write``) after the first data
    write, so a file is left half-written."""

    def __init__(self, inner, rank: int, point: str = "write") -> None:
        self.inner, self.rank, self.writes, self.point = inner, rank, 0, point

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _tick(self) -> None:
        self.writes += 1
        if self.writes == 2:
            fault(self.point, self.rank)

    def write(self, data) -> None:
        self.inner.write(data)
        self._tick()

    def pwrite(self, data, offset: int) -> None:
        self.inner.pwrite(data, offset)
        self._tick()


class UploadFaults:
    """A storage whose writers fire the ``upload`` fault (rank -1, as the raw
    staging's) once a file's data is being written: the encoded staging's uploads."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_write(self, path: str, size_hint: int | None = None):
        return _MidWriteFault(self.inner.open_write(path, size_hint=size_hint), -1, "upload")


def upload_storage(storage):
    """``storage`` itself unless an ``upload`` fault is armed (one environment lookup)."""
    return UploadFaults(storage) if "upload:" in os.environ.get("DCKPT_FAULT", "") else storage


def wrap_writer(writer, rank: int):
    """``writer`` itself unless a ``write`` fault is armed."""
    if "write:" in os.environ.get("DCKPT_FAULT", ""):
        return _MidWriteFault(writer, rank)
    return writer
