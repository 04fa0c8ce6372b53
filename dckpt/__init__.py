"""dckpt: distributed, sharded, atomic and verified checkpoints for PyTorch.

Public API: :func:`save`, :func:`load`, :func:`async_save` (:class:`SaveHandle`,
:func:`prepare_async_save`),
:class:`CheckpointInfo`, :class:`TrainingState`, :func:`export` (to Hugging Face
safetensors), :func:`import_checkpoint` (from DCP, safetensors, torch.save),
:func:`open` (a read-only :class:`Checkpoint` view, no process group), :func:`diff`
(:class:`DiffResult`: two checkpoints compared by value) and the errors.
"""
from __future__ import annotations

from .format.version import __version__  # noqa: F401 (the package version)

from typing import TYPE_CHECKING

# The API is imported at first use (PEP 562), not with the package: the CLI's ls,
# inspect, du and history read JSON only and must not pay for importing torch.
_LAZY = {"save": ".protocol.commit", "CheckpointInfo": ".protocol.commit",
         "SideFile": ".protocol.commit",
         "load": ".protocol.restore", "SaveHandle": ".protocol.async_save",
         "async_save": ".protocol.async_save", "prepare_async_save": ".protocol.async_save",
         "CheckpointManager": ".manager.core",
         "TrainingState": ".state.training", "ExportInfo": ".interop", "export": ".interop",
         "import_checkpoint": ".interop", "open": ".view.open", "Checkpoint": ".view.open",
         "diff": ".view.diff", "DiffResult": ".view.diff", "KeyDiff": ".view.diff",
         "load_hf": ".interop.hf_load", "HFLoadInfo": ".interop.hf_load"}

if TYPE_CHECKING:
    from .protocol.commit import CheckpointInfo, SideFile, save
    from .protocol.restore import load
    from .protocol.async_save import SaveHandle, async_save, prepare_async_save
    from .manager.core import CheckpointManager
    from .state.training import TrainingState
    from .interop import ExportInfo, export, import_checkpoint
    from .view.open import Checkpoint, open
    from .view.diff import DiffResult, KeyDiff, diff
    from .interop.hf_load import HFLoadInfo, load_hf


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


from .errors import (  # noqa: E402
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
    "save", "load", "async_save", "prepare_async_save", "SaveHandle", "CheckpointInfo", "SideFile",
    "TrainingState",
    "CheckpointManager",
    # not "open": `from dckpt import *` must not shadow the builtin open()
    "export", "ExportInfo", "import_checkpoint", "load_hf", "HFLoadInfo", "Checkpoint", "diff", "DiffResult", "KeyDiff",
    "CheckpointError", "NotCommittedError", "AlreadyExistsError", "IntegrityError",
    "ManifestError", "StateMismatchError", "UnsupportedValueError", "RankFailure", "CommunicationError",
]
