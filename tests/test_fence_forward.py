"""Forwards that write saved tensors in place (Embedding(max_norm=) renormalises the rows
it looks up; spectral norm's power iteration updates u and v) must not run before a
fenced snapshot is taken, whatever the module's class: the checkpoint holds the values
from before the forward, bitwise, through dckpt.async_save(fence=) and through a
manager with async_save=True, with and without a fast tier. One process."""
from __future__ import annotations

import time

import pytest
import torch

import dckpt
from dckpt.engine.staging import StagingPool


class _EmbedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 32, max_norm=1.0)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def _embedding() -> torch.nn.Module:
    return _EmbedNet()


def _spectral() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(64, 64)),
                               torch.nn.Linear(64, 4))


def _parametrized() -> torch.nn.Module:
    from torch.nn.utils.parametrizations import spectral_norm

    return torch.nn.Sequential(spectral_norm(torch.nn.Linear(64, 64)), torch.nn.Linear(64, 4))


MODELS = {"embedding_max_norm": _embedding, "spectral_norm": _spectral,
          "parametrizations_spectral_norm": _parametrized}


class _Inputs:
    """Each call gives inputs the model has not seen: for the embedding, rows never
    looked up (so never renormalised yet), which the next forward will change."""

    def __init__(self, kind: str) -> None:
        self.kind, self.n = kind, 0

    def __call__(self) -> torch.Tensor:
        self.n += 1
        if self.kind == "embedding_max_norm":
            return torch.arange(16 * self.n, 16 * self.n + 16)
        return torch.randn(8, 64)


def _build(kind: str) -> tuple:
    torch.manual_seed(0)
    m = MODELS[kind]()
    with torch.no_grad():
        if kind == "embedding_max_norm":
            m.emb.weight.mul_(10)  # every row far above max_norm
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    return m, opt, _Inputs(kind)


def _train_step(m, opt, inputs) -> None:
    opt.zero_grad()
    m(inputs()).sum().backward()
    opt.step()


def _values(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _check(path: str, want: dict, m, prefix: tuple = ()) -> None:
    """The checkpoint at ``path`` holds ``want`` bitwise, and the forward after the save
    did change the model (or the test would prove nothing)."""
    like = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    for p in reversed(prefix):
        like = {p: like}
    got = dckpt.load(like, path, strict=False)
    for p in prefix:
        got = got[p]
    for k, v in want.items():
        assert torch.equal(got["model"][k], v), k
    now = _values(m)
    assert any(not torch.equal(now[k], v) for k, v in want.items())


def _slow_copy(monkeypatch, seconds: float = 0.4) -> None:
    real = StagingPool.run

    def slow(copies, copy=True, after=None):
        time.sleep(seconds)
        real(copies, copy, after)

    monkeypatch.setattr(StagingPool, "run", staticmethod(slow))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_async_save_fenced_on_the_model_holds_the_values_before_the_forward(
        tmp_path, monkeypatch, kind):
    """fence=[opt, model]: the model's forward waits, and so does a forward of one of
    its submodules called directly (not through the root's forward)."""
    _slow_copy(monkeypatch)
    m, opt, inputs = _build(kind)
    _train_step(m, opt, inputs)
    first = next(iter(m.children()))
    for i, call in enumerate((lambda: m(inputs()), lambda: first(inputs()))):
        want = _values(m)
        path = str(tmp_path / f"c{i}")
        h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, path, fence=[opt, m])
        call()  # right away: waits for the copy, then writes into saved tensors
        h.result()
        _check(path, want, m, ("train",))


@pytest.mark.parametrize("local", [False, True], ids=["durable", "fast_tier"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_manager_fences_forwards_that_write_saved_tensors(tmp_path, monkeypatch, kind, local):
    """A TrainingState saved by a manager with async_save=True: its model's forward is
    fenced by itself, whatever its modules' classes. With a fast tier the files are
    written from the live tensors (no copy): the forward waits until they are."""
    if local:
        monkeypatch.setenv("DCKPT_FAULT", "write:*:sleep=0.4")
    else:
        _slow_copy(monkeypatch)
    m, opt, inputs = _build(kind)
    _train_step(m, opt, inputs)
    kw = dict(async_save=True, capture_rng=False)
    if local:
        kw["local_root"] = str(tmp_path / "node")
    wants = {}
    with dckpt.CheckpointManager(str(tmp_path / "r"), **kw) as mgr:
        for s in (1, 2):
            wants[s] = _values(m)
            mgr.save(s, {"train": dckpt.TrainingState(m, opt)}, force=True)
            t0 = time.perf_counter()
            m(inputs())  # right away: returns once the snapshot is taken
            assert time.perf_counter() - t0 < 30
            if local:
                assert mgr.tier.pool.nbytes == 0  # written from the live tensors
            _train_step(m, opt, inputs)
        mgr.wait()
    monkeypatch.delenv("DCKPT_FAULT", raising=False)
    for s, want in wants.items():
        _check(mgr.path(s), want, m, ("state", "train"))
    if local:
        m2, o2, _ = _build(kind)
        with dckpt.CheckpointManager(str(tmp_path / "r"), **kw) as mgr:
            assert mgr.restore({"train": dckpt.TrainingState(m2, o2)}) == 2
            assert mgr.restored_from == "local"
        for k, v in wants[2].items():
            assert torch.equal(m2.state_dict()[k], v), k


def test_module_hooks_go_once_the_snapshot_is_taken(tmp_path, monkeypatch):
    """Every module of a fenced model gets a hook for the save; each removes itself at
    its first call after the snapshot, so later forwards run with no hook at all."""
    _slow_copy(monkeypatch, 0.2)
    m, opt, inputs = _build("spectral_norm")
    _train_step(m, opt, inputs)
    before = [len(x._forward_pre_hooks) for x in m.modules()]  # spectral_norm's own
    h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, str(tmp_path / "c"),
                         fence=[opt, m])
    assert [len(x._forward_pre_hooks) for x in m.modules()] == [n + 1 for n in before]
    m(inputs())
    assert [len(x._forward_pre_hooks) for x in m.modules()] == before
    assert len(opt._optimizer_step_pre_hooks) == 1  # a check of one event per step
    h.result()
    assert not opt._optimizer_step_pre_hooks


def test_a_compiled_module_is_fenced_at_its_own_call():
    """The inside of a torch.compile'd module is not hooked (its hooks would be traced
    into the graph); the compiled wrapper is, so calling it waits."""
    from dckpt.engine.fence import eager_modules

    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiled = torch.compile(inner, backend="eager")
    root = torch.nn.ModuleDict({"c": compiled, "plain": torch.nn.Linear(4, 4)})
    got = eager_modules(root)
    assert compiled in got and root["plain"] in got and root in got
    assert not any(x is inner or x is inner[0] for x in got)


def test_an_unfenced_write_before_the_copy_fails_the_save(tmp_path, monkeypatch):
    """A saved tensor written in place after the call by something the fence does not
    hold back (not the optimizer, not a forward), before the background copy: the
    copy would hold the new value, so the save fails naming the tensor, on
    result(), and nothing is committed."""
    _slow_copy(monkeypatch, 0.3)
    sd = {"w": torch.randn(1024), "v": torch.randn(1024)}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    h = dckpt.async_save(sd, str(tmp_path / "c"), fence=opt)
    sd["v"].add_(1.0)  # at once, outside the fence
    with pytest.raises(dckpt.CheckpointError, match="'v' changed while its snapshot was taken"):
        h.result()
    with pytest.raises(dckpt.CheckpointError):
        dckpt.load({"w": torch.zeros(1024), "v": torch.zeros(1024)}, str(tmp_path / "c"))


def test_an_unfenced_write_before_the_fast_tier_write_fails_the_save(tmp_path, monkeypatch):
    """The fast tier is written from the live tensors: a parameter changed by hand
    after the call and before the write starts is read consistently by the checksum
    and data passes (the read-back cannot see it), so its version counter is what
    catches it: the save fails on every rank naming the tensor, step 1 stays."""
    import threading

    from dckpt.tiers import local

    m, opt, inputs = _build("spectral_norm")
    _train_step(m, opt, inputs)
    want = _values(m)
    real, gate, go_on = local.write_file, threading.Event(), threading.Event()

    def gated(*a, **kw):  # the background writer, before its first byte
        gate.set()
        go_on.wait(10)
        return real(*a, **kw)

    kw = dict(async_save=True, capture_rng=False, local_root=str(tmp_path / "node"))
    with dckpt.CheckpointManager(str(tmp_path / "r"), **kw) as mgr:
        mgr.save(1, {"train": dckpt.TrainingState(m, opt)}, force=True)
        mgr.wait()
        monkeypatch.setattr(local, "write_file", gated)
        mgr.save(2, {"train": dckpt.TrainingState(m, opt)}, force=True)
        assert gate.wait(10)
        with torch.no_grad():
            m[1].bias.add_(1.0)  # not through the optimizer nor a forward
        go_on.set()
        with pytest.raises(dckpt.CheckpointError,
                           match="'state.train.model.1.bias' changed while the fast tier was written"):
            mgr.wait()
        monkeypatch.setattr(local, "write_file", real)
        assert mgr.steps(tier="local") == [1] and mgr.steps() == [1]
    m2, o2, _ = _build("spectral_norm")
    with dckpt.CheckpointManager(str(tmp_path / "r"), **kw) as mgr:
        assert mgr.restore({"train": dckpt.TrainingState(m2, o2)}) == 1
    for k, v in want.items():
        assert torch.equal(m2.state_dict()[k], v), k
