"""What the ``dckpt`` commands share: the --storage-options parsing and how a path is
shown as the user typed it. Pure (no I/O)."""
from __future__ import annotations

import json
import re

from ..errors import CheckpointError


def _shown(given: str, storage_path: str) -> str:
    """A checkpoint path as the user gave it where it is a URL (the storage path has
    lost the scheme and would not load), else the absolute local path."""
    if "://" not in given or given.startswith("file://"):
        return storage_path
    return given if given.endswith("://") else given.rstrip("/")


def _as_typed(message: str, storage_path: str, shown: str) -> str:
    """``message`` with the storage path of a URL checkpoint (``bucket/run/step``, the
    scheme lost) written as the user typed it (``s3://bucket/run/step``)."""
    if shown == storage_path:
        return message
    # not where it is already part of a URL or a longer path
    return re.sub(r"(?<![\w:/.-])" + re.escape(storage_path.rstrip("/")), lambda _: shown,
                  message)


def _opts(args) -> dict | None:
    """The --storage-options JSON object. Raises CheckpointError when it is not one."""
    return json_opts(args.storage_options, "--storage-options")


def json_opts(text: str | None, flag: str) -> dict | None:
    """The JSON object of storage options given as ``flag`` (None when not given).
    Raises CheckpointError naming ``flag`` when it is not a JSON object."""
    if not text:
        return None
    try:
        opts = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(opts, dict):
        raise CheckpointError(f"{flag} must be a JSON object, not {type(opts).__name__}")
    return opts
