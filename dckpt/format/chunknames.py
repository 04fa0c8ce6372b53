"""Names of chunks in shard files. A file's only chunk of a tensor is stored under the
tensor's key; when a file holds several chunks of one tensor (a strided DTensor's local
tensor is several boxes of the global tensor), each is stored as ``key@o0,o1,...``, its
global offsets, and so is every chunk of a key holding ``@`` (which could otherwise spell
another key's chunk name). Every chunk's global offsets are also recorded in its file's header
(``at:<name>``), and :func:`checked_stored` holds what a manifest names against them.
Pure; see docs/FORMAT.md."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import IntegrityError, UnsupportedValueError

if TYPE_CHECKING:
    from .shards import StoredTensor


def stored_name(key: str, offsets) -> str:
    """The safetensors name of the chunk of ``key`` at ``offsets`` in a file that holds
    several chunks of ``key`` (a strided DTensor's local tensor is several boxes):
    ``key@o0,o1,...``. A file's only chunk of a tensor is named ``key``. Pure."""
    return f"{key}@{','.join(str(int(x)) for x in offsets)}"


def bare(key: str, count: int) -> bool:
    """Whether a file's chunk of ``key`` is stored under the key itself: its only chunk
    there, and a key without ``@`` (a key holding ``@`` could spell another key's
    ``key@offsets`` name: it is always stored with its offsets). Pure."""
    return count == 1 and "@" not in key


def stored_names(pieces: list) -> list[str]:
    """The names ``pieces`` get in one shard file: the key for a key's only piece,
    :func:`stored_name` for each of several and for every chunk of a key holding ``@``
    (see :func:`bare`): a bare name holds no ``@`` and an offset name splits at its last
    ``@``, so no name stands for two chunks. Pure, O(pieces). Raises
    UnsupportedValueError if two names still coincide (a guard; not reachable by the
    rule above)."""
    count: dict[str, int] = {}
    for p in pieces:
        count[p.key] = count.get(p.key, 0) + 1
    names = [p.key if bare(p.key, count[p.key]) else stored_name(p.key, p.box.offsets)
             for p in pieces]
    held = set(names)
    if len(held) != len(names):
        taken = sorted(set(n for n in names if names.count(n) > 1))[0]
        raise UnsupportedValueError(
            f"tensor key {taken!r} is also the name dckpt gives a box of a strided tensor "
            "in its shard file; rename that key")
    return names


def find_stored(tensors: dict, key: str, offsets) -> "StoredTensor | None":
    """The stored tensor of the chunk of ``key`` at ``offsets`` in a parsed shard
    header: ``key`` when its file holds that chunk only, else named
    :func:`stored_name` (:func:`stored_names` makes the two unambiguous). O(1) for a
    key's only chunk, O(ndim) otherwise. The name lookup only: what reads a chunk for
    a manifest uses :func:`checked_stored`, which also checks where the chunk belongs."""
    if "@" in key:
        # stored with its offsets; bare only in a file written before offsets were
        # recorded (a bare name holding '@' in a newer file is another key's chunk)
        st = tensors.get(stored_name(key, offsets))
        if st is not None:
            return st
        st = tensors.get(key)
        return st if st is not None and st.at is None else None
    st = tensors.get(key)
    return st if st is not None else tensors.get(stored_name(key, offsets))


def checked_stored(tensors: dict, key: str, offsets, file: str,
                   cells: "int | Callable[[], int]") -> "StoredTensor | None":
    """:func:`find_stored`, and a check that the stored tensor is the chunk of ``key``
    at ``offsets`` (those a manifest names) and no other: its header's recorded
    offsets (``StoredTensor.at``) must be ``offsets``. A file written before offsets
    were recorded cannot say; there, a chunk stored under the bare key is refused
    when the manifest assigns ``cells`` >= 2 chunks of ``key`` to the file (its
    writer named each ``key@offsets`` then: the file and manifest disagree, and the
    bare name could be any of them). ``cells``: that count, or a function returning it
    (called only for such a file). None when the file holds no such name. O(ndim)
    (plus ``cells()``). Raises IntegrityError naming the tensor key and ``file``."""
    st = find_stored(tensors, key, offsets)
    if st is None:
        return None
    if st.at is not None:
        want = tuple(int(x) for x in offsets)
        if st.at != want:
            raise IntegrityError(
                f"shard file {file}, tensor {key!r}: the file holds the chunk at offsets "
                f"{list(st.at)}, the manifest names the chunk at {list(want)} there (a "
                "manifest that points the chunk at the wrong file)")
    elif st.name == key and (cells() if callable(cells) else cells) > 1:
        raise IntegrityError(
            f"shard file {file}, tensor {key!r}: the manifest puts several chunks of the "
            "tensor in this file, which holds one under the bare key and records no "
            "offsets (a file written before dckpt recorded them): which chunk it holds "
            "is ambiguous")
    return st
