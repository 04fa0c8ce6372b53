"""Reading checkpoints without a job: :func:`dckpt.open` (module ``open``: a read-only
:class:`Checkpoint`), ``get_slice`` handles (``slices``: :class:`SliceError`) and
:func:`dckpt.diff` (module ``diff``). ``from dckpt.view import Checkpoint, SliceError, MissingKeyError`` is their
documented home; imported at first use (PEP 562)."""
from __future__ import annotations

import importlib

# Not "open" nor "diff": those names are this package's modules (dckpt.open and
# dckpt.diff are the functions).
_LAZY = {"Checkpoint": ".open", "MissingKeyError": ".open", "TensorInfo": ".open",
         "ValueInfo": ".open", "SliceError": ".slices", "TensorSlice": ".slices",
         "DiffResult": ".diff", "KeyDiff": ".diff"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
