"""Cached save plans at 3 ranks: a steady-state save reuses the coordinator's plan; any
change of keys, shapes or dtypes on any rank (one rank alone too) falls back to full
plans in the same save, and an invalid change is still refused."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _state(step: int, extra_on: int | None = None, dtype=torch.float32) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(70, dtype=torch.float32).reshape(10, 7) + step
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None),
          "b": torch.full((4,), float(step), dtype=dtype), "step": step,
          "lr": 0.1 / (step + 1)}
    if extra_on is not None and dist.get_rank() == extra_on:
        sd[f"only.rank{extra_on}"] = torch.full((3,), 7.0)  # a rank-local tensor
    return sd


def _check(path: str, step: int, extra_on: int | None = None) -> None:
    import dckpt

    sd = _state(step, extra_on)
    t = {k: (torch.zeros_like(v) if torch.is_tensor(v) else None) for k, v in sd.items()}
    dckpt.load(t, path, strict=False)
    assert t["step"] == step and t["lr"] == 0.1 / (step + 1)
    assert torch.equal(t["w"].full_tensor(), sd["w"].full_tensor()) and torch.equal(t["b"], sd["b"])
    if extra_on is not None and dist.get_rank() == extra_on:
        assert torch.equal(t[f"only.rank{extra_on}"], torch.full((3,), 7.0))


def _steady_and_changes(root: str) -> list:
    import dckpt

    out = []
    for step in range(4):  # values change every save: still cached
        out.append(dckpt.save(_state(step), f"{root}/s{step}").plan_cached)
        _check(f"{root}/s{step}", step)
    # a key on rank 1 only: everyone falls back, in this save
    out.append(dckpt.save(_state(4, extra_on=1), f"{root}/s4").plan_cached)
    _check(f"{root}/s4", 4, extra_on=1)
    out.append(dckpt.save(_state(5, extra_on=1), f"{root}/s5").plan_cached)
    # back to the first layout: a change again
    out.append(dckpt.save(_state(6), f"{root}/s6").plan_cached)
    _check(f"{root}/s6", 6)
    # a dtype change on rank 2 only: an invalid plan, refused on every rank
    bad = _state(7, dtype=torch.float64 if dist.get_rank() == 2 else torch.float32)
    with pytest.raises(dckpt.StateMismatchError, match="'b'"):
        dckpt.save(bad, f"{root}/s7")
    # a shape change on rank 0 only: refused too
    bad = _state(8)
    if dist.get_rank() == 0:
        bad["b"] = torch.zeros(5)
    with pytest.raises(dckpt.StateMismatchError, match="'b'"):
        dckpt.save(bad, f"{root}/s8")
    out.append(dckpt.save(_state(9), f"{root}/s9").plan_cached)
    out.append(dckpt.save(_state(10), f"{root}/s10").plan_cached)
    _check(f"{root}/s10", 10)
    # rank-local values (a different value per rank under one key: the lowest rank's
    # is kept, as without the cache): the ranks send their values, the plan is kept
    for step in (11, 12):
        sd = _state(step)
        sd["who"] = dist.get_rank()
        out.append(dckpt.save(sd, f"{root}/s{step}").plan_cached)
    t = dckpt.load({"who": -1}, f"{root}/s12", strict=False)
    assert t["who"] == 0
    # values under a key per rank that change every save (the manager's RNG states)
    for step in (16, 17):
        sd = _state(step)
        sd[f"rng.rank{dist.get_rank()}"] = [step, dist.get_rank()]
        out.append(dckpt.save(sd, f"{root}/s{step}").plan_cached)
    t = dckpt.load({f"rng.rank{r}": [0, 0] for r in range(3)}, f"{root}/s17", strict=False)
    assert [t[f"rng.rank{r}"] for r in range(3)] == [[17, r] for r in range(3)]
    # async saves cache in their own group
    for step in (13, 14, 15):
        out.append(dckpt.async_save(_state(step), f"{root}/a{step}").result().plan_cached)
    _check(f"{root}/a15", 15)
    return out


def test_plans_are_cached_and_changes_fall_back(ranks, tmp_path):
    got = ranks(3).run(_steady_and_changes, str(tmp_path))
    assert all(g == got[0] for g in got)
    assert got[0] == [False, True, True, True,   # steady state
                      False, True,               # a key on rank 1 only, then steady
                      False,                     # the key gone again
                      True, True,                # after two refused saves: s6's plan
                      True, True,                # rank-local values: sent, plan kept
                      True, True,                # per-rank value keys: values only
                      False, True, True]         # async: its own group's cache


def test_reuse_uniform_is_reuse_or_defers():
    """Rank 0's numpy path for a later save (issue 38) gives reuse's plan when every
    rank offered its cached structure, plan id and rank 0's values; on any other offer
    it defers (None) to the per-rank path, which decides."""
    import numpy as np

    from dckpt.layout import plan as gplan
    from dckpt.protocol import plancache

    n = 6
    structs = [bytes([r + 1]) * plancache.HASH for r in range(n)]
    vh = plancache.values_hash({"step": 1})
    cache = plancache.CoordCache()
    first = [plancache.Offer(False, s, vh) for s in structs]
    gp = gplan.GlobalPlan({}, {}, [], np.zeros(n, np.int64), {}, [])
    pid = cache.store(first, [type("P", (), {"values": {"step": 1}})()] * n, gp)

    def offers(values=None, **bad):
        out = []
        for r in range(n):
            s, v, p = structs[r], plancache.values_hash({"step": 2}), pid
            if r == bad.get("rank"):
                s, v, p = bad.get("s", s), bad.get("v", v), bad.get("p", p)
            out.append(plancache.encode_offer(True, (s, v), b"", {"step": 2} if r == 0 else None, p))
        return out

    good = offers()
    got = cache.reuse_uniform(good)
    assert got is not None and got.values == {"step": 2} and got.tensors is gp.tensors
    kind, want = cache.reuse([plancache.decode_offer(b) for b in good])
    assert kind == "plan" and want.values == got.values and want.conflicts == got.conflicts
    for r in (0, 1, n - 1):
        for bad in ({"s": bytes(plancache.HASH)}, {"v": bytes(plancache.HASH)},
                    {"p": bytes(plancache.PLAN_ID)}):
            assert cache.reuse_uniform(offers(rank=r, **bad)) is None, (r, bad)
    short = offers()
    short[2] = short[2][:-1]
    assert cache.reuse_uniform(short) is None
    full = offers()
    full[3] = plancache.encode_offer(False, (structs[3], vh), b"plan")
    assert cache.reuse_uniform(full) is None
    no_values = offers()
    no_values[0] = plancache.encode_offer(True, (structs[0], vh), b"", None, pid)
    assert cache.reuse_uniform(no_values) is None
    assert cache.reuse_uniform(good[:-1]) is None  # another world size
