"""Lightning Fabric on dckpt: ``DckptModelParallelStrategy`` for Fabric, defined in
:mod:`dckpt.integrations.lightning.fabric` (this module is its documented import path).
Requires ``pip install "dckpt[lightning]"``."""
from __future__ import annotations

from .lightning.fabric import DckptModelParallelStrategy

__all__ = ["DckptModelParallelStrategy"]
