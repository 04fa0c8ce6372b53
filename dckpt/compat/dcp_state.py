"""The state walks of :mod:`dckpt.compat.dcp`: what a DCP-style state_dict becomes for
dckpt's engine, how a load target is matched against the manifest with DCP's rules,
and how the caller's containers are filled back.

Order: every walk visits dict keys sorted (``key=str``), so Stateful objects get
``state_dict()`` and ``load_state_dict()`` in the same order on every rank whatever
each rank's insertion order; their methods may run collectives (DCP sorts the
top-level keys of a load for the same reason). Pure Python over the state; the only
torch calls allocate (bytes values, meta tensors, dtype-conversion temporaries).
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any, Collection

import torch

from ..errors import CheckpointError, StateMismatchError, UnsupportedValueError
from ..format import manifest as mf
from ..format.dtypes import to_torch
from ..state.flatten import fill, is_stateful
from .dcp_values import MISSING, Saved, is_plain

log = logging.getLogger(__name__)
BYTES_KEY = "__dckpt_compat_bytes__"  # JSON value: {flat key: "bytes" | "bytesio"}
_FLOAT = {torch.float64, torch.float32, torch.float16, torch.bfloat16}


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _items(obj: Any) -> list:
    """(key, value) pairs of a dict (keys sorted by str) or a list; else none."""
    if isinstance(obj, dict):
        return [(k, obj[k]) for k in sorted(obj, key=str)]
    if type(obj) is list:
        return list(enumerate(obj))
    return []


@dataclass
class Resolved:
    """A DCP state_dict as dckpt sees it: ``target`` is a parallel structure (new
    dicts, lists and tuples) whose leaves are the caller's own tensors, Stateful
    objects replaced by their ``state_dict()`` and bytes by uint8 tensors."""

    target: dict
    stateful: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (obj, its sd)
    kinds: dict[str, str] = field(default_factory=dict)  # key -> "bytes" | "bytesio"


def resolve(state_dict: Any, what: str) -> Resolved:
    """Resolve ``state_dict`` (see :class:`Resolved`). Calls each Stateful's
    ``state_dict()`` once, in sorted key order (depth first); copies only bytes
    values. Raises CheckpointError (not a dict), UnsupportedValueError (a top-level
    key that is not a str)."""
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"dckpt.compat.dcp.{what}: state_dict must be a dict, not "
                              f"{type(state_dict).__name__}")
    for k in state_dict:
        if not isinstance(k, str):
            raise UnsupportedValueError(f"dckpt.compat.dcp.{what}: top-level key {k!r} is not "
                                        "a str (DCP requires str keys at the top)")
    out = Resolved({})

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, (bytes, bytearray, io.BytesIO)):
            out.kinds[key] = "bytesio" if isinstance(obj, io.BytesIO) else "bytes"
            raw = obj.getvalue() if isinstance(obj, io.BytesIO) else bytes(obj)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
                torch.zeros(0, dtype=torch.uint8)
        if is_stateful(obj):
            sd = walk(obj.state_dict(), key)
            out.stateful[key] = (obj, sd)
            return sd
        if isinstance(obj, dict):
            done = {k: walk(v, _join(key, k)) for k, v in _items(obj)}
            return {k: done[k] for k in obj}  # the caller's order, for readability
        if type(obj) in (list, tuple):
            return type(obj)(walk(v, _join(key, i)) for i, v in enumerate(obj))
        return obj

    out.target = walk(state_dict, "")
    return out


def as_bytes(t: torch.Tensor, kind: str) -> bytes | io.BytesIO:
    """A loaded uint8 tensor back as what was saved: bytes, or a BytesIO at position 0."""
    raw = t.numpy().tobytes()
    return io.BytesIO(raw) if kind == "bytesio" else raw


@dataclass
class Prepared:
    """What :func:`prepare_load` changed in the target, to be undone or applied after
    dckpt's load: ``replaced`` (key -> the new object the caller's container gets:
    loaded bytes, tensors that were on the meta device), ``converted`` (key -> (the
    caller's tensor, a temporary in the saved dtype) copied after the load),
    ``whole`` (key -> the saved value that replaces a plain value whole, lists of
    plain values included: :mod:`~dckpt.compat.dcp_values`), ``kept`` (keys
    allow_partial_load leaves as they are), ``held`` ((container, key, value) swapped
    for ``()`` so that dckpt's load does not touch them: put back after it)."""

    bytes_: dict[str, torch.Tensor] = field(default_factory=dict)
    replaced: dict[str, Any] = field(default_factory=dict)
    converted: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    whole: dict[str, Any] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)
    held: list = field(default_factory=list)


def prepare_load(target: dict, m: mf.Manifest, saved_kinds: dict[str, str],
                 partial: bool, saved: Saved | None = None,
                 stateful: Collection[str] = ()) -> Prepared:
    """Match ``target`` against the manifest with DCP's rules, before any read, and
    adjust it in place: a bytes value gets a uint8 tensor of the saved size; a meta
    tensor a real one (plain tensors on CPU, DTensors with the same mesh and
    placements), as DCP initialises meta tensors; a tensor saved in another dtype that
    dckpt's cast does not convert (int <-> float, bool...) a temporary of the saved
    dtype, copied back with ``copy_`` after the load (DCP's copy converts any dtype);
    a plain value (a scalar, or a list/tuple holding no tensor and no dict) is
    replaced whole by what the checkpoint holds at its key (``saved``), whatever its
    length, as DCP does; under ``partial`` an entry the checkpoint lacks is kept as
    it is (in a dict or a list). ``stateful``: the keys of Stateful objects (a list
    holding one is not a plain value: its ``load_state_dict`` must run). An empty
    list the checkpoint holds nothing for stays empty (a checkpoint written before
    the shim recorded empty lists cannot tell "[]" from "absent"). Raises
    StateMismatchError with DCP's wording: "Missing key in checkpoint state_dict:
    k." (the first few keys), "Size mismatch between saved torch.Size([...]) and
    current: torch.Size([...]) for k". O(leaves + V log V) for V saved values; no
    I/O."""
    out = Prepared()
    saved = saved or Saved(m, [])
    missing: list[str] = []
    # Every proper dotted prefix of a saved key, built once: O(total key length). A
    # scan of all keys per container was O(containers x keys), seconds for an
    # optimizer's per-parameter state dicts.
    parents: set[str] = set()
    for name in (*m.tensors, *m.values, *saved.empties):  # an empty list leaves no leaf
        i = name.find(".")
        while i >= 0:
            parents.add(name[:i])
            i = name.find(".", i + 1)
    inner = {k.rsplit(".", n)[0] for k in stateful for n in range(1, k.count(".") + 1)}

    def has_under(key: str) -> bool:
        return key in parents

    def hold(obj: Any, k: Any, v: Any) -> None:
        out.held.append((obj, k, v))
        obj[k] = ()  # holds no key: dckpt's load neither reads nor checks it

    def keep(obj: Any, k: Any, v: Any, sub: str) -> None:
        log.info("allow_partial_load: %r is not in the checkpoint; left as it is", sub)
        out.kept.add(sub)
        hold(obj, k, v)

    def plain(obj: Any, k: Any, v: Any, sub: str) -> None:
        got = saved.value(sub, v)
        if got is not MISSING:
            out.whole[sub] = got
            hold(obj, k, v)
        elif not v:
            pass  # an empty list the checkpoint has nothing for: stays empty
        elif partial:
            keep(obj, k, v, sub)
        else:
            missing.append(sub)

    def walk(obj: Any, key: str) -> None:
        for k, v in _items(obj):
            sub = _join(key, k)
            if sub in saved_kinds and sub in m.tensors:
                obj[k] = out.bytes_[sub] = torch.empty(m.tensors[sub].shape, dtype=torch.uint8)
            elif is_plain(v) and sub not in inner:
                plain(obj, k, v, sub)
            elif sub in m.tensors or sub in m.values:
                if isinstance(v, torch.Tensor) and sub in m.tensors:
                    tensor(obj, k, v, sub, m.tensors[sub])
                elif isinstance(v, (dict, list)) and v:
                    walk(v, sub)  # a container where a leaf was saved: dckpt's load says so
            elif (not isinstance(v, (torch.Tensor, dict, list, tuple))
                  and (got := saved.value(sub, v)) is not MISSING):
                out.whole[sub] = got  # a scalar where a list was saved
                hold(obj, k, v)
            elif isinstance(v, (dict, list)) and v and has_under(sub):
                walk(v, sub)
            elif isinstance(v, tuple) and has_under(sub):
                continue  # tuples are rebuilt by dckpt's load, which checks their leaves
            elif isinstance(v, dict) and not v:
                continue  # an empty dict holds no key (a fresh optimizer's state)
            elif partial:
                keep(obj, k, v, sub)
            else:
                missing.append(sub)

    def tensor(obj: Any, k: Any, t: torch.Tensor, key: str, entry: mf.TensorEntry) -> None:
        if tuple(t.shape) != tuple(entry.shape):
            raise StateMismatchError(
                f"Size mismatch between saved torch.Size({list(entry.shape)}) and current: "
                f"torch.Size({list(t.shape)}) for {key}")
        saved = to_torch(entry.dtype)
        if t.is_meta:
            obj[k] = out.replaced[key] = _materialise(t, key)
            t = obj[k]
        if t.dtype != saved and not (t.dtype in _FLOAT and saved in _FLOAT):
            tmp = _like(t, saved, key)
            out.converted[key] = (t, tmp)
            obj[k] = tmp

    walk(target, "")
    if missing:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:6])})" if len(missing) > 1 else ""
        raise StateMismatchError(f"Missing key in checkpoint state_dict: {missing[0]}.{more}")
    return out


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def _device() -> torch.device:
    """Where DCP puts a meta tensor it initialises: the default group's device."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_pg_default_device()
        except Exception:  # a private helper: fall back to the CPU
            pass
    return torch.device("cpu")


def _materialise(t: torch.Tensor, key: str) -> torch.Tensor:
    """A real (uninitialised) tensor in place of meta tensor ``t``."""
    DTensor = _dtensor_type()
    if DTensor is not None and isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), device=_device())
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.size(), stride=t.stride())
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedValueError(f"tensor {key!r} is a {type(t).__name__} on the meta "
                                    "device: only plain tensors and DTensors can be loaded "
                                    "from the meta device")
    return torch.empty_like(t, device=_device())


def _like(t: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
    """A temporary shaped and sharded like ``t`` in ``dtype`` (a DTensor: same mesh
    and placements, so the copy back is local)."""
    DTensor = _dtensor_type()
    if DTensor is not None and isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), dtype=dtype)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.size(), stride=t.stride())
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise StateMismatchError(f"tensor {key!r} ({type(t).__name__}) has dtype {t.dtype}, "
                                 f"the checkpoint {dtype}: dckpt.compat.dcp converts only "
                                 "plain tensors and DTensors between these dtypes")
    return torch.empty_like(t, dtype=dtype)


def fill_back(state_dict: dict, stateful: dict[str, tuple[Any, Any]], get,
              whole: Collection[str] = ()) -> None:
    """Fill the caller's ``state_dict`` in place, DCP's way: dicts and lists keep their
    identity, every leaf becomes ``get(key, old)``, and so does every key of
    ``whole`` (a plain list replaced as one value), tuples are rebuilt; a Stateful
    object gets ``load_state_dict`` of its loaded state_dict (inner ones first) and
    stays in its slot; every other top-level value is assigned back
    (``state_dict[key] = value``, as DCP does). Keys are visited sorted at every
    level, so Stateful objects are loaded in the same order on every rank. This is
    :func:`dckpt.state.flatten.fill` (the walk :func:`dckpt.load` fills with), sorted."""
    fill(state_dict, get, stateful, sort=True, whole=whole)
