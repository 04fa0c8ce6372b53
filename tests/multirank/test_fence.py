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
