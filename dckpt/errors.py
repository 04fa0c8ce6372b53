"""Errors raised by dckpt.

Every error is an ``Exception`` (never ``BaseException``), so ``except Exception`` in a
training loop catches it. A failure on any rank of a collective call is re-raised on
every rank; ``failures`` then maps each failing rank to a one-line cause.
"""
from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every dckpt error.

    Attributes:
        failures: ``{rank: cause}`` for errors gathered from several ranks; empty when
            the error was raised locally.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class NotCommittedError(CheckpointError):
    """The path holds no committed checkpoint (no ``manifest.json``)."""


class AlreadyExistsError(CheckpointError):
    """A committed checkpoint exists at the path and ``overwrite`` was not given."""


class IntegrityError(CheckpointError):
    """Stored bytes do not match what the manifest recorded: flipped bits, a truncated,
    missing or foreign file."""


class ManifestError(IntegrityError):
    """The manifest is not valid: garbage JSON, unknown version, inconsistent sizes, or a
    file reference that leaves the checkpoint directory."""


class StateMismatchError(CheckpointError):
    """The state_dict does not match the checkpoint (missing/unexpected keys, shapes,
    dtypes), or ranks disagree about a tensor during a save."""


class UnsupportedValueError(CheckpointError):
    """A state_dict leaf that dckpt cannot store (a function, a module, an arbitrary
    object, a Partial DTensor...). Raised before any file is written."""


class RankFailure(CheckpointError):
    """A rank failed with an error that is not a :class:`CheckpointError` (an
    ``OSError`` from the disk, a bug); ``failures`` names every failing rank."""


class CommunicationError(RankFailure):
    """A collective of a checkpoint operation failed on this rank: a peer died or hung
    past the timeout, or its process group was destroyed. The other ranks get their own
    CommunicationError (or the operation's error) within the group's timeout."""


# Name -> class, used to re-raise a remote rank's error with its own type. Only our own
# classes are ever reconstructed: a peer can never make us instantiate arbitrary types.
ERROR_TYPES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        NotCommittedError,
        AlreadyExistsError,
        IntegrityError,
        ManifestError,
        StateMismatchError,
        UnsupportedValueError,
        RankFailure,
        CommunicationError,
    )
}


def preview(keys: list, n: int = 6) -> str:
    """A short list of keys for an error message: the first ``n``, then how many more.
    Pure."""
    out = ", ".join(repr(k) for k in keys[:n])
    return out + (f" and {len(keys) - n} more" if len(keys) > n else "")
