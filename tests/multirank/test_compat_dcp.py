"""dckpt.compat.dcp at several ranks, as DCP's e2e test uses it: an FSDP2 model and its
optimizer passed as Stateful values (with torch's state_dict patches), saved at 2 ranks
and loaded at 2 and 3; async_save; a process group argument."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _model():
    from torch.distributed.checkpoint.state_dict import (_patch_model_state_dict,
                                                         _patch_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _patch_model_state_dict(model)
    _patch_optimizer_state_dict(model, optimizers=optim)
    return model, optim


def _train(model, optim, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        model(torch.randn(4, 8, generator=g)).sum().backward()
        optim.step()
        optim.zero_grad()


def _full(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in {**msd, **osd}.items()}


def _save(path: str, use_async: bool) -> dict:
    from dckpt.compat import dcp

    model, optim = _model()
    _train(model, optim, 2)
    state = {"model": model, "optimizer": optim, "step": 2, "note": b"bytes too"}
    if use_async:
        dcp.async_save(state, checkpoint_id=path, process_group=dist.group.WORLD).result()
    else:
        dcp.save(state, checkpoint_id=path)
    return _full(model, optim)


def _load(path: str) -> dict:
    from dckpt.compat import dcp

    model, optim = _model()
    state = {"model": model, "optimizer": optim, "step": 0, "note": b""}
    dcp.load(state, checkpoint_id=path)
    assert state["step"] == 2 and state["note"] == b"bytes too"
    got = _full(model, optim)
    _train(model, optim, 1)  # training goes on
    return got


@pytest.mark.parametrize("use_async, m", [(False, 2), (False, 3), (True, 2)])
def test_fsdp2_model_and_optimizer_through_compat(ranks, tmp_path, use_async, m):
    path = str(tmp_path / "c")
    want = ranks(2).run(_save, path, use_async)[0]
    for got in ranks(m).run(_load, path):
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert (torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k]), k
