"""torchtitan on dckpt: :class:`DckptCheckpointManager` (:mod:`.manager`), the checkpoint
manager a torchtitan trainer config selects. Requires ``pip install "dckpt[torchtitan]"``;
importing this package imports torchtitan only when the manager is asked for (the
pure parts, :mod:`.load` and :mod:`.resume`, never import it)."""
from __future__ import annotations

from typing import Any

__all__ = ["DckptCheckpointManager"]


def __getattr__(name: str) -> Any:
    if name == "DckptCheckpointManager":
        from .manager import DckptCheckpointManager

        return DckptCheckpointManager
    raise AttributeError(name)
