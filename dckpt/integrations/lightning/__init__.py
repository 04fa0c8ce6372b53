"""PyTorch Lightning and Fabric on dckpt: the Trainer's strategy
(:class:`DckptModelParallelStrategy`, :mod:`.trainer`) and Fabric's
(:mod:`.fabric`, also ``dckpt.integrations.fabric``), over one Committer
(:mod:`.committer`: layout, atomic placement, loads), the fast tier (``common/tier.py``,
``common/slots.py``), the "last" lookup (:mod:`.last`) and Lightning's metadata
(:mod:`.meta`). Requires ``pip install "dckpt[lightning]"``; importing this package
imports Lightning only when a strategy is asked for."""
from __future__ import annotations

from typing import Any

__all__ = ["DckptModelParallelStrategy"]


def __getattr__(name: str) -> Any:
    if name == "DckptModelParallelStrategy":
        from .trainer import DckptModelParallelStrategy

        return DckptModelParallelStrategy
    raise AttributeError(name)
