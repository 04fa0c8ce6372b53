"""The fast tier's on-disk names: ``local_root/step-<N>/`` and each rank's view
``manifest-<rank>.json`` in it (docs/TIERS.md "What is where").

One torch-free home for them, so that :mod:`dckpt.tiers.local` (which writes them and
imports torch) and :mod:`dckpt.catalog.local` (``dckpt ls``, which must not import
torch) cannot drift apart. Pure."""
from __future__ import annotations

import re

STEP_DIR = re.compile(r"^step-(\d+)$")
VIEW_FILE = re.compile(r"^manifest-(\d{5,})\.json$")  # what view_name() writes


def step_name(step: int) -> str:
    return f"step-{int(step):08d}"


def view_name(rank: int) -> str:
    """The name of ``rank``'s manifest view in a local step directory."""
    return f"manifest-{rank:05d}.json"
