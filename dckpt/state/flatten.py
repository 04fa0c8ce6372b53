"""Flatten a nested state_dict into dotted keys, and fill one back in place.

Containers: dict (str keys), list, tuple. Leaves: torch.Tensor, DTensor, and JSON scalars
(None, bool, int, float, str). Anything else raises UnsupportedValueError naming its key.
Keys join path parts with "."; two paths that would give the same key are refused.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import StateMismatchError, UnsupportedValueError

JSON_TYPES = (type(None), bool, int, float, str)


def _join(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


def flatten(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return ({key: tensor or DTensor}, {key: JSON value}), in traversal order. Pure
    Python walk, O(leaves); raises UnsupportedValueError before any I/O."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            leaf(key, obj, tensors)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise UnsupportedValueError(
                        f"key {k!r} under {key or '<root>'!r} is a {type(k).__name__}; "
                        "state_dict keys must be strings")
                walk(v, _join(key, k))
        elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            for i, v in enumerate(obj):
                walk(v, _join(key, str(i)))
        elif isinstance(obj, JSON_TYPES) and type(obj) in JSON_TYPES:
            leaf(key, obj, values)  # NaN/inf are written as Python's json writes them
        else:
            raise UnsupportedValueError(
                f"value at key {key or '<root>'!r} is a {type(obj).__module__}."
                f"{type(obj).__qualname__}; dckpt stores only tensors, DTensors, nested "
                "dict/list/tuple and None/bool/int/float/str (no pickle)")

    def leaf(key: str, obj: Any, into: dict) -> None:
        if key in tensors or key in values:
            raise UnsupportedValueError(f"two entries of the state_dict flatten to key {key!r}; "
                                        "rename one (keys containing '.' can collide)")
        if not key:
            raise UnsupportedValueError("the state_dict itself must be a dict, list or tuple")
        into[key] = obj

    walk(state, "")
    return tensors, values


def fill(state: Any, get: Callable[[str, Any], Any]) -> Any:
    """Rebuild ``state`` with every leaf replaced by ``get(key, old_leaf)``. Dicts and
    lists are updated in place (and returned); tuples are rebuilt, keeping their type.
    ``get`` copies tensors in place and returns them, so tensor identity is kept."""

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return get(key, obj)
        if isinstance(obj, dict):
            for k in list(obj):
                obj[k] = walk(obj[k], _join(key, k))
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
