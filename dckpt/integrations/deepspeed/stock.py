"""Import a stock DeepSpeed ZeRO-1/2/3 tag (DeepSpeed's own pickles) into a dckpt
DeepSpeed tag, in one process, without DeepSpeed and without a process group.

The tag folder (``global_step<N>/``) holds ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (ZeRO-3), and
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank. Each file is read by
torch's loader with ``weights_only=True`` (:mod:`.stock_files`) and exactly the DeepSpeed globals a tag
holds allowed (:data:`.stock_files.DEEPSPEED_GLOBALS`), each mapped to a stand-in defined here: a
plain record whose attributes the pickle fills, or a function returning an int. No
DeepSpeed code and no other global runs; any other global (``os.system``...) makes
the import fail with a CheckpointError naming the file. This is defence in depth, not
a reason to import tags from untrusted places.

The output is what :func:`.tree.build` writes for the same engine (minus ``rng.*``:
stock tags have no RNG state): ``master.<name>`` / ``optim.<state>.<name>`` as full
1-D tensors rebuilt from every rank's flat partition with :mod:`.layout`'s range
arithmetic (dckpt reshards them on load), ``frozen.<name>``, ``buffers.<name>``, the
``scheduler`` / ``client`` / ``hyper`` codec entries and the ``deepspeed.meta``
record, so ``engine.load_checkpoint`` of an attached engine loads it at any
data-parallel size and ZeRO stage.

Memory: the rebuilt full tensors (fp32 master + each optimizer state, i.e. about
``(1 + states) * 4`` bytes per trainable element, 12 for Adam), plus the stored frozen
parameters and buffers, which stay memory-mapped from the model-states file(s); the
rank files are opened one at a time (memory-mapped: only the ranges copied are read)
and dropped before the next.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from ...errors import CheckpointError, UnsupportedValueError
from ..common import codec
from ..common.zero.layout import grouped, split
from ..common.zero.tree import FORMAT
from .stock_files import (DS_KEYS, MAX_FILE, _DynamicLossScaler, _int, _LossScaler, _need,
                          _refusals, _scan, _shapes, _Tag, read_file)

def _steps_and_keys(osd: dict, holders: list[list[int]], numel_of: dict[int, int],
                    path: str) -> tuple[list[Any], list[str], dict[str, torch.dtype]]:
    """(step per param group, flat-shaped state keys, their dtypes) of one rank's torch
    optimizer state dict; ``holders[g]`` the state indices of group g, ``numel_of`` each
    index's flat numel (padded)."""
    state = _need(osd, "state", dict, path)
    steps: list[Any] = [None] * len(holders)
    keys: list[str] = []
    dtypes: dict[str, torch.dtype] = {}
    for g, idxs in enumerate(holders):
        for i in idxs:
            s = state.get(i)
            if not s:
                continue
            if not isinstance(s, dict):
                raise CheckpointError(f"{path}: optimizer state {i} is a {type(s).__name__}")
            for k, val in s.items():
                if k == "step":
                    if isinstance(val, torch.Tensor):
                        if val.numel() != 1:
                            raise CheckpointError(
                                f"{path}: a step count of shape {list(val.shape)}")
                        val = val.item()
                    if steps[g] is not None and steps[g] != val:
                        raise CheckpointError(f"{path}: param group {g} has different step "
                                              f"counts ({steps[g]} and {val}); dckpt stores one")
                    steps[g] = val
                elif (isinstance(val, torch.Tensor) and val.dim() == 1
                      and val.numel() == numel_of[i]):
                    if k not in keys:
                        keys.append(k)
                        dtypes[k] = val.dtype
                else:
                    raise CheckpointError(
                        f"{path}: the optimizer state {k!r} ({type(val).__name__}) is neither "
                        "shaped like the flat partition nor a step count: dckpt cannot store it")
    return steps, keys, dtypes


def _hyper(osd: dict, path: str) -> list[dict]:
    groups = _need(osd, "param_groups", list, path)
    if not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{path}: malformed param_groups")
    return groups


def _holders(groups: list[dict], count: int, path: str) -> list[list[int]]:
    """Each param group's state indices (its flats: ZeRO-1/2 one, ZeRO-3 its sub-groups);
    each of ``range(count)`` exactly once."""
    out, seen = [], []
    for g in groups:
        idx = g.get("params")
        if not isinstance(idx, list) or not all(isinstance(i, int) for i in idx):
            raise CheckpointError(f"{path}: param group 'params' {idx!r} is not a list of ints")
        out.append(list(idx))
        seen += idx
    if sorted(seen) != list(range(count)):
        raise CheckpointError(f"{path}: the param groups hold flats {sorted(seen)}, expected "
                              f"0..{count - 1}")
    return out


def _scaler(kind: str, osd: dict, cfg: dict, path: str) -> dict:
    """The ``loss_scaler`` record :func:`.tree._scaler` writes for the live optimizer."""
    out: dict[str, Any] = {}
    s = osd.get("loss_scaler")
    if s is not None:
        if not isinstance(s, (_LossScaler, _DynamicLossScaler)):
            raise CheckpointError(f"{path}: loss_scaler is a {type(s).__name__}")
        for k, val in vars(s).items():
            if isinstance(val, torch.Tensor) and val.numel() == 1:
                val = val.item()
            if val is None or isinstance(val, (bool, int, float, str)):
                if isinstance(val, float) and not math.isfinite(val):
                    val = repr(val)
                out[k] = val
    if kind == "zero3":  # stage 3 does not save clip_grad: the engine's gradient_clipping
        clip = cfg.get("gradient_clipping", 1.0)
        extra = {"dynamic_loss_scale": osd.get("dynamic_loss_scale"),
                 "overflow": osd.get("overflow"), "clip_grad": clip}
    elif kind == "bf16":  # BF16_Optimizer: no loss scaling, overflow always False
        extra = {"overflow": False, "clip_grad": osd.get("clip_grad")}
    else:
        extra = {k: osd.get(k) for k in ("dynamic_loss_scale", "overflow", "clip_grad")}
    for k, val in extra.items():
        if isinstance(val, (bool, int, float)):
            out["@" + k] = val
    return out


def _storage_id(t: torch.Tensor) -> tuple:
    """What tells two memory-mapped tensors of one file apart (tied parameters share
    their storage record)."""
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _module_names(module: dict, trainable: set[str], frozen_shapes: dict | None,
                  buffers: set[str], shared: dict, path: str) -> tuple[dict[str, str], list[str]]:
    """(tied alias -> the name kept, the frozen parameters' names when the file does not
    list them (ZeRO-1: ``frozen_param_shapes`` is None)) from the module's state dict:
    an entry sharing its storage with an earlier parameter is an alias (as
    ``named_parameters(remove_duplicate=False)`` finds them)."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    frozen: list[str] = []
    known = trainable | set(frozen_shapes or ())
    for k, t in module.items():
        if k in buffers:
            continue
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path}: module entry {k!r} is a {type(t).__name__}, not a "
                                  "tensor")
        sid = _storage_id(t)
        if k in known:
            first.setdefault(sid, k)
        elif k in shared and isinstance(shared[k], str):
            aliases[k] = shared[k]
        elif sid in first:
            aliases[k] = first[sid]
        elif frozen_shapes is None:
            frozen.append(k)
            first[sid] = k
        else:
            raise CheckpointError(f"{path}: module entry {k!r} is neither a parameter the tag "
                                  "lists, a buffer nor a tied alias")
    return aliases, frozen


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def import_tag(src_tag_dir: str, dst: str, *, storage_options: dict | None = None,
               overwrite: bool = False, compression: str | None = None,
               max_file_size: int = MAX_FILE) -> Any:
    """Write the stock DeepSpeed ZeRO-1/2/3 tag folder ``src_tag_dir`` (local) as a dckpt
    DeepSpeed tag at ``dst`` (a path or fsspec URL; ``storage_options`` its options),
    which an attached engine's ``load_checkpoint(parent, tag=basename)`` (or tag=None)
    loads at any data-parallel size and stage. One process; if torch.distributed is
    initialised, a private one-rank group is used, so call it on one rank only.

    Cost: reads each rank file once (memory-mapped), writes the checkpoint once.
    Memory: see the module docstring (about 12 bytes per trainable element for Adam).
    Returns the :class:`dckpt.CheckpointInfo` of the commit.

    Raises CheckpointError naming the file: a file over ``max_file_size`` bytes, one
    that is not a torch.save zip or references a global other than
    :data:`.stock_files.DEEPSPEED_GLOBALS` (nothing of it runs), a missing or extra rank file,
    model/pipeline parallelism, MoE, ZeRO stage 0, round-robin gradients, per-parameter
    alignment padding, elastic or NVMe-offloaded tags, a layout whose fragments
    disagree with DeepSpeed's ``param_slice_mappings``, optimizer state that is not
    flat-shaped; UnsupportedValueError naming a client_state key dckpt cannot store;
    AlreadyExistsError when ``dst`` holds a checkpoint and not ``overwrite``."""
    src = os.path.normpath(src_tag_dir)
    tag = _scan(src)
    m0path = tag.model[min(tag.model)]
    ms0 = read_file(m0path, max_file_size)
    if not isinstance(ms0, dict):
        raise CheckpointError(f"{m0path} holds a {type(ms0).__name__}, not DeepSpeed's dict")
    _refusals(ms0, m0path)
    world = _int(_need(ms0, "dp_world_size", (int, torch.Tensor), m0path), "dp_world_size", m0path)
    if world < 1:
        raise CheckpointError(f"{m0path}: dp_world_size {world}")
    for r in range(world):
        if r not in tag.optim:
            prefix = "bf16_" if any(os.path.basename(p).startswith("bf16_")
                                    for p in tag.optim.values()) else ""
            name = f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            raise CheckpointError(f"{os.path.join(src, name)} is missing: the tag was saved "
                                  f"by {world} ranks")
    extra = sorted(set(tag.optim) - set(range(world)))
    if extra:
        raise CheckpointError(f"{tag.optim[extra[0]]}: a rank file beyond the tag's "
                              f"dp_world_size {world}")
    cfg = ms0.get("ds_config") if isinstance(ms0.get("ds_config"), dict) else {}
    per_rank = any(os.path.basename(p).startswith("zero_pp_rank_") for p in tag.model.values())
    if per_rank:  # ZeRO-3: one model-states file per rank
        lacking = sorted(set(range(world)) - tag.model.keys())
        if lacking:
            raise CheckpointError(
                f"{os.path.join(src, f'zero_pp_rank_{lacking[0]}_mp_rank_00_model_states.pt')}"
                f" is missing: the ZeRO-3 tag was saved by {world} ranks")
        if len(tag.model) > world:
            raise CheckpointError(f"{tag.model[max(tag.model)]}: a rank file beyond the tag's "
                                  f"dp_world_size {world}")
    elif len(tag.model) > 1:
        raise CheckpointError(f"{src} holds both per-rank and single model-states files")
    module = _need(ms0, "module", dict, m0path)
    buffer_names = [b for b in _need(ms0, "buffer_names", list, m0path) if b in module]
    pshapes_raw = _need(ms0, "param_shapes", list, m0path)
    pshapes = [_shapes(ps, m0path, "param_shapes") for ps in pshapes_raw]
    trainable = {n for grp in pshapes for n, _ in grp}
    fshapes_raw = ms0.get("frozen_param_shapes")
    fshapes = dict(_shapes(fshapes_raw, m0path, "frozen_param_shapes")) \
        if fshapes_raw is not None else None
    shared = ms0.get("shared_params") if isinstance(ms0.get("shared_params"), dict) else {}
    aliases, frozen_from_module = _module_names(module, trainable, fshapes, set(buffer_names),
                                                shared, m0path)
    aliases = {a: k for a, k in aliases.items() if a not in trainable and k in (
        trainable | set(fshapes or ()) | set(frozen_from_module))}
    for n in trainable:
        if n not in module:
            raise CheckpointError(f"{m0path}: trainable parameter {n!r} is not in its module")

    # -- optimizer files, one rank at a time ----------------------------------------
    out_master: dict[str, torch.Tensor] = {}
    out_optim: dict[str, dict[str, torch.Tensor]] = {}
    kind = stage = None
    keys: list[str] = []
    steps: list[Any] = []
    hyper: list[dict] = []
    scaler: dict = {}
    group_names: list[list[str]] = []
    for r in range(world):
        path = tag.optim[r]
        d = read_file(path, max_file_size)
        osd = _need(d, "optimizer_state_dict", dict, path)
        if "fp32_flat_groups" in osd:
            k_r = "zero3"
        elif "zero_stage" in osd:
            k_r = "zero12"
        elif "single_partition_of_fp32_groups" in osd:
            k_r = "bf16"
        else:
            raise CheckpointError(f"{path}: an optimizer state dict dckpt does not know "
                                  f"(keys {sorted(map(str, osd))[:8]})")
        st = (3 if k_r == "zero3" else
              _int(osd["zero_stage"], "zero_stage", path) if k_r == "zero12" else
              _int((cfg.get("zero_optimization") or {}).get("stage", 1), "stage", path))
        if r == 0:
            kind, stage = k_r, st
        elif (k_r, st) != (kind, stage):
            raise CheckpointError(f"{path}: a {k_r} stage {st} file next to {kind} stage {stage}")
        if (kind == "zero3") != (stage == 3) or stage not in (1, 2, 3) or \
                (kind == "zero3") != per_rank:
            raise CheckpointError(f"{path}: ZeRO stage {stage} with a {kind} optimizer file")
        pc = osd.get("partition_count")
        pcs = pc if isinstance(pc, list) else [pc]
        if any(_int(x, "partition_count", path) != world for x in pcs):
            raise CheckpointError(f"{path}: partition_count {pc} but dp_world_size {world}")
        if kind == "zero3":
            _zero3_rank(r, world, osd, pshapes, path, out_master, out_optim, keys, steps,
                        hyper, group_names)
        else:
            _zero12_rank(r, world, kind, osd, pshapes, path, out_master, out_optim, keys,
                         steps, hyper, group_names)
        if r == 0:
            scaler = _scaler(kind, osd, cfg, path)
        del d, osd

    # -- frozen parameters, buffers ---------------------------------------------------
    frozen_meta: dict[str, list] = {}
    stored: dict[str, torch.Tensor] = {}
    frags0 = ms0.get("frozen_param_fragments")
    if fshapes is not None:
        if not isinstance(frags0, dict):
            raise CheckpointError(f"{m0path}: frozen_param_shapes without "
                                  "frozen_param_fragments")
        for n, shape in fshapes.items():
            t = frags0.get(n)
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{m0path}: no frozen_param_fragments entry for {n!r}")
            frozen_meta[n] = [list(shape), _dtype_name(t.dtype)]
        if kind == "zero3":
            stored = _zero3_frozen(tag, world, fshapes, frags0, m0path, max_file_size)
        else:
            for n, shape in fshapes.items():
                t = frags0[n]
                if t.numel() != math.prod(shape):
                    raise CheckpointError(f"{m0path}: frozen parameter {n!r} has {t.numel()} "
                                          f"elements, its shape {list(shape)}")
                if t.numel():
                    stored[n] = t.reshape(-1)
    else:
        if kind == "zero3" and frozen_from_module:
            raise CheckpointError(f"{m0path}: module entries {frozen_from_module[:4]} are not "
                                  "parameters the ZeRO-3 tag lists")
        for n in frozen_from_module:
            t = module[n]
            frozen_meta[n] = [list(t.shape), _dtype_name(t.dtype)]
            if t.numel():
                stored[n] = t.reshape(-1)
    buffers = {n: module[n] for n in buffer_names}

    # -- the tree -------------------------------------------------------------------
    client = {k: v for k, v in ms0.items() if k not in DS_KEYS}
    tree: dict[str, Any] = {"master": out_master, "optim": out_optim, "frozen": stored,
                            "buffers": buffers}
    sched = ms0.get("lr_scheduler")
    if sched is not None:
        tree["scheduler"] = codec.encode(sched, "lr_scheduler")
    try:
        # rank 0's model-states file: what stock's ZeRO-1/2 load gives every rank
        tree["client"] = {"rank0": codec.encode(client, "client_state")}
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"{m0path}: {e}") from None
    tree["hyper"] = codec.encode([{k: v for k, v in g.items() if k != "params"} for g in hyper],
                                 "param_groups")
    params = {n: list(s) for grp in pshapes for n, s in grp}
    meta = {
        "format": FORMAT, "tag": os.path.basename(dst.rstrip("/")), "kind": kind,
        "save_latest": True,
        "zero_stage": stage, "dp_world_size": world,
        "ds_version": str(ms0.get("ds_version", "")),
        "global_steps": _int(ms0.get("global_steps", 0), "global_steps", m0path),
        "global_samples": _int(ms0.get("global_samples", 0), "global_samples", m0path),
        "skipped_steps": _int(ms0.get("skipped_steps", 0), "skipped_steps", m0path),
        "params": params, "frozen": frozen_meta, "stored_frozen": list(stored),
        "dtypes": {n: _dtype_name(module[n].dtype) for n in params},
        "groups": group_names, "steps": steps, "state_keys": keys, "aliases": aliases,
        "loss_scaler": scaler, "buffers": sorted(buffers),
    }
    tree["deepspeed"] = {"meta": json.dumps(meta, sort_keys=True)}
    return _save(tree, dst, storage_options, overwrite, compression)


def _save(tree: dict, dst: str, storage_options: dict | None, overwrite: bool,
          compression: str | None) -> Any:
    """``dckpt.save`` by this process alone (a private one-rank group when a job's
    process group is up)."""
    import torch.distributed as dist

    from ...protocol.commit import save

    group = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from ...protocol.collectives import OwnGroup

        group = OwnGroup([dist.get_rank()], 600.0)
    try:
        return save(tree, dst, process_group=group, storage_options=storage_options,
                    overwrite=overwrite, compression=compression)
    finally:
        if group is not None:
            group.shutdown()


def _alloc(out: dict, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    t = out.get(name)
    if t is None:
        t = out[name] = torch.zeros(numel, dtype=dtype)
    return t


def _first_rank(r: int, path: str, steps_r: list, keys_r: list,
                steps: list, keys: list, hyper: list, groups_r: list[dict]) -> None:
    """Rank 0 sets the tag-wide steps, state keys and hyper-parameters; the others must
    agree."""
    if r == 0:
        steps[:] = steps_r
        keys[:] = keys_r
        hyper[:] = groups_r
    elif steps_r != steps or keys_r != keys:
        raise CheckpointError(f"{path}: steps {steps_r} / states {keys_r} differ from rank "
                              f"0's {steps} / {keys}")


def _zero12_rank(r: int, world: int, kind: str, osd: dict, pshapes: list, path: str,
                 master: dict, optim: dict, keys: list, steps: list, hyper: list,
                 group_names: list) -> None:
    """Copy rank ``r``'s ZeRO-1/2 (or BF16_Optimizer) partitions into the full tensors."""
    base = osd.get("base_optimizer_state")
    if isinstance(base, list):
        raise CheckpointError(f"{path}: an elastic checkpoint (per-group state list): not "
                              "supported")
    if not isinstance(base, dict):
        raise CheckpointError(f"{path}: base_optimizer_state is a {type(base).__name__}")
    fp32 = _need(osd, "single_partition_of_fp32_groups", list, path)
    pads = _need(osd, "group_paddings", list, path)
    align = osd.get("param_alignment_paddings") or []
    if any(_int(x, "param_alignment_paddings", path) for grp in align for x in grp):
        raise CheckpointError(f"{path}: per-parameter alignment padding "
                              "(zero_optimization.parameter_alignment): not supported")
    maps = _need(osd, "param_slice_mappings", list, path)
    ngroups = len(pshapes)
    if not (len(fp32) == len(pads) == len(maps) == ngroups):
        raise CheckpointError(f"{path}: {len(fp32)} fp32 partitions, {len(pads)} paddings, "
                              f"{len(maps)} mappings for {ngroups} param groups")
    groups = _hyper(base, path)
    if len(groups) != ngroups:
        raise CheckpointError(f"{path}: {len(groups)} optimizer param groups, {ngroups} in "
                              "param_shapes")
    holders = _holders(groups, ngroups, path)
    parts = []
    for g in range(ngroups):
        t = fp32[g]
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise CheckpointError(f"{path}: fp32 partition {g} is not a 1-D tensor")
        # ZeRO-1/2 save the last rank(s)' partition without its padding, BF16_Optimizer with
        part = t.numel() + (_int(pads[g], "group_paddings", path) if kind == "zero12" else 0)
        parts.append(part)
    numel_of = {i: parts[g] for g, idx in enumerate(holders) for i in idx}
    steps_r, keys_r, dtypes = _steps_and_keys(base, holders, numel_of, path)
    _first_rank(r, path, steps_r, keys_r, steps, keys, hyper, groups)
    if r == 0:
        group_names[:] = [[n for n, _ in grp] for grp in pshapes]
    state = base["state"]
    for g, grp in enumerate(pshapes):
        numels = [math.prod(s) for _, s in grp]
        try:
            frags = grouped(numels, parts[g], world)
        except ValueError as e:
            raise CheckpointError(f"{path}: param group {g}'s parameters do not fit its "
                                  f"partitions ({e})") from None
        want = {}
        for (n, _), fs, numel in zip(grp, frags, numels):
            for f in fs:
                if f.rank == r:
                    want[n] = (f.flat, f.numel)
        got = maps[g]
        if not isinstance(got, dict) or {n: (_int(getattr(a, "start", None), "start", path),
                                             _int(getattr(a, "numel", None), "numel", path))
                                         for n, a in got.items()} != want:
            raise CheckpointError(f"{path}: DeepSpeed's param_slice_mappings of group {g} "
                                  "disagree with the partition layout dckpt computes "
                                  "(round-robin gradients, parameter alignment or an unknown "
                                  "layout): not supported")
        src = fp32[g]
        st = state.get(holders[g][0]) if holders[g] else None
        for (n, _), fs, numel in zip(grp, frags, numels):
            m = _alloc(master, n, numel, torch.float32)
            for f in fs:
                if f.rank != r:
                    continue
                if f.flat + f.numel > src.numel():
                    raise CheckpointError(f"{path}: parameter {n!r}'s range ends past the "
                                          "saved fp32 partition")
                m[f.start:f.start + f.numel].copy_(src[f.flat:f.flat + f.numel])
                for k in keys:
                    if st is None or k not in st:
                        raise CheckpointError(f"{path}: param group {g} has no {k!r} state")
                    _alloc(optim.setdefault(k, {}), n, numel, dtypes.get(k, torch.float32))[
                        f.start:f.start + f.numel].copy_(st[k][f.flat:f.flat + f.numel])


def _zero3_rank(r: int, world: int, osd: dict, pshapes: list, path: str, master: dict,
                optim: dict, keys: list, steps: list, hyper: list, group_names: list) -> None:
    """Copy rank ``r``'s ZeRO-3 partitions (``[r*c, min(n, (r+1)*c))`` of each parameter,
    concatenated per sub-group in ``param_shapes`` order) into the full tensors."""
    flats = _need(osd, "fp32_flat_groups", list, path)
    tsd = _need(osd, "optimizer_state_dict", dict, path)
    nsub = len(pshapes)
    if len(flats) != nsub:
        raise CheckpointError(f"{path}: {len(flats)} fp32 flats for {nsub} sub-groups in "
                              "param_shapes")
    groups = _hyper(tsd, path)
    holders = _holders(groups, nsub, path)
    numel_of = {}
    for sg, grp in enumerate(pshapes):
        want = sum(-(-math.prod(s) // world) for _, s in grp)
        t = flats[sg]
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != want:
            raise CheckpointError(f"{path}: sub-group {sg}'s fp32 flat is not the "
                                  f"{want} elements its parameters' partitions take")
        numel_of[sg] = want
    steps_r, keys_r, dtypes = _steps_and_keys(tsd, holders, numel_of, path)
    _first_rank(r, path, steps_r, keys_r, steps, keys, hyper, groups)
    if r == 0:
        group_names[:] = [[n for sg in idx for n, _ in pshapes[sg]] for idx in holders]
    state = tsd["state"]
    for sg, grp in enumerate(pshapes):
        off = 0
        st = state.get(sg)
        for n, s in grp:
            numel = math.prod(s)
            c = -(-numel // world)
            m = _alloc(master, n, numel, torch.float32)
            for f in split(numel, world):
                if f.rank != r:
                    continue
                m[f.start:f.start + f.numel].copy_(flats[sg][off:off + f.numel])
                for k in keys:
                    if st is None or k not in st:
                        raise CheckpointError(f"{path}: sub-group {sg} has no {k!r} state")
                    _alloc(optim.setdefault(k, {}), n, numel, dtypes.get(k, torch.float32))[
                        f.start:f.start + f.numel].copy_(st[k][off:off + f.numel])
            off += c


def _zero3_frozen(tag: _Tag, world: int, fshapes: dict, frags0: dict, m0path: str,
                  max_file: int) -> dict[str, torch.Tensor]:
    """The stored frozen parameters of a ZeRO-3 tag, each rebuilt from every rank's
    ``ds_tensor`` partition (in its model-states file, read one at a time)."""
    out: dict[str, torch.Tensor] = {}
    for r in range(world):
        path = tag.model[r]
        frags = frags0 if r == min(tag.model) else None
        if frags is None:
            d = read_file(path, max_file)
            frags = d.get("frozen_param_fragments") if isinstance(d, dict) else None
            if not isinstance(frags, dict):
                raise CheckpointError(f"{path}: no frozen_param_fragments")
        for n, shape in fshapes.items():
            numel = math.prod(shape)
            if not numel:
                continue
            t = frags.get(n)
            c = -(-numel // world)
            if not isinstance(t, torch.Tensor) or t.numel() != c:
                raise CheckpointError(f"{path}: frozen parameter {n!r}'s partition is not "
                                      f"{c} elements")
            full = out.get(n)
            if full is None:
                full = out[n] = torch.empty(numel, dtype=t.dtype)
            for f in split(numel, world):
                if f.rank == r:
                    full[f.start:f.start + f.numel].copy_(t.reshape(-1)[:f.numel])
    return out
