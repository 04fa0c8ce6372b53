"""Import a stock DeepSpeed ZeRO-1/2/3 tag (DeepSpeed's own pickles) into a dckpt
DeepSpeed tag, in one process, without DeepSpeed and without a process group.

The tag folder (``global_step<N>/``) holds ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (ZeRO-3), and
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank. Each file is read by
torch's loader with ``weights_only=True`` (:mod:`.stock_files`) and exactly the DeepSpeed globals a tag
holds allowed (:data:`.stock_files.DEEPSPEED_GLOBALS`), each mapped to a stand-in defined there: a
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
from ..common.zero.tree import FORMAT, scaler_record
from .stock_files import (DS_KEYS, MAX_FILE, _DynamicLossScaler, _int, _LossScaler, _need,
                          _refusals, _scan, _shapes, read_file)
from .stock_ranks import zero3_frozen, zero3_rank, zero12_rank


def _scaler(kind: str, osd: dict, cfg: dict, path: str) -> dict:
    """The ``loss_scaler`` record :func:`.tree._scaler` writes for the live optimizer."""
    s = osd.get("loss_scaler")
    if s is not None and not isinstance(s, (_LossScaler, _DynamicLossScaler)):
        raise CheckpointError(f"{path}: loss_scaler is a {type(s).__name__}")
    if kind == "zero3":  # stage 3 does not save clip_grad: the engine's gradient_clipping
        clip = cfg.get("gradient_clipping", 1.0)
        extra = {"dynamic_loss_scale": osd.get("dynamic_loss_scale"),
                 "overflow": osd.get("overflow"), "clip_grad": clip}
    elif kind == "bf16":  # BF16_Optimizer: no loss scaling, overflow always False
        extra = {"overflow": False, "clip_grad": osd.get("clip_grad")}
    else:
        extra = {k: osd.get(k) for k in ("dynamic_loss_scale", "overflow", "clip_grad")}
    return scaler_record(s, extra)


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
            zero3_rank(r, world, osd, pshapes, path, out_master, out_optim, keys, steps,
                        hyper, group_names)
        else:
            zero12_rank(r, world, kind, osd, pshapes, path, out_master, out_optim, keys,
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
            stored = zero3_frozen(tag, world, fshapes, frags0, m0path, max_file_size)
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
        "loss_scaler": scaler, "buffers": sorted(buffers), "model_only": False,
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
