"""dckpt for Hugging Face Accelerate: ``from dckpt.integrations.accelerate import
DckptAccelerator as Accelerator`` (``pip install "dckpt[accelerate]"``). See docs/HF.md.
Importing :mod:`dckpt` never imports this package (nor accelerate)."""
from .accelerator import DckptAccelerator

__all__ = ["DckptAccelerator"]
