"""Adversarial scenarios for dckpt's DeepSpeed adapter (2 gloo CPU ranks unless the
test says otherwise): ``python -m torch.distributed.run ... deepspeed_review_job.py
ROOT SCENARIO...``. Prints ``CASE <scenario> rank <r> OK|FAIL <why>`` per scenario.
Engines come from jobs/deepspeed_job.py (which patches DeepSpeed's shm op build)."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import deepspeed_job as dj  # noqa: E402
import torch  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import dckpt  # noqa: E402
from dckpt.errors import CheckpointError  # noqa: E402
from dckpt.integrations import deepspeed as dds  # noqa: E402

say = dj.say


def _build(model_fn, cfg: dict, groups_fn=None, optimizer_fn=None):
    """An attached engine of ``model_fn()`` under ``cfg`` (ZeRO-3: built under
    zero.Init); ``groups_fn(model)`` the param groups (default: the trainable
    parameters), ``optimizer_fn(params)`` a client optimizer (default: cfg's)."""
    torch.manual_seed(0)
    if cfg["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            m = model_fn()
    else:
        m = model_fn()
    params = groups_fn(m) if groups_fn else [p for p in m.parameters() if p.requires_grad]
    kw = {}
    if optimizer_fn is not None:
        kw["optimizer"] = optimizer_fn(params)
    eng, *_ = dds.initialize(model=m, model_parameters=params, config=cfg, **kw)
    return eng


def _cfg(stage: int, **zero) -> dict:
    cfg = dj.config(dj.parse(f"z{stage}-fp32"))
    cfg["zero_optimization"].update(zero)
    return cfg


def _train(eng, n: int, dt=torch.float32, start: int = 0) -> list:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5, generator=g).to(dt) for _ in range(start + n)]
    return [dj.step(eng, x) for x in xs[start:]]


def _full(eng) -> dict:
    """name -> [master] + every optimizer state (full; collective)."""
    out = {}
    stage = eng.zero_optimization_stage()
    for n, p in eng.module.named_parameters():
        if not p.requires_grad or int(getattr(p, "ds_numel", p.numel())) == 0:
            continue
        if stage == 0:
            st = eng.optimizer.state.get(p, {})
            out[n] = [p.detach().float().clone()] + [
                st[k].clone() for k in sorted(st) if k != "step" and st[k] is not None]
        else:
            got = safe_get_full_fp32_param(p)
            if got is not None:
                out[n] = [got.clone()]
    return out


def _same(a: dict, b: dict) -> list[str]:
    return [n for n in a for i in range(len(a[n]))
            if n not in b or i >= len(b[n]) or not torch.equal(a[n][i], b[n][i])]


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _rank() -> int:
    return torch.distributed.get_rank()


# -- scenarios: each returns None (as it should be) or why not -------------------------

def sgd_momentum(root, r):
    """A client torch SGD with momentum (no ``step`` in its state) at ZeRO-2 and stage 0:
    saved after 2 steps, loaded by a fresh engine: momentum buffers restored exactly."""
    problems = []
    for stage in (2, 0):
        cfg = _cfg(stage)
        cfg.pop("optimizer")
        cfg["zero_allow_untested_optimizer"] = True
        mk = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
        eng = _build(lambda: dj.Net(False, False), cfg, optimizer_fn=mk)
        _train(eng, 2)
        d = os.path.join(root, f"z{stage}")
        eng.save_checkpoint(d, tag="t")
        inner = eng.optimizer if stage == 0 else eng.optimizer.optimizer
        want = {i: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                for i, s in enumerate(inner.state.values())}
        fresh = _build(lambda: dj.Net(False, False), cfg, optimizer_fn=mk)
        e = _raised(lambda: fresh.load_checkpoint(d, tag="t"))
        if e is not None:
            problems.append(f"stage {stage}: load raised {type(e).__name__}: {str(e)[:200]}")
            continue
        inner = fresh.optimizer if stage == 0 else fresh.optimizer.optimizer
        got = {i: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)}
               for i, s in enumerate(inner.state.values())}
        if len(got) != len(want) or any(
                set(got[i]) != set(want[i]) or any(not torch.equal(got[i][k], want[i][k])
                                                   for k in want[i]) for i in want):
            problems.append(f"stage {stage}: momentum state not restored "
                            f"({[sorted(s) for s in got.values()]})")
    return "; ".join(problems) or None


class Unused(torch.nn.Module):
    """A parameter that never gets a gradient (an unused head, a pooler)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 5)
        self.unused = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.a(x)


def unused_param_stage0(root, r):
    """Stage 0 fp32 with a parameter that never gets a gradient: a save after 2 steps
    must load back (into a fresh engine)."""
    cfg = _cfg(0)
    eng = _build(Unused, cfg)
    _train(eng, 2)
    eng.save_checkpoint(root, tag="t")
    ref = _full(eng)
    fresh = _build(Unused, cfg)
    e = _raised(lambda: fresh.load_checkpoint(root, tag="t"))
    if e is not None:
        return f"the load raised {type(e).__name__}: {str(e)[:300]}"
    bad = _same(ref, _full(fresh))
    return f"differ {bad}" if bad else None


class Sometimes(torch.nn.Module):
    """A branch used on every other step only (its parameter's Adam step lags)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 5)
        self.extra = torch.nn.Linear(5, 5)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        return self.extra(h) if self.calls % 2 else h


def sometimes_param_stage0(root, r):
    """Stage 0 fp32, a parameter that gets a gradient on every other step only (torch
    Adam keeps a lower step for it): the save must succeed and load back exactly."""
    cfg = _cfg(0)
    eng = _build(Sometimes, cfg)
    _train(eng, 3)
    ref = _full(eng)
    e = _raised(lambda: eng.save_checkpoint(root, tag="t"))
    if e is not None:
        return f"the save raised {type(e).__name__}: {str(e)[:300]}"
    fresh = _build(Sometimes, cfg)
    e = _raised(lambda: fresh.load_checkpoint(root, tag="t"))
    if e is not None:
        return f"the load raised {type(e).__name__}: {str(e)[:300]}"
    bad = _same(ref, _full(fresh))
    steps = sorted(float(s["step"]) for s in fresh.optimizer.state.values())
    want = sorted(float(s["step"]) for s in eng.optimizer.state.values())
    return (f"differ {bad}" if bad else None) or (f"steps {steps} != {want}" if steps != want
                                                  else None)


def _two_groups(m):
    decay = [p for n, p in m.named_parameters() if p.requires_grad and n.endswith("weight")]
    no = [p for n, p in m.named_parameters() if p.requires_grad and not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no, "weight_decay": 0.0}]


def regrouped(root, r):
    """Saved with one param group (weight_decay 0.01), loaded into an engine whose
    parameters are in two groups (weights decay 0.1, biases 0.0: another grouping):
    a clear CheckpointError naming the grouping, not a raw error or silently mixed
    hyper-parameters."""
    cfg = _cfg(2)
    eng = _build(lambda: dj.Net(False, False), cfg)
    _train(eng, 2)
    eng.save_checkpoint(root, tag="one")
    two = _build(lambda: dj.Net(False, False), cfg, groups_fn=_two_groups)
    e = _raised(lambda: two.load_checkpoint(root, tag="one"))
    if e is None:
        wds = [g["weight_decay"] for g in two.optimizer.optimizer.param_groups]
        return f"loaded silently; the groups' weight_decay is now {wds} (was [0.1, 0.0])"
    if not isinstance(e, CheckpointError) or _raw(e):
        return f"not a clear error: {type(e).__name__}: {str(e)[:300]}"
    return None


def _raw(e: BaseException) -> bool:
    """Whether ``e`` is (or wraps, as RankFailure does) a raw Python error."""
    return isinstance(e, (KeyError, TypeError, IndexError, AttributeError, ValueError)) or any(
        f"{n}:" in str(e) for n in ("KeyError", "TypeError", "IndexError", "AttributeError",
                                    "ValueError"))


def two_groups_resize_save(root, r):
    """Two param groups (weight decay 0.1 and 0.0, the second lr-scaled): saved at
    2 ranks for the 3-rank load below."""
    cfg = _cfg(2)
    eng = _build(lambda: dj.Net(False, False), cfg, groups_fn=_two_groups)
    _train(eng, 3)
    eng.save_checkpoint(root, tag="g")
    hyper = [{k: v for k, v in g.items() if k != "params"}
             for g in eng.optimizer.optimizer.param_groups]
    full = _full(eng)  # collective
    if r == 0:
        torch.save({"full": full, "hyper": hyper}, os.path.join(root, "ref.pt"))
    return None


def two_groups_resize_load(root, r):
    """The two-group tag loaded at another size into ZeRO-3 and ZeRO-1: every master,
    each group's hyper-parameters and its step as saved."""
    ref = torch.load(os.path.join(os.path.dirname(root), "two_groups_resize_save", "ref.pt"),
                     weights_only=False)
    problems = []
    for stage in (3, 1):
        eng = _build(lambda: dj.Net(False, False), _cfg(stage), groups_fn=_two_groups)
        eng.load_checkpoint(os.path.join(os.path.dirname(root), "two_groups_resize_save"), tag="g")
        bad = _same(ref["full"], _full(eng))
        hyper = [{k: v for k, v in g.items() if k != "params"}
                 for g in eng.optimizer.optimizer.param_groups]
        if bad:
            problems.append(f"z{stage} differ {bad}")
        if hyper != ref["hyper"]:
            problems.append(f"z{stage} hyper {hyper} != {ref['hyper']}")
        steps = sorted({float(s["step"]) for s in eng.optimizer.optimizer.state.values()})
        if steps != [3.0]:
            problems.append(f"z{stage} steps {steps}")
    return "; ".join(problems) or None


class Freezable(torch.nn.Module):
    def __init__(self, freeze: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3)
        if freeze:
            self.b.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def trained_then_frozen(root, r):
    """Saved with every parameter trained; loaded into the same model with layer b
    frozen (fine-tuning after pre-training; stock's module state dict loads it): b's
    weights are the saved masters, the load does not refuse them as "not saved"."""
    problems = []
    for stage in (2, 3):
        d = os.path.join(root, f"z{stage}")
        eng = _build(lambda: Freezable(False), _cfg(stage))
        _train(eng, 4)  # WarmupLR: the first steps barely move the weights
        eng.save_checkpoint(d, tag="t")
        ref = _full(eng)
        frozen = _build(lambda: Freezable(True), _cfg(stage))
        e = _raised(lambda: frozen.load_checkpoint(d, tag="t"))
        if e is not None:
            problems.append(f"z{stage} strict load raised {type(e).__name__}: {str(e)[:160]}")
            frozen = _build(lambda: Freezable(True), _cfg(stage))
            frozen.load_checkpoint(d, tag="t", load_module_strict=False)
        for n in ("b.weight", "b.bias"):
            p = dict(frozen.module.named_parameters())[n]
            if stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    got = p.detach().clone()
            else:
                got = p.detach().clone()
            if not torch.equal(got.float(), ref[n][0].view_as(got)):
                problems.append(f"z{stage} {n} not the saved value (the load left it as "
                                "initialised)")
    return "; ".join(problems) or None


class Shaped(torch.nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(rows, cols))
        self.k = torch.nn.Parameter(torch.randn(rows, cols), requires_grad=False)

    def forward(self, x):
        h = (x.float() @ torch.ones(5, 6)) @ self.w.reshape(6, 4)
        return h @ self.k.reshape(4, 6)


def other_shapes(root, r):
    """A model with the same names and numels but transposed shapes ([6, 4] saved, [4, 6]
    here; a trainable and a frozen parameter): a StateMismatchError naming them (stock's
    load_state_dict refuses a size mismatch), not a silent load of scrambled values."""
    problems = []
    for stage in (2, 0):
        d = os.path.join(root, f"z{stage}")
        eng = _build(lambda: Shaped(6, 4), _cfg(stage))
        _train(eng, 1)
        eng.save_checkpoint(d, tag="t")
        other = _build(lambda: Shaped(4, 6), _cfg(stage))
        e = _raised(lambda: other.load_checkpoint(d, tag="t"))
        if e is None:
            problems.append(f"z{stage}: loaded [6, 4] into [4, 6] silently")
        elif not (isinstance(e, CheckpointError) and "w" in str(e)):
            problems.append(f"z{stage}: {type(e).__name__}: {str(e)[:200]}")
    return "; ".join(problems) or None


class ZeroSize(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 5)
        self.empty = torch.nn.Parameter(torch.zeros(0, 5))

    def forward(self, x):
        return self.a(x) + self.empty.sum()


def zero_size_param(root, r):
    """A zero-size trainable parameter (an empty prefix embedding): saved at ZeRO-2 and
    stage 0 (ZeRO-3 itself cannot train one), each tag loaded at every other stage
    (ZeRO-3 included), masters equal."""
    problems = []
    refs = {}
    for stage in (2, 0):
        d = os.path.join(root, f"z{stage}")
        eng = _build(ZeroSize, _cfg(stage))
        _train(eng, 2)
        e = _raised(lambda: eng.save_checkpoint(d, tag="t"))
        if e is not None:
            problems.append(f"z{stage} save raised {type(e).__name__}: {str(e)[:160]}")
            continue
        refs[stage] = {"a.weight": _full(eng)["a.weight"][:1]}
    for src in refs:
        for dst in (2, 0, 3):
            if dst == src:
                continue
            eng = _build(ZeroSize, _cfg(dst))
            e = _raised(lambda: eng.load_checkpoint(os.path.join(root, f"z{src}"), tag="t"))
            if e is not None:
                problems.append(f"z{src}->z{dst} raised {type(e).__name__}: {str(e)[:160]}")
                continue
            got = {"a.weight": _full(eng)["a.weight"][:1]}
            if _same(refs[src], got):
                problems.append(f"z{src}->z{dst} differ")
    return "; ".join(problems) or None


def keep_last_other_checkpoints(root, r):
    """keep_last=2 while the same folder holds another dckpt checkpoint the user saved
    there (``dckpt.save(..., save_dir/"best")``, say the best weights): the rotation
    removes only DeepSpeed tags of this engine, never that checkpoint."""
    eng = _build(lambda: dj.Net(False, False), _cfg(1))
    eng.dckpt.keep_last = 2
    dckpt.save({"best": torch.arange(4.0)}, os.path.join(root, "best"))
    for _ in range(3):
        _train(eng, 1)
        eng.save_checkpoint(root)
    torch.distributed.barrier()
    return None if os.path.isdir(os.path.join(root, "best")) else \
        f"keep_last removed {root}/best (left {sorted(os.listdir(root))})"


def keep_last_spares_latest(root, r):
    """global_step1 saved (latest names it), then evaluation snapshots saved with
    save_latest=False under keep_last=2: the tag ``latest`` names is never removed
    (stock tools and a stock load follow ``latest``), and load_checkpoint(tag=None)
    resumes what ``latest`` names, not an evaluation snapshot saved with
    save_latest=False."""
    eng = _build(lambda: dj.Net(False, False), _cfg(1))
    eng.dckpt.keep_last = 2
    _train(eng, 1)
    eng.save_checkpoint(root)
    ref = _full(eng)
    problems = []
    for i in range(2):
        _train(eng, 1, start=1 + i)
        eng.save_checkpoint(root, tag=f"eval{i}", save_latest=False)
    torch.distributed.barrier()
    latest = open(os.path.join(root, "latest")).read()
    if not os.path.isdir(os.path.join(root, latest)):
        problems.append(f"keep_last removed {latest!r}, the tag latest names "
                        f"(left {sorted(os.listdir(root))})")
    fresh = _build(lambda: dj.Net(False, False), _cfg(1))
    path, _ = fresh.load_checkpoint(root)
    if path is None or os.path.basename(path) != latest:
        problems.append(f"tag=None loaded {path}, latest names {latest!r}")
    return "; ".join(problems) or None


def hostile_tags(root, r):
    """Tags that cannot be folder names (300 characters, a NUL): a
    CheckpointError naming the tag on every rank, never a raw OSError / ValueError."""
    eng = _build(lambda: dj.Net(False, False), _cfg(1))
    problems = []
    for tag in ("x" * 300, "a\x00b"):
        e = _raised(lambda: eng.save_checkpoint(root, tag=tag))
        if e is None:
            problems.append(f"tag {tag[:12]!r}: saved")
        elif not isinstance(e, CheckpointError) or _raw(e):
            problems.append(f"tag {tag[:12]!r}: {type(e).__name__}: {str(e)[:160]}")
    return "; ".join(problems) or None


def damaged_meta(root, r):
    """A manifest whose deepspeed.meta record was edited (hand-made or damaged, then
    re-sealed so its checksum matches): a CheckpointError naming the record, never a raw
    KeyError / TypeError (wrapped or not)."""
    import json

    from dckpt.format import sealed

    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    _train(eng, 1)
    problems = []
    edits = {"no_params": lambda m: m.pop("params"),
             "steps_str": lambda m: m.__setitem__("steps", "x"),
             "groups_int": lambda m: m.__setitem__("groups", 3),
             "counter_str": lambda m: m.__setitem__("global_steps", "many"),
             "state_keys_none": lambda m: m.__setitem__("state_keys", None)}
    for name, edit in edits.items():
        d = os.path.join(root, name)
        eng.save_checkpoint(d, tag="t")
        torch.distributed.barrier()
        if r == 0:
            mp = os.path.join(d, "t", "manifest.json")
            raw = open(mp, "rb").read()
            doc = json.loads(raw)
            meta = json.loads(doc["values"]["deepspeed.meta"])
            edit(meta)
            doc["values"]["deepspeed.meta"] = json.dumps(meta)
            open(mp, "wb").write(sealed.seal(doc))
        torch.distributed.barrier()
        fresh = _build(lambda: dj.Net(False, False), _cfg(2))
        e = _raised(lambda: fresh.load_checkpoint(d, tag="t"))
        if e is None:
            problems.append(f"{name}: loaded")
        elif not isinstance(e, CheckpointError) or _raw(e):
            problems.append(f"{name}: {type(e).__name__}: {str(e)[-160:]}")
    return "; ".join(problems) or None


def client_per_rank_z3(root, r):
    """ZeRO-3: each rank saves its own client_state tensor (its data shard position),
    as stock ZeRO-3 stores one model-states file per rank: each rank gets its own back,
    or the save refuses the disagreement; never rank 0's value on every rank."""
    problems = []
    for stage in (3, 2):
        eng = _build(lambda: dj.Net(False, False), _cfg(stage))
        _train(eng, 1)
        d = os.path.join(root, f"z{stage}")
        e = _raised(lambda: eng.save_checkpoint(d, tag="t",
                                                client_state={"pos": torch.tensor([10 + r])}))
        if e is not None:
            if not isinstance(e, CheckpointError):
                problems.append(f"z{stage}: {type(e).__name__}: {e}")
            continue
        fresh = _build(lambda: dj.Net(False, False), _cfg(stage))
        _, cs = fresh.load_checkpoint(d, tag="t")
        got = int(cs["pos"][0])
        # ZeRO-3: stock gives each rank its own; ZeRO-1/2: rank 0's (its only file)
        ok = (10 + r,) if stage == 3 else (10 + r, 10)
        if got not in ok:
            problems.append(f"z{stage}: rank {r} got pos {got}, saved {10 + r}")
    return "; ".join(problems) or None


def rewind_clock_behind(root, r):
    """global_step1..3 saved; global_step1 loaded (a rewind), training goes on on a host
    whose clock is an hour behind, global_step2 saved again with other state: tag=None
    then loads the new global_step2 (the run's newest), exactly."""
    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    for i in range(3):
        _train(eng, 1, start=i)
        eng.save_checkpoint(root)
    back = _build(lambda: dj.Net(False, False), _cfg(2))
    back.load_checkpoint(root, tag="global_step1")
    real = time.time
    time.time = lambda: real() - 3600.0
    try:
        _train(back, 1, start=5)  # another batch: another branch
        back.save_checkpoint(root)
        ref = _full(back)
        fresh = _build(lambda: dj.Net(False, False), _cfg(2))
        path, _ = fresh.load_checkpoint(root)
    finally:
        time.time = real
    if os.path.basename(path) != "global_step2":
        return f"tag=None loaded {path}"
    bad = _same(ref, _full(fresh))
    return f"global_step2 is not the re-saved one: differ {bad}" if bad else None


def zero3_knobs(root, r):
    """ZeRO-3 with several sub-groups per param group (sub_group_size 16), with
    stage3_param_persistence_threshold 0 and 10**6, AdamW, 2 param groups: saved at 2
    ranks for the 3-rank and ZeRO-2 loads (zero3_knobs_load)."""
    for thr in (0, 10 ** 6):
        cfg = _cfg(3, sub_group_size=16, stage3_param_persistence_threshold=thr)
        eng = _build(lambda: dj.Net(True, False), cfg, groups_fn=_two_groups)
        _train(eng, 3)
        d = os.path.join(root, f"t{thr}")
        eng.save_checkpoint(d, tag="t")
        full = _full(eng)
        if r == 0:
            torch.save(full, os.path.join(d, "ref.pt"))
        torch.distributed.barrier()
    return None


def zero3_knobs_load(root, r):
    src = os.path.join(os.path.dirname(root), "zero3_knobs")
    problems = []
    for thr in (0, 10 ** 6):
        ref = torch.load(os.path.join(src, f"t{thr}", "ref.pt"), weights_only=False)
        for stage, knobs in ((3, dict(sub_group_size=7, stage3_param_persistence_threshold=thr)),
                             (2, {})):
            eng = _build(lambda: dj.Net(True, False), _cfg(stage, **knobs),
                         groups_fn=_two_groups)
            eng.load_checkpoint(os.path.join(src, f"t{thr}"), tag="t")
            bad = _same(ref, _full(eng))
            if bad:
                problems.append(f"thr {thr} -> z{stage}: differ {bad}")
            _train(eng, 1, start=3)
    return "; ".join(problems) or None


def offload_optimizer(root, r):
    """offload_optimizer to the CPU (torch Adam, zero_force_ds_cpu_optimizer false) at
    ZeRO-2 and ZeRO-3: the round trip is exact and a load at ZeRO-1 without offload
    too."""
    problems = []
    for stage in (2, 3):
        cfg = _cfg(stage, offload_optimizer={"device": "cpu"})
        cfg["zero_force_ds_cpu_optimizer"] = False
        d = os.path.join(root, f"z{stage}")
        e = _raised(lambda: _build(lambda: dj.Net(False, False), cfg))
        if e is not None:
            problems.append(f"z{stage} attach/initialize raised {type(e).__name__}: {e}")
            continue
        eng = _build(lambda: dj.Net(False, False), cfg)
        _train(eng, 3)
        eng.save_checkpoint(d, tag="t")
        ref = _full(eng)
        for cf in (cfg, _cfg(1)):
            fresh = _build(lambda: dj.Net(False, False), cf)
            fresh.load_checkpoint(d, tag="t")
            bad = _same(ref, _full(fresh))
            if bad:
                problems.append(f"z{stage} -> {cf['zero_optimization']}: differ {bad}")
    return "; ".join(problems) or None


def adagrad(root, r):
    """A client torch Adagrad (its state made eagerly, step per parameter) at stages
    0-3: saved after 2 steps, loaded by a fresh engine of the same stage: the sums and
    steps as saved."""
    problems = []
    for stage in (0, 1, 2, 3):
        cfg = _cfg(stage)
        cfg.pop("optimizer")
        cfg["zero_allow_untested_optimizer"] = True
        mk = lambda ps: torch.optim.Adagrad(ps, lr=0.05)  # noqa: E731
        d = os.path.join(root, f"z{stage}")
        try:
            eng = _build(lambda: dj.Net(False, False), cfg, optimizer_fn=mk)
        except Exception as e:  # noqa: BLE001
            problems.append(f"z{stage} initialize raised {type(e).__name__}: {str(e)[:120]}")
            continue
        _train(eng, 2)
        e = _raised(lambda: eng.save_checkpoint(d, tag="t"))
        if e is not None:
            problems.append(f"z{stage} save raised {type(e).__name__}: {str(e)[:200]}")
            continue
        inner = eng.optimizer if stage == 0 else eng.optimizer.optimizer
        want = sorted(float(s["sum"].double().sum()) for s in inner.state.values() if "sum" in s)
        fresh = _build(lambda: dj.Net(False, False), cfg, optimizer_fn=mk)
        e = _raised(lambda: fresh.load_checkpoint(d, tag="t"))
        if e is not None:
            problems.append(f"z{stage} load raised {type(e).__name__}: {str(e)[:200]}")
            continue
        inner = fresh.optimizer if stage == 0 else fresh.optimizer.optimizer
        got = sorted(float(s["sum"].double().sum()) for s in inner.state.values() if "sum" in s)
        if got != want:
            problems.append(f"z{stage} sums {got[:3]} != {want[:3]}")
    return "; ".join(problems) or None


def async_fail_destroy(root, r):
    """An asynchronous save that fails (an OSError at the write on rank 1), then
    engine.destroy(): the failure is raised (as a CheckpointError) and the engine is
    destroyed all the same (DeepSpeed's destroy ran)."""
    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    eng.dckpt.committer.async_save = True
    _train(eng, 1)
    ran = []
    stock = type(eng).destroy
    os.environ["DCKPT_FAULT"] = "write:1:raise"
    try:
        eng.save_checkpoint(root, tag="t")
        e = _raised(lambda: eng.destroy())
    finally:
        os.environ.pop("DCKPT_FAULT", None)
    problems = []
    if not isinstance(e, CheckpointError):
        problems.append(f"destroy raised {type(e).__name__}: {e}")
    if os.path.exists(os.path.join(root, "t", "manifest.json")):
        problems.append("the failed tag was placed")
    again = _raised(lambda: eng.save_checkpoint(root, tag="t2"))
    if again is not None:
        problems.append(f"a save after the reported failure raised {type(again).__name__}")
    return "; ".join(problems) or None


def trained_engine_no_step_tag(root, r):
    """A tag saved before the first step, loaded into an engine that has trained 2
    steps (ZeRO-2): the optimizer state is gone (as saved), and after one more step
    DeepSpeed's own view of it (safe_get_full_optimizer_state) is the optimizer's new
    state, not the stale pre-load tensors."""
    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    eng.save_checkpoint(root, tag="t0")
    other = _build(lambda: dj.Net(False, False), _cfg(2))
    _train(other, 2)
    other.load_checkpoint(root, tag="t0")
    if other.optimizer.optimizer.state:
        return "optimizer state kept after loading a tag that has none"
    _train(other, 1, start=4)
    _train(eng, 1, start=4)
    bad = []
    for (n, p), (_, q) in zip(other.module.named_parameters(), eng.module.named_parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = safe_get_full_optimizer_state(p, k), safe_get_full_optimizer_state(q, k)
            if not torch.equal(a, b):
                bad.append(f"{n}.{k}")
    return f"stale DeepSpeed optimizer-state links: {bad}" if bad else None


def resave_same_tag(root, r):
    """The same tag saved twice with different state (the second after 2 more steps):
    the tag holds the second state; nothing of the first remains."""
    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    _train(eng, 1)
    eng.save_checkpoint(root, tag="same")
    _train(eng, 2, start=1)
    eng.save_checkpoint(root, tag="same")
    ref = _full(eng)
    fresh = _build(lambda: dj.Net(False, False), _cfg(2))
    fresh.load_checkpoint(root, tag="same")
    bad = _same(ref, _full(fresh))
    return f"differ {bad}" if bad else None


def newer_stock_tag(root, r):
    """dckpt tag global_step1, then a stock DeepSpeed save global_step2 (the
    integration was off for a while; stock writes latest=global_step2): tag=None loads
    global_step2 (what latest names, the newest), not the older dckpt tag."""
    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    _train(eng, 1)
    eng.save_checkpoint(root)
    _train(eng, 1, start=1)
    eng.dckpt.stock_save(root)
    fresh = _build(lambda: dj.Net(False, False), _cfg(2))
    path, _ = fresh.load_checkpoint(root)
    return None if path and "global_step2" in path else \
        f"tag=None loaded {path}; latest names global_step2 (stock, newer)"


def memory_url(root, r):
    """One rank: save_dir a fsspec memory:// URL, keep_last=1, two saves (latest
    written there), then load_checkpoint(tag=None) by a fresh engine: the newest tag,
    exact; the older one removed."""
    import fsspec

    url = "memory://dsreview/ck"
    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    eng.dckpt.keep_last = 1
    for i in range(2):
        _train(eng, 1, start=i)
        eng.save_checkpoint(url)
    ref = _full(eng)
    fresh = _build(lambda: dj.Net(False, False), _cfg(2))
    path, _ = fresh.load_checkpoint(url)
    fs = fsspec.filesystem("memory")
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls("/dsreview/ck", detail=False))
    problems = []
    if not path or not path.endswith("global_step2"):
        problems.append(f"loaded {path}")
    if _same(ref, _full(fresh)):
        problems.append("differ")
    if names != ["global_step2", "latest"]:
        problems.append(f"left {names}")
    return "; ".join(problems) or None


def backslash_tag(root, r):
    """A tag with a backslash (a legal folder name on POSIX, e.g. a run name), saved
    after global_step1: load_checkpoint(tag=None) loads it (the newest), not
    global_step1; or the save refuses the name."""
    eng = _build(lambda: dj.Net(False, False), _cfg(1))
    _train(eng, 1)
    eng.save_checkpoint(root)
    _train(eng, 1, start=1)
    e = _raised(lambda: eng.save_checkpoint(root, tag="run\\2"))
    if e is not None:
        return None if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    fresh = _build(lambda: dj.Net(False, False), _cfg(1))
    path, _ = fresh.load_checkpoint(root)
    return None if path and path.endswith("run\\2") else \
        f"tag=None loaded {path}, not the newest tag 'run\\2' (latest names it)"


def many_saves(root, r):
    """40 asynchronous saves with keep_last=2: open files and threads do not grow with
    the number of saves (after the 10th vs after the 40th)."""
    import threading

    eng = _build(lambda: dj.Net(False, False), _cfg(1))
    eng.dckpt.keep_last = 2
    eng.dckpt.committer.async_save = True
    seen = {}
    for i in range(40):
        _train(eng, 1, start=i % 5)
        eng.save_checkpoint(root, tag=f"s{i}")
        if i in (9, 39):
            eng.dckpt.wait()
            seen[i] = (len(os.listdir("/proc/self/fd")), threading.active_count())
    eng.dckpt.wait()
    (f0, t0), (f1, t1) = seen[9], seen[39]
    return None if f1 <= f0 + 2 and t1 <= t0 + 1 else f"fds {f0}->{f1}, threads {t0}->{t1}"


def model_only_tag(root, r):
    """A weights-only tree (the Trainer's save_only_model) at ZeRO-2: no optimizer
    state, param groups or scheduler stored; loaded with the optimizer's state asked
    for, a CheckpointError naming save_only_model (no mix of loaded weights and a stale
    optimizer); loaded module-only into a fresh ZeRO-3 engine, every master equal, its
    optimizer without state. A full tag the framework's record calls weights-only:
    refused."""
    from dckpt.integrations.common.zero.restore import What, load_tag
    from dckpt.integrations.common.zero.tree import engine_tree
    from dckpt.integrations.common.zero.view import view

    eng = _build(lambda: dj.Net(False, False), _cfg(2))
    _train(eng, 2)
    tree = engine_tree(eng, client_state={}, exclude_frozen=False, tag="mo",
                       with_rng=False, model_only=True)
    dckpt.save(tree, root)
    with dckpt.open(root) as c:
        # no param groups either: a group value dckpt cannot store must not fail it
        optim = [k for k in c.keys() if k.startswith(("optim.", "scheduler", "hyper"))]
    ref = {n: v[:1] for n, v in _full(eng).items()}
    fresh = _build(lambda: dj.Net(False, False), _cfg(3))
    e = _raised(lambda: load_tag(view(fresh), root, What()))
    problems = []
    if optim:
        problems.append(f"optimizer state stored: {optim[:4]}")
    if not isinstance(e, CheckpointError) or "save_only_model" not in str(e):
        problems.append(f"full load of a weights-only tag: {e!r}")
    load_tag(view(fresh), root, What(module_only=True))
    bad = _same(ref, {n: v[:1] for n, v in _full(fresh).items()})
    if bad:
        problems.append(f"masters differ {bad}")
    if fresh.optimizer.optimizer.state:
        problems.append("optimizer state after a module-only load")
    # a full tag whose framework record was edited to say weights-only: refused, never
    # loaded as weights with the optimizer silently dropped
    full = root + "-full"
    dckpt.save(engine_tree(eng, client_state={}, exclude_frozen=False, tag="f",
                           with_rng=False), full)
    e = _raised(lambda: load_tag(view(fresh), full, What(module_only=True, model_only=True)))
    if not isinstance(e, CheckpointError) or "disagree" not in str(e):
        problems.append(f"a full tag loaded as weights-only: {e!r}")
    return "; ".join(problems) or None


SCENARIOS = {f.__name__: f for f in (
    sgd_momentum, unused_param_stage0, sometimes_param_stage0, regrouped,
    two_groups_resize_save, two_groups_resize_load, trained_then_frozen, other_shapes,
    zero_size_param, keep_last_other_checkpoints, keep_last_spares_latest, hostile_tags,
    damaged_meta, client_per_rank_z3, rewind_clock_behind, zero3_knobs, zero3_knobs_load,
    offload_optimizer, adagrad, async_fail_destroy, trained_engine_no_step_tag,
    resave_same_tag, newer_stock_tag, memory_url, backslash_tag, many_saves,
    model_only_tag)}


def main() -> None:
    root, names = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    r = torch.distributed.get_rank()
    for name in names:
        d = os.path.join(root, name)
        try:
            why = SCENARIOS[name](d, r)
        except Exception as e:  # noqa: BLE001
            import traceback
            why = (f"ERROR {type(e).__name__}: {str(e)[:400]} | "
                   + traceback.format_exc()[-1200:].replace("\n", " | "))
        say(f"CASE {name} rank {r} {'OK' if why is None else 'FAIL ' + why}")
        torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
