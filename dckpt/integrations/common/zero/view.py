"""A live DeepSpeed engine seen as dckpt needs it: every trainable parameter (by its
module name) with the fp32 master range and optimizer-state ranges this rank holds, the
frozen parameters, the persistent buffers, and the flat buffers the optimizer steps.

Read from DeepSpeed's own structures (deepspeed 0.19: ``bit16_groups`` /
``single_partition_of_fp32_groups`` / ``partition_size`` of ZeRO-1/2, ``bf16_groups`` /
``fp32_groups_flat_partition`` of ``BF16_Optimizer``, ``fp16_groups`` /
``fp32_partitioned_groups_flat`` / ``grad_position`` / ``ds_tensor`` of ZeRO-3, the
torch optimizer itself at stage 0), and checked against DeepSpeed's own fragment
mapping (``_hp_mapping``) so a layout dckpt does not understand is refused, never
saved wrong. No I/O, no collective (cheap: O(parameters))."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ....errors import CheckpointError
from .layout import Fragment, grouped, mine, split

# the optimizer wrappers whose layout this module knows (class names: DeepSpeed's
# modules are imported only by the user's script)
ZERO12 = ("DeepSpeedZeroOptimizer",)
BF16 = ("BF16_Optimizer",)
ZERO3 = ("DeepSpeedZeroOptimizer_Stage3",)


@dataclass
class Param:
    """A trainable parameter: ``frags`` every rank's range of it, ``local`` this
    rank's (None: it holds none), ``flat`` the index of the flat buffer holding it and
    ``at`` where this rank's range starts in that flat."""

    name: str
    param: torch.nn.Parameter
    shape: tuple[int, ...]
    numel: int
    group: int
    flat: int
    frags: list[Fragment]
    local: Fragment | None
    at: int = 0


@dataclass
class Flat:
    """A flat fp32 buffer the torch optimizer steps (its state is keyed by it), of torch
    param group ``group``; ``pad`` the (start, length) ranges holding no parameter
    (kept zero). Stage 0 has none: the parameters are stepped themselves."""

    tensor: torch.Tensor
    group: int
    pad: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class View:
    engine: Any
    kind: str  # "plain" (stage 0), "zero12", "bf16", "zero3"
    stage: int
    rank: int
    world: int
    optimizer: Any  # the torch optimizer (its state holds the flats' states)
    params: dict[str, Param]
    frozen: dict[str, torch.nn.Parameter]
    buffers: dict[str, torch.Tensor]
    flats: list[Flat]
    aliases: dict[str, str]  # a tied parameter's other names -> the name kept
    groups: list[list[str]]  # the trainable names of each torch param group, in order

    def state_key(self, p: Param) -> Any:
        """The tensor the torch optimizer's state of ``p``'s range is keyed by."""
        return p.param if self.kind == "plain" else self.flats[p.flat].tensor


def _names(module: torch.nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """id(param) -> its first name, and every other name of a tied parameter -> the
    first (``named_parameters`` drops duplicates: the optimizer holds the tensor once)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return first, aliases


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers by name (what ``state_dict()`` holds)."""
    out = {}
    for mname, mod in module.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None and bname not in skip:
                out[f"{mname}.{bname}" if mname else bname] = b
    return out


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(f"dckpt's DeepSpeed checkpoints do not support {what}")


def view(engine: Any) -> View:
    """The engine's :class:`View`. Raises CheckpointError for a layout dckpt does not
    know (an optimizer wrapper it has not been built for, round-robin gradients, a
    fragment that disagrees with DeepSpeed's own mapping)."""
    import torch.distributed as dist

    module = engine.module
    opt = engine.optimizer
    stage = int(engine.zero_optimization_stage())
    first, aliases = _names(module)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    name = type(opt).__name__
    params: dict[str, Param] = {}
    flats: list[Flat] = []
    groups: list[list[str]] = []
    if stage == 0:
        if not isinstance(opt, torch.optim.Optimizer):
            raise _refuse(f"ZeRO stage 0 with the {name} wrapper (fp16/bf16 at stage 0): use "
                          "fp32 at stage 0, or ZeRO stage 1-3")
        for g, group in enumerate(opt.param_groups):
            groups.append([])
            for p in group["params"]:
                n = first.get(id(p))
                if n is None:
                    raise CheckpointError("an optimizer parameter is not a parameter of the "
                                          "engine's module")
                groups[-1].append(n)
                whole = [Fragment(r, 0, p.numel(), 0) for r in range(world)]
                params[n] = Param(n, p, tuple(p.shape), p.numel(), g, -1, whole,
                                  whole[rank] if p.numel() else None)
        kind = "plain"
    elif name in ZERO12 or name in BF16:
        kind = "zero12" if name in ZERO12 else "bf16"
        if kind == "zero12" and getattr(opt, "round_robin_gradients", False):
            raise _refuse("round_robin_gradients (DeepSpeed's own fragment mapping is "
                          "wrong under it): set zero_optimization.round_robin_gradients "
                          "to false")
        lp_groups = opt.bit16_groups if kind == "zero12" else opt.bf16_groups
        fp32 = (opt.single_partition_of_fp32_groups if kind == "zero12"
                else opt.fp32_groups_flat_partition)
        lp_flats = opt.bit16_groups_flat if kind == "zero12" else opt.bf16_groups_flat
        for g, plist in enumerate(lp_groups):
            pg = opt.real_dp_process_group[g]
            w, r = dist.get_world_size(group=pg), dist.get_rank(group=pg)
            if w != world:
                raise _refuse("a data-parallel group smaller than the world (tensor, "
                              "pipeline or sequence parallelism, MoE experts)")
            part = lp_flats[g].numel() // w
            offsets = None
            if kind == "zero12" and any(opt.round_robin_bit16_padding[g]):
                by = {id(q): o for q, o in zip(opt.round_robin_bit16_groups[g],
                                               opt.round_robin_bit16_offsets[g])}
                offsets = [by[id(q)] for q in plist]
            frags = grouped([q.numel() for q in plist], part, w, offsets)
            ends = sorted((f.flat, f.flat + f.numel) for fs in frags for f in fs if f.rank == r)
            flats.append(Flat(fp32[g], g, _gaps(ends, fp32[g].numel())))
            groups.append([])
            for q, fs in zip(plist, frags):
                n = first[id(q)]
                loc = mine(fs, r)
                _check_mapping(n, q, loc)
                params[n] = Param(n, q, tuple(q.shape), q.numel(), g, g, fs, loc,
                                  loc.flat if loc else 0)
                groups[-1].append(n)
    elif name in ZERO3:
        kind = "zero3"
        pg = opt.dp_process_group
        w, r = dist.get_world_size(group=pg), dist.get_rank(group=pg)
        if w != world or getattr(opt, "zero_hpz_partition_size", 1) > 1:
            raise _refuse("a ZeRO-3 partition group smaller than the world (hpZ, tensor "
                          "or pipeline parallelism)")
        ngroups = len(opt.optimizer.param_groups)
        groups = [[] for _ in range(ngroups)]
        for sg, plist in enumerate(opt.fp16_groups):
            g = int(opt.sub_group_to_group_id[sg])
            flat = opt.fp32_partitioned_groups_flat[sg]
            pad = []
            for q in plist:
                n = first[id(q)]
                _, off, c = opt.grad_position[opt.get_param_id(q)]
                numel = int(q.ds_numel)
                if c != -(-numel // w):
                    raise _refuse(f"parameter {n!r}'s ZeRO-3 partition of {c} elements (not "
                                  f"ceil({numel}/{w}))")
                fs = split(numel, w)
                loc = mine(fs, r)
                real = loc.numel if loc else 0
                if real < c:
                    pad.append((off + real, c - real))
                params[n] = Param(n, q, tuple(q.ds_shape), numel, g, sg, fs, loc, off)
                groups[g].append(n)
            flats.append(Flat(flat, g, pad))
    else:
        raise _refuse(f"the {name} optimizer wrapper (known: ZeRO-1/2, BF16_Optimizer, "
                      "ZeRO-3, a torch optimizer at stage 0)")
    frozen = {n: p for n, p in module.named_parameters() if n not in params}
    return View(engine, kind, stage, rank, world, opt if kind == "plain" else opt.optimizer,
                params, frozen, _buffers(module), flats, aliases, groups)


def _gaps(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The (start, length) ranges of ``[0, size)`` no range of ``ranges`` covers."""
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - at))
        at = max(at, hi)
    if at < size:
        out.append((at, size - at))
    return out


def _check_mapping(name: str, p: Any, loc: Fragment | None) -> None:
    """DeepSpeed's own link of ``p`` to this rank's flat (``_hp_mapping``) must be the
    fragment computed here: a layout dckpt misreads is refused, never saved wrong."""
    hm = getattr(p, "_hp_mapping", None)
    got = None if hm is None else (int(hm.lp_fragment_address.start),
                                   int(hm.lp_fragment_address.numel),
                                   int(hm.hp_fragment_address.start))
    want = None if loc is None else (loc.start, loc.numel, loc.flat)
    if got != want:
        raise CheckpointError(
            f"parameter {name!r}: DeepSpeed maps elements {got} of it to this rank, dckpt "
            f"computed {want}; this layout is not supported (please report it)")


def local_range(v: View, p: Param, t: torch.Tensor) -> torch.Tensor | None:
    """This rank's range of ``p`` within ``t`` (its flat buffer, or an optimizer state
    of the flat's shape; stage 0: the parameter-shaped tensor itself), a view; None when
    it holds none."""
    if p.local is None:
        return None
    if v.kind == "plain":
        return t.detach().reshape(-1)
    return t.detach().narrow(0, p.at, p.local.numel)


def frozen_local(v: View, name: str, p: torch.nn.Parameter) -> tuple[torch.Tensor | None, list[Fragment], int]:
    """(this rank's range of a frozen parameter as a 1-D view, every rank's fragments,
    its numel): ZeRO-3 the real part of ``ds_tensor``; else the whole parameter, held by
    every rank (stored once)."""
    if v.kind == "zero3" and hasattr(p, "ds_tensor"):
        numel = int(p.ds_numel)
        fs = split(numel, v.world)
        loc = mine(fs, v.rank)
        local = p.ds_tensor.detach().reshape(-1).narrow(0, 0, loc.numel) if loc else None
        return local, fs, numel
    numel = p.numel()
    return p.detach().view(-1), [Fragment(r, 0, numel) for r in range(v.world)], numel


def refusals(engine: Any) -> None:
    """Raise CheckpointError for what dckpt's DeepSpeed checkpoints do not cover."""
    name = type(engine).__name__
    if name == "PipelineEngine" or hasattr(engine, "num_stages"):
        raise CheckpointError("dckpt's DeepSpeed checkpoints do not support pipeline "
                              "parallelism (PipelineEngine)")
    if getattr(engine, "has_moe_layers", False):
        raise CheckpointError("dckpt's DeepSpeed checkpoints do not support MoE expert "
                              "parallelism")
    nvme = False
    for fn in ("zero_nvme_offload_optimizer", "zero_nvme_offload_param"):
        try:
            nvme = nvme or bool(getattr(engine, fn)())
        except Exception:  # noqa: BLE001 - an older engine without the query
            pass
    if nvme:
        raise CheckpointError("dckpt's DeepSpeed checkpoints do not support ZeRO-Infinity's "
                              "NVMe offload")
    if int(getattr(engine, "mp_world_size", 1) or 1) > 1:
        raise CheckpointError("dckpt's DeepSpeed checkpoints do not support model (tensor) "
                              "parallelism yet")
    if getattr(getattr(engine, "_config", None), "load_universal_checkpoint", False):
        raise CheckpointError("load_universal is set: dckpt's checkpoints reshard by "
                              "themselves; remove checkpoint.load_universal")
