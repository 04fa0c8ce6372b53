"""Plans by rule (issue 38) at 4 gloo ranks: the first save of a process sends plan
signatures and hashes, not boxes; rank 0 derives the plan. The derived path and the
gathered path write identical manifests (tensors, chunk tables by rank, values) for
FSDP2, FSDP2+TP (a real fully_shard over parallelize_module), HSDP, uneven shards and
per-rank keys; a rank whose real boxes differ from the derived ones makes the save fall
back to the gathered path (never a wrong plan committed), and so does a wrong
derivation rule on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _state(layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    r, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(13 * 5, dtype=torch.float32).reshape(13, 5)  # 13: uneven
    sd: dict = {"step": 3, "lr": 0.5, "plain": torch.full((4,), 2.0)}
    if layout == "fsdp2_tp":
        import sys, os  # noqa: E401
        sys.path.insert(0, os.path.dirname(__file__))
        from test_fsdp_tp import _build, _step

        import dckpt
        model, opt = _build("fsdp2_tp")
        _step(model, opt)
        sd["train"] = dckpt.TrainingState(model, opt)
        return sd
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        sd["w"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        sd["v"] = distribute_tensor(full[:3].clone(), mesh, [Shard(0)], src_data_rank=None)  # empty shards
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2))
        sd["w"] = distribute_tensor(full, mesh, [Replicate(), Shard(0)], src_data_rank=None)
        sd["n"] = distribute_tensor(full[0].clone(), mesh, [Replicate(), Replicate()], src_data_rank=None)
        sd["c"] = distribute_tensor(full, mesh, [Shard(1), Shard(0)], src_data_rank=None)
    elif layout == "per_rank":
        mesh = init_device_mesh("cpu", (world,))
        sd["w"] = distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None)
        sd[f"dataloader.dp_rank_{r}"] = bytes([r]) * 5  # torchtitan's per-rank bytes
        sd[f"rng.rank{r}"] = [r, 7]
        sd["who"] = r  # a rank-local value under one key
    return sd


def _entries(path: str) -> dict:
    """The manifest's tensors as comparable plain data (file index -> writing rank)."""
    from dckpt.protocol.restore import read_manifest
    from dckpt.storage.fsspec_storage import make_storage

    st, root = make_storage(path)
    m, _ = read_manifest(st, root)
    out = {}
    for k, t in m.tensors.items():
        c = t.chunks
        out[k] = (t.dtype, t.shape, None if c.grid is None else [list(map(int, b)) for b in c.grid],
                  c.offsets.tolist(), c.sizes.tolist(), [m.files[i].rank for i in c.file.tolist()])
    return {"tensors": out, "values": m.values, "int_keys": m.meta.get("int_keys")}


def _fresh() -> None:
    from dckpt.protocol import plancache

    plancache._CACHES.clear()  # a first save, as in a new process


def _save_gathered(state, path: str, **kw):
    """A first save of ``state`` by the gathered path (plans by rule off)."""
    import dckpt
    from dckpt.protocol import plancache

    _fresh()
    plancache.RULES = False
    try:
        return dckpt.save(state, path, **kw)
    finally:
        plancache.RULES = True


def _save_both(root: str, layout: str, break_rank: int | None = None,
               bad_rule: bool = False) -> tuple:
    import dckpt
    from dckpt.layout import rules
    from dckpt.protocol import coordinator, rulesig

    derived: list = []
    real = coordinator._Coordinator._derive
    coordinator._Coordinator._derive = lambda self, offers: derived.append(real(self, offers)) or derived[-1]
    saved_hash, saved_sig = rules.plan_hash, rulesig.signature
    try:
        if break_rank == dist.get_rank():  # this rank's real boxes differ from the rule's
            rulesig.rules = type("R", (), {"plan_hash": staticmethod(
                lambda *a: bytes(16)), "encode": staticmethod(rules.encode)})
        if bad_rule:  # every rank describes its mesh with the ranks reversed
            def wrong(tensors, ranks, int_keys):
                sig = saved_sig(tensors, ranks, int_keys)
                sig.layouts = [rules.Layout(tuple(reversed(lay.ranks)), lay.shape, lay.placements)
                               for lay in sig.layouts]
                return sig
            rulesig.signature = wrong
        _fresh()
        info = dckpt.save(_state(layout), f"{root}/rule")
    finally:
        rulesig.rules, rulesig.signature = rules, saved_sig
        coordinator._Coordinator._derive = real
    _save_gathered(_state(layout), f"{root}/gathered")
    # a later save takes the cached plan the derived save left
    again = dckpt.save(_state(layout), f"{root}/again")
    target = _state(layout)
    dckpt.load(target, f"{root}/rule", strict=False)
    ok = all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v,
                         w.full_tensor() if hasattr(w, "full_tensor") else w)
             for (k, v), w in zip(_state(layout).items(), target.values())
             if isinstance(v, torch.Tensor))
    return (info.plan_cached, again.plan_cached, [d is not None for d in derived], ok,
            (_entries(f"{root}/rule"), _entries(f"{root}/gathered")) if dist.get_rank() == 0 else None)


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp2_tp", "hsdp", "per_rank"])
def test_derived_and_gathered_manifests_are_identical(ranks, tmp_path, layout):
    out = ranks(4).run(_save_both, str(tmp_path), layout)
    first_cached, again_cached, derived, ok, manifests = zip(*out)
    assert not any(first_cached) and all(again_cached) and all(ok)
    assert derived[0] == [True]  # rank 0 derived the plan, on the first try
    rule, gathered = manifests[0]
    assert rule == gathered


@pytest.mark.parametrize("how", ["one_rank", "wrong_rule"])
def test_a_wrong_derivation_falls_back_to_the_gathered_plan(ranks, tmp_path, how, caplog):
    out = ranks(4).run(_save_both, str(tmp_path), "fsdp2_tp",
                       1 if how == "one_rank" else None, how == "wrong_rule")
    first_cached, again_cached, derived, ok, manifests = zip(*out)
    assert derived[0] == [False]  # the check refused the derived plan
    assert all(ok) and all(again_cached)
    rule, gathered = manifests[0]
    assert rule == gathered  # what committed is the gathered (true) plan
