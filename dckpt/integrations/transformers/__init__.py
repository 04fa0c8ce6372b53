"""dckpt for the Hugging Face transformers ``Trainer``:
``from dckpt.integrations.transformers import DckptTrainer as Trainer``, or
``class MySFT(DckptTrainerMixin, trl.SFTTrainer)`` (``pip install "dckpt[transformers]"``).
See docs/HF.md. Importing :mod:`dckpt` never imports this package (nor transformers)."""
from .trainer import DckptTrainer, DckptTrainerMixin

__all__ = ["DckptTrainer", "DckptTrainerMixin"]
