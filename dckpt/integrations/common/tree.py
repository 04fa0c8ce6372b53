"""A training state as one dckpt tree, and its load back at any world size.

Layout (``dckpt ls/inspect/verify`` read it):
- ``models.<i>``: model i's sharded state, FQN-keyed (:class:`.states.ModelState`);
- ``optimizers.<j>``: optimizer j's, keyed by its model's FQNs
  (:class:`.states.OptimizerState`);
- ``objects.<name>``: rank 0's copy of each framework object's ``state_dict()``
  (schedulers, scaler, dataloaders, registered objects) as :mod:`.codec` entries: JSON
  skeleton, tensors, bytes; saved by rank 0 only, loaded on every rank (so a per-rank
  value is rank 0's, as the frameworks' own rank-0 saves, never "some rank's copy");
- ``rng.rank<r>``: each rank's RNG states (:mod:`.rng`);
- ``<meta_key>``: the framework's metadata as a JSON string, rank 0's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...errors import CheckpointError, ManifestError, NotCommittedError
from ...protocol.collectives import Comm
from ...protocol.restore import load as _load
from ...tiers.chooser import timeline_of
from . import codec, rng
from .states import ModelState, OptimizerState, span


@dataclass
class Contents:
    """What a checkpoint holds. ``models``: the prepared models; ``skip``: indices of
    models not saved or loaded (a framework hook took them over; their optimizers
    still are). ``optimizers``: (optimizer, index of its model in ``models``, or -1
    when its parameters span several models or include loose ones: keyed then by
    :func:`.states.span`). ``objects``: {name: state} (a save: rank 0's ``state_dict()`` values,
    ``{}`` on other ranks; names of ``[A-Za-z0-9_]``). ``meta``: rank 0's JSON-able
    metadata (a save)."""

    models: list[torch.nn.Module]
    skip: set[int] = field(default_factory=set)
    optimizers: list[tuple[torch.optim.Optimizer, int]] = field(default_factory=list)  # -1: span
    objects: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] | None = None


def _check(c: Contents) -> None:
    for j, (_, i) in enumerate(c.optimizers):
        if not (isinstance(i, int) and -1 <= i < len(c.models)):
            raise CheckpointError(f"optimizer {j} belongs to model {i!r}, which is not one "
                                  f"of the {len(c.models)} models: an optimizer is keyed by "
                                  "its model's parameter names")
    for name in c.objects:
        if not name or not all(ch.isalnum() or ch == "_" for ch in name):
            raise CheckpointError(f"object name {name!r}: use letters, digits and '_'")


def _optimizer_states(c: Contents) -> dict[str, OptimizerState]:
    return {str(j): OptimizerState(span(opt, c.models) if i == -1 else c.models[i], opt)
            for j, (opt, i) in enumerate(c.optimizers)}


def build(c: Contents, rank: int, meta_key: str) -> dict[str, Any]:
    """The tree to save for ``c`` on ``rank``. Calls each object's encoding (rank 0)
    and captures this rank's RNG; the models' and optimizers' states are taken by the
    save itself. No I/O, no collective. Raises CheckpointError (a bad Contents) or
    UnsupportedValueError naming an object's value dckpt cannot store."""
    _check(c)
    tree: dict[str, Any] = {
        "models": {str(i): ModelState(m) for i, m in enumerate(c.models) if i not in c.skip},
        "optimizers": _optimizer_states(c),
        rng.ROOT: rng.entry(rank),
    }
    if rank == 0:
        tree["objects"] = {n: codec.encode(s, n) for n, s in c.objects.items()}
        tree[meta_key] = json.dumps(c.meta or {})
    return tree


def fence_targets(c: Contents) -> list:
    """What an overlapped asynchronous save must fence: each optimizer (its next
    ``step()`` waits for the snapshot's copy) and each saved model (its forwards that
    write saved tensors in place, BatchNorm's running statistics, wait too:
    dckpt.engine.fence). No I/O."""
    models = [m for i, m in enumerate(c.models) if i not in c.skip
              and isinstance(m, torch.nn.Module)]
    return [opt for opt, _ in c.optimizers] + models


@dataclass
class Loaded:
    """A load's outcome: the checkpoint's metadata, its objects' states ({name:
    state}), the world size it was saved at, the RNG states to set
    (:meth:`restore_rng`), and its place on the run's timeline (time, save id: the
    next commit continues it, :meth:`.commit.Committer.saw`)."""

    meta: dict[str, Any]
    objects: dict[str, Any]
    world_size: int
    _rng: Any = None
    timeline: float = 0.0  # its time on the run's timeline (tiers.chooser.timeline_of)
    save_id: str = ""

    def restore_rng(self) -> None:
        """Set this rank's generators (the r mod N rule at another world size). Never
        raises."""
        rng.apply(self._rng)


def load(path: str, c: Contents, meta_key: str, *, storage_options: dict | None = None,
         check: Callable[[dict, set], None] | None = None,
         ignore: tuple[str, ...] = (), manifest_name: str | None = None,
         strict: bool = True) -> Loaded:
    """Fill ``c``'s models and optimizers from the checkpoint at ``path`` (reshards:
    any world size, any parallelism) and return its metadata and objects (decoded, not
    applied). ``check(meta, object names)`` runs on every rank before any byte is read
    and may raise a CheckpointError (every rank raises it alike). Collective. Blocking
    I/O: each rank reads the byte ranges it needs. Raises on every rank alike:
    NotCommittedError (nothing committed there, or not this adapter's checkpoint),
    IntegrityError/ManifestError, StateMismatchError (names, shapes, dtypes), what
    ``check`` raises. ``ignore``: key prefixes of the checkpoint not loaded and not
    reported as unexpected (``("optimizers.",)``: the models only). ``manifest_name``:
    the manifest each rank reads (a fast-tier slot: this rank's view). ``strict=False``
    (stock ``load_state_dict(strict=False)``): keys the models lack or the checkpoint
    lacks are left alone (the models' own load decides); the optimizers still match.
    A model buffer whose saved shape differs from the live one is handed to the model's
    own ``load_state_dict`` at the saved shape (a buffer that grows with the data)."""
    _check(c)
    rank = Comm().rank
    models = {str(i): ModelState(m, strict) for i, m in enumerate(c.models) if i not in c.skip}
    optimizers = _optimizer_states(c)
    target: dict[str, Any] = {"models": models, "optimizers": optimizers}
    skipped = tuple(f"models.{i}." for i in sorted(c.skip))
    found: dict[str, Any] = {}

    def extra(m) -> dict[str, Any]:
        raw = m.values.get(meta_key)
        if not isinstance(raw, str):
            raise NotCommittedError(f"{path} holds no {meta_key!r} metadata: not a checkpoint "
                                    "saved by this adapter")
        try:
            meta = json.loads(raw)
        except ValueError as e:
            raise ManifestError(f"{path}: its {meta_key!r} metadata is not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise ManifestError(f"{path}: its {meta_key!r} metadata is not a JSON object")
        names = codec.names(m, "objects")
        if check is not None:
            check(meta, names)
        _shape_targets(m, models, optimizers)
        found["meta"], found["world"] = meta, m.world_size
        found["timeline"] = timeline_of(m), m.save_id
        objs = {n: codec.target(m, f"objects.{n}") for n in sorted(names)}
        found["objects"] = objs
        out: dict[str, Any] = {"objects": objs} if objs else {}
        rt, found["rng"] = rng.target(m, rank)
        if rt:
            out[rng.ROOT] = rt
        return out

    try:
        _load(target, path, storage_options=storage_options, strict=True, extra=extra,
              ignore_prefixes=(rng.ROOT + ".", meta_key) + skipped + tuple(ignore)
              + (() if strict else ("models.",)),
              manifest_name=manifest_name, allow_missing=not strict)
    except CheckpointError as e:  # extra()'s own error, the same on every rank: its type
        cause = e.__cause__
        if isinstance(cause, CheckpointError) and type(cause) is not type(e):
            raise type(cause)(str(cause)) from None
        raise
    objects = {n: codec.decode(t, f"{path}: objects.{n}") for n, t in found["objects"].items()}
    return Loaded(found["meta"], objects, found["world"], found.get("rng"),
                  found["timeline"][0][0], found["timeline"][1])


def apply_agreed(apply: Callable[[], None], what: str) -> None:
    """Run ``apply()`` (the frameworks' objects' ``load_state_dict``: schedulers, a
    scaler, registered objects) and raise its error on every rank alike: a
    CheckpointError or OSError as it is, any other as a StateMismatchError naming
    ``what`` (the object's own mismatch, the same on any checkpoint: never damage that a
    fallback to an older checkpoint would cure). Collective (one all-gather)."""
    from ...errors import StateMismatchError
    from ...protocol.collectives import agree

    err: BaseException | None = None
    try:
        apply()
    except (CheckpointError, OSError) as e:
        err = e
    except Exception as e:
        err = StateMismatchError(f"{what}: {type(e).__name__}: {e}")
    agree(Comm(), err, what)


def _shape_targets(m: Any, models: dict[str, ModelState],
                   optimizers: dict[str, OptimizerState]) -> None:
    """Before a load matches: whether each optimizer's saved entry holds state (a
    fresh optimizer is initialised only then, and a saved fresh one loads fresh), and
    which model buffers must be handed over at their saved shape. Pure over the
    manifest's keys: O(keys)."""
    saved: dict[str, set[str]] = {}  # optimizer -> its saved "state.<fqn>.<name>" keys
    for keys in (m.tensors, m.values):
        for k in keys:
            if k.startswith("optimizers."):
                parts = k.split(".", 2)
                if len(parts) == 3 and parts[2].startswith("state."):
                    saved.setdefault(parts[1], set()).add(parts[2])
    for j, o in optimizers.items():
        o.saved_has_state = j in saved
        o.saved_state_keys = saved.get(j, set())
    for i, ms in models.items():
        prefix = f"models.{i}."
        saved = {k[len(prefix):]: tuple(e.shape) for k, e in m.tensors.items()
                 if k.startswith(prefix)}
        ms.resize = ms.buffers_to_resize(saved) if saved else {}

