"""How a process of dckpt's framework adapters ends: work abandoned after a
failure never keeps it from exiting (a hung store would otherwise keep the failed rank
alive, and the other ranks waiting on it in their collectives), and a failed
asynchronous save nobody waited for fails it (Fabric, Accelerate: nothing needs to call
the adapter after the user's last save). Exit hooks only; no collective.
"""
from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Any, Callable

from ...protocol.async_save import at_thread_exit

log = logging.getLogger(__name__)
# Work given up on after a failure ("still running?" probes): at exit, dckpt's own exit
# hooks and concurrent.futures would wait for it without bound (a hung store), and a
# rank that cannot exit keeps the others waiting in their collectives.
_ABANDONED: list[Callable[[], bool]] = []
# The Committers whose failed asynchronous saves fail the process at exit when nobody
# waited for them (Fabric: nothing calls the strategy after the user's last save).
_WATCHED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _hard_exit(code: int, message: str) -> None:
    log.error(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(code)


def _exit_abandoned() -> None:
    """At exit (before dckpt's hooks that wait for saves, and concurrent.futures'):
    leave at once, with status 1, when work abandoned after a failure still runs."""
    if any(still() for still in _ABANDONED):
        _hard_exit(1, "exiting without waiting for the checkpoint saves abandoned after the "
                      "training's failure (the store does not answer)")


def abandoned(still_running: Callable[[], bool]) -> None:
    """Record work a failed rank stopped waiting for (see :func:`_exit_abandoned`).
    The hook is registered on first use, after dckpt's other exit hooks, so it runs
    before them (threading runs its exit hooks last registered first)."""
    if not _ABANDONED:
        at_thread_exit(_exit_abandoned)
    _ABANDONED.append(still_running)


def _exit_unobserved() -> None:
    """At exit: wait for the saves of the watched Committers nobody waited for, and
    fail the process (status 1) when one failed: a script whose last ``fabric.save``
    with ``async_save`` failed must not exit 0 with no checkpoint."""
    for c in list(_WATCHED):
        try:
            err = c.unobserved_error()
        except Exception as e:
            err = e
        if err is not None:
            _hard_exit(1, f"the last asynchronous checkpoint save failed and nothing waited "
                          f"for it: {err}")


def watch(committer: Any) -> None:
    """Fail the process at exit if an asynchronous save of ``committer`` (anything
    with ``unobserved_error()``: the Lightning adapters' or :mod:`.commit`'s
    Committer) failed and nothing waited for it."""
    if not _WATCHED:
        at_thread_exit(_exit_unobserved)
    _WATCHED.add(committer)
