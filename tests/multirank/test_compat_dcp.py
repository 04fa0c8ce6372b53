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


def _load_in_place(path: str) -> dict:
    """Loads the model part into a plain nested dict of the model's DTensors (as code
    that calls get_model_state_dict does), held elsewhere too: every container, DTensor
    and local shard keeps its identity and storage, and the aliases see the new values."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dckpt.compat import dcp

    model, optim = _model()
    msd = get_model_state_dict(model)
    extra = {"step": 0, "hist": [0, torch.zeros(2)]}
    state = {"model": msd, "extra": extra}
    alias = {"msd": msd, "extra": extra}
    before = {k: (v, v.to_local(), v.to_local().data_ptr()) for k, v in msd.items()}
    dcp.load(state, checkpoint_id=path, process_group=dist.group.WORLD)
    assert state["model"] is msd and alias["extra"] is extra and state["extra"] is extra
    assert extra["step"] == 2 and torch.equal(extra["hist"][1], torch.ones(2))
    for k, (t, local, ptr) in before.items():
        assert msd[k] is t and t.to_local().data_ptr() == ptr, k
    # the DTensors are views of the model's parameters: the model itself was restored
    return {k: v for k, v in _full(model, optim).items() if not k.startswith(("state.", "param_groups"))}


def _save_with_extra(path: str) -> dict:
    from dckpt.compat import dcp

    model, optim = _model()
    _train(model, optim, 2)
    dcp.save({"model": model, "extra": {"step": 2, "hist": [0, torch.ones(2)]}},
             checkpoint_id=path)
    return {k: v for k, v in _full(model, optim).items() if not k.startswith(("state.", "param_groups"))}


@pytest.mark.parametrize("m", [2, 3])
def test_load_fills_plain_dicts_of_dtensors_in_place(ranks, tmp_path, m):
    path = str(tmp_path / "c")
    want = ranks(2).run(_save_with_extra, path)[0]
    assert want
    for got in ranks(m).run(_load_in_place, path):
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert torch.equal(v, got[k]), k


def _one_rank_differs(path: str) -> list[str]:
    """A failure on one rank only (a key the checkpoint lacks; a Stateful whose
    state_dict() raises) is raised on every rank as DCP's CheckpointException: no rank
    is left waiting in a collective the failing one never reaches."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dckpt.compat import dcp

    class Broken:
        def state_dict(self):
            raise ValueError("state_dict failed on rank 1")

        def load_state_dict(self, sd) -> None:
            pass

    dcp.save({"w": torch.ones(2)}, checkpoint_id=path)
    seen = []
    target = {"w": torch.zeros(2)}
    if dist.get_rank() == 1:
        target["only_here"] = torch.zeros(1)
    try:
        dcp.load(target, checkpoint_id=path)
    except CheckpointException as e:
        seen.append(str(e))
    assert torch.equal(target["w"], torch.zeros(2))  # nothing read before the error
    state = {"w": torch.ones(2), "b": Broken() if dist.get_rank() == 1 else {"x": 1}}
    for call in (dcp.save, dcp.load):
        try:
            call(state, checkpoint_id=path)
        except CheckpointException as e:
            seen.append(str(e))
    return seen


def test_a_failure_on_one_rank_is_raised_on_every_rank(ranks, tmp_path):
    for seen in ranks(2).run(_one_rank_differs, str(tmp_path / "c"), timeout=60):
        assert len(seen) == 3
        assert "Missing key in checkpoint state_dict: only_here." in seen[0]
        assert all("state_dict failed on rank 1" in s for s in seen[1:])
