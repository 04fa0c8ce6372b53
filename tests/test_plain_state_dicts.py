"""The state dicts people already write: ``{"epoch": e, "model": model.state_dict(),
"optimizer": optimizer.state_dict()}`` (torch.save style), with a plain optimizer's
int keys, saved and loaded in place, into a fresh optimizer too. One process."""
from __future__ import annotations

import pytest
import torch

import dckpt
from dckpt.errors import UnsupportedValueError
from dckpt.format import manifest as mf


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95)),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),  # state holds None buffers
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def _train(model, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        opt.step()


def _same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert all(type(x) is int for x in b["state"]), list(b["state"])
        assert st.keys() == b["state"][k].keys(), k
        for n, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, b["state"][k][n]), (k, n)
            else:
                assert v == b["state"][k][n], (k, n)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torch_save_style_dict_round_trips_into_a_fresh_optimizer(tmp_path, name):
    model = _net()
    opt = OPTIMIZERS[name](model.parameters())
    _train(model, opt, 3)
    dckpt.save({"epoch": 3, "model": model.state_dict(), "optimizer": opt.state_dict()},
               str(tmp_path / "c"))
    m = mf.parse(open(tmp_path / "c" / "manifest.json", "rb").read())
    if opt.state_dict()["state"]:  # plain SGD keeps no state
        assert "optimizer.state.0" in m.meta["int_keys"]

    model2 = _net(seed=9)  # different weights, an optimizer that never stepped
    opt2 = OPTIMIZERS[name](model2.parameters())
    ck = {"epoch": 0, "model": model2.state_dict(), "optimizer": opt2.state_dict()}
    assert ck["optimizer"]["state"] == {} or name == "adagrad"  # Adagrad fills it at once
    dckpt.load(ck, str(tmp_path / "c"))
    assert ck["epoch"] == 3
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(v, v2), k
    _same_optimizer_state(opt.state_dict(), opt2.state_dict())
    # Training goes on identically from both.
    _train(model, opt, 2, seed=5)
    _train(model2, opt2, 2, seed=5)
    for v, v2 in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(v, v2)


def test_in_place_into_a_stepped_optimizer_keeps_tensor_identity(tmp_path):
    model = _net()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 2)
    dckpt.save({"optimizer": opt.state_dict()}, str(tmp_path / "c"))
    model2 = _net(seed=3)
    opt2 = torch.optim.Adam(model2.parameters())
    _train(model2, opt2, 1)
    sd = opt2.state_dict()
    before = sd["state"][0]["exp_avg"]
    dckpt.load({"optimizer": sd}, str(tmp_path / "c"))
    assert sd["state"][0]["exp_avg"] is before  # filled in place
    _same_optimizer_state(opt.state_dict(), sd)


def test_int_keys_everywhere_and_their_limits(tmp_path):
    sd = {"table": {3: torch.ones(2), -1: {"x": 5}, 10: [1, 2]}, "ok": {"a": 1}}
    dckpt.save(sd, str(tmp_path / "c"))
    back = {"table": {}, "ok": {"a": 0}}
    dckpt.load(back, str(tmp_path / "c"))
    assert back["table"].keys() == {3, -1, 10}
    assert torch.equal(back["table"][3], torch.ones(2)) and back["table"][-1] == {"x": 5}
    # A list under a rebuilt dict comes back as a dict of its indexes (no type info
    # for what the target does not hold); in a target that has the list, it is a list.
    assert back["table"][10] == {"0": 1, "1": 2}
    with pytest.raises(UnsupportedValueError, match="flatten to key 'd.0'"):
        dckpt.save({"d": {0: 1, "0": 2}}, str(tmp_path / "x"))
    with pytest.raises(UnsupportedValueError, match="strings or ints.*TrainingState"):
        dckpt.save({"d": {(1, 2): 1}}, str(tmp_path / "y"))
    with pytest.raises(UnsupportedValueError, match="bool"):
        dckpt.save({"d": {True: 1}}, str(tmp_path / "z"))


def test_cast_on_load(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(6)}
    sd.update({"ids": torch.arange(10), "h": torch.randn(8, dtype=torch.float64, generator=g)})
    dckpt.save(sd, str(tmp_path / "c"))
    target = {k: torch.zeros(v.shape, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype)
              for k, v in sd.items()}
    with pytest.raises(dckpt.StateMismatchError, match="cast=True"):
        dckpt.load(target, str(tmp_path / "c"))
    # A small read budget: the casts go in several groups.
    dckpt.load(target, str(tmp_path / "c"), cast=True, read_budget=20_000)
    for k, v in sd.items():
        assert target[k].dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype)
        assert torch.equal(target[k], v.to(target[k].dtype)), k
    bad = {**target, "ids": torch.zeros(10)}  # int64 saved: never cast to float
    with pytest.raises(dckpt.StateMismatchError, match="'ids'"):
        dckpt.load(bad, str(tmp_path / "c"), cast=True)
