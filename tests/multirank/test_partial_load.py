"""Partial and renamed loads at 2 ranks (issue 29, item 3): DTensors under another prefix,
keys some rank's target holds and the checkpoint lacks (one warning, on rank 0), the
collision error on every rank, and an FSDP2 model that gained a layer restored through
TrainingState + CheckpointManager.restore(allow_missing=True), training going on."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

DEADLINE = 90.0  # seconds per run on the spawned ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _dtensors(path: str) -> dict:
    import dckpt
    from dckpt.errors import StateMismatchError
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = torch.arange(60.0).reshape(6, 10)
    b = torch.arange(10, dtype=torch.int32)
    saved = {"module": {"w": distribute_tensor(w, mesh, [Shard(0)]),
                        "b": distribute_tensor(b, mesh, [Replicate()]), "it": 7},
             "extra": 1}
    dckpt.save(saved, path)
    # into another layout and dtype, under other keys; one key only rank 1 holds
    target = {"w": distribute_tensor(torch.zeros(6, 10, dtype=torch.bfloat16), mesh, [Shard(1)]),
              "b": distribute_tensor(torch.zeros(10, dtype=torch.int32), mesh, [Shard(0)]),
              "it": 0, "new": distribute_tensor(torch.full((4,), 5.0), mesh, [Shard(0)])}
    if rank == 1:
        target["only1"] = "kept"
    out: dict = {}
    try:
        dckpt.load(target, path, rename={"": "module."}, cast=True, strict=False)
    except StateMismatchError as e:
        out["default"] = str(e)
    logger = logging.getLogger("dckpt.protocol.restore")
    h = _Records()
    logger.addHandler(h)
    try:
        dckpt.load(target, path, rename={"": "module."}, allow_missing=True, strict=False,
                   cast=True)
    finally:
        logger.removeHandler(h)
    out["warnings"] = h.messages
    out["w"] = torch.equal(target["w"].full_tensor(), w.to(torch.bfloat16))
    out["b"] = torch.equal(target["b"].full_tensor(), b)
    out["new"] = torch.equal(target["new"].full_tensor(), torch.full((4,), 5.0))
    out["it"], out["only1"] = target["it"], target.get("only1")
    try:  # two target keys onto one checkpoint key: the same error on every rank
        dckpt.load({"w": target["w"], "x": {"w": target["w"]}}, path,
                   rename={"": "module.", "x.": "module."}, cast=True, strict=False)
    except StateMismatchError as e:
        out["collision"] = str(e)
    return out


def test_dtensors_renamed_with_missing_keys(ranks, tmp_path):
    got = ranks(2).run(_dtensors, str(tmp_path / "c"), timeout=DEADLINE)
    for r, out in enumerate(got):
        assert out["w"] and out["b"] and out["new"] and out["it"] == 7, (r, out)
        assert "lacks" in out["default"] and "'new'" in out["default"], out["default"]
        assert "'w'" in out["collision"] and "'x.w'" in out["collision"], out["collision"]
        assert "'module.w'" in out["collision"]
    assert got[1]["only1"] == "kept"
    assert got[1]["warnings"] == []
    assert len(got[0]["warnings"]) == 1, got[0]["warnings"]
    msg = got[0]["warnings"][0]
    assert "lacks 2 key(s)" in msg and "'new'" in msg and "'only1'" in msg, msg


def _build(new_layer: bool, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 8)]
    if new_layer:
        layers += [torch.nn.Tanh(), torch.nn.Linear(8, 5)]
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, opt, steps: int) -> float:
    loss = torch.tensor(0.0)
    for s in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * s + dist.get_rank()))
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in {**{f"model.{k}": v for k, v in msd.items()},
                         **{f"optim.{k}": v for k, v in osd.items()}}.items()}


def _new_layer(root: str) -> dict:
    import dckpt

    model, opt = _build(False, seed=0)
    _train(model, opt, 3)
    saved = _full(model, opt)
    with dckpt.CheckpointManager(root, every_steps=1) as mgr:
        mgr.save(3, dckpt.TrainingState(model, opt), force=True)
    model, opt = _build(True, seed=9)
    _train(model, opt, 2)
    before = _full(model, opt)
    logger = logging.getLogger("dckpt.protocol.restore")
    h = _Records()
    logger.addHandler(h)
    try:
        with dckpt.CheckpointManager(root, every_steps=1) as mgr:
            step = mgr.restore(dckpt.TrainingState(model, opt), allow_missing=True)
    finally:
        logger.removeHandler(h)
    after = _full(model, opt)
    bad = [k for k in after
           if not _same(after[k], before[k] if ".4." in k else saved.get(k, "absent"))]
    loss = _train(model, opt, 3)
    return {"step": step, "bad": bad, "warnings": h.messages, "loss": loss,
            "fresh": sorted(k for k in after if ".4." in k)}


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
        else a == b


def test_fsdp2_model_with_a_new_layer_through_the_manager(ranks, tmp_path):
    got = ranks(2).run(_new_layer, str(tmp_path), timeout=DEADLINE)
    for r, out in enumerate(got):
        assert out["step"] == 3 and out["bad"] == [], (r, out["bad"])
        assert out["loss"] == out["loss"]
        assert "optim.state.4.weight.exp_avg_sq" in out["fresh"]
    assert len(got[0]["warnings"]) == 1 and got[1]["warnings"] == []
    assert "'state.model.4.weight'" in got[0]["warnings"][0]
