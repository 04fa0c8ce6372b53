"""DeepSpeed engines on CPU (DS_ACCELERATOR=cpu, gloo) under torchrun, saved and loaded
through dckpt's adapter, next to DeepSpeed's own methods. Several cases per launch (an
engine starts in seconds; a launch costs more).

    save ROOT CASE...   train 3 steps, save with dckpt (ROOT/CASE/dckpt) and stock
                        (ROOT/CASE/stock), record the full fp32 masters, optimizer states,
                        counters, scheduler and the next 3 losses (ROOT/CASE/ref.pt)
    load ROOT SRC:DST...  a fresh engine of case DST loads SRC's dckpt tag; compare
    stock ROOT SRC:DST... a fresh engine of DST loads SRC's stock tag; prints the outcome

A case is ``z<stage>-<fp32|bf16|bf16acc>[-frozen][-tied]``. Prints one line per case:
``CASE <name> rank <r> OK ...`` or ``... FAIL <why>``."""
from __future__ import annotations

import importlib
import os
import sys

import torch

import deepspeed  # noqa: E402

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT op build
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from dckpt.integrations import deepspeed as dds  # noqa: E402


class Net(torch.nn.Module):
    """Sizes that do not divide by 2 or 3 (padding on the last ranks), a parameter on
    one rank only, a persistent buffer, optionally a frozen layer and tied weights."""

    def __init__(self, frozen: bool, tied: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(5, 7, bias=False)
        self.a = torch.nn.Linear(7, 11)
        self.b = torch.nn.Linear(11, 7)
        self.register_buffer("seen", torch.arange(3, dtype=torch.float32))
        self.freeze = torch.nn.Linear(7, 7) if frozen else None
        if frozen:
            self.freeze.requires_grad_(False)
        self.head = torch.nn.Linear(7, 5, bias=False)
        # tied: one weight under two names (as lm_head and embed_tokens)
        self.mix = torch.nn.Linear(7, 7, bias=False) if tied else None
        self.mix2 = self.mix

    def forward(self, x):
        h = torch.relu(self.a(self.emb(x)))
        h = self.b(h)
        if self.freeze is not None:
            h = h + self.freeze(h)
        if self.mix is not None:
            h = self.mix2(torch.tanh(self.mix(h)))
        return self.head(h)


def parse(case: str) -> dict:
    parts = case.split("-")
    return {"stage": int(parts[0][1:]), "prec": parts[1], "frozen": "frozen" in parts,
            "tied": "tied" in parts, "exclude": "exclude" in parts}


def config(c: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True,
                                                     "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
           "zero_optimization": {"stage": c["stage"]},
           "bf16": {"enabled": c["prec"] != "fp32"}}
    if c["prec"] == "bf16acc":  # BF16_Optimizer (stage 1 only)
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if c["stage"] == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 8
    return cfg


def engine(case: str):
    c = parse(case)
    cfg = config(c)
    torch.manual_seed(0)
    if c["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            m = Net(c["frozen"], c["tied"])
    else:
        m = Net(c["frozen"], c["tied"])
    params = [p for p in m.parameters() if p.requires_grad]
    eng, *_ = dds.initialize(model=m, model_parameters=params, config=cfg)
    return eng, c


def batches(c: dict) -> list:
    g = torch.Generator().manual_seed(1)
    dt = torch.float32 if c["prec"] == "fp32" else torch.bfloat16
    return [torch.randn(2, 5, generator=g).to(dt) for _ in range(6)]


def step(eng, x) -> float:
    loss = eng(x).float().pow(2).mean()
    eng.backward(loss)
    eng.step()
    return loss.item()


def full(eng, stage: int) -> dict:
    """name -> [fp32 master, exp_avg, exp_avg_sq] (full values; collective)."""
    out = {}
    for n, p in eng.module.named_parameters():
        if not p.requires_grad:
            continue
        if stage == 0:
            st = eng.optimizer.state[p]
            out[n] = [p.detach().float().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
        else:
            out[n] = [safe_get_full_fp32_param(p).clone()] + [
                safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


def steps_of(eng) -> list:
    return sorted({float(s["step"]) for s in eng.optimizer.state.values() if "step" in s}) if \
        eng.zero_optimization_stage() == 0 else sorted(
            {float(s["step"]) for s in eng.optimizer.optimizer.state.values() if "step" in s})


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def save(root: str, case: str, r: int) -> None:
    eng, c = engine(case)
    xs = batches(c)
    for x in xs[:3]:
        step(eng, x)
    d = os.path.join(root, case)
    client = {"epoch": 3, "t": torch.arange(3), "nested": {"k": [1, 2.5, None]}}
    eng.save_checkpoint(os.path.join(d, "dckpt"), client_state=client,
                        exclude_frozen_parameters=c["exclude"])
    eng.dckpt.stock_save(os.path.join(d, "stock"), client_state=dict(client))
    ref = {"full": full(eng, c["stage"]), "steps": steps_of(eng),
           "counters": [eng.global_steps, eng.global_samples, eng.skipped_steps],
           "sched": eng.lr_scheduler.state_dict(), "rand": torch.rand(3)}
    ref["losses"] = [step(eng, x) for x in xs[3:]]
    if r == 0:
        torch.save(ref, os.path.join(d, "ref.pt"))
    say(f"CASE {case} rank {r} OK saved losses {ref['losses']}")


def load(root: str, spec: str, r: int, stock: bool) -> None:
    src, dst = spec.split(":")
    eng, c = engine(dst)
    d = os.path.join(root, src)
    ref = torch.load(os.path.join(d, "ref.pt"), weights_only=False)
    try:
        if stock:
            path, cs = eng.dckpt.stock_load(os.path.join(d, "stock"))
            if hasattr(eng.optimizer, "_lazy_init_hp_params_optimizer_state"):
                # DeepSpeed's own load relinks the parameters to their fp32 fragments but
                # leaves the optimizer-state links dropped until the next step(): relink
                # them so safe_get_full_optimizer_state works (a stock quirk, not ours)
                eng.optimizer._hp_optimizer_states_linked = False
                eng.optimizer._lazy_init_hp_params_optimizer_state()
        else:
            path, cs = eng.load_checkpoint(os.path.join(d, "dckpt"))
    except Exception as e:  # noqa: BLE001 - printed for the test
        say(f"CASE {spec} rank {r} RAISED {type(e).__name__}: {str(e)[:300]}")
        return
    rand = torch.rand(3)
    got = full(eng, c["stage"])
    bad = [f"{n}[{i}]" for n in ref["full"] for i in range(3)
           if not torch.equal(ref["full"][n][i], got[n][i])]
    problems = []
    if bad:
        problems.append(f"differ {bad}")
    if steps_of(eng) != ref["steps"]:
        problems.append(f"steps {steps_of(eng)} != {ref['steps']}")
    if eng.global_steps != ref["counters"][0] or eng.skipped_steps != ref["counters"][2]:
        problems.append(f"counters {eng.global_steps} {eng.skipped_steps} != {ref['counters']}")
    if eng.lr_scheduler.state_dict() != ref["sched"]:
        problems.append(f"scheduler {eng.lr_scheduler.state_dict()} != {ref['sched']}")
    if not stock:
        if cs.get("epoch") != 3 or not torch.equal(cs.get("t"), torch.arange(3)) or \
                cs.get("nested") != {"k": [1, 2.5, None]}:
            problems.append(f"client_state {cs}")
        if r == 0 and not torch.equal(rand, ref["rand"]):
            problems.append("rng not restored")
    losses = [step(eng, x) for x in batches(c)[3:]]
    same = losses == ref["losses"]
    say(f"CASE {spec} rank {r} {'FAIL ' + '; '.join(problems) if problems else 'OK'} "
        f"losses_equal={same} {losses} {ref['losses']}")


def crash(root: str, spec: str, r: int) -> None:
    """``FAULT[@async]``: save global_step3, then global_step5 with DCKPT_FAULT=FAULT
    armed (the process dies there, or the save fails); the full state at each save is
    recorded first (ROOT/ref<step>.pt)."""
    fault, _, how = spec.partition("@")
    eng, c = engine("z2-fp32")
    eng.dckpt.committer.async_save = how == "async"
    xs = batches(c)
    for i in range(5):
        step(eng, xs[i])
        if eng.global_steps in (3, 5):
            ref = {"full": full(eng, 2), "rand": None}
            if r == 0:
                torch.save(ref, os.path.join(root, f"ref{eng.global_steps}.pt"))
            torch.distributed.barrier()
            if eng.global_steps == 5:
                # global_step3's asynchronous commit and placement first: the fault is
                # armed for global_step5's save only (a background placement of
                # global_step3 would otherwise meet it)
                eng.dckpt.wait()
                os.environ["DCKPT_FAULT"] = fault
            eng.save_checkpoint(os.path.join(root, "ck"), client_state={"at": eng.global_steps})
    eng.dckpt.wait()
    say(f"CASE {spec} rank {r} OK survived")


def resume(root: str, _: str, r: int) -> None:
    """load_checkpoint(tag=None): which tag, and whether the state is that tag's."""
    eng, c = engine("z2-fp32")
    path, cs = eng.load_checkpoint(os.path.join(root, "ck"))
    at = cs["at"]
    ref = torch.load(os.path.join(root, f"ref{at}.pt"), weights_only=False)
    got = full(eng, 2)
    bad = [n for n in ref["full"] for i in range(3) if not torch.equal(ref["full"][n][i], got[n][i])]
    latest = open(os.path.join(root, "ck", "latest")).read()
    say(f"CASE resume rank {r} {'FAIL ' + str(bad) if bad else 'OK'} at={at} "
        f"path={os.path.basename(path)} latest={latest}")


def main() -> None:
    mode, root, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    deepspeed.init_distributed(dist_backend="gloo")
    r = torch.distributed.get_rank()
    for case in cases:
        try:
            if mode == "save":
                save(root, case, r)
            elif mode == "crash":
                crash(root, case, r)
            elif mode == "resume":
                resume(root, case, r)
            else:
                load(root, case, r, stock=(mode == "stock"))
        except Exception as e:  # noqa: BLE001
            import traceback
            say(f"CASE {case} rank {r} ERROR {type(e).__name__}: {str(e)[:400]} "
                + traceback.format_exc()[-1500:].replace("\n", " | "))
            # the ranks' collectives no longer pair up: end now, the others fail fast
            sys.stdout.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: gloo's threads racing it abort the process now and then
    os._exit(0)


if __name__ == "__main__":
    main()
