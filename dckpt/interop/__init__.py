"""Interoperability: export a dckpt checkpoint as a Hugging Face safetensors directory
(:func:`export`), and make a dckpt checkpoint out of a torch.distributed.checkpoint
directory, Hugging Face safetensors or a ``torch.save`` file (:func:`import_checkpoint`).
See docs/INTEROP.md."""
from __future__ import annotations

from .hf_export import ExportInfo, export
from .importer import import_checkpoint

__all__ = ["export", "ExportInfo", "import_checkpoint"]
