"""The names of a checkpoint's files: what a save writes and what cleanup, gc and the
reference counting recognise as dckpt's own. Pure."""
from __future__ import annotations

import re

DATA_FILE = re.compile(r"^data-([0-9a-f]{16})-(\d{5,})\.safetensors$")
TEMP_MANIFEST = re.compile(r"^\.manifest\.json\.tmp-[0-9a-f]+$")


def data_name(save_id: str, rank: int) -> str:
    """The name of ``rank``'s shard file of save ``save_id``."""
    return f"data-{save_id}-{rank:05d}.safetensors"
