"""Reading a committed checkpoint's manifest: torch-free, so that tools that only read
JSON (``dckpt ls``, ``inspect``, ``du``) do not pay for importing torch. The load
protocol (:mod:`dckpt.protocol.restore`) re-exports these."""
from __future__ import annotations

from ..errors import ManifestError, NotCommittedError
from ..format import manifest as mf
from ..storage.base import FileTooLargeError, NotRegularFileError

MAX_MANIFEST = 1 << 30  # a manifest of 10^5 tensors in 10^4 chunks each is a few hundred MB


def read_manifest_bytes(storage, root: str, name: str = mf.MANIFEST_NAME) -> bytes:
    """The raw bytes of ``root/manifest.json`` (or ``root/name``). Blocking I/O of the file's size only.
    Raises NotCommittedError, ManifestError (not a regular file: a FIFO, a link to a
    device; or over MAX_MANIFEST bytes: not something a save writes), OSError."""
    where = storage.join(root, name)
    try:
        return storage.read_file(where, MAX_MANIFEST)
    except FileNotFoundError:
        raise NotCommittedError(
            f"{root} holds no committed checkpoint (no {name}): the save that "
            "wrote it did not finish, or the path is wrong") from None
    except IsADirectoryError:
        raise NotCommittedError(f"{where} is a directory, not a manifest") from None
    except NotRegularFileError:
        raise ManifestError(f"{where} is not a regular file (a FIFO, device or socket): "
                            "not a dckpt manifest; refusing to read it") from None
    except FileTooLargeError:
        raise ManifestError(f"{where} is over {MAX_MANIFEST >> 20} MiB: not a dckpt "
                            "manifest (or a damaged one)") from None


def read_manifest(storage, root: str) -> tuple[mf.Manifest, bytes]:
    """Read and validate ``root/manifest.json``. Blocking I/O. Raises
    NotCommittedError (none there) or ManifestError (garbage, unsafe, newer version)."""
    data = read_manifest_bytes(storage, root)
    return mf.parse(data, storage.join(root, mf.MANIFEST_NAME)), data
