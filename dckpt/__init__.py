"""dckpt: distributed, sharded, atomic and verified checkpoints for PyTorch.

Public API: :func:`save`, :func:`load`, :func:`async_save` (:class:`SaveHandle`),
:class:`CheckpointInfo`, :class:`TrainingState`, :func:`export` (to Hugging Face
safetensors), :func:`import_checkpoint` (from DCP, safetensors, torch.save)
and the errors.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .protocol.commit import CheckpointInfo, save
from .protocol.restore import load
from .engine.async_save import SaveHandle, async_save
from .manager import CheckpointManager
from .state.training import TrainingState
from .interop import ExportInfo, export, import_checkpoint
from .errors import (
    AlreadyExistsError,
    CheckpointError,
    IntegrityError,
    ManifestError,
    NotCommittedError,
    RankFailure,
    CommunicationError,
    StateMismatchError,
    UnsupportedValueError,
)

__all__ = [
    "save", "load", "async_save", "SaveHandle", "CheckpointInfo", "TrainingState",
    "CheckpointManager",
    "export", "ExportInfo", "import_checkpoint",
    "CheckpointError", "NotCommittedError", "AlreadyExistsError", "IntegrityError",
    "ManifestError", "StateMismatchError", "UnsupportedValueError", "RankFailure", "CommunicationError",
]
