"""Fenced async saves of an FSDP2 model at 2 ranks: the optimizer steps right after the
call, and the checkpoint holds the values at the call, bitwise."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _build(seed: int):
    from statekit import fsdp2_mlp

    return fsdp2_mlp((256, 512, 256), seed, lr=0.1)


def _step(model, opt, s: int) -> None:
    g = torch.Generator().manual_seed(s * 10 + dist.get_rank())
    opt.zero_grad()
    model(torch.randn(4, 256, generator=g)).sum().backward()
    opt.step()


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in {**msd, **osd}.items()}


def _fenced(root: str) -> None:
    import dckpt

    model, opt = _build(0)
    _step(model, opt, 0)
    wants = []
    for i in range(3):
        wants.append(_full(model, opt))
        h = dckpt.async_save({"train": dckpt.TrainingState(model, opt)}, f"{root}/c{i}", fence=opt)
        _step(model, opt, i + 1)  # right away
        h.result()
    for i, want in enumerate(wants):
        m2, o2 = _build(5)
        dckpt.load({"train": dckpt.TrainingState(m2, o2)}, f"{root}/c{i}")
        got = _full(m2, o2)
        for k, v in want.items():
            assert (torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k]), (i, k)


def test_fenced_fsdp2_saves(ranks, tmp_path):
    ranks(2).run(_fenced, str(tmp_path))


def _fenced_tier(base: str, streamed: bool = False) -> tuple:
    """A manager with a fast tier saving an FSDP2 TrainingState: the tier is written
    from the live DTensors' local shards (no staging buffers), the optimizer steps
    right after each call, and both tiers hold the values at the call. ``streamed``:
    through 64 KiB bounce buffers, the path GPU shards take (dckpt.engine.devstream)."""
    from dckpt.engine import devstream

    saved = devstream.STREAM_CPU, devstream.BOUNCE, devstream._FREE
    devstream.STREAM_CPU, devstream.BOUNCE, devstream._FREE = streamed, 64 << 10, {}
    try:
        return _tier_rounds(base, streamed)
    finally:  # the rank processes run this module's other jobs too, in any order
        devstream.STREAM_CPU, devstream.BOUNCE, devstream._FREE = saved


def _tier_rounds(base: str, streamed: bool) -> tuple:
    import os

    import dckpt
    from dckpt.engine import devstream

    model, opt = _build(0)
    _step(model, opt, 0)
    wants = {}
    kw = dict(async_save=True, capture_rng=False, every_steps=1, durable_every_steps=2,
              local_root=os.path.join(base, f"node{dist.get_rank()}"))
    with dckpt.CheckpointManager(os.path.join(base, "durable"), **kw) as mgr:
        for s in (1, 2, 3, 4):
            wants[s] = _full(model, opt)
            mgr.save(s, {"train": dckpt.TrainingState(model, opt)})
            assert mgr.tier.pool.nbytes == 0
            _step(model, opt, s)  # right away
        mgr.wait()
        durable, local = mgr.steps(), mgr.steps(tier="local")
    assert bool(devstream._FREE) == streamed  # a bounce pair was used, and returned
    for tier_steps, want_tier in ((local, "local"), (durable, "durable")):
        m2, o2 = _build(5)
        with dckpt.CheckpointManager(os.path.join(base, "durable"), **kw) as mgr:
            if want_tier == "durable":  # this rank's node lost its fast tier
                import shutil

                shutil.rmtree(kw["local_root"])
            step = mgr.restore({"train": dckpt.TrainingState(m2, o2)})
            assert (step, mgr.restored_from) == (max(tier_steps), want_tier)
        got = _full(m2, o2)
        for k, v in wants[step].items():
            assert (torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k]), (step, k)
    return durable, local


def test_fenced_fsdp2_saves_into_a_fast_tier(ranks, tmp_path):
    assert ranks(2).run(_fenced_tier, str(tmp_path)) == [([2, 4], [4])] * 2


def test_fenced_fsdp2_streamed_into_a_fast_tier(ranks, tmp_path):
    assert ranks(2).run(_fenced_tier, str(tmp_path), True) == [([2, 4], [4])] * 2


def _unfenced_write_on_one_rank(root: str) -> str:
    """Rank 1 writes a saved tensor in place right after the call, outside the fence
    (the copy is slowed so the write surely comes first): the save fails on every rank
    with rank 1's error naming the tensor, and nothing is committed."""
    import time

    import dckpt
    from dckpt.engine.staging import StagingPool

    real = StagingPool.run

    def slow(copies, copy=True, after=None):
        time.sleep(0.3)
        real(copies, copy, after)

    StagingPool.run = staticmethod(slow)
    try:
        model, opt = _build(0)
        _step(model, opt, 0)
        h = dckpt.async_save({"train": dckpt.TrainingState(model, opt)}, f"{root}/c",
                             fence=[opt, model])
        if dist.get_rank() == 1:
            with torch.no_grad():
                next(model.parameters()).add_(1.0)  # neither a step nor a forward
        try:
            h.result()
        except dckpt.CheckpointError as e:
            return str(e)
        return "committed"
    finally:
        StagingPool.run = real


def test_unfenced_write_on_one_rank_fails_the_save_everywhere(ranks, tmp_path):
    import os

    errors = ranks(2).run(_unfenced_write_on_one_rank, str(tmp_path))
    for e in errors:
        assert "rank 1" in e and "changed while its snapshot was taken" in e, e
    assert not os.path.exists(tmp_path / "c" / "manifest.json")
