"""Issue 36, item 3: a framework's Stateful wrappers that also subclass Optimizer or
Module (torchtitan's OptimizersContainer and ModelWrapper) are saved as the Stateful
objects they are; a bare Optimizer or Module keeps the error that points to
TrainingState. Before: every Optimizer/Module was refused, wrapper or not."""
from __future__ import annotations

import pytest
import torch

import dckpt
from dckpt.state.flatten import is_bare_native


class OptimizersContainer(torch.optim.Optimizer):
    """Shaped like torchtitan's: one optimizer per model part behind one Optimizer,
    with its own (flattened) state_dict and load_state_dict."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=0.1) for p in parts]
        params = [q for p in parts for q in p.parameters()]
        torch.optim.Optimizer.__init__(self, params, {"lr": 0.1})

    def step(self, closure=None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        out = {}
        for i, o in enumerate(self.optimizers):
            sd = o.state_dict()
            for pid, st in sd["state"].items():
                for name, v in st.items():
                    out[f"part{i}.{pid}.{name}"] = v
            out[f"part{i}.lr"] = sd["param_groups"][0]["lr"]
        return out

    def load_state_dict(self, sd: dict) -> None:
        for i, o in enumerate(self.optimizers):
            params = [p for g in o.param_groups for p in g["params"]]
            for pid, p in enumerate(params):
                o.state[p] = {name: sd[f"part{i}.{pid}.{name}"]
                              for name in ("step", "exp_avg", "exp_avg_sq")}
            for g in o.param_groups:
                g["lr"] = sd[f"part{i}.lr"]


class ModelWrapper(torch.nn.Module):
    """Shaped like torchtitan's ModelWrapper: its own state_dict over the model parts."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def state_dict(self, *args, **kwargs) -> dict:
        return {f"{i}.{k}": v for i, p in enumerate(self.parts)
                for k, v in torch.nn.Module.state_dict(p).items()}

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        for i, p in enumerate(self.parts):
            torch.nn.Module.load_state_dict(
                p, {k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(f"{i}.")})


def _trained(seed: int) -> tuple[ModelWrapper, OptimizersContainer]:
    torch.manual_seed(seed)
    parts = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    model, opt = ModelWrapper(parts), OptimizersContainer(parts)
    for _ in range(2):
        x = torch.randn(5, 4)
        parts[1](parts[0](x)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("how", ["save", "async_save", "manager"])
def test_framework_wrappers_round_trip_as_stateful(tmp_path, how):
    model, opt = _trained(0)
    want_m, want_o = model.state_dict(), opt.state_dict()
    path = str(tmp_path / "ck")
    if how == "save":
        dckpt.save({"model": model, "optim": opt}, path)
    elif how == "async_save":
        h = dckpt.async_save({"model": model, "optim": opt}, path)
        opt.step()  # after the call: the checkpoint holds the values at the call
        h.result()
    else:
        mgr = dckpt.CheckpointManager(str(tmp_path / "run"), every_steps=1, async_save=True,
                                      capture_rng=False)
        mgr.save(1, {"model": model, "optim": opt})
        mgr.close()
        path = mgr.path(1)
    model2, opt2 = _trained(1)
    assert not _same(model2.state_dict(), want_m)
    if how == "manager":
        mgr = dckpt.CheckpointManager(str(tmp_path / "run"), every_steps=1, capture_rng=False)
        assert mgr.restore({"model": model2, "optim": opt2}) == 1
        mgr.close()
    else:
        dckpt.load({"model": model2, "optim": opt2}, path)
    assert _same(model2.state_dict(), want_m)
    assert _same(opt2.state_dict(), want_o)


def test_bare_optimizers_and_modules_are_still_refused(tmp_path):
    lin = torch.nn.Linear(2, 2)
    for bare in (lin, torch.optim.AdamW(lin.parameters())):
        assert is_bare_native(bare)
        with pytest.raises(dckpt.UnsupportedValueError, match="dckpt.TrainingState"):
            dckpt.save({"x": bare}, str(tmp_path / type(bare).__name__))

    class HalfWrapped(torch.optim.SGD):  # its own state_dict, torch's load_state_dict
        def state_dict(self):
            return {"lr": 1.0}

    half = HalfWrapped(lin.parameters(), lr=0.1)
    assert is_bare_native(half)
    with pytest.raises(dckpt.UnsupportedValueError, match="dckpt.TrainingState"):
        dckpt.save({"x": half}, str(tmp_path / "half"))
    assert not is_bare_native(OptimizersContainer([lin]))
    assert not is_bare_native(ModelWrapper([lin]))
