"""Rebuilding full 1-D tensors from the per-rank partitions of a stock DeepSpeed tag
(:mod:`.stock` reads the files and writes the checkpoint): ZeRO-1/2 and
BF16_Optimizer flats by :func:`..common.zero.layout.grouped`'s fragments (cross-checked
with DeepSpeed's ``param_slice_mappings``), ZeRO-3 by ``ceil(n/W)`` pieces. Each
function copies one rank's ranges into the full tensors it allocates on first use.
Pure tensor work: no I/O except :func:`zero3_frozen` (the other ranks' model-states
files, one at a time); raises CheckpointError naming the file."""
from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import CheckpointError
from ..common.zero.layout import grouped, split
from .stock_files import _int, _need, _Tag, read_file


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


def zero12_rank(r: int, world: int, kind: str, osd: dict, pshapes: list, path: str,
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


def zero3_rank(r: int, world: int, osd: dict, pshapes: list, path: str, master: dict,
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


def zero3_frozen(tag: _Tag, world: int, fshapes: dict, frags0: dict, m0path: str,
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
