"""Plain values in :mod:`dckpt.compat.dcp`: a list or tuple that holds no tensor and no
dict is one value to DCP, loaded whole.

DCP's flatten (``torch.distributed.checkpoint._traverse``) walks dicts always, and
lists only while they hold a tensor or a dict somewhere below; anything else (a list
of floats, ``[[1, 2], []]``, a tuple, a scalar) is one leaf, saved pickled and, on
load, put in the caller's container in place of what was there, whatever its length.
A state_dict's lists of plain values (an optimizer's ``param_groups[i]["params"]``, a
scheduler's ``base_lrs``) must therefore load as the saved list: filling them index by
index gave ``[]`` for ``[0.9, 0.5, 0.3]`` loaded into ``[]`` and a "Missing key" when
the caller's list was longer (issue 34).

dckpt stores such a list as one JSON leaf per element ("k.0", "k.1", ...; so
:func:`dckpt.load` reads it like any other state), which loses empty lists: the shim's
save lists their keys in the JSON value :data:`EMPTY_KEY` (``EMPTY_KEY.<rank>``: one
record per rank, see :func:`records`). A load rebuilds the saved
value from the leaves under "k." and that record. Pure Python, no I/O.
"""
from __future__ import annotations

import bisect
import json
from typing import Any

import torch

from ..errors import ManifestError
from ..format import manifest as mf

EMPTY_KEY = "__dckpt_compat_empty__"  # JSON value: sorted flat keys of empty lists/tuples
_RECORDS = "__dckpt_compat_"  # the shim's own records (EMPTY_KEY, the bytes kinds): not state
MISSING = object()  # what :meth:`Saved.value` returns when the checkpoint has no such value


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def is_plain(v: Any) -> bool:
    """Whether ``v`` is a list or tuple DCP loads as one value: nothing below it is a
    tensor or a dict (bytes are uint8 tensors here, and a Stateful's state a dict, so
    both keep their own keys). O(elements)."""
    if type(v) not in (list, tuple):
        return False
    return all(not isinstance(x, (torch.Tensor, dict)) and
               (type(x) not in (list, tuple) or is_plain(x)) for x in v)


def empty_keys(target: Any) -> list[str]:
    """Flat keys of the empty lists and tuples in ``target`` (what :func:`resolve`
    returns), sorted: they leave no leaf in the checkpoint. O(containers)."""
    out: list[str] = []

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, _join(key, k))
        elif type(obj) in (list, tuple):
            if not obj and key:
                out.append(key)
            for i, v in enumerate(obj):
                walk(v, _join(key, i))

    walk(target, "")
    return sorted(out)


def records(m: mf.Manifest, key: str, kind: type) -> Any:
    """The union of the shim's JSON records ``key.<rank>`` (each rank writes its own:
    ranks hold different keys, torchtitan's dataloader ``dp_rank_<r>`` bytes, and a
    value every rank writes under one key keeps only one rank's) and of ``key`` itself
    (checkpoints written before). O(values); raises as :func:`record`."""
    out = kind()
    head = key + "."
    for k in sorted(k for k in m.values if k == key or k.startswith(head)):
        got = record(m, k, kind)
        if kind is dict:
            out.update(got)
        else:
            out.extend(got)
    return out


def record(m: mf.Manifest, key: str, kind: type) -> Any:
    """The shim's JSON record ``key`` in the manifest's values (``kind()`` when absent).
    Raises ManifestError naming the key when it is not JSON of that kind: a manifest
    is untrusted input."""
    raw = m.values.get(key)
    if raw is None:
        return kind()
    try:
        got = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json's
        got = None
    strings = got if isinstance(got, list) else got.values() if isinstance(got, dict) else ()
    if type(got) is not kind or not all(isinstance(x, str) for x in strings):
        raise ManifestError(f"checkpoint value {key!r} is not the JSON {kind.__name__} of "
                            "strings dckpt.compat.dcp writes there: the manifest is damaged "
                            "or was not written by dckpt")
    return got


class Saved:
    """The plain values of a checkpoint, for rebuilding a list saved as one leaf per
    element. Built once per load: sorts the value keys and :data:`EMPTY_KEY`'s keys
    (O(V log V)); each :meth:`value` is O(log V + the leaves under its key)."""

    def __init__(self, m: mf.Manifest, empties: list[str]) -> None:
        self.values = m.values
        self.keys = sorted(k for k in m.values if not k.startswith(_RECORDS))
        self.empties = sorted(set(empties))
        self.empty = set(self.empties)
        # every proper dotted prefix of a tensor key: a list cannot be rebuilt there
        self.tensor_parents: set[str] = set()
        for name in m.tensors:
            i = name.find(".")
            while i >= 0:
                self.tensor_parents.add(name[:i])
                i = name.find(".", i + 1)

    @staticmethod
    def _under(keys: list[str], head: str) -> list[str]:
        lo = bisect.bisect_left(keys, head)
        hi = bisect.bisect_left(keys, head[:-1] + chr(ord(".") + 1))
        return keys[lo:hi]

    def value(self, key: str, like: Any) -> Any:
        """What the checkpoint holds at ``key`` as one value, or MISSING: the scalar
        saved there, else the list rebuilt from the leaves "key.0", "key.1.0", ...
        and the recorded empty lists (tuple where ``like``, the caller's value, has a
        tuple at that place; list elsewhere). MISSING also when what is under "key."
        is not a list of plain values (tensors, dict keys, holes)."""
        if key in self.values:
            return self.values[key]
        if key in self.tensor_parents:
            return MISSING
        head = key + "."
        tree: dict = {}
        for names, leaf in ((self._under(self.keys, head), True),
                            (self._under(self.empties, head), False)):
            for name in names:
                if not _place(tree, name[len(head):].split("."), name, leaf):
                    return MISSING
        if not tree:
            if key not in self.empty:
                return MISSING
            return () if type(like) is tuple else []
        return _build(tree, like, self.values)


def _place(tree: dict, parts: list[str], name: str, leaf: bool) -> bool:
    """Put checkpoint key ``name`` (its index path ``parts``) into ``tree``: {index:
    subtree | ("leaf", key) | ("empty",)}. False when a part is not a list index or
    two keys claim one place."""
    node = tree
    for j, p in enumerate(parts):
        if not (p.isascii() and p.isdigit()) or (p != "0" and p.startswith("0")):
            return False  # a dict key, or "01"/"²" (int() accepts both)
        i = int(p)
        if j == len(parts) - 1:
            if i in node:
                return False
            node[i] = ("leaf", name) if leaf else ("empty",)
        else:
            child = node.setdefault(i, {})
            if not isinstance(child, dict):
                return False
            node = child
    return True


def _build(tree: dict, like: Any, values: dict) -> Any:
    if sorted(tree) != list(range(len(tree))):
        return MISSING  # a hole: not a list the shim saved
    out = []
    for i in range(len(tree)):
        sub = like[i] if type(like) in (list, tuple) and i < len(like) else None
        node = tree[i]
        if isinstance(node, dict):
            v = _build(node, sub, values)
            if v is MISSING:
                return MISSING
        elif node[0] == "leaf":
            v = values[node[1]]
        else:
            v = () if type(sub) is tuple else []
        out.append(v)
    return tuple(out) if type(like) is tuple else out


def into(old: Any, new: Any) -> Any:
    """``new`` for the caller's ``old``: a list stays the same object (filled in place,
    nested lists too: a list held elsewhere sees the loaded values); anything else is
    replaced."""
    if type(old) is list and type(new) is list:
        old[:] = [into(old[i], v) if i < len(old) else v for i, v in enumerate(new)]
        return old
    return new
