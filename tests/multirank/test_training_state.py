"""TrainingState: FSDP2 / DDP model + AdamW saved at one world size, restored exactly at
another (or in another parallelism), and training continues."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _build(kind: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 8))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "fsdp1":  # FullyShardedDataParallel: ShardedTensor state dicts
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train(model, opt, steps: int, start: int) -> float:
    loss = torch.tensor(0.0)
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x = torch.randn(4, 16, generator=g)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return float(loss)


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    out = {}
    for k, v in {**{f"model.{k}": v for k, v in msd.items()},
                 **{f"optim.{k}": v for k, v in osd.items()}}.items():
        out[k] = v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v
    return out


def _train_and_save(path: str, kind: str, use_async: bool = False) -> dict:
    import dckpt

    model, opt = _build(kind, seed=0)
    _train(model, opt, steps=3, start=0)
    state = {"train": dckpt.TrainingState(model, opt), "step": 3}
    if use_async:  # staged copies of the local shards, rebuilt as the same layout
        h = dckpt.async_save(state, path)
        _train(model, opt, steps=1, start=3)  # changes after the snapshot are not saved
        h.result()
        opt.zero_grad()
        return _full(*_restored(path, kind))
    dckpt.save(state, path)
    return _full(model, opt)


def _restored(path: str, kind: str):
    import dckpt

    model, opt = _build(kind, seed=7)
    dckpt.load({"train": dckpt.TrainingState(model, opt), "step": 0}, path)
    return model, opt


def _restore_and_continue(path: str, kind: str) -> dict:
    import dckpt

    model, opt = _build(kind, seed=123)  # different init: everything must come from disk
    state = {"train": dckpt.TrainingState(model, opt), "step": 0}
    dckpt.load(state, path)
    assert state["step"] == 3
    restored = _full(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _train(model, opt, steps=2, start=3)
    assert loss == loss and loss < 1e6
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    return restored


def _assert_same(want: dict, got: dict) -> None:
    assert want.keys() == got.keys(), set(want) ^ set(got)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(want[k], got[k]), k
        else:
            assert want[k] == got[k], k
    assert any(k.endswith("exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)


@pytest.mark.parametrize("m", [1, 3, 4])
def test_fsdp2_restored_at_other_world_sizes(ranks, tmp_path, m):
    path = str(tmp_path / "ckpt")
    want = ranks(2).run(_train_and_save, path, "fsdp2")[0]
    for got in ranks(m).run(_restore_and_continue, path, "fsdp2"):
        _assert_same(want, got)


@pytest.mark.parametrize("m", [2, 3, 1])
def test_fsdp1_restored_at_other_world_sizes(ranks, tmp_path, m):
    from dckpt.format import manifest as mf

    path = str(tmp_path / "ckpt")
    want = ranks(2).run(_train_and_save, path, "fsdp1")[0]
    # Saved as the ShardedTensors' shards: one chunk per rank, no gather.
    man = mf.parse(open(f"{path}/manifest.json", "rb").read())
    assert len(man.tensors["train.model.0.weight"].chunks) == 2
    assert len(man.tensors["train.optim.state.0.weight.exp_avg"].chunks) == 2
    for got in ranks(m).run(_restore_and_continue, path, "fsdp1"):
        _assert_same(want, got)


def test_fsdp1_async_save(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    want = ranks(2).run(_train_and_save, path, "fsdp1")[0]
    path2 = str(tmp_path / "async")
    got = ranks(2).run(_train_and_save, path2, "fsdp1", True)[0]
    _assert_same(want, got)


@pytest.mark.parametrize("src, dst, n, m", [("ddp", "fsdp2", 2, 3), ("fsdp2", "ddp", 2, 2),
                                            ("fsdp2", "plain", 2, 1), ("fsdp1", "fsdp2", 2, 3),
                                            ("fsdp2", "fsdp1", 2, 2)])
def test_between_parallelisms(ranks, tmp_path, src, dst, n, m):
    path = str(tmp_path / "ckpt")
    want = ranks(n).run(_train_and_save, path, src)[0]
    for got in ranks(m).run(_restore_and_continue, path, dst):
        _assert_same(want, got)
