"""One DeepSpeed tag as a dckpt tree, and the load target shaped after a saved one.

Keys (``<name>`` a parameter's module name, ``<s>`` an optimizer state such as
``exp_avg``): ``master.<name>`` the fp32 master of a trainable parameter as a 1-D tensor
of its numel, each rank storing the range it holds (ZeRO-1/2/3; stage 0: the parameter
itself); ``optim.<s>.<name>`` each flat-shaped optimizer state, the same ranges;
``frozen.<name>`` a parameter no optimizer steps (1-D, its own dtype; ZeRO-3: each rank
its ``ds_tensor`` range); ``buffers.<name>`` the persistent buffers; ``deepspeed.meta``
a JSON string (shapes, groups, steps, counters, loss scaler, ...); ``scheduler`` and
``client`` codec entries (:mod:`..common.codec`); ``rng.rank<r>`` each rank's RNG.
Padding is never stored. Pure but for reading the live engine: no I/O, no collective."""
from __future__ import annotations

import json
import math
from typing import Any

import torch

from ....errors import CheckpointError, StateMismatchError
from .. import codec, rng
from .fragments import sharded
from .view import Param, View, frozen_local, local_range

FORMAT = 1
META = "deepspeed.meta"
# stock load_checkpoint refuses these client keys / returns DeepSpeed's under them
RESERVED = ("checkpoint_parallel_dimensions",)


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise CheckpointError(f"an optimizer step count of shape {list(v.shape)}")
        return v.item()
    return v


def _ranged(v: View, p: Param, t: torch.Tensor) -> Any:
    """``p``'s range of ``t`` (a flat or a flat-shaped state) as the stored tensor."""
    local = local_range(v, p, t)
    if v.kind == "plain":
        return local
    return sharded(local, p.frags, p.numel, t.dtype, v.rank)


def _scaler(opt: Any) -> dict:
    """The loss scaler's plain fields (a static 1.0 for fp32/bf16; fp16's dynamic
    scaler's counters), stored as JSON: never the pickled object."""
    return scaler_record(getattr(opt, "loss_scaler", None),
                         {k: getattr(opt, k, None)
                          for k in ("dynamic_loss_scale", "overflow", "clip_grad")})


def scaler_record(scaler: Any, extra: dict[str, Any]) -> dict:
    """The ``loss_scaler`` record of ``deepspeed.meta``: ``scaler``'s plain attributes
    (one-element tensors as numbers, non-finite floats as their repr, other values
    dropped) and each number of ``extra`` (the optimizer's flags) under ``@<name>``.
    Shared by a live engine's save and the stock-tag importer, so both write the same
    record. Pure."""
    out: dict[str, Any] = {}
    for k, val in (vars(scaler).items() if scaler is not None else ()):
        if isinstance(val, torch.Tensor) and val.numel() == 1:
            val = val.item()
        if val is None or isinstance(val, (bool, int, float, str)):
            if isinstance(val, float) and not math.isfinite(val):
                val = repr(val)
            out[k] = val
    for k, val in extra.items():
        if isinstance(val, (bool, int, float)):
            out["@" + k] = val
    return out


def _states(v: View) -> tuple[list[str], list[Any]]:
    """(the names of the flat-shaped optimizer states, the step count of each torch param
    group or None where it has no state yet). Raises CheckpointError for a state this
    layout cannot store (neither flat-shaped nor a step count) or steps that differ
    within a group."""
    keys: list[str] = []
    steps: list[Any] = [None] * len(v.groups)
    st = v.optimizer.state
    if v.kind == "plain":
        holders = [(v.params[n].param, v.params[n].numel, g)
                   for g, names in enumerate(v.groups) for n in names]
    else:
        holders = [(f.tensor, f.tensor.numel(), f.group) for f in v.flats]
    for t, numel, g in holders:
        s = st.get(t) if hasattr(st, "get") else None
        if not s:
            continue
        for k, val in s.items():
            if k == "step":
                got = _scalar(val)
                if steps[g] is not None and steps[g] != got:
                    raise CheckpointError(f"param group {g} has different step counts "
                                          f"({steps[g]} and {got}); dckpt stores one per group")
                steps[g] = got
            elif isinstance(val, torch.Tensor) and val.numel() == numel and numel:
                if k not in keys:
                    keys.append(k)
            elif val is None or (isinstance(val, torch.Tensor) and val.numel() == 0
                                 and numel == 0):
                continue  # SGD without momentum keeps momentum_buffer None
            else:
                raise CheckpointError(
                    f"the optimizer state {k!r} ({type(val).__name__}) is neither shaped "
                    "like the parameters nor a step count: dckpt cannot store it by range")
    return keys, steps


def build(v: View, *, client_state: dict, exclude_frozen: bool, tag: str,
          with_rng: bool = True, save_latest: bool = True,
          model_only: bool = False) -> dict[str, Any]:
    """The tree of one save of ``v``'s engine (views of the live buffers: copy before
    the next step, as dckpt's save or async snapshot does). ``model_only`` (the
    Trainer's ``save_only_model``): the weights only (fp32 masters, frozen parameters,
    buffers), no optimizer state, param groups or scheduler; such a tag loads with
    ``module_only`` only. Raises CheckpointError
    (UnsupportedValueError naming the key) for a ``client_state`` value dckpt cannot
    store, a reserved key, or optimizer state it cannot store."""
    import deepspeed

    eng, opt = v.engine, v.optimizer
    if not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    for k in client_state:
        if k in RESERVED:
            raise CheckpointError(f"client_state key {k!r} is reserved by DeepSpeed")
    keys, steps = ([], [None] * len(v.groups)) if model_only else _states(v)
    tree: dict[str, Any] = {"master": {}, "optim": {k: {} for k in keys}}
    st = opt.state
    for n, p in v.params.items():
        if not p.numel:  # a zero-size parameter: its shape (meta) is all there is
            continue
        src = p.param if v.kind == "plain" else v.flats[p.flat].tensor
        tree["master"][n] = _ranged(v, p, src)
        s = st.get(v.state_key(p)) if keys else None
        for k in keys:
            if not s or k not in s:  # a stage-0 parameter that never had a gradient
                continue
            tree["optim"][k][n] = _ranged(v, p, s[k])
    frozen_names = [] if exclude_frozen else [n for n, q in v.frozen.items() if _numel(q)]
    tree["frozen"] = {}
    for n in frozen_names:
        local, fs, numel = frozen_local(v, n, v.frozen[n])
        tree["frozen"][n] = (local if len(fs) and all(f.numel == numel for f in fs)
                             and v.kind != "zero3" else
                             sharded(local, fs, numel, local.dtype if local is not None else
                                     _dtype(v.frozen[n]), v.rank))
    tree["buffers"] = {n: b.detach() for n, b in v.buffers.items()}
    sched = None if model_only else getattr(eng, "lr_scheduler", None)
    if sched is not None and hasattr(sched, "state_dict"):
        tree["scheduler"] = codec.encode(sched.state_dict(), "lr_scheduler")
    # each rank's own (stock ZeRO-3 keeps one per rank: a data shard's position)
    tree["client"] = {f"rank{v.rank}": codec.encode(dict(client_state), "client_state")}
    if not model_only:  # a weights-only save never reads the optimizer's groups
        tree["hyper"] = codec.encode([{k: val for k, val in g.items() if k != "params"}
                                      for g in opt.param_groups], "param_groups")
    meta = {
        "format": FORMAT, "tag": tag, "kind": v.kind, "zero_stage": v.stage,
        "save_latest": bool(save_latest),
        "dp_world_size": v.world, "ds_version": deepspeed.__version__,
        "global_steps": int(eng.global_steps), "global_samples": int(eng.global_samples),
        "skipped_steps": int(eng.skipped_steps),
        "params": {n: list(p.shape) for n, p in v.params.items()},
        "frozen": {n: [list(_shape(q)), str(_dtype(q)).replace("torch.", "")]
                   for n, q in v.frozen.items()},
        "stored_frozen": frozen_names, "dtypes": {n: str(p.param.dtype).replace("torch.", "")
                                                  for n, p in v.params.items()},
        "groups": v.groups, "steps": steps, "state_keys": keys,
        "aliases": v.aliases, "loss_scaler": _scaler(eng.optimizer),
        "buffers": sorted(v.buffers), "model_only": bool(model_only),
    }
    tree["deepspeed"] = {"meta": json.dumps(meta, sort_keys=True)}
    if with_rng:  # a framework that nests the tag saves the RNG itself
        tree["rng"] = rng.entry(torch.distributed.get_rank())
    return tree


def engine_tree(engine: Any, **build_options: Any) -> dict[str, Any]:
    """:func:`build` of a live engine between DeepSpeed's checkpoint prologue and
    epilogue (ZeRO-3: every parameter partitioned while read; the persistent ones
    gathered again after), as stock's ``save_checkpoint`` brackets its writes: the tree
    holds fp32 flats, optimizer state, ``ds_tensor`` ranges and buffers, none of which
    the epilogue changes. Collective (ZeRO-3's gather). Raises CheckpointError for an
    engine dckpt does not support."""
    from .view import refusals, view

    refusals(engine)
    opt = engine.optimizer
    prologue = getattr(opt, "checkpoint_event_prologue", None)
    if prologue is not None:
        prologue()
    try:
        return build(view(engine), **build_options)
    finally:
        epilogue = getattr(opt, "checkpoint_event_epilogue", None)
        if epilogue is not None:
            epilogue()


def _numel(p: Any) -> int:
    """A parameter's true size (ZeRO-3 partitions leave ``p.numel()`` 0)."""
    return int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()


def _shape(p: Any) -> tuple[int, ...]:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def _dtype(p: Any) -> torch.dtype:
    return p.ds_tensor.dtype if hasattr(p, "ds_tensor") else p.dtype


def read_meta(manifest: Any, head: str = "") -> dict:
    """The ``deepspeed.meta`` record of a checkpoint's manifest (``head``: the prefix of
    a tag nested in a framework's checkpoint). Raises CheckpointError when the
    checkpoint is not a DeepSpeed tag saved by dckpt (or a newer format), ManifestError
    when the record is malformed."""
    raw = manifest.values.get(head + META)
    if not isinstance(raw, str):
        raise CheckpointError("this checkpoint is not a DeepSpeed tag saved by dckpt (it has "
                              f"no {META} record)")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"its {META} record is not JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"its {META} record has format {meta.get('format')!r} "
                              f"(this dckpt reads {FORMAT})" if isinstance(meta, dict) else
                              f"its {META} record is not an object")
    _check_meta(meta)
    return meta


def _ints(x: Any) -> bool:
    return isinstance(x, list) and all(type(i) is int and i >= 0 for i in x)


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, str) for i in x)


# each field of the record and the check its value must pass (an untrusted manifest:
# a wrong type is a clear error here, never a KeyError or TypeError in the load)
_FIELDS = {
    "global_steps": lambda x: type(x) is int, "global_samples": lambda x: type(x) is int,
    "skipped_steps": lambda x: type(x) is int, "dp_world_size": lambda x: type(x) is int,
    "ds_version": lambda x: isinstance(x, str),
    "params": lambda x: isinstance(x, dict) and all(_ints(v) for v in x.values()),
    "frozen": lambda x: isinstance(x, dict) and all(
        isinstance(v, list) and len(v) == 2 and _ints(v[0]) and isinstance(v[1], str)
        for v in x.values()),
    "stored_frozen": _strs, "buffers": _strs, "state_keys": _strs,
    "groups": lambda x: isinstance(x, list) and all(_strs(g) for g in x),
    "steps": lambda x: isinstance(x, list) and all(
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in x),
    "aliases": lambda x: isinstance(x, dict) and all(isinstance(v, str) for v in x.values()),
    "loss_scaler": lambda x: isinstance(x, dict),
}


def _check_meta(meta: dict) -> None:
    """Raise ManifestError naming the first field of ``meta`` that is missing or of the
    wrong type, or steps that do not match the groups."""
    from ....errors import ManifestError

    for k, ok in _FIELDS.items():
        if k not in meta or not ok(meta[k]):
            raise ManifestError(f"its {META} record's {k!r} is missing or malformed")
    if type(meta.get("model_only", False)) is not bool:
        raise ManifestError(f"its {META} record's 'model_only' is malformed")
    if len(meta["steps"]) != len(meta["groups"]):
        raise ManifestError(f"its {META} record has {len(meta['steps'])} step counts for "
                            f"{len(meta['groups'])} param groups")


def target(v: View, meta: dict, *, masters: bool, optim: bool, frozen: bool,
           buffers: bool, stored: Any = None) -> dict[str, Any]:
    """The load target of a saved tag (``meta``) for ``v``'s engine: views into its
    buffers, which the load fills in place. Creates the optimizer's state tensors when
    ``optim`` and the checkpoint has state (padding zeroed: the load fills the rest).
    ``stored(key)``: whether the tag holds tensor ``key`` (a stage-0 parameter that never
    had a gradient has no optimizer state: it gets none here either). Raises
    StateMismatchError naming parameters missing on either side or of another size."""
    saved, saved_frozen = meta["params"], meta["frozen"]
    live = {n: p for n, p in v.params.items() if p.numel}  # a zero-size one: nothing to load
    missing = [n for n in live if n not in saved]
    shapes = {n: list(p.shape) for n, p in live.items()}
    shapes.update({n: list(_shape(q)) for n, q in v.frozen.items()})
    shaped = [n for n, sh in shapes.items() if (n in saved and list(saved[n]) != sh) or (
        n not in saved and n in saved_frozen and list(saved_frozen[n][0]) != sh)]
    if missing or shaped:
        def was(n: str) -> list:
            return list(saved[n]) if n in saved else list(saved_frozen[n][0])
        raise StateMismatchError(
            (f"the checkpoint lacks trainable parameter(s) {missing[:8]}" if missing else "")
            + ("; " if missing and shaped else "")
            + (f"parameter(s) {[(n, was(n), shapes[n]) for n in shaped[:8]]} (saved, here) "
               "have another shape here" if shaped else "")
            + " (is it a checkpoint of another model?)")
    out: dict[str, Any] = {}
    if masters:
        for f in v.flats:  # the load fills every parameter's range: zero the rest only
            _zero_pads(f.tensor, f.pad)
        out["master"] = {n: _ranged(v, p, p.param if v.kind == "plain" else
                                         v.flats[p.flat].tensor) for n, p in live.items()}
    if frozen:  # trained when saved, frozen here: its weights from the saved master
        for n, q in v.frozen.items():
            if n in saved and _numel(q):
                out.setdefault("master", {})[n] = _frozen_target(v, n, q)
    keys = meta["state_keys"] if optim else []
    if optim:
        _prepare_state(v, meta)
    if keys:
        out["optim"] = {}
        st = v.optimizer.state
        for k in keys:
            out["optim"][k] = {n: _ranged(v, p, st[v.state_key(p)][k])
                               for n, p in live.items()
                               if stored is None or stored(f"optim.{k}.{n}")}
        if v.kind == "plain" and stored is not None:  # as saved: no state, no entry
            for n, p in live.items():
                if not all(stored(f"optim.{k}.{n}") for k in keys):
                    st.pop(p.param, None)
    if frozen:
        out["frozen"] = {}
        stored = set(meta["stored_frozen"])
        for n, q in v.frozen.items():
            if n not in stored:
                continue
            out["frozen"][n] = _frozen_target(v, n, q)
    if buffers:
        out["buffers"] = {n: b for n, b in v.buffers.items() if n in meta["buffers"]}
    return out


def _frozen_target(v: View, n: str, q: Any) -> Any:
    """The load target of frozen parameter ``q``: its live storage (ZeRO-3: this rank's
    range of ``ds_tensor``), filled in place."""
    local, fs, numel = frozen_local(v, n, q)
    return (local if v.kind != "zero3" or not hasattr(q, "ds_tensor")
            else sharded(local, fs, numel, _dtype(q), v.rank))


def _zero_pads(t: torch.Tensor, pads: list[tuple[int, int]]) -> None:
    """Zero the (start, length) ranges of the 1-D ``t`` that hold no parameter."""
    for start, n in pads:
        t.data.narrow(0, start, n).zero_()


def _prepare_state(v: View, meta: dict) -> None:
    """Give the optimizer the state the checkpoint has: zero tensors of each saved
    state key per flat (or parameter at stage 0) and the saved step per group; none
    where the checkpoint has none (saved before the first step)."""
    import torch as _t

    st = v.optimizer.state
    keys, steps = meta["state_keys"], meta["steps"]
    holders = ([(v.params[n].param, g) for g, names in enumerate(v.groups) for n in names]
               if v.kind == "plain" else [(f.tensor, f.group) for f in v.flats])
    pads = {id(f.tensor): f.pad for f in v.flats}
    for t, g in holders:
        step = steps[g] if g < len(steps) else None
        if not keys:  # saved before the first step: no state, as then
            st.pop(t, None)
            continue
        old = st.get(t, {})
        s = {}
        for k in keys:
            # the load fills every parameter's range: only the padding needs zeros
            # (a fresh engine's state: empty, not zeros_like, which costs a pass more)
            s[k] = old[k] if isinstance(old.get(k), _t.Tensor) else _t.empty_like(t)
            if v.kind == "plain":
                continue
            _zero_pads(s[k], pads[id(t)])
        prev = old.get("step")
        if step is None:  # an optimizer without a step count (SGD)
            st[t] = s
            continue
        if isinstance(prev, _t.Tensor):
            s["step"] = _t.tensor(float(step), dtype=prev.dtype, device=prev.device)
        else:  # as torch's Adam creates it: a 0-d tensor of its scalar dtype
            hp = v.optimizer.param_groups[g]
            s["step"] = _t.tensor(float(step), dtype=(
                _t.float64 if _t.get_default_dtype() == _t.float64 else _t.float32),
                device=t.device if hp.get("capturable") or hp.get("fused") else "cpu")
        st[t] = s
