"""Flatten a nested state_dict into dotted keys, and fill one back in place.

Containers: dict (str or int keys: a plain ``optimizer.state_dict()`` has int keys),
list, tuple. Leaves: torch.Tensor, DTensor, ShardedTensor (FSDP1), JSON scalars
(None, bool, int, float, str) and ``bytes`` (an opaque blob a framework serialised
itself, such as torchtitan's dataloader state: stored as is, never unpickled; carried
as its {"$bytes": base64} tag, or, for a save, one over 64 KiB as a uint8 tensor listed
in ``Flat.bytes_keys``: see dckpt.format.sealed). A *Stateful*
object (one with ``state_dict()`` and ``load_state_dict()``: an LR scheduler, a sampler,
a :class:`dckpt.TrainingState`) is stored as its ``state_dict()`` under its key and
restored through ``load_state_dict``. Modules and optimizers are refused: their
state_dict depends on the parallelism, so they go through :class:`dckpt.TrainingState`;
a subclass that defines its own ``state_dict``/``load_state_dict`` (a framework's
wrapper) is a Stateful object. Anything else raises UnsupportedValueError naming its key.
Keys join path parts with "."; two paths that would give the same key are refused.
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any, Callable, Container

import torch

from ..errors import StateMismatchError, UnsupportedValueError
from ..format.sealed import INLINE_BYTES, MAX_BYTES_TAG, MAX_BYTES_VALUE, tag_bytes

JSON_TYPES = (type(None), bool, int, float, str)
# Python's json refuses to write or read ints over 4300 decimal digits (int/str conversion
# limit); 13000 bits is about 3913 digits, a cheap test that stays well inside it.
MAX_INT_BITS = 13000


def _join(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


def _utf8(s: str) -> bool:
    """Whether ``s`` has a UTF-8 encoding (no lone surrogates). O(len(s)); ASCII is a
    fast path."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_utf8(what: str, key: str) -> UnsupportedValueError:
    # repr: the key itself cannot be printed to a UTF-8 terminal
    return UnsupportedValueError(
        f"{what} {key!r} is not valid UTF-8 (it holds a lone surrogate, e.g. from "
        "os.fsdecode of undecodable bytes): safetensors headers and the manifest are UTF-8; "
        "clean the string (s.encode('utf-8', 'replace').decode())")


def check_utf8(key: str, what: str = "key") -> None:
    """The check :func:`flatten` applies to every key and string, for keys made
    elsewhere (an import's): raises UnsupportedValueError naming ``key`` when it is not
    valid UTF-8. O(len(key))."""
    if not _utf8(key):
        raise _not_utf8(what, key)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


_NATIVE = (torch.nn.Module, torch.optim.Optimizer)


def is_bare_native(obj: Any) -> bool:
    """Whether ``obj`` is a Module or an Optimizer whose ``state_dict`` or
    ``load_state_dict`` is torch's own: its state depends on the parallelism, so it is
    refused (dckpt.TrainingState saves it in its native sharded layout). A subclass
    that defines both itself (a framework's wrapper, such as torchtitan's
    ``OptimizersContainer`` or ``ModelWrapper``, which implement DCP's Stateful
    protocol) is the Stateful it says it is. Pure; O(MRO)."""
    for base in _NATIVE:
        if isinstance(obj, base):
            cls = type(obj)
            return (getattr(cls, "state_dict", None) is base.state_dict
                    or getattr(cls, "load_state_dict", None) is base.load_state_dict)
    return False


@dataclass
class Flat:
    """A flattened state: tensors and JSON values by key (a bytes value as its
    {"$bytes": base64} tag, except in a load's target; with ``flatten(blobs=True)`` one
    over INLINE_BYTES as a uint8 tensor among ``tensors``, its key in ``bytes_keys``),
    in traversal order, and the Stateful objects met on the way with the state_dict each
    gave (``load`` fills that very dict, then hands it to the object's
    ``load_state_dict``)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    stateful: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    # joined keys whose last part was an int dict key ("optim.state.0"): saved in the
    # manifest so a load can rebuild an empty dict (a fresh optimizer's state) with ints
    int_keys: list[str] = field(default_factory=list)
    # keys of ``tensors`` that are bytes values (flatten(blobs=True)): saved as 1-D U8
    # entries marked as bytes in the manifest, so a load hands back bytes
    bytes_keys: list[str] = field(default_factory=list)


def _check_size(key: str, raw: bytes, limit: int) -> bytes:
    """``raw``, or UnsupportedValueError naming the key and size when it is over
    ``limit``. O(1)."""
    if len(raw) > limit:
        raise UnsupportedValueError(
            f"the bytes value at key {key!r} is {len(raw)} bytes, over the {limit}-byte "
            "limit for bytes values" + (" kept inline (dckpt.save and dckpt import store "
                                        "larger ones in data files)" if limit == MAX_BYTES_TAG
                                        else " (a load allocates it whole): split it, or "
                                        "store it as a tensor"))
    return raw


def bytes_tensor(raw: bytes) -> torch.Tensor:
    """``raw`` as a 1-D uint8 tensor. One copy, O(len(raw)): torch warns on a tensor
    over immutable memory, and silencing that (warnings.catch_warnings) is not
    thread-safe; a save's bytes values are a framework's fresh pickles of a few MB."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
        torch.empty(0, dtype=torch.uint8)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A 1-D uint8 CPU tensor's contents as ``bytes`` (a bytes value read from a data
    file). One copy, O(len)."""
    return t.numpy().tobytes()


def flatten(state: Any, *, target: bool = False, blobs: bool = False) -> Flat:
    """Flatten ``state``. Calls ``state_dict()`` of every Stateful object once; otherwise
    a pure Python walk, O(leaves) plus the length of non-ASCII strings and of small bytes
    values (base64-encoded into their {"$bytes"} tag). ``target``: ``state`` is a
    load's target, whose leaves only name what to read: a bytes leaf stays as it is (any
    length, not encoded). ``blobs`` (a save): a bytes value over INLINE_BYTES becomes a
    1-D uint8 tensor (a copy: :func:`bytes_tensor`), its key listed in ``bytes_keys``;
    without it, every bytes value is a tag (for callers that write no data file for
    values). Raises UnsupportedValueError before any I/O: for an unsupported type
    (bytearray and memoryview included), a key or str that is not valid UTF-8 (a lone
    surrogate), an int too long for JSON, a bytes value over MAX_BYTES_VALUE (over
    MAX_BYTES_TAG without ``blobs``), colliding keys."""
    flat = Flat()
    tensors, values = flat.tensors, flat.values

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            leaf(key, obj, tensors)
        elif is_bare_native(obj):
            raise UnsupportedValueError(
                f"value at key {key or '<root>'!r} is a {type(obj).__name__}: wrap the model "
                "and optimizer in dckpt.TrainingState(model, optimizer), which saves them in "
                "their parallelism's native sharded layout")
        elif is_stateful(obj) and key:
            sd = obj.state_dict()
            flat.stateful[key] = (obj, sd)
            walk(sd, key)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if type(k) is int:  # not bool: True would come back as "True"
                    sub = _join(key, str(k))
                    flat.int_keys.append(sub)
                    walk(v, sub)
                    continue
                if not isinstance(k, str):
                    raise UnsupportedValueError(
                        f"key {k!r} under {key or '<root>'!r} is a {type(k).__name__}; "
                        "state_dict keys must be strings or ints (for sharded models and "
                        "their optimizers, use dckpt.TrainingState)")
                if not _utf8(k):  # checked once per part, not per joined key: O(leaves)
                    raise _not_utf8("key", _join(key, k))
                walk(v, _join(key, k))
        elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            for i, v in enumerate(obj):
                walk(v, _join(key, str(i)))
        elif isinstance(obj, JSON_TYPES) and type(obj) in JSON_TYPES:
            if type(obj) is str and not _utf8(obj):
                raise _not_utf8("the string value at key", key)
            if type(obj) is int and obj.bit_length() > MAX_INT_BITS:
                raise UnsupportedValueError(
                    f"the int at key {key!r} has {obj.bit_length()} bits (over about 3900 "
                    "decimal digits): JSON cannot carry it; store it as a str or a tensor")
            leaf(key, obj, values)  # NaN/inf: tagged objects in the manifest (format/sealed.py)
        elif type(obj) is bytes:  # exactly: a subclass would come back as plain bytes
            if target:
                leaf(key, obj, values)
            elif blobs and len(obj) > INLINE_BYTES:  # a data-file entry, not the manifest
                leaf(key, bytes_tensor(_check_size(key, obj, MAX_BYTES_VALUE)), tensors)
                flat.bytes_keys.append(key)
            else:
                leaf(key, tag_bytes(_check_size(key, obj, MAX_BYTES_TAG)), values)
        elif isinstance(obj, (bytearray, memoryview)):
            # A load hands back bytes (the manifest keeps no Python type), and a mutable
            # buffer cannot be refilled in place at another length: say so at save.
            raise UnsupportedValueError(
                f"value at key {key!r} is a {type(obj).__name__}: dckpt stores bytes "
                "values as bytes and loads them back as bytes; pass bytes(x)")
        else:
            raise UnsupportedValueError(
                f"value at key {key or '<root>'!r} is a {type(obj).__module__}."
                f"{type(obj).__qualname__}; dckpt stores only tensors, DTensors, nested "
                "dict/list/tuple and None/bool/int/float/str/bytes (no pickle)")

    def leaf(key: str, obj: Any, into: dict) -> None:
        if key in tensors or key in values:
            raise UnsupportedValueError(f"two entries of the state_dict flatten to key {key!r}; "
                                        "rename one (keys containing '.' can collide)")
        if not key:
            raise UnsupportedValueError("the state_dict itself must be a dict, list or tuple")
        if key == "__metadata__" and into is tensors:
            raise UnsupportedValueError(
                "a tensor cannot have the key '__metadata__': safetensors reserves that name "
                "in shard headers; nest it under another key")
        into[key] = obj

    walk(state, "")
    return flat


def load_into(obj: Any, sd: Any, key: str) -> None:
    """``obj.load_state_dict(sd)``. Its own error that is neither a CheckpointError
    nor an OSError (an IndexError, a RuntimeError of torch's: the state does not fit
    the object) is a StateMismatchError naming ``key``: the caller's mismatch, the
    same on any checkpoint, never damage that a fallback to an older one would cure."""
    from ..errors import CheckpointError

    try:
        obj.load_state_dict(sd)
    except (CheckpointError, OSError):
        raise
    except Exception as e:
        raise StateMismatchError(f"{key or 'the state'}: load_state_dict of "
                                 f"{type(obj).__name__} raised {type(e).__name__}: {e}") from e


def fill(state: Any, get: Callable[[str, Any], Any],
         stateful: dict[str, tuple[Any, Any]] | None = None, *, sort: bool = False,
         whole: Container[str] = ()) -> Any:
    """Rebuild ``state`` with every leaf replaced by ``get(key, old_leaf)``. Dicts and
    lists are updated in place (and returned); tuples are rebuilt, keeping their type.
    ``get`` copies tensors in place and returns them, so tensor identity is kept. A
    Stateful object at key k gets ``load_state_dict`` of ``stateful[k]``'s state_dict,
    filled the same way (inner objects first). ``sort``: visit dict keys sorted
    (``key=str``) instead of in insertion order, so Stateful objects are loaded in the
    same order on every rank whatever each rank's insertion order (their
    ``load_state_dict`` may run collectives). ``whole``: keys whose value, a
    container included, is a leaf: ``get`` replaces it as one value (DCP loads a list
    of plain values that way: :mod:`dckpt.compat.dcp`)."""
    stateful = stateful or {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return get(key, obj)
        if key in stateful and stateful[key][0] is obj:
            sd = walk(stateful[key][1], key)
            load_into(obj, sd, key)
            return obj
        if key in whole:
            return get(key, obj)
        if isinstance(obj, dict):
            for k in sorted(obj, key=str) if sort else list(obj):
                sub, v = _join(key, str(k)), obj[k]
                new = walk(v, sub)
                if new is not v or sub not in stateful:  # a Stateful stays, unassigned (DCP)
                    obj[k] = new
            return obj
        if type(obj) is list:
            for i in range(len(obj)):
                obj[i] = walk(obj[i], _join(key, str(i)))
            return obj
        if type(obj) is tuple:
            return tuple(walk(v, _join(key, str(i))) for i, v in enumerate(obj))
        return get(key, obj)

    if not isinstance(state, dict):
        raise StateMismatchError("load needs a dict state_dict to fill in place")
    return walk(state, "")


_INT_PART = re.compile(r"-?[0-9]+")


def grow(state: Any, tensors: dict, values: dict, int_keys: Any,
         rename: Callable[[str], str] | None = None) -> None:
    """Rebuild, from a checkpoint, the dicts of ``state`` that are empty but held int
    keys when saved: a fresh optimizer's ``state_dict()["state"]`` is ``{}`` until its
    first step, so loading a torch.save-style checkpoint into it must create its
    entries. Under such a dict every saved key comes back: int keys where the saved
    dict had them, nested dicts with str keys elsewhere (a str key that itself contains
    "." cannot be told apart there), tensors as empty CPU tensors of the saved dtype and
    global shape, values (bytes entries included) as None (the load then fills
    both). ``tensors``/``values`` are the manifest's; ``int_keys`` its
    ``meta["int_keys"]``. ``rename`` (a renamed load's target -> checkpoint key
    function): an empty dict at key k is grown from the checkpoint's entries under
    ``rename(k + ".")`` (a trailing "." so that prefix tables ending in "." match the
    container too). Only entries the checkpoint holds are made. Allocates; no I/O.
    Raises ManifestError when ``int_keys`` is not a list of strings."""
    from ..errors import ManifestError
    from ..format.dtypes import to_torch

    if not isinstance(int_keys, list) or not all(isinstance(k, str) for k in int_keys):
        raise ManifestError("meta.int_keys must be a list of strings")
    ints = set(int_keys)
    parents = {k.rpartition(".")[0] for k in ints}

    def _renamed(key: str) -> str | None:
        try:  # a key function written for leaf keys may not take a container's
            out = rename(key + ".")
        except Exception:
            return None
        return out[:-1] if isinstance(out, str) and out.endswith(".") else None

    def build(into: dict, prefix: str) -> None:
        head = prefix + "." if prefix else ""
        for key in (*tensors, *values):
            if not key.startswith(head):
                continue
            node, path = into, prefix
            parts = key[len(head):].split(".")
            for i, part in enumerate(parts):
                path = _join(path, part)
                k = part
                if path in ints:  # what str(int) writes: ASCII digits ("²".isdigit() too)
                    if not _INT_PART.fullmatch(part):
                        raise ManifestError(f"checkpoint key {key!r}: {path!r} is recorded "
                                            "as an int key but is not an integer")
                    k = int(part)
                if i == len(parts) - 1:
                    if k not in node:
                        t = tensors.get(key)  # a bytes entry is a value: None, as values
                        node[k] = (torch.empty(t.shape, dtype=to_torch(t.dtype))
                                   if t is not None and not t.bytes_value else None)
                elif isinstance(node.setdefault(k, {}), dict):
                    node = node[k]
                else:
                    break  # a leaf already there: the load's own checks report it

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor) or is_stateful(obj) and key:
            return
        if isinstance(obj, dict):
            if not obj:
                src = _renamed(key) if rename is not None and key else key
                if src in parents:
                    build(obj, src)
                return
            for k, v in obj.items():
                walk(v, _join(key, str(k)))
        elif type(obj) in (list, tuple):
            for i, v in enumerate(obj):
                walk(v, _join(key, str(i)))

    walk(state, "")
