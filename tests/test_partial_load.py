"""Partial and renamed loads (issue 29, item 3): ``allow_missing=`` and ``rename=`` in
dckpt.load, CheckpointManager.restore and TrainingState, with strict=False and cast=True;
the pure key mapping of dckpt.protocol.rename, property-tested."""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dckpt
from dckpt.errors import CheckpointError, StateMismatchError
from dckpt.state.flatten import flatten


# ---------------------------------------------------------------- the pure mapping

_parts = st.sampled_from(["module", "_orig_mod", "fc", "0", "1", "weight", "bias", "m", "mo"])
_keys = st.lists(_parts, min_size=1, max_size=4).map(".".join)
_prefix = st.lists(_parts, min_size=0, max_size=2).map(
    lambda p: "".join(x + "." for x in p)) | _keys  # dotted prefixes, and bare ones ("mo")


def _reference(table: dict[str, str], key: str) -> str:
    """Longest matching prefix wins; no match: unchanged."""
    best = max((p for p in table if key.startswith(p)), key=len, default=None)
    return key if best is None else table[best] + key[len(best):]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_prefix, _prefix, max_size=4), st.lists(_keys, max_size=12, unique=True))
def test_prefix_table_is_longest_prefix_wins(table, keys):
    from dckpt.protocol.rename import map_keys, resolve

    fn = resolve(table) or (lambda k: k)  # None: no renaming (an empty table)
    want = {k: _reference(table, k) for k in keys}
    assert all(fn(k) == want[k] for k in keys)
    by_ck: dict[str, list[str]] = {}
    for k, ck in want.items():
        by_ck.setdefault(ck, []).append(k)
    clashes = [v for v in by_ck.values() if len(v) > 1]
    if clashes:
        with pytest.raises(CheckpointError) as e:
            map_keys(keys, fn)
        # names two target keys that clash, and the checkpoint key they share
        assert any(all(repr(k) in str(e.value) for k in v[:2]) for v in clashes), str(e.value)
    else:
        assert map_keys(keys, fn) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(_keys, max_size=12, unique=True), _prefix, _prefix)
def test_prefix_table_round_trips_and_nests(keys, outer, p):
    from dckpt.protocol.rename import nested, resolve

    # {"module.": ""} undoes {"": "module."}
    add, strip = resolve({"": "module."}), resolve({"module.": ""})
    assert all(strip(add(k)) == k for k in keys)
    assert resolve(None) is None and resolve({}) is None
    # nested(prefix, r) renames only under prefix, relative to it
    fn = nested("state.", {p: "x."})
    for k in keys:
        assert fn("rng." + k) == "rng." + k
        assert fn("state." + k) == "state." + _reference({p: "x."}, k)
    assert nested("state.", None) is None


def test_bad_renames_are_named():
    from dckpt.protocol.rename import map_keys, resolve

    with pytest.raises(CheckpointError, match="rename"):
        resolve({"a.": 3})
    with pytest.raises(CheckpointError, match="rename"):
        resolve(42)
    with pytest.raises(CheckpointError, match="'a'.*int"):
        map_keys(["a"], resolve(lambda k: 7))
    with pytest.raises(CheckpointError, match="'a'.*boom"):
        map_keys(["a"], resolve(lambda k: (_ for _ in ()).throw(ValueError("boom"))))


# ---------------------------------------------------------------- dckpt.load

def _model(seed: int, new_layer: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4)]
    if new_layer:
        layers += [torch.nn.Tanh(), torch.nn.Linear(4, 3)]
    return torch.nn.Sequential(*layers)


def test_ddp_module_prefix_both_ways(tmp_path):
    # rename maps target keys to checkpoint keys
    src = _model(0)
    ddp = torch.nn.Module()
    ddp.module = _model(1)  # a DDP-wrapped model's keys, without a process group
    assert all(k.startswith("module.") for k in ddp.state_dict())
    dckpt.save(src.state_dict(), str(tmp_path / "plain"))
    # a plain checkpoint into DDP-style keys: "module.0.weight" reads "0.weight"
    dckpt.load(ddp.state_dict(), str(tmp_path / "plain"), rename={"module.": ""})
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                 ddp.state_dict().values()))
    # the reverse: a DDP-saved checkpoint into an unwrapped model: "0.weight" reads
    # "module.0.weight"
    torch.nn.init.zeros_(ddp.module[0].weight)
    dckpt.save(ddp.state_dict(), str(tmp_path / "ddp"))
    dst = _model(2)
    dckpt.load(dst.state_dict(), str(tmp_path / "ddp"), rename={"": "module."})
    assert all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(),
                                                 dst.state_dict().values()))
    assert torch.equal(dst[0].weight, torch.zeros(5, 6))
    # without the rename: today's error, naming what the checkpoint lacks
    with pytest.raises(StateMismatchError, match="lacks 4 key"):
        dckpt.load(dst.state_dict(), str(tmp_path / "ddp"))


def test_torch_compile_prefix_through_a_callable(tmp_path):
    src = _model(0)
    compiled = torch.compile(_model(1))  # not run: only its state_dict's keys matter
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    dckpt.save({"model": compiled.state_dict()}, str(tmp_path / "c"))
    sd = {"model": src.state_dict()}
    dckpt.load(sd, str(tmp_path / "c"), rename=lambda k: k.replace("model.", "model._orig_mod.", 1))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                 compiled.state_dict().values()))


def test_rename_collision_names_both_keys(tmp_path):
    dckpt.save({"x": torch.ones(2)}, str(tmp_path / "c"))
    target = {"a": {"x": torch.zeros(2)}, "b": {"x": torch.zeros(2)}}
    with pytest.raises(CheckpointError) as e:
        dckpt.load(target, str(tmp_path / "c"), rename={"a.": "", "b.": ""})
    assert "'a.x'" in str(e.value) and "'b.x'" in str(e.value) and "'x'" in str(e.value)
    assert torch.equal(target["a"]["x"], torch.zeros(2)), "nothing touched"


def test_allow_missing_leaves_tensors_and_values_untouched(tmp_path, caplog):
    dckpt.save({"w": torch.arange(4.0), "n": 3, "old": {"s": "x"}}, str(tmp_path / "c"))
    target = {"w": torch.zeros(4), "n": 0, "old": {"s": ""},
              "new": torch.full((2,), 7.0), "extra": {"i": 5, "k": [1, 2]}}
    # the default: today's error, naming the missing keys
    with pytest.raises(StateMismatchError, match=r"the checkpoint lacks 4 key\(s\) of the "
                       r"state_dict: 'new', 'extra.i', 'extra.k.0', 'extra.k.1'"):
        dckpt.load(target, str(tmp_path / "c"))
    target["w"].zero_()
    with caplog.at_level(logging.WARNING, logger="dckpt.protocol.restore"):
        dckpt.load(target, str(tmp_path / "c"), allow_missing=True)
    assert torch.equal(target["w"], torch.arange(4.0)) and target["n"] == 3
    assert target["old"] == {"s": "x"}
    assert torch.equal(target["new"], torch.full((2,), 7.0))
    assert target["extra"] == {"i": 5, "k": [1, 2]}
    warned = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    assert len(warned) == 1 and "4 key(s)" in warned[0] and "'new'" in warned[0], warned


def test_strict_rename_and_cast_together(tmp_path):
    saved = {"module.a": torch.randn(3, 2), "module.b": torch.randn(4), "module.n": 9,
             "module.extra": torch.ones(1)}
    dckpt.save(saved, str(tmp_path / "c"))
    target = {"a": torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.zeros(4), "n": 0}
    # the unexpected keys are computed on the renamed keys: only module.extra is extra
    with pytest.raises(StateMismatchError) as e:
        dckpt.load(target, str(tmp_path / "c"), rename={"": "module."}, cast=True)
    assert "1 key(s) the state_dict lacks: 'module.extra'" in str(e.value), str(e.value)
    target["new"] = torch.full((2,), 5.0)
    dckpt.load(target, str(tmp_path / "c"), rename={"": "module."}, cast=True, strict=False,
               allow_missing=True)
    assert torch.equal(target["a"], saved["module.a"].to(torch.bfloat16))
    assert torch.equal(target["b"], saved["module.b"]) and target["n"] == 9
    assert torch.equal(target["new"], torch.full((2,), 5.0))
    # without cast, the dtype error names the key as the state_dict has it
    with pytest.raises(StateMismatchError, match="'a'.*module.a.*cast=True"):
        dckpt.load(target, str(tmp_path / "c"), rename={"": "module."}, strict=False)


def test_needed_chunks_plans_with_the_rename(tmp_path):
    from dckpt.protocol.restore import needed_chunks, read_manifest
    from dckpt.storage.fsspec_storage import make_storage

    dckpt.save({"module.a": torch.randn(3), "module.b": torch.randn(2)}, str(tmp_path / "c"))
    m = read_manifest(*make_storage(str(tmp_path / "c"), None))[0]
    target = {"a": torch.zeros(3), "new": torch.zeros(1)}
    with pytest.raises(StateMismatchError, match="lacks"):
        needed_chunks(target, m, rename={"": "module."})
    got = needed_chunks(target, m, rename={"": "module."}, allow_missing=True)
    assert {k for v in got.values() for k, _ in v} == {"module.a"}


def test_fresh_plain_optimizer_grows_under_a_rename_and_only_what_was_saved(tmp_path):
    old = _model(0)
    opt = torch.optim.AdamW(old.parameters(), lr=1e-2)
    _train(old, opt, 2)
    dckpt.save({"opt": opt.state_dict()}, str(tmp_path / "c"))  # int keys: param ids
    new = _model(0, new_layer=True)
    fresh = torch.optim.AdamW(new.parameters(), lr=1e-2)
    sd = {"o": fresh.state_dict()}
    assert sd["o"]["state"] == {}  # never stepped: grown from the checkpoint
    dckpt.load(sd, str(tmp_path / "c"), rename={"o.": "opt."}, allow_missing=True)
    assert sorted(sd["o"]["state"]) == [0, 1, 2, 3], "no entries for the new layer's params"
    assert sd["o"]["param_groups"][0]["params"] == [0, 1, 2, 3, 4, 5]
    fresh.load_state_dict(sd["o"])
    for i, (p, q) in enumerate(zip(old.parameters(), new.parameters())):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][name], fresh.state[q][name]), (i, name)
    assert new[4].weight not in fresh.state
    _train(new, fresh, 1)


# ---------------------------------------------------------------- TrainingState + manager

def _train(model, opt, steps: int) -> float:
    loss = torch.tensor(0.0)
    for s in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _snapshot(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        flatten_optimizer_state_dict=True))
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in {**{f"model.{k}": v for k, v in msd.items()},
                         **{f"optim.{k}": v for k, v in osd.items()}}.items()}


def _equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("stepped", [True, False])
def test_new_layer_and_adamw_through_the_manager(tmp_path, caplog, stepped):
    old = _model(0)
    opt = torch.optim.AdamW(old.parameters(), lr=1e-2, weight_decay=0.1)
    _train(old, opt, 3)
    saved = _snapshot(old, opt)
    with dckpt.CheckpointManager(str(tmp_path), every_steps=1) as mgr:
        mgr.save(3, dckpt.TrainingState(old, opt), force=True)

    new = _model(5, new_layer=True)
    nopt = torch.optim.AdamW(new.parameters(), lr=1e-2, weight_decay=0.1)
    if stepped:  # the new model trained a little on its own: its state must survive
        _train(new, nopt, 2)
    ts = dckpt.TrainingState(new, nopt)
    mgr = dckpt.CheckpointManager(str(tmp_path), every_steps=1)
    with pytest.raises(CheckpointError, match="lacks"):
        mgr.restore(ts)
    before = _snapshot(new, nopt)  # (a fresh optimizer: as TrainingState initialises it)
    fresh = {k for k in before if ".4." in k}
    assert fresh and all(".4." not in k for k in saved)
    with caplog.at_level(logging.WARNING, logger="dckpt.protocol.restore"):
        assert mgr.restore(ts, allow_missing=True) == 3
    after = _snapshot(new, nopt)
    assert after.keys() == before.keys()
    for k in after:
        want = before[k] if k in fresh else saved[k]
        assert _equal(after[k], want), k
    assert any(k.endswith(".4.weight.exp_avg_sq") for k in fresh)
    if stepped:
        assert not torch.equal(after["optim.state.4.weight.exp_avg"], torch.zeros(3, 4))
    warned = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    flat = flatten(ts.state_dict())  # betas: one key per element
    lacking = [k for k in (*flat.tensors, *flat.values) if ".4." in k]
    assert len(warned) == 1 and f"lacks {len(lacking)} key(s)" in warned[0], warned
    assert "state.model.4.weight" in warned[0] or "model.4.weight" in warned[0]
    loss = _train(new, nopt, 3)  # training goes on
    assert loss == loss
    assert not torch.equal(new[0].weight, saved["model.0.weight"])
    assert nopt.state[new[4].weight]["step"].item() == (
        before["optim.state.4.weight.step"].item() + 3)
    mgr.close()


def test_manager_rename_is_relative_to_the_state(tmp_path):
    src = _model(0)
    with dckpt.CheckpointManager(str(tmp_path), every_steps=1) as mgr:  # with RNG capture
        mgr.save(1, {"net": {f"module.{k}": v for k, v in src.state_dict().items()}, "it": 4},
                 force=True)
    dst = _model(1)
    state = {"net": dst.state_dict(), "it": 0}
    with dckpt.CheckpointManager(str(tmp_path), every_steps=1) as mgr:
        assert mgr.restore(state, rename={"net.": "net.module."}) == 1
        assert state["it"] == 4
        assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                     dst.state_dict().values()))
        # a callable sees the state's own keys too; "rng."/"manager." are never renamed
        seen: list[str] = []

        def fn(k: str) -> str:
            seen.append(k)
            return k.replace("net.", "net.module.", 1)

        assert mgr.restore(state, step=1, rename=fn) == 1
        assert seen and all(k.startswith(("net.", "it")) for k in seen), seen
        # the read plan of a restore from peers (_needs) matches with the same rename
        # and allow_missing as the restore's loads
        from dckpt.protocol.restore import read_manifest
        from dckpt.storage.fsspec_storage import make_storage

        m = read_manifest(*make_storage(mgr.path(1), None))[0]
        state["net"]["added"] = torch.zeros(2)
        mgr.restore(state, rename={"net.": "net.module."}, allow_missing=True)
        keys = {k for v in mgr._needs(state, m).values() for k, _ in v
                if not k.startswith("rng.")}
        assert keys == {f"state.net.module.{k}" for k in src.state_dict()}, keys
        assert torch.equal(state["net"]["added"], torch.zeros(2))
