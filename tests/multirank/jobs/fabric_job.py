"""A tiny Fabric run on CPU under ModelParallelStrategy (FSDP2), stock or dckpt's.

    python fabric_job.py --strategy dckpt --devices 2 --root DIR save
    python fabric_job.py --strategy dckpt --devices 3 --root DIR load

``save``: 3 steps of AdamW, then fabric.save(ROOT/ckpt, {"model", "optimizer", "step",
"sched", "note"}); rank 0 writes ROOT/ref.pt (the full state, gathered). ``load``: a
fresh model and optimizer, fabric.load of everything, then a partial load (the model
alone), a strict load asking for a key the checkpoint lacks, and the same with
strict=False. ``dotted``: 3 steps, fabric.save of {"model", "opt.main"} (a key with a
dot), then fabric.load of the same keys into a fresh model and optimizer, strict and
not. Rank 0 prints one line ``RESULT <json>`` with what it saw.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

import torch
from torch import nn

from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy

p = argparse.ArgumentParser()
p.add_argument("--strategy", choices=["dckpt", "stock"], required=True)
p.add_argument("--devices", type=int, default=2)
p.add_argument("--root", required=True)
p.add_argument("mode", choices=["save", "load", "dotted", "asyncfail"])
p.add_argument("--local-root", default=None)  # dckpt's fast tier
p.add_argument("--async-save", action="store_true")  # dckpt's
args = p.parse_args()


def parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp)
    return fully_shard(model, mesh=dp)


def build(fabric):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    return model, opt, sched


def full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         get_optimizer_state_dict)

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    return {"model": get_model_state_dict(model, options=o),
            "optim": get_optimizer_state_dict(model, inner, options=o)}


def same(a: dict, b: dict) -> bool:
    if a["model"].keys() != b["model"].keys():
        return False
    ok = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    return ok and sa.keys() == sb.keys() and all(
        torch.equal(torch.as_tensor(sa[k][s]), torch.as_tensor(sb[k][s]))
        for k in sa for s in sa[k])


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dckpt").setLevel(logging.INFO)  # the tests read where loads came from
    kw = {}
    if args.strategy == "dckpt":
        from dckpt.integrations.fabric import DckptModelParallelStrategy as S
        kw = {"local_root": args.local_root}
        if args.async_save:
            kw["async_save"] = True
    else:
        S = ModelParallelStrategy
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=S(parallelize_fn=parallelize, data_parallel_size=args.devices,
                               tensor_parallel_size=1, **kw))
    fabric.launch()
    model, opt, sched = build(fabric)
    path = os.path.join(args.root, "ckpt")
    out: dict = {}
    if args.mode == "asyncfail":
        fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        os.environ["DCKPT_FAULT"] = "vote:*:raise"
        fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
        out["saved_call_returned"] = True
    elif args.mode == "dotted":
        for i in range(3):
            fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
            opt.step()
            opt.zero_grad()
        dotted = os.path.join(args.root, "ckpt-dotted")
        fabric.save(dotted, {"model": model, "opt.main": opt})
        ref = full(model, opt)
        for strict in (True, False):
            model2, opt2, _ = build(fabric)
            try:
                fabric.load(dotted, {"model": model2, "opt.main": opt2}, strict=strict)
                out[f"strict={strict}"] = same(full(model2, opt2), ref)
            except Exception as e:
                out[f"strict={strict}"] = f"{type(e).__name__}: {e}"[:300]
    elif args.mode == "save":
        for i in range(3):
            x = torch.randn(4, 8)
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
        fabric.save(path, {"model": model, "optimizer": opt, "step": 3, "sched": sched,
                           "note": "hello"})
        ref = full(model, opt)
        if fabric.global_rank == 0:
            torch.save({**ref, "sched": sched.state_dict()}, os.path.join(args.root, "ref.pt"))
        out["saved"] = True
        try:  # only the weights (no bias), as Fabric's filter documents
            fabric.save(path + "-filtered", {"model": model, "step": 3},
                        filter={"model": lambda k, v: "bias" not in k})
            out["filtered"] = "saved"
        except Exception as e:
            out["filtered"] = type(e).__name__
    else:
        ref = torch.load(os.path.join(args.root, "ref.pt"))
        state = {"model": model, "optimizer": opt, "step": 0, "sched": sched}
        rest = fabric.load(path, state)
        out["equal"] = same(full(model, opt), ref)
        out["step"] = state["step"]
        out["sched_restored"] = isinstance(state["sched"], torch.optim.lr_scheduler.StepLR) \
            and state["sched"].state_dict() == ref["sched"]
        out["sched_type"] = type(state["sched"]).__name__
        out["remainder"] = sorted(rest)
        model2, opt2, _ = build(fabric)
        rest = fabric.load(path, {"model": model2})  # partial: the model alone
        out["partial_remainder"] = sorted(rest)
        out["partial_model_equal"] = same({**full(model2, opt2), "optim": ref["optim"]},
                                          {**ref, "optim": ref["optim"]})
        try:
            fabric.load(path, {"model": model2, "missing": 1})
            out["strict_missing"] = "loaded"
        except KeyError as e:
            out["strict_missing"] = type(e).__name__
        st = {"model": model2, "missing": 1}
        rest = fabric.load(path, st, strict=False)
        out["nonstrict_missing"] = st["missing"]
        model3, opt3, _ = build(fabric)
        try:
            fabric.load_raw(path, model3)
            out["load_raw"] = same({**full(model3, opt3), "optim": ref["optim"]}, ref)
        except Exception as e:
            out["load_raw"] = type(e).__name__
        if os.path.exists(path + "-filtered"):
            model4, opt4, _ = build(fabric)
            before = full(model4, opt4)["model"]
            fabric.load(path + "-filtered", {"model": model4}, strict=False)
            after = full(model4, opt4)["model"]
            out["filtered_load"] = all(
                torch.equal(after[k], (before if "bias" in k else ref["model"])[k])
                for k in after)
    if fabric.global_rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
