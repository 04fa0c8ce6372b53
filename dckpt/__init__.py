"""dckpt: distributed, sharded, atomic and verified checkpoints for PyTorch.

Public API: :func:`save`, :func:`load`, :class:`CheckpointInfo`, :class:`TrainingState`
and the errors.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .dist.commit import CheckpointInfo, save
from .dist.restore import load
from .state.training import TrainingState
from .errors import (
    AlreadyExistsError,
    CheckpointError,
    IntegrityError,
    ManifestError,
    NotCommittedError,
    RankFailure,
    StateMismatchError,
    UnsupportedValueError,
)

__all__ = [
    "save", "load", "CheckpointInfo", "TrainingState",
    "CheckpointError", "NotCommittedError", "AlreadyExistsError", "IntegrityError",
    "ManifestError", "StateMismatchError", "UnsupportedValueError", "RankFailure",
]
