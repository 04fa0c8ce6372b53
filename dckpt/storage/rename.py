"""Move a complete file into place in one step, on any dckpt storage."""
from __future__ import annotations

import os

from .fsspec_storage import FsspecStorage


def replace_file(storage, src: str, dst: str) -> None:
    """Move the complete file ``src`` over ``dst`` in one step: ``os.replace`` and a
    directory fsync on the local fast path, the file system's move elsewhere (fsspec).
    Blocking I/O; raises OSError from the storage."""
    if isinstance(storage, FsspecStorage):
        storage.fs.mv(src, dst)
        return
    os.replace(src, dst)
    fd = os.open(os.path.dirname(dst) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
