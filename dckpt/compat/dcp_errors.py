"""DCP's exception types for :mod:`dckpt.compat.dcp`, so code that catches them works.

torch.distributed.checkpoint raises ``CheckpointException`` (a ``BaseException``) for
every failure of a save or load, with ``failures`` mapping each failing rank to
``(exception, traceback summary)``; it raises ``RuntimeError("Cannot detect ...")``
for a ``checkpoint_id`` no storage understands. The shim raises classes that are both
DCP's type and dckpt's (``class DCPStateMismatchError(CheckpointException,
StateMismatchError)``), so ``except CheckpointException``, ``except CheckpointError``,
``except StateMismatchError`` and ``except Exception`` all catch them. Multiple
inheritance from a ``BaseException`` subclass and an ``Exception`` subclass works in
CPython (both have BaseException's layout); the one clash, DCP's read-only
``failures`` property against dckpt's ``failures`` attribute, is settled for DCP:
``failures`` is ``{rank: (exception, StackSummary)}`` (DCP's shape), each exception a
dckpt error carrying that rank's message. Pure; no I/O.
"""
from __future__ import annotations

import traceback
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import (ERROR_TYPES, AlreadyExistsError, CheckpointError, CommunicationError,
                      IntegrityError, ManifestError, NotCommittedError, RankFailure,
                      StateMismatchError, UnsupportedValueError)

__all__ = ["CheckpointException", "DCPCheckpointError", "StorageDetectionError", "as_dcp"]


class DCPCheckpointError(CheckpointException, CheckpointError):
    """A dckpt error raised through :mod:`dckpt.compat.dcp`: an instance of DCP's
    ``CheckpointException`` and of dckpt's ``CheckpointError``. ``str()`` is DCP's
    (``CheckpointException ranks:...`` then each rank's error line)."""

    def __init__(self, message: str, failures: dict[int, Any] | None = None) -> None:
        # Neither parent's __init__: DCP's would store (msg, failures) as args and
        # dckpt's would assign the read-only ``failures`` property.
        BaseException.__init__(self, message)
        self.message = message
        self._failures = dict(failures or {})

    def __reduce__(self):  # picklable (a rank's error sent to another process)
        return (type(self), (self.message, self._failures))


def _dual(cls: type[CheckpointError]) -> type[DCPCheckpointError]:
    return type(f"DCP{cls.__name__}", (DCPCheckpointError, cls), {
        "__module__": __name__,
        "__doc__": f"{cls.__name__} raised as DCP's CheckpointException too."})


DCPNotCommittedError = _dual(NotCommittedError)
DCPAlreadyExistsError = _dual(AlreadyExistsError)
DCPIntegrityError = _dual(IntegrityError)
DCPManifestError = _dual(ManifestError)
DCPStateMismatchError = _dual(StateMismatchError)
DCPUnsupportedValueError = _dual(UnsupportedValueError)
DCPRankFailure = _dual(RankFailure)
DCPCommunicationError = _dual(CommunicationError)
_DUALS: dict[type, type[DCPCheckpointError]] = {
    NotCommittedError: DCPNotCommittedError, AlreadyExistsError: DCPAlreadyExistsError,
    ManifestError: DCPManifestError, IntegrityError: DCPIntegrityError,
    StateMismatchError: DCPStateMismatchError,
    UnsupportedValueError: DCPUnsupportedValueError,
    CommunicationError: DCPCommunicationError, RankFailure: DCPRankFailure,
}


class StorageDetectionError(CheckpointError, RuntimeError):
    """``checkpoint_id`` names a URL scheme no installed fsspec file system handles:
    DCP raises ``RuntimeError("Cannot detect which StorageReader or StorageWriter to
    use ...")`` there, so this is a RuntimeError (and a CheckpointError)."""


def _dual_of(cls: type) -> type[DCPCheckpointError]:
    for base in cls.__mro__:  # the nearest dckpt class that has a dual
        if base in _DUALS:
            return _DUALS[base]
    return DCPCheckpointError


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _worded(cls: type, message: str) -> str:
    """DCP's wording where code matches on it (DCP's tests do)."""
    if issubclass(cls, AlreadyExistsError) and "Checkpoint already exists" not in message:
        return f"Checkpoint already exists and overwrite=False: {message}"
    return message


def as_dcp(err: CheckpointError) -> BaseException:
    """``err`` as DCP's exception type: a :class:`DCPCheckpointError` subclass matching
    ``err``'s dckpt class, same message. ``failures``: one entry per failing rank, from
    ``err.failures`` (``"Type: message"``, as gathered by dckpt's collectives) or, for
    a local error, this rank with ``err`` and its traceback. An AlreadyExistsError's
    message gains DCP's wording ("Checkpoint already exists"). Errors already of
    DCP's type, and StorageDetectionError (DCP raises a RuntimeError there), are
    returned as they are."""
    if isinstance(err, (CheckpointException, StorageDetectionError)):
        return err
    message = _worded(type(err), str(err))
    failures: dict[int, tuple[BaseException, traceback.StackSummary]] = {}
    for rank, cause in sorted(getattr(err, "failures", {}).items()):
        name, _, text = str(cause).partition(": ")
        cls = ERROR_TYPES.get(name)
        failures[rank] = ((cls(_worded(cls, text)) if cls else RankFailure(str(cause))),
                          traceback.StackSummary())
    if not failures:
        failures[_rank()] = (type(err)(message) if message != str(err) else err,
                             traceback.extract_tb(err.__traceback__))
    return _dual_of(type(err))(message, failures)
