"""Incremental durable copies under a fast tier across ranks (issue 30): every rank
re-encodes its own local data file against the last durable step, and a job of another
world size restores from the durable chain (resharded 2 -> 3). Spawned gloo ranks, each
with its own ``local_root``; deadlines from the RankPool."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

ROWS = 1020  # divisible by 2 and 3; 4 KiB per row: ~2 MiB of backbone per rank at 2 ranks


def _state(step: int) -> dict:
    """A frozen sharded backbone (~4 MiB, the same every step), a sharded head and a
    replicated tensor that change every step, and a plain value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(7)
    backbone = torch.randn(ROWS, 1024, generator=g)
    head = torch.arange(48 * 8, dtype=torch.float32).reshape(48, 8) + step
    return {"backbone": distribute_tensor(backbone, mesh, [Shard(0)], src_data_rank=None),
            "head": distribute_tensor(head, mesh, [Shard(0)], src_data_rank=None),
            "rep": torch.full((64,), float(step)), "step": step}


def _same(a: dict, b: dict) -> bool:
    return (all(torch.equal(a[k].to_local(), b[k].to_local()) for k in ("backbone", "head"))
            and torch.equal(a["rep"], b["rep"]) and a["step"] == b["step"])


def _manager(base: str, **kw):
    import dckpt

    kw.setdefault("capture_rng", False)
    return dckpt.CheckpointManager(os.path.join(base, "durable"), every_steps=1,
                                   local_root=os.path.join(base, f"node{dist.get_rank()}"), **kw)


def _save_chain(base: str) -> tuple[list[int], list[int]]:
    """(the durable steps kept, each durable copy's own bytes as committed)."""
    from dckpt.format import manifest as mf

    mgr = _manager(base, incremental=True, compression="lz4", keep_last=2)
    owned = []
    for s in (1, 2, 3):
        assert mgr.save(s, _state(s))
        mgr.wait()  # each durable copy committed before the next save
        with open(os.path.join(mgr.path(s), "manifest.json"), "rb") as f:
            owned.append(mf.parse(f.read(), mgr.path(s)).total_bytes)
    mgr.close()
    return mgr.steps(), owned


def _restore(base: str, wipe: bool) -> tuple:
    if wipe:  # every node lost its fast tier
        shutil.rmtree(os.path.join(base, f"node{dist.get_rank()}"), ignore_errors=True)
    dist.barrier()
    mgr = _manager(base)
    st = _state(0)
    step = mgr.restore(st)
    ok = step is not None and _same(st, _state(step))
    mgr.close()
    return step, mgr.restored_from, ok


def _continue_at_3(base: str) -> tuple:
    """Restore (from the durable chain: the fast tier's parts are 2 ranks'), then go on
    saving incrementally at 3 ranks: (restored step, tier, ok, the new copies' bases and
    own bytes)."""
    from dckpt.format import manifest as mf

    mgr = _manager(base, incremental=True, compression="lz4")
    st = _state(0)
    step = mgr.restore(st)
    ok = _same(st, _state(step))
    out = []
    for s in (4, 5):
        assert mgr.save(s, _state(s))
        mgr.wait()
        with open(os.path.join(mgr.path(s), "manifest.json"), "rb") as f:
            m = mf.parse(f.read(), mgr.path(s))
        out.append((m.meta.get("base"), m.total_bytes, sorted(f.rank for f in m.files
                                                              if not f.dir)))
    mgr.close()
    return step, mgr.restored_from, ok, out


def test_restore_2_to_3_ranks_from_a_durable_incremental_chain(ranks, tmp_path):
    from dckpt.format import manifest as mf
    from dckpt.catalog.verify import verify_checkpoint

    base = str(tmp_path)
    out = ranks(2).run(_save_chain, base, timeout=120)
    assert out[0] == out[1] and out[0][0] == [2, 3]
    full, _, last = out[0][1]
    durable = tmp_path / "durable"

    def load(step: int) -> mf.Manifest:
        d = durable / f"step-{step:08d}"
        return mf.parse((d / "manifest.json").read_bytes(), str(d))

    m3 = load(3)
    # step 3 is a delta on step 2 that references both ranks' files of step 1 (the
    # full copy) for the frozen backbone (resolved physically)
    assert m3.meta["base"] == "step-00000002"
    assert {f.dir for f in m3.files if f.dir} == {"step-00000001"}
    assert sorted(f.rank for f in m3.files if f.dir) == [0, 1]
    assert full >= 3 << 20 and last == m3.total_bytes  # randn: lz4 saves little
    assert last <= 0.15 * full, (last, full)
    # retention (keep_last=2) removed step 1's manifest, not the files step 3 uses
    assert not (durable / "step-00000001" / "manifest.json").exists()
    assert all((durable / "step-00000001" / f.name).exists() for f in m3.files if f.dir)
    assert verify_checkpoint(str(durable / "step-00000003")).ok
    # another world size: the fast tier's parts do not fit; the durable chain, 2 -> 3
    assert ranks(3).run(_restore, base, False, timeout=120) == [(3, "durable", True)] * 3
    # the same world size with every node's fast tier lost
    assert ranks(2).run(_restore, base, True, timeout=120) == [(3, "durable", True)] * 2
    # 3 ranks go on from the chain: the first copy after the restore is full (3 files,
    # the boxes cut for 3), the next one a delta on it; a 3-rank restore with every
    # fast tier lost reads the new chain
    out = ranks(3).run(_continue_at_3, base, timeout=120)
    assert all(o == out[0] for o in out)
    step, tier, ok, copies = out[0]
    assert (step, tier, ok) == (3, "durable", True)
    (b4, n4, r4), (b5, n5, r5) = copies
    assert b4 is None and r4 == [0, 1, 2] and n4 >= 3 << 20
    assert b5 == "step-00000004" and n5 <= 0.15 * n4, (n5, n4)
    assert ranks(3).run(_restore, base, True, timeout=120) == [(5, "durable", True)] * 3
