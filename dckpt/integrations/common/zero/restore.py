"""Load one dckpt DeepSpeed tag into a live engine of any data-parallel size and ZeRO
stage: each rank reads exactly the ranges of its new partitions into DeepSpeed's flat
buffers and optimizer state, in place, then DeepSpeed's low-precision weights are
refreshed from the masters (what ``step()`` does after an update)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ....errors import CheckpointError, StateMismatchError
from ....protocol.restore import load as dckpt_load
from .. import codec, rng
from .tree import _numel, read_meta, target
from .view import View

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class What:
    """Which parts a load restores (DeepSpeed's ``load_checkpoint`` flags)."""

    optimizer: bool = True
    scheduler: bool = True
    module_only: bool = False
    strict: bool = True
    # what the framework's own record says of the tag (the Trainer's model_only flag):
    # it must agree with the tag's record, else the load refuses it (None: unchecked)
    model_only: bool | None = None


def _check_names(v: View, meta: dict, strict: bool, optim: bool) -> None:
    """Parameters and buffers saved vs here: a trainable one missing is always an
    error (its master and optimizer state cannot be made up); with ``strict`` anything
    saved that the engine lacks, or a frozen parameter / buffer it has that was not
    saved, too (``load_module_strict``). Raises CheckpointError naming them."""
    here = set(v.params) | set(v.frozen)
    saved = set(meta["params"]) | set(meta["frozen"])
    unexpected = sorted(saved - here - set(v.aliases))
    frozen_now_trained = sorted(n for n, p in v.params.items() if p.numel
                                and n not in meta["params"] and n in meta["frozen"])
    if frozen_now_trained:
        raise StateMismatchError(
            f"parameter(s) {frozen_now_trained[:8]} were frozen when saved and are trained "
            "here: the checkpoint has no fp32 master or optimizer state for them")
    if optim:
        saved_group = {n: g for g, names in enumerate(meta["groups"]) for n in names}
        moved = sorted(n for g, names in enumerate(v.groups) for n in names
                       if n in saved_group and saved_group[n] != g)
        if len(meta["groups"]) != len(v.groups) or moved:
            raise StateMismatchError(
                f"the optimizer has {len(v.groups)} param group(s), the checkpoint "
                f"{len(meta['groups'])}" + (f"; parameter(s) {moved[:8]} are in another "
                                            "group here" if moved else "")
                + ": build the optimizer's groups as when saved (or load with "
                "load_optimizer_states=False)")
    if not strict:
        return
    lacking = sorted(n for n in v.frozen if _numel(v.frozen[n])  # trained when saved: its master
                     and n not in set(meta["stored_frozen"]) and n not in meta["params"])
    lacking_buf = sorted(n for n in v.buffers if n not in set(meta["buffers"]))
    problems = []
    if unexpected:
        problems.append(f"unexpected parameter(s) {unexpected[:8]}")
    if lacking:
        problems.append(f"frozen parameter(s) {lacking[:8]} not saved (saved with "
                        "exclude_frozen_parameters=True? load with load_module_strict=False)")
    if lacking_buf:
        problems.append(f"buffer(s) {lacking_buf[:8]} not saved")
    if problems:
        raise StateMismatchError("the checkpoint does not match the engine's module: "
                              + "; ".join(problems))


def load_tag(v: View, path: str, what: What, storage_options: dict | None = None,
             root: str = "", manifest_name: str | None = None) -> dict:
    """Restore the tag at ``path`` into ``v``'s engine (``root``: the tree key the tag
    is nested under in a framework's checkpoint, whose RNG is the framework's; "" for a
    tag of its own); returns the saved
    ``client_state`` (the user's keys, plus ``global_samples`` and ``ds_version`` as
    stock returns them). Collective (dckpt's load, DeepSpeed's all-gather of the
    refreshed weights); blocking I/O: this rank's ranges. Raises CheckpointError on
    every rank alike (a damaged file: IntegrityError; another model: the names); after
    an error the engine's state is undefined (load another tag into it)."""
    eng = v.engine
    opt_w = eng.optimizer
    state: dict[str, Any] = {}
    box: dict[str, Any] = {}

    head = root + "." if root else ""

    def extra(m: Any) -> dict:
        meta = read_meta(m, head)
        box["meta"] = meta
        optim = what.optimizer and not what.module_only
        if what.model_only is not None and bool(meta.get("model_only")) != what.model_only:
            raise StateMismatchError(
                f"{path}: the checkpoint's records disagree: the framework's says "
                f"model_only={what.model_only}, its DeepSpeed tag's "
                f"model_only={bool(meta.get('model_only'))} (edited or assembled by hand)")
        if meta.get("model_only") and not what.module_only:
            raise CheckpointError(
                f"{path} holds the weights only (saved with save_only_model=True): no "
                "optimizer, scheduler, counters or RNG to restore; load it module-only")
        _check_names(v, meta, what.strict, optim)
        out = target(v, meta, masters=True, optim=optim, frozen=True, buffers=True,
                     stored=lambda k: (head + k) in m.tensors)
        out["deepspeed"] = {"meta": ""}
        if optim and _has(m, head + "hyper"):
            out["hyper"] = codec.target(m, head + "hyper")
        if what.scheduler and not what.module_only and _has(m, head + "scheduler"):
            out["scheduler"] = codec.target(m, head + "scheduler")
        # rank r's client_state; beyond the saved ranks rank r mod N's (as the RNG)
        r = torch.distributed.get_rank()
        src = r % max(1, int(meta["dp_world_size"]))
        if not _has(m, f"{head}client.rank{src}"):
            src = 0  # an imported stock tag: rank 0's, as stock's ZeRO-1/2 load
        box["client"] = f"rank{src}"
        out["client"] = {box["client"]: codec.target(m, f"{head}client.rank{src}")}
        if not what.module_only and not root:
            sd, box["rng"] = rng.target(m, torch.distributed.get_rank())
            if sd:
                out["rng"] = sd
        return {root: out} if root else out

    prologue = getattr(opt_w, "checkpoint_event_prologue", None)
    if v.kind == "zero3" and prologue is not None:
        prologue()
    # not strict: _check_names decides which saved names the engine must have
    # cast: a stage or precision change stores buffers and frozen weights in another
    # floating dtype (ZeRO-3 casts them with the model, ZeRO-1/2 do not)
    dckpt_load(state, path, storage_options=storage_options, extra=extra, strict=False,
               cast=True, manifest_name=manifest_name)
    if root:
        state = state[root]
    meta = box["meta"]
    optim = what.optimizer and not what.module_only
    if optim and "hyper" in state:
        for g, saved in zip(v.optimizer.param_groups, codec.decode(state["hyper"], "param_groups")):
            for k, val in saved.items():
                if k != "params":
                    g[k] = val
    _refresh(v, optim, has_state=bool(meta["state_keys"]))
    if not what.module_only:
        eng.global_steps = int(meta["global_steps"])
        eng.global_samples = int(meta["global_samples"])
        eng.skipped_steps = int(meta["skipped_steps"])
        if "scheduler" in state and getattr(eng, "lr_scheduler", None) is not None:
            eng.lr_scheduler.load_state_dict(codec.decode(state["scheduler"], "lr_scheduler"))
        if optim:
            _set_scaler(opt_w, meta.get("loss_scaler", {}))
        rng.apply(box.get("rng"))
    client = codec.decode(state["client"][box["client"]], "client_state")
    for k in ("global_samples", "ds_version"):
        client.setdefault(k, meta[k])
    return client


def _has(m: Any, root: str) -> bool:
    return (root + ".doc") in m.values


def _set_scaler(opt: Any, saved: dict) -> None:
    s = getattr(opt, "loss_scaler", None)
    for k, val in saved.items():
        if k.startswith("@"):
            if hasattr(opt, k[1:]):
                setattr(opt, k[1:], val)
        elif s is not None and hasattr(s, k) and not isinstance(getattr(s, k), torch.Tensor):
            setattr(s, k, float(val) if val in ("inf", "-inf", "nan") else val)


def _refresh(v: View, relink: bool, has_state: bool) -> None:
    """DeepSpeed's low-precision copies from the freshly loaded fp32 masters, and the
    optimizer's fragment links to its new state tensors. Collective (ZeRO-1/2's
    all-gather of the partitions; ZeRO-3's gather of persistent parameters)."""
    opt = v.engine.optimizer
    if v.kind in ("zero12", "bf16"):
        if relink:  # the state tensors were replaced (or dropped): link them anew
            opt._hp_optimizer_states_linked = False
            if has_state:
                opt._lazy_init_hp_params_optimizer_state()
        opt.update_lp_params()
    elif v.kind == "zero3":
        for sg, flat in enumerate(opt.fp32_partitioned_groups_flat):
            opt.fp16_partitioned_groups_flat[sg].data.copy_(flat.data)
            opt._unflatten_partitioned_parameters(sg)
        opt.checkpoint_event_epilogue()
