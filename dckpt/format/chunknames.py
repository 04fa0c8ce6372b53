"""Names of chunks in shard files. A file's only chunk of a tensor is stored under the
tensor's key; when a file holds several chunks of one tensor (a strided DTensor's local
tensor is several boxes of the global tensor), each is stored as ``key@o0,o1,...``, its
global offsets. Pure; see docs/FORMAT.md."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UnsupportedValueError

if TYPE_CHECKING:
    from .shards import StoredTensor


def stored_name(key: str, offsets) -> str:
    """The safetensors name of the chunk of ``key`` at ``offsets`` in a file that holds
    several chunks of ``key`` (a strided DTensor's local tensor is several boxes):
    ``key@o0,o1,...``. A file's only chunk of a tensor is named ``key``. Pure."""
    return f"{key}@{','.join(str(int(x)) for x in offsets)}"


def stored_names(pieces: list) -> list[str]:
    """The names ``pieces`` get in one shard file: the key for a key's only piece,
    :func:`stored_name` for each of several. Pure, O(pieces). Raises
    UnsupportedValueError when a name so made is also another tensor's key."""
    count: dict[str, int] = {}
    for p in pieces:
        count[p.key] = count.get(p.key, 0) + 1
    names = [p.key if count[p.key] == 1 else stored_name(p.key, p.box.offsets) for p in pieces]
    if len(set(names)) != len(names):
        taken = sorted(set(n for n in names if names.count(n) > 1))[0]
        raise UnsupportedValueError(
            f"tensor key {taken!r} is also the name dckpt gives a box of a strided tensor "
            "in its shard file; rename that key")
    return names


def find_stored(tensors: dict, key: str, offsets) -> "StoredTensor | None":
    """The stored tensor of the chunk of ``key`` at ``offsets`` in a parsed shard
    header: named :func:`stored_name` when its file holds several chunks of ``key``,
    else ``key``. O(ndim)."""
    st = tensors.get(stored_name(key, offsets)) if len(tensors) > 1 else None
    return st if st is not None else tensors.get(key)
