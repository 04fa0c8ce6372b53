"""The names of a checkpoint's files: what a save writes and what cleanup, gc and the
reference counting recognise as dckpt's own. Pure.

A save writes one data file per rank (``data-<save_id>-<rank>.safetensors``) and, when
asked for a side file (:class:`dckpt.protocol.commit.SideFile`: a model's tensors under
the names a Hugging Face model folder uses), one more per rank that holds such tensors
(``model-<save_id>-<rank>.safetensors``). Both are the save's own files: a failed save
removes them, gc recognises them, the manifest lists and checksums them."""
from __future__ import annotations

import re

DATA_FILE = re.compile(r"^(?:data|model)-([0-9a-f]{16})-(\d{5,})\.safetensors$")
TEMP_MANIFEST = re.compile(r"^\.manifest\.json\.tmp-[0-9a-f]+$")


def data_name(save_id: str, rank: int) -> str:
    """The name of ``rank``'s shard file of save ``save_id``."""
    return f"data-{save_id}-{rank:05d}.safetensors"


def side_name(save_id: str, rank: int) -> str:
    """The name of ``rank``'s side file of save ``save_id`` (see the module doc)."""
    return f"model-{save_id}-{rank:05d}.safetensors"


def save_files_prefixes(save_id: str) -> tuple[str, str]:
    """The name prefixes of every file save ``save_id`` writes (what a failed save
    removes)."""
    return f"data-{save_id}-", f"model-{save_id}-"
