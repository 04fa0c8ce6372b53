"""Lightning's checkpoint metadata (loops, callbacks, hyper-parameters, schedulers,
user keys) as dckpt entries, without pickle where the values allow it.

The stock ``ModelParallelStrategy`` writes this dict with ``torch.save`` to ``meta.pt``
(a pickle, written by rank 0 after the sharded save: not part of any commit). Here it
becomes three entries of the dckpt checkpoint itself, so it is committed, checksummed
and verified with the weights:

- ``<key>.tree``: a JSON document (a str value in dckpt's manifest): the nested
  structure with every JSON-able leaf in place (dicts with str/int keys, lists,
  tuples, None/bool/int/float/str; non-finite floats tagged);
- ``<key>.tensors.<i>``: the tensors met on the way (a ModelCheckpoint's scores), as
  ordinary dckpt tensors;
- ``<key>.pickle`` (only when needed): a uint8 tensor holding ``torch.save`` of the
  leaves that are none of these (an ``argparse.Namespace`` or an OmegaConf container in
  the hyper-parameters, a custom object a callback returns). Loading it runs
  ``torch.load`` on those bytes, with Lightning's ``weights_only``: that is a pickle
  dckpt checksums but does not control.

Pure CPU, no I/O, no collective.
"""
from __future__ import annotations

import io
import json
import math
from typing import Any

import torch

from ...errors import ManifestError
from ...format.dtypes import to_code, to_torch

FORMAT = 1
_SCALARS = (type(None), bool, int, str)


def _storable(t: torch.Tensor) -> bool:
    """A plain strided tensor of a dtype dckpt stores (else it is pickled)."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return False
    try:
        to_code(t.dtype)
    except Exception:
        return False
    return True


def encode(obj: Any) -> dict[str, Any]:
    """``{"format", "tree", "tensors"[, "pickle"]}`` for ``obj`` (a dict of Lightning
    metadata), ready to be saved under one key of a dckpt state. Tensors are detached
    (no copy). O(leaves); the pickle part costs one ``torch.save`` of the leftovers."""
    tensors: list[torch.Tensor] = []
    leftovers: list[Any] = []

    def walk(x: Any) -> Any:
        t = type(x)
        if t in _SCALARS:
            return x
        if t is float:
            return x if math.isfinite(x) else {"float": repr(x)}
        if t is dict and all(type(k) in (str, int) for k in x):
            return {"dict": [[k, walk(v)] for k, v in x.items()]}
        if t is list:
            return {"list": [walk(v) for v in x]}
        if t is tuple:
            return {"tuple": [walk(v) for v in x]}
        if isinstance(x, torch.Tensor) and _storable(x):
            tensors.append(x.detach())
            return {"tensor": len(tensors) - 1}
        leftovers.append(x)
        return {"pickle": len(leftovers) - 1}

    tree = walk(obj)
    out: dict[str, Any] = {"format": FORMAT, "tree": json.dumps(tree, allow_nan=False),
                           "tensors": tensors}
    if leftovers:
        buf = io.BytesIO()
        torch.save(leftovers, buf)
        out["pickle"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return out


def decode(enc: dict[str, Any], where: str, weights_only: bool | None = None) -> Any:
    """The metadata :func:`encode` stored, rebuilt from the entries a load filled
    (``enc``: the same keys). ``where`` names the checkpoint in errors. Raises
    ManifestError for a malformed tree; the unpickling of ``pickle`` raises what
    ``torch.load`` raises (``weights_only=True`` refuses arbitrary objects)."""
    if enc.get("format") != FORMAT:
        raise ManifestError(f"{where}: Lightning metadata of format {enc.get('format')!r}, "
                            f"this dckpt reads format {FORMAT}")
    try:
        tree = json.loads(enc["tree"])
    except (TypeError, ValueError) as e:
        raise ManifestError(f"{where}: the Lightning metadata is not JSON: {e}") from None
    tensors = enc.get("tensors") or []
    leftovers: list[Any] = []
    if enc.get("pickle") is not None:
        data = enc["pickle"].numpy().tobytes()
        leftovers = torch.load(io.BytesIO(data), weights_only=weights_only)

    def bad(x: Any) -> ManifestError:
        return ManifestError(f"{where}: malformed Lightning metadata node {str(x)[:80]!r}")

    def walk(x: Any) -> Any:
        if not isinstance(x, dict):
            if isinstance(x, list):
                raise bad(x)
            return x
        if len(x) != 1:
            raise bad(x)
        (tag, v), = x.items()
        try:
            if tag == "dict":
                return {k: walk(w) for k, w in v}
            if tag == "list":
                return [walk(w) for w in v]
            if tag == "tuple":
                return tuple(walk(w) for w in v)
            if tag == "float":
                return float(v)
            if tag == "tensor":
                return tensors[v]
            if tag == "pickle":
                return leftovers[v]
        except (TypeError, ValueError, IndexError, KeyError):
            raise bad(x) from None
        raise bad(x)

    return walk(tree)


def target(manifest: Any, key: str) -> dict[str, Any] | None:
    """A load target for the entries :func:`encode` wrote under ``key``, shaped after
    what ``manifest`` holds (tensors empty, of the saved dtype and shape; values None),
    or None when the checkpoint has none. Allocates the metadata's tensors; no I/O."""
    head = key + "."
    if head + "tree" not in manifest.values:
        return None
    tensors = {}
    for k, e in manifest.tensors.items():
        rest = k[len(head):] if k.startswith(head + "tensors.") else ""
        if rest:
            idx = rest[len("tensors."):]
            if not idx.isdigit():
                raise ManifestError(f"unexpected Lightning metadata key {k!r}")
            tensors[int(idx)] = torch.empty(e.shape, dtype=to_torch(e.dtype))
    if sorted(tensors) != list(range(len(tensors))):
        raise ManifestError(f"Lightning metadata tensors under {head}tensors are not 0..n-1")
    out: dict[str, Any] = {"format": None, "tree": None,
                           "tensors": [tensors[i] for i in range(len(tensors))]}
    p = manifest.tensors.get(head + "pickle")
    if p is not None:
        out["pickle"] = torch.empty(p.shape, dtype=to_torch(p.dtype))
    return out


def to_bytes(enc: dict[str, Any] | None) -> bytes:
    """The entry :func:`encode` made (or None) as bytes for a broadcast: a JSON header
    (format, tree, each tensor's dtype and shape) and the tensors' raw bytes. No pickle.
    Pure CPU, O(bytes)."""
    if enc is None:
        return b"null"
    ts = [*enc["tensors"], *([enc["pickle"]] if "pickle" in enc else [])]
    head = json.dumps({"format": enc["format"], "tree": enc["tree"], "pickle": "pickle" in enc,
                       "tensors": [[to_code(t.dtype), list(t.shape)] for t in ts]}).encode()
    body = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for t in ts]
    return len(head).to_bytes(8, "little") + head + b"".join(body)


def from_bytes(data: bytes) -> dict[str, Any] | None:
    """:func:`to_bytes`'s entry back (new tensors). Pure CPU."""
    if data == b"null":
        return None
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + n])
    pos, ts = 8 + n, []
    for code, shape in head["tensors"]:
        dtype = to_torch(code)
        t = torch.empty(shape, dtype=dtype)
        size = t.numel() * t.element_size()
        if size:
            raw = torch.frombuffer(bytearray(data[pos:pos + size]), dtype=torch.uint8)
            t = raw.view(dtype).reshape(shape)
        ts.append(t)
        pos += size
    out: dict[str, Any] = {"format": head["format"], "tree": head["tree"]}
    if head["pickle"]:
        out["pickle"] = ts.pop()
    out["tensors"] = ts
    return out


def resumable(manifest: Any, key: str = "__lightning__") -> bool:
    """Whether the checkpoint of ``manifest`` holds a whole training state as the
    Trainer dumps it (its metadata has ``lr_schedulers``, which
    ``dump_checkpoint(weights_only=True)`` leaves out), not the weights alone. Pure;
    never raises (False for anything else)."""
    try:
        doc = dict(json.loads(manifest.values[key + ".tree"])["dict"])
        return any(k == "lr_schedulers" for k, _ in doc["meta"]["dict"])
    except Exception:
        return False
