"""DckptAccelerator run as Accelerate users write their scripts, next to the stock
``accelerate.Accelerator`` on the same script: one process, CPU, real Accelerate.
Each test pins a behaviour stock has (or a promise dckpt adds) that a drop-in lost."""
from __future__ import annotations

import os
import pathlib
import pickle
import time

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from .hf_helpers import accelerator as _accelerator, params  # noqa: E402
from .hf_helpers import fresh_accelerate_state  # noqa: E402,F401 (autouse)

import dckpt  # noqa: E402


def steps(acc, model, opt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, model_in(model), generator=g)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def model_in(m) -> int:
    return next(p for p in m.parameters() if p.dim() == 2).shape[1]


accelerator = _accelerator
KINDS = ["stock", "dckpt"]


# ----------------------------------------------------------- a save changes nothing
@pytest.mark.parametrize("kind", KINDS)
def test_save_before_the_first_step_leaves_the_optimizer_fresh(tmp_path, kind):
    """Reading a fresh Adam's state ran torch's zero-lr step: its step count was one
    ahead and every later update differed from stock's."""
    def run(save: bool):
        acc = accelerator(kind)
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        m, o = acc.prepare(m, o)
        if save:
            acc.save_state(str(tmp_path / f"{kind}-early"))
            assert not o.optimizer.state, "the save initialised the optimizer's state"
        steps(acc, m, o, 3)
        return params(m), [int(s["step"]) for s in o.optimizer.state.values()]
    (w0, s0), (w1, s1) = run(False), run(True)
    assert s1 == s0 == [3, 3]
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_optimizer_saved_loads_back_fresh(tmp_path, kind):
    """Saved before any step, trained, loaded: the optimizer is fresh again and the
    next steps repeat the first ones exactly (stock: optimizer.load_state_dict of an
    empty state)."""
    acc = accelerator(kind)
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m, o = acc.prepare(m, o)
    acc.save_state(str(tmp_path / "fresh"))
    steps(acc, m, o, 2)
    first = params(m)
    steps(acc, m, o, 2)
    acc.load_state(str(tmp_path / "fresh"))
    assert not o.optimizer.state and o.optimizer.state_dict()["state"] == {}
    steps(acc, m, o, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, params(m)))


# ------------------------------------------------------------ empty parameter groups
@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_parameter_group_resumes_exactly(tmp_path, kind):
    """The Trainer's no-decay group is empty for LoRA models and models without
    biases: the save worked, the load raised IndexError inside torch."""
    def make():
        acc = accelerator(kind)
        torch.manual_seed(0)
        m = nn.Linear(3, 2, bias=False)
        o = torch.optim.AdamW([{"params": list(m.parameters()), "weight_decay": 0.1},
                               {"params": [], "weight_decay": 0.0, "lr": 0.05}], lr=0.1)
        return (acc, *acc.prepare(m, o))
    acc, m, o = make()
    steps(acc, m, o, 2)
    acc.save_state(str(tmp_path / "ck"))
    steps(acc, m, o, 2, seed=1)
    want = params(m)
    acc, m, o = make()
    acc.load_state(str(tmp_path / "ck"))
    assert len(o.optimizer.param_groups) == 2 and o.optimizer.param_groups[1]["lr"] == 0.05
    steps(acc, m, o, 2, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(want, params(m)))


class _Picky:
    """A registered object whose load_state_dict refuses what it is given."""

    def state_dict(self) -> dict:
        return {"v": 1}

    def load_state_dict(self, sd: dict) -> None:
        raise ValueError("not my state")


def test_a_load_failure_that_is_not_damage_does_not_fall_back(tmp_path):
    """An object's own load error (an optimizer's IndexError in torch, a registered
    object's ValueError) is the caller's mismatch on every checkpoint: automatic
    naming must raise it, not report each checkpoint as damaged and fall back
    through all of them to the oldest."""
    acc = accelerator("dckpt", tmp_path / "p", auto=True)
    acc.register_for_checkpointing(_Picky())
    acc.prepare(nn.Linear(3, 2))
    acc.save_state()
    acc.save_state()
    acc = accelerator("dckpt", tmp_path / "p", auto=True)
    acc.register_for_checkpointing(_Picky())
    acc.prepare(nn.Linear(3, 2))
    with pytest.raises(dckpt.StateMismatchError, match="not my state") as e:
        acc.load_state()
    assert "checkpoint_1" in str(e.value) and "no checkpoint could be loaded" not in str(e.value)


# --------------------------------------------- optimizers across models, loose params
@pytest.mark.parametrize("kind", KINDS)
def test_one_optimizer_over_two_models_and_a_loose_parameter_resumes(tmp_path, kind):
    """DreamBooth's --train_text_encoder: one optimizer over the UNet and the text
    encoder, and a learnable scalar of no model: save_state raised KeyError."""
    def make():
        acc = accelerator(kind)
        torch.manual_seed(0)
        a, b = nn.Linear(3, 3), nn.Linear(3, 2)
        scale = nn.Parameter(torch.ones(()))
        o = torch.optim.Adam([*a.parameters(), *b.parameters(), scale], lr=0.1)
        a, b, o = acc.prepare(a, b, o)
        # a parameter of no model is not stored by stock: the script registers it
        acc.register_for_checkpointing(_Value(scale))
        return acc, a, b, scale, o

    def train(acc, a, b, scale, o, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            loss = (b(a(torch.randn(4, 3, generator=g))) * scale).pow(2).mean()
            acc.backward(loss)
            o.step()
            o.zero_grad()
    acc, a, b, scale, o = make()
    train(acc, a, b, scale, o, 2, 0)
    acc.save_state(str(tmp_path / "ck"))
    saved_scale = scale.detach().clone()
    train(acc, a, b, scale, o, 2, 1)
    want = [*params(a), *params(b), scale.detach().clone()]
    acc, a, b, scale, o = make()
    acc.load_state(str(tmp_path / "ck"))
    assert torch.equal(scale.detach(), saved_scale)
    train(acc, a, b, scale, o, 2, 1)
    got = [*params(a), *params(b), scale.detach().clone()]
    assert all(torch.equal(x, y) for x, y in zip(want, got))


class _Value:
    """A registered object holding one parameter's value (what a stock script does)."""

    def __init__(self, p: torch.Tensor) -> None:
        self.p = p

    def state_dict(self) -> dict:
        return {"v": self.p.detach().clone()}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            self.p.copy_(sd["v"])


# ------------------------------------------------------- buffers that change shape
class Recorder(nn.Module):
    """A model whose buffer records the data it saw (grows with it), and whose own
    load_state_dict takes the saved buffer at its saved shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(0))

    def forward(self, x):
        self.seen = torch.cat([self.seen, x[:, 0].detach()])
        return self.lin(x)

    def _load_from_state_dict(self, sd, prefix, *args, **kwargs):
        key = prefix + "seen"
        if key in sd:
            self.seen = torch.empty_like(sd[key])
        super()._load_from_state_dict(sd, prefix, *args, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_buffer_that_grew_is_restored_at_its_saved_shape(tmp_path, kind):
    acc = accelerator(kind)
    torch.manual_seed(0)
    m = Recorder()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = acc.prepare(m, o)
    steps(acc, m, o, 2)
    saved = m.seen.clone()
    acc.save_state(str(tmp_path / "ck"))
    steps(acc, m, o, 3)
    assert m.seen.shape != saved.shape
    acc.load_state(str(tmp_path / "ck"))
    assert torch.equal(m.seen, saved)


# ------------------------------------------------------------------- strict=False
@pytest.mark.parametrize("kind", KINDS)
def test_load_state_strict_false_loads_into_a_model_with_more_keys(tmp_path, kind):
    class Bigger(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.head = nn.Linear(2, 2)

    acc = accelerator(kind)
    torch.manual_seed(0)
    small = nn.Sequential()
    small.add_module("lin", nn.Linear(3, 2))
    small = acc.prepare(small)
    acc.save_state(str(tmp_path / "ck"))
    want = params(small)
    acc = accelerator(kind)
    big = acc.prepare(Bigger())
    head = params(big.head)
    with pytest.raises(Exception) as e:
        acc.load_state(str(tmp_path / "ck"))
    if kind == "dckpt":
        assert "strict=False" in str(e.value) and "allow_missing" not in str(e.value)
    acc.load_state(str(tmp_path / "ck"), strict=False)
    assert all(torch.equal(a, b) for a, b in zip(want, params(big.lin)))
    assert all(torch.equal(a, b) for a, b in zip(head, params(big.head)))


# ------------------------------------------------------------------ pickling, Path
@pytest.mark.parametrize("kind", KINDS)
def test_the_accelerator_pickles(tmp_path, kind):
    acc = accelerator(kind, async_save=True)
    m = nn.Linear(2, 2)
    m, o = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    acc.save_state(str(tmp_path / "ck"))  # dckpt: a save in flight, fenced
    copy = pickle.loads(pickle.dumps(acc))
    assert type(copy) is type(acc)
    acc.end_training()


@pytest.mark.parametrize("kind", KINDS)
def test_save_state_returns_a_path(tmp_path, kind):
    acc = accelerator(kind)
    acc.prepare(nn.Linear(2, 2))
    got = acc.save_state(str(tmp_path / "ck"))
    assert isinstance(got, pathlib.Path) and got == tmp_path / "ck"
    assert (got / "x").parent == got


# -------------------------------------------------- files written into the folder
@pytest.mark.parametrize("async_save", [False, True])
def test_files_written_into_the_checkpoint_folder_are_kept(tmp_path, async_save):
    """Scripts write next to save_state's files (a tokenizer, an adapter, a json of
    their own), before the save or after it returned. With async_save the placement
    removed what stood at the name; nothing dckpt did not write may be deleted."""
    acc = accelerator("dckpt", async_save=async_save)
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = acc.prepare(m, o)
    out = tmp_path / "ck"
    out.mkdir()
    (out / "before.json").write_text("1")
    path = acc.save_state(str(out))
    os.makedirs(path / "adapter_model", exist_ok=True)
    (path / "adapter_model" / "adapter.bin").write_bytes(b"a")
    (path / "after.json").write_text("2")
    acc.end_training()
    assert (out / "before.json").read_text() == "1"
    assert (out / "after.json").read_text() == "2"
    assert (out / "adapter_model" / "adapter.bin").read_bytes() == b"a"
    assert (out / "manifest.json").exists()
    acc = accelerator("dckpt")
    m2 = nn.Linear(2, 2)
    acc.prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1))
    acc.load_state(str(out))
    assert torch.equal(m2.weight, m.weight)


def test_a_stock_checkpoint_at_the_name_is_refused_not_mixed(tmp_path):
    acc = accelerator("stock")
    m = acc.prepare(nn.Linear(2, 2))
    acc.save_state(str(tmp_path / "ck"))
    before = sorted(os.listdir(tmp_path / "ck"))
    acc = accelerator("dckpt")
    acc.prepare(nn.Linear(2, 2))
    with pytest.raises(dckpt.CheckpointError, match="framework's own checkpoint"):
        acc.save_state(str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck")) == before


# ------------------------------------------------------------ the run's timeline
def test_a_host_whose_clock_is_behind_resumes_the_newest_and_rotation_keeps_it(
        tmp_path, monkeypatch):
    """Run 1 saves checkpoint_0 and _1; run 2 resumes on a host whose clock is a day
    behind and saves _2 and _3 with total_limit=2. By commit time (rank 0's clock)
    _2 and _3 were 'oldest': rotation removed them and a resume took _1."""
    def make():
        acc = accelerator("dckpt", tmp_path / "p", auto=True, total_limit=2)
        m = nn.Linear(2, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        return (acc, *acc.prepare(m, o))
    acc, m, o = make()
    for _ in range(2):
        steps(acc, m, o, 1)
        acc.save_state()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400.0)
    acc, m, o = make()
    acc.load_state()
    for _ in range(2):
        steps(acc, m, o, 1)
        acc.save_state()
    want = params(m)
    monkeypatch.setattr(time, "time", real)
    names = sorted(os.listdir(tmp_path / "p" / "checkpoints"))
    assert names == ["checkpoint_2", "checkpoint_3"], names
    acc, m, o = make()
    acc.load_state()
    assert acc.project_configuration.iteration == 4
    assert all(torch.equal(a, b) for a, b in zip(want, params(m)))


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_checks_map_location_as_stock(tmp_path, kind):
    acc = accelerator(kind)
    m = nn.Linear(2, 2)
    m, o = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    acc.save_state(str(tmp_path / "ck"))
    with pytest.raises(TypeError, match="Unsupported optimizer map location"):
        acc.load_state(str(tmp_path / "ck"), map_location="invalid")
    for where in ("cpu", "on_device", None):
        acc.load_state(str(tmp_path / "ck"), map_location=where)
