"""A dckpt DeepSpeed tag's weights under their module names, for ``dckpt export``
(what DeepSpeed's ``zero_to_fp32.py`` gives, without gathering in one process): each
trainable parameter's fp32 master (``master.<name>``, stored 1-D) reshaped to the
parameter's shape, each stored frozen parameter (``frozen.<name>``) and each persistent
buffer (``buffers.<name>``). Tied aliases are left out, as ``save_pretrained`` leaves
them. Pure: the manifest's ``deepspeed.meta`` record only; no torch, no I/O."""
from __future__ import annotations

import json
import math
from typing import Any

META = "deepspeed.meta"


def weights(values: dict[str, Any], tensors: dict[str, Any],
            head: str = "") -> list[tuple[str, str, tuple]] | None:
    """``[(checkpoint key, output name, output shape)]`` of a DeepSpeed tag's manifest
    (``values``/``tensors``: the manifest's; ``head``: the key prefix of a tag nested in
    a framework's checkpoint, e.g. ``"engine."``), in module order; None when it is not one
    (no ``deepspeed.meta``) or the record does not describe its tensors (then the
    export falls back to keys). Raises ValueError on a record whose shapes disagree
    with the stored sizes (a damaged or hand-made manifest)."""
    raw = values.get(head + META)
    if not isinstance(raw, str):
        return None
    try:
        meta = json.loads(raw)
        params, frozen = dict(meta["params"]), dict(meta["frozen"])
        buffers = list(meta["buffers"])
    except (ValueError, KeyError, TypeError):
        return None
    out = []
    try:  # an untrusted record: every shape a list of ints, or a clear error
        shaped = [("master.", {n: _dims(s) for n, s in params.items()}),
                  ("frozen.", {n: _dims(s[0]) for n, s in frozen.items()})]
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"its {META} record has a malformed shape ({e})") from None
    for prefix, shapes in shaped:
        for name, shape in shapes.items():
            key = head + prefix + name
            e = tensors.get(key)
            if e is None:
                continue  # a frozen parameter saved with exclude_frozen_parameters
            if math.prod(shape) != math.prod(e.shape):
                raise ValueError(f"{key}: {list(e.shape)} stored, the record says {list(shape)}")
            out.append((key, name, shape))
    for name in buffers:
        if not isinstance(name, str):
            raise ValueError(f"its {META} record names a buffer {name!r}")
        key = head + "buffers." + name
        e = tensors.get(key)
        if e is not None:
            out.append((key, name, tuple(e.shape)))
    return out


def _dims(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
        raise ValueError(f"{shape!r} is not a list of sizes")
    return tuple(shape)
