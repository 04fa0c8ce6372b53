"""A framework object's ``state_dict()`` (a scheduler's, a registered object's, a
stateful dataloader's) as a dckpt entry, and back, exactly: no pickle.

The entry is ``{"doc": <JSON skeleton>, "t": {"<i>": tensor}, "b": {"<i>": bytes}}``.
The skeleton keeps what dckpt's flat keys cannot: list vs tuple vs dict, int/float/
bool/None dict keys, key order, and NaN/inf floats. Tensors and bytes leave it as
``{"$t": i}`` / ``{"$b": i}`` and are stored as dckpt tensors and bytes values (a big
bytes value lands in the data files, checksummed). Pure: no I/O, no collective.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from ...errors import ManifestError, UnsupportedValueError

SCALARS = (type(None), bool, int, float, str)


def encode(obj: Any, where: str = "state") -> dict[str, Any]:
    """The entry for ``obj`` (nested dict/list/tuple of tensors, bytes, None, bool,
    int, float, str; subclasses of int/float/str, numpy scalars included, are stored
    as the base type). Tensors are detached, not copied. O(size of ``obj``). Raises
    UnsupportedValueError naming the path (under ``where``) of anything else."""
    tensors: dict[str, torch.Tensor] = {}
    blobs: dict[str, bytes] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            tensors[str(len(tensors))] = o.detach()
            return {"$t": len(tensors) - 1}
        if type(o) is bytes:
            blobs[str(len(blobs))] = o
            return {"$b": len(blobs) - 1}
        if isinstance(o, bool):
            return bool(o)
        if isinstance(o, SCALARS):
            return _base(o)
        if type(o).__module__ == "numpy" and hasattr(o, "item") and getattr(o, "ndim", 1) == 0:
            return walk(o.item(), path)
        if isinstance(o, dict):
            items = []
            for k, v in o.items():
                if not (isinstance(k, SCALARS)):
                    raise UnsupportedValueError(
                        f"{path}: a dict key {k!r} is a {type(k).__name__}; keys must be "
                        "str, int, float, bool or None (dckpt stores no pickle)")
                items.append([_base(k), walk(v, f"{path}[{k!r}]")])
            return {"$d": items}
        if type(o) in (list, tuple):
            return {"$l" if type(o) is list else "$tp":
                    [walk(v, f"{path}[{i}]") for i, v in enumerate(o)]}
        raise UnsupportedValueError(
            f"{path} is a {type(o).__module__}.{type(o).__qualname__}; a checkpointed "
            "state_dict may hold only tensors, bytes, None/bool/int/float/str and "
            "dict/list/tuple of them (dckpt stores no pickle): convert it in state_dict()")

    doc = walk(obj, where)
    return {"doc": json.dumps(doc, allow_nan=True), "t": tensors, "b": blobs}


def _base(o: Any) -> Any:
    if o is None or type(o) in SCALARS:
        return o
    for t in (bool, int, float, str):
        if isinstance(o, t):
            return t(o)
    return o


def decode(entry: dict[str, Any], where: str = "state") -> Any:
    """The object :func:`encode` was given (tensors are the loaded CPU tensors).
    Pure. Raises ManifestError naming ``where`` on a malformed entry (an untrusted
    checkpoint)."""
    try:
        doc = json.loads(entry["doc"])
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: its JSON skeleton is missing or invalid ({e})") from None
    except RecursionError:  # an untrusted skeleton nested deeper than the parser allows
        raise ManifestError(f"{where}: its JSON skeleton is nested too deeply") from None
    tensors, blobs = entry.get("t") or {}, entry.get("b") or {}

    def walk(d: Any, depth: int) -> Any:
        if depth > 200:
            raise ManifestError(f"{where}: nested over 200 levels")
        if d is None or type(d) in SCALARS:
            return d
        if isinstance(d, dict) and len(d) == 1:
            (tag, v), = d.items()
            if tag == "$t" and type(v) is int and str(v) in tensors:
                return tensors[str(v)]
            if tag == "$b" and type(v) is int and str(v) in blobs:
                return blobs[str(v)]
            if tag in ("$l", "$tp") and isinstance(v, list):
                out = [walk(x, depth + 1) for x in v]
                return out if tag == "$l" else tuple(out)
            if tag == "$d" and isinstance(v, list) and all(
                    isinstance(p, list) and len(p) == 2 and (p[0] is None or type(p[0]) in SCALARS)
                    for p in v):
                return {k: walk(x, depth + 1) for k, x in v}
        raise ManifestError(f"{where}: unexpected node {str(d)[:80]!r} in its JSON skeleton")

    return walk(doc, 0)


def target(manifest: Any, prefix: str) -> dict[str, Any]:
    """A load target for the entry saved under ``prefix`` (``"objects.scheduler.0"``),
    shaped after the manifest: empty CPU tensors of the saved dtypes and shapes, ``b""``
    for bytes values, ``""`` for the skeleton. No I/O; allocates the tensors."""
    from ...format.dtypes import to_torch

    out: dict[str, Any] = {"doc": "", "t": {}, "b": {}}
    t_head, b_head = prefix + ".t.", prefix + ".b."
    for key, e in manifest.tensors.items():
        if key.startswith(t_head) and "." not in key[len(t_head):]:
            out["t"][key[len(t_head):]] = torch.empty(e.shape, dtype=to_torch(e.dtype))
        elif key.startswith(b_head) and "." not in key[len(b_head):]:
            out["b"][key[len(b_head):]] = b""
    for key in manifest.values:
        if key.startswith(b_head) and "." not in key[len(b_head):]:
            out["b"][key[len(b_head):]] = b""
    if not out["t"]:
        del out["t"]
    if not out["b"]:
        del out["b"]
    return out


def names(manifest: Any, root: str) -> set[str]:
    """The names of the entries saved under ``root`` (``"objects"`` -> {"scheduler.0",
    ...}): those with a skeleton ``<root>.<name>.doc``. No I/O."""
    head = root + "."
    return {k[len(head):-len(".doc")] for k in manifest.values
            if k.startswith(head) and k.endswith(".doc")}
