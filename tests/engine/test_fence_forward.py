"""Forwards that write saved tensors in place (Embedding(max_norm=) renormalises the rows
it looks up; spectral norm's power iteration updates u and v; BatchNorm's running
stats) must not run before a fenced snapshot is taken, whatever the module's class:
the checkpoint holds the values from before the forward, bitwise, through
dckpt.async_save(fence=) and through a manager with async_save=True, with and without a
fast tier, at the first save and at the next ones. The forwards that write nothing
(plain Linear layers) wait only at the first save: from the next one on they overlap
the snapshot, and only the optimizer's step waits. A forward that writes for the first
time fails that save (version check) and waits from the next save on. One process."""
from __future__ import annotations

import threading
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


def _batchnorm() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))


MODELS = {"embedding_max_norm": _embedding, "spectral_norm": _spectral,
          "parametrizations_spectral_norm": _parametrized, "batchnorm": _batchnorm}


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


def _check(path: str, want: dict, m, prefix: tuple = (), changed: bool = True) -> None:
    """The checkpoint at ``path`` holds ``want`` bitwise, and (``changed``) the forward
    after the save did change the model (or the test would prove nothing)."""
    like = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    for p in reversed(prefix):
        like = {p: like}
    got = dckpt.load(like, path, strict=False)
    for p in prefix:
        got = got[p]
    for k, v in want.items():
        assert torch.equal(got["model"][k], v), k
    now = _values(m)
    assert not changed or any(not torch.equal(now[k], v) for k, v in want.items())


def _snapshot_event(mgr, local: bool) -> threading.Event:
    """The event set once the manager's save in flight has taken its snapshot."""
    return (mgr.tier._local_job if local else mgr._inflight[1])._copied


def _gated_copy(monkeypatch) -> threading.Event:
    """Hold the background snapshot copy of a fenced async_save back until the
    returned event is set (cleared by the caller before each save)."""
    gate = threading.Event()
    real = StagingPool.run

    def gated(copies, copy=True, after=None):
        assert gate.wait(30)
        real(copies, copy, after)

    monkeypatch.setattr(StagingPool, "run", staticmethod(gated))
    return gate


def _slow_copy(monkeypatch, seconds: float = 0.4) -> None:
    real = StagingPool.run

    def slow(copies, copy=True, after=None):
        time.sleep(seconds)
        real(copies, copy, after)

    monkeypatch.setattr(StagingPool, "run", staticmethod(slow))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_async_save_fenced_on_the_model_holds_the_values_before_the_forward(
        tmp_path, monkeypatch, kind):
    """fence=[opt, model]: the model's forward waits at the first save (every forward
    waits then), and at the second a forward of the submodule that writes, called
    directly (not through the root's forward), still waits: it is a writer by its
    buffers, or learned at the first save."""
    _slow_copy(monkeypatch)
    m, opt, inputs = _build(kind)
    _train_step(m, opt, inputs)
    first = next(iter(m.children()))
    for i, call in enumerate((lambda: m(inputs()), lambda: first(inputs()))):
        want = _values(m)
        path = str(tmp_path / f"c{i}")
        h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, path, fence=[opt, m])
        call()  # right away: waits for the copy, then writes into saved tensors
        assert h._copied.is_set()  # it waited
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
            assert _snapshot_event(mgr, local).is_set()  # it waited, at either save
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


def _hooks(m) -> list:
    return [(len(x._forward_pre_hooks), len(x._forward_hooks)) for x in m.modules()]


def test_module_hooks_go_once_the_snapshot_is_taken(tmp_path, monkeypatch):
    """Every module of a fenced model gets a pre- and a post-hook for the save (a wait
    and the learning of writers); they remove themselves after the first call that
    starts once the snapshot is taken, so later forwards run with no hook at all. At
    the second save a forward that does not wait keeps them until then."""
    gate = _gated_copy(monkeypatch)
    m, opt, inputs = _build("spectral_norm")
    _train_step(m, opt, inputs)
    before = _hooks(m)  # spectral_norm's own
    armed = [(a + 1, b + 1) for a, b in before]
    for i in range(2):
        gate.clear()
        h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, str(tmp_path / f"c{i}"),
                             fence=[opt, m])
        assert _hooks(m) == armed
        if i == 1:
            m[1](torch.randn(8, 64))  # a plain Linear: no wait, learns nothing
            assert not h._copied.is_set() and _hooks(m) == armed
        threading.Timer(0.2, gate.set).start()
        m(inputs())  # the spectral-norm layer waits
        assert _hooks(m) == before
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


def _plain() -> tuple:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                            torch.nn.Linear(64, 4))
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def _full(m, opt) -> dict:
    """The model's and the optimizer's tensors, cloned."""
    out = {f"m.{k}": v.detach().clone() for k, v in m.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{n}": t.clone() for n, t in st.items()})
    return out


def _restored(path: str, prefix: tuple = ()) -> dict:
    m2, o2 = _plain()
    _train_step(m2, o2, lambda: torch.randn(8, 64))  # Adam's state exists to load into
    like = {"train": dckpt.TrainingState(m2, o2)}
    for p in reversed(prefix):
        like = {p: like}
    dckpt.load(like, path, strict=False)
    return _full(m2, o2)


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("local", [False, True], ids=["async_save", "manager_fast_tier"])
def test_plain_layers_overlap_the_snapshot_from_the_second_save(tmp_path, monkeypatch, local):
    """Linear layers and Adam, fenced on [opt, model] (by hand, or by a manager's fast
    tier written from the live tensors): at the first save the forward waits; from the
    second on the forward returns while the snapshot is still held back (it writes
    nothing saved), the optimizer's step still waits, and every checkpoint holds the
    values at its call, bitwise."""
    from dckpt.tiers import local as local_tier

    gate = threading.Event()
    if local:
        real = local_tier.write_file

        def gated(*a, **kw):  # the background writer, before its first byte
            assert gate.wait(30)
            return real(*a, **kw)

        monkeypatch.setattr(local_tier, "write_file", gated)
    else:
        gate = _gated_copy(monkeypatch)
    m, opt = _plain()
    x = torch.randn(8, 64)
    _train_step(m, opt, lambda: x)
    wants = {}
    kw = dict(async_save=True, capture_rng=False, local_root=str(tmp_path / "node"))
    with dckpt.CheckpointManager(str(tmp_path / "r"), **kw) as mgr:
        for s in (1, 2, 3):
            wants[s] = _full(m, opt)
            gate.clear()
            if local:
                mgr.save(s, {"train": dckpt.TrainingState(m, opt)}, force=True)
                taken = _snapshot_event(mgr, True)
            else:
                h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)},
                                     str(tmp_path / f"c{s}"), fence=[opt, m])
                taken = h._copied
            if s == 1:  # nothing learned yet: every forward waits
                threading.Timer(0.2, gate.set).start()
                opt.zero_grad()
                m(x).sum().backward()
                assert taken.is_set()
            else:
                opt.zero_grad()
                m(x).sum().backward()  # overlaps the held-back snapshot
                assert not taken.is_set()
                threading.Timer(0.3, gate.set).start()
                t0 = time.perf_counter()
            opt.step()  # waits for the snapshot
            assert taken.is_set()
            if s > 1:
                assert time.perf_counter() - t0 >= 0.2
            if not local:
                h.result()
        mgr.wait()
    for s, want in wants.items():
        assert not torch.equal(want["m.0.weight"], m[0].weight)
        if local:
            _same(_restored(mgr.path(s), ("state",)), want)
        else:
            _same(_restored(str(tmp_path / f"c{s}")), want)


class _WritesWhenTold(torch.nn.Module):
    """Writes its parameter in place in its forward once ``writes`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64))
        self.writes = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.writes:
            with torch.no_grad():
                self.w.mul_(0.5)
        return x * self.w


def test_a_forward_writing_for_the_first_time_fails_that_save_and_is_fenced_next(
        tmp_path, monkeypatch):
    """A module that writes nothing at the first save (learned: not a writer), then
    writes its parameter: the second save's forward does not wait, so the write comes
    before the snapshot, and the save fails naming the tensor (nothing committed).
    The write was seen: the third save's forward waits, and it commits the values at
    its call."""
    gate = _gated_copy(monkeypatch)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), _WritesWhenTold())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    for s in (1, 2, 3):
        m[1].writes = s > 1
        want = _values(m)
        gate.clear()
        path = str(tmp_path / f"c{s}")
        h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, path, fence=[opt, m])
        if s == 2:
            m(x)  # not fenced: writes w before the snapshot
            assert not h._copied.is_set()
            gate.set()
            with pytest.raises(dckpt.CheckpointError,
                               match=r"'train\.model\.1\.w' changed while its snapshot was taken"):
                h.result()
            with pytest.raises(dckpt.CheckpointError):
                dckpt.load({"train": {"model": {"1.w": torch.zeros(64)}}}, path, strict=False)
            continue
        threading.Timer(0.2, gate.set).start()
        m(x)  # waits (every forward at the first save; a learned writer at the third)
        assert h._copied.is_set()
        h.result()
        _check(path, want, m, ("train",), changed=s == 3)


class _Parent(torch.nn.Module):
    """Writes its child's parameter outside the child's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.9)
        return self.lin(x)


def test_a_write_outside_its_owners_forward_fences_the_whole_forward(tmp_path, monkeypatch):
    """The child's forward writes nothing, its parent writes the child's parameter: the
    write is its owner's forward's, so the outermost call (the root) is learned at the
    first save, and its whole forward waits at the next ones."""
    gate = _gated_copy(monkeypatch)
    torch.manual_seed(0)
    m = torch.nn.Sequential(_Parent(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    for s in (1, 2, 3):
        want = _values(m)
        gate.clear()
        path = str(tmp_path / f"c{s}")
        h = dckpt.async_save({"train": dckpt.TrainingState(m, opt)}, path, fence=[opt, m])
        threading.Timer(0.2, gate.set).start()
        m(x)
        assert h._copied.is_set()  # it waited
        h.result()
        _check(path, want, m, ("train",))
