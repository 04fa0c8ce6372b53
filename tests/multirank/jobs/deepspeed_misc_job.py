"""The DeepSpeed adapter's options and bad inputs, one scenario after another in one
launch (2 gloo CPU ranks): ``python -m torch.distributed.run ... deepspeed_misc_job.py
ROOT SCENARIO...``. Prints ``CASE <scenario> rank <r> OK|FAIL ...`` per scenario."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import deepspeed_job as dj  # noqa: E402  (engines, steps, full values; patches the op build)
import torch  # noqa: E402

from dckpt.errors import CheckpointError, IntegrityError, StateMismatchError  # noqa: E402
from dckpt.integrations import deepspeed as dds  # noqa: E402

say = dj.say


def _expect(fn, exc, *words):
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        return f"message lacks {missing}: {e}" if missing else None
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e}"
    return f"did not raise {exc.__name__}"


def _same(a: dict, b: dict) -> list[str]:
    return [n for n in a for i in range(len(a[n])) if not torch.equal(a[n][i], b[n][i])]


def async_values(root, r):
    """An asynchronous save stores the values at the call, whatever training does after."""
    eng, c = dj.engine("z2-fp32")
    eng.dckpt.committer.async_save = True
    xs = dj.batches(c)
    for x in xs[:3]:
        dj.step(eng, x)
    ref = dj.full(eng, 2)
    eng.save_checkpoint(root, tag="a")
    for x in xs[3:]:
        dj.step(eng, x)
    eng.destroy()  # waits for the save in flight
    fresh, _ = dj.engine("z2-fp32")
    fresh.load_checkpoint(root, tag="a")
    bad = _same(ref, dj.full(fresh, 2))
    return f"differ {bad}" if bad else None


def keep_last(root, r):
    eng, c = dj.engine("z1-fp32")
    eng.dckpt.keep_last = 2
    for i, x in enumerate(dj.batches(c)[:4]):
        dj.step(eng, x)
        eng.save_checkpoint(root)
    torch.distributed.barrier()
    names = sorted(n for n in os.listdir(root) if not n.startswith("."))
    latest = open(os.path.join(root, "latest")).read()
    want = ["global_step3", "global_step4", "latest"]
    return None if names == want and latest == "global_step4" else f"{names} latest={latest}"


def damaged(root, r):
    """tag=None: a damaged newest tag is skipped with a warning (the one before loads);
    the damaged tag named: IntegrityError on every rank."""
    eng, c = dj.engine("z2-fp32")
    xs = dj.batches(c)
    dj.step(eng, xs[0])
    eng.save_checkpoint(root, tag="t1")
    ref = dj.full(eng, 2)
    dj.step(eng, xs[1])
    eng.save_checkpoint(root, tag="t2")
    torch.distributed.barrier()
    if r == 0:
        d = os.path.join(root, "t2")
        f = sorted(n for n in os.listdir(d) if n.startswith("data-"))[0]
        with open(os.path.join(d, f), "r+b") as fh:
            fh.seek(-20, 2)
            b = fh.read(1)
            fh.seek(-20, 2)
            fh.write(bytes([b[0] ^ 0xFF]))
    torch.distributed.barrier()
    fresh, _ = dj.engine("z2-fp32")
    path, _ = fresh.load_checkpoint(root)
    if os.path.basename(path) != "t1":
        return f"tag=None loaded {path}"
    bad = _same(ref, dj.full(fresh, 2))
    if bad:
        return f"differ {bad}"
    return _expect(lambda: fresh.load_checkpoint(root, tag="t2"), IntegrityError, "t2")


def other_model(root, r):
    eng, c = dj.engine("z2-fp32")
    eng.save_checkpoint(root, tag="m")
    other, _ = dj.engine("z2-fp32-tied")  # one more parameter (mix.weight)
    return _expect(lambda: other.load_checkpoint(root, tag="m"), StateMismatchError,
                   "mix.weight")


def excluded(root, r):
    eng, c = dj.engine("z2-fp32-frozen")
    eng.save_checkpoint(root, tag="x", exclude_frozen_parameters=True)
    fresh, _ = dj.engine("z2-fp32-frozen")
    why = _expect(lambda: fresh.load_checkpoint(root, tag="x"), StateMismatchError,
                  "freeze.weight", "load_module_strict=False")
    if why:
        return why
    path, _ = fresh.load_checkpoint(root, tag="x", load_module_strict=False)
    return None if path.endswith("x") else f"loaded {path}"


def client_value(root, r):
    """A client_state value dckpt cannot store: the same error on every rank, naming the
    key; nothing is placed."""
    eng, c = dj.engine("z1-fp32")
    why = _expect(lambda: eng.save_checkpoint(root, tag="bad", client_state={"fn": object()}),
                  CheckpointError, "fn")
    torch.distributed.barrier()
    if why:
        return why
    return "a tag folder was placed" if os.path.exists(os.path.join(root, "bad")) else None


def refusals(root, r):
    eng, c = dj.engine("z1-fp32")
    eng.save_checkpoint(root, tag="a")
    why = _expect(lambda: eng.load_checkpoint(root, custom_load_fn=lambda *a: None),
                  CheckpointError, "custom_load_fn")
    if why:
        return why
    why = _expect(lambda: eng.save_checkpoint(root, tag=f"rank{r}"), CheckpointError,
                  "same tag")
    if why:
        return why
    return _expect(lambda: dds.attach(eng), CheckpointError, "already attached")


def round_robin(root, r):
    import deepspeed

    cfg = dj.config(dj.parse("z2-fp32"))
    cfg["zero_optimization"]["round_robin_gradients"] = True
    torch.manual_seed(0)
    m = dj.Net(False, False)
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return _expect(lambda: dds.attach(eng), CheckpointError, "round_robin_gradients")


def module_only(root, r):
    """load_module_only: the weights (masters) only: no optimizer state, no counters,
    no scheduler, as DeepSpeed's. load_optimizer_states=False: weights, counters and
    scheduler, the optimizer left as it is."""
    eng, c = dj.engine("z2-fp32")
    for x in dj.batches(c)[:2]:
        dj.step(eng, x)
    ref = dj.full(eng, 2)
    eng.save_checkpoint(root, tag="w")
    fresh, _ = dj.engine("z2-fp32")
    fresh.load_checkpoint(root, tag="w", load_module_only=True)
    from deepspeed.utils import safe_get_full_fp32_param

    got = {n: safe_get_full_fp32_param(p) for n, p in fresh.module.named_parameters()}
    bad = [n for n in ref if not torch.equal(ref[n][0], got[n])]
    if bad or fresh.global_steps != 0 or fresh.optimizer.optimizer.state:
        return f"module_only: differ {bad}, steps {fresh.global_steps}"
    other, _ = dj.engine("z2-fp32")
    other.load_checkpoint(root, tag="w", load_optimizer_states=False)
    got = {n: safe_get_full_fp32_param(p) for n, p in other.module.named_parameters()}
    bad = [n for n in ref if not torch.equal(ref[n][0], got[n])]
    if bad or other.global_steps != 2 or other.optimizer.optimizer.state:
        return f"no optimizer: differ {bad}, steps {other.global_steps}"
    return None


def stock_tag(root, r):
    """A stock DeepSpeed tag at its own world size still loads through load_checkpoint
    (DeepSpeed's own method), with the same losses after."""
    eng, c = dj.engine("z2-fp32")
    xs = dj.batches(c)
    for x in xs[:3]:
        dj.step(eng, x)
    eng.dckpt.stock_save(root)
    want = [dj.step(eng, x) for x in xs[3:]]
    fresh, _ = dj.engine("z2-fp32")
    path, _ = fresh.load_checkpoint(root)
    got = [dj.step(fresh, x) for x in xs[3:]]
    return None if path and got == want else f"{path} {got} != {want}"


def none_saved(root, r):
    eng, c = dj.engine("z1-fp32")
    got = eng.load_checkpoint(os.path.join(root, "nothing-here"))
    return None if got == (None, None) else f"returned {got}"


def export_llama(root, r):
    """A tiny Llama (tied embeddings) trained under ZeRO-3 at 2 ranks, saved by dckpt,
    exported by ``dckpt.export`` (no gather, one process): transformers'
    ``from_pretrained`` of the folder has every weight equal to the full fp32 masters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers import LlamaConfig, LlamaForCausalLM

    import dckpt

    cfg = dj.config(dj.parse("z3-fp32"))
    conf = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=37, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(conf)
    eng, *_ = dds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
    eng.save_checkpoint(root, tag="t")
    ref = {n: safe_get_full_fp32_param(p).clone() for n, p in eng.module.named_parameters()}
    if r == 0:
        out = os.path.join(root, "hf")
        info = dckpt.export(os.path.join(root, "t"), out)
        conf.save_pretrained(out)
        got = LlamaForCausalLM.from_pretrained(out).state_dict()
        bad = [n for n in ref if not torch.equal(ref[n], got[n])]
        if "lm_head.weight" in got and got["lm_head.weight"].data_ptr() != \
                got["model.embed_tokens.weight"].data_ptr():
            bad.append("lm_head not tied")
        if bad or info.tensors != len(ref):
            return f"differ {bad}, {info.tensors} tensors for {len(ref)}"
    return None


def _raw(case: str, **options):
    """A fresh engine attached with ``options`` (dj.engine attaches with none)."""
    import deepspeed

    c = dj.parse(case)
    cfg = dj.config(c)
    torch.manual_seed(0)
    m = dj.Net(c["frozen"], c["tied"])
    eng, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return dds.attach(eng, **options), c


def fast_tier(root, r):
    """local_root: each save commits on the node's fast tier and is copied to the
    durable folder behind (latest once copied; keep_last over both); a load takes the
    newest tag from the fast tier, or its durable copy when the fast tier lost it, or
    the fast tier's when the durable copy is gone."""
    import shutil

    local, ck = os.path.join(root, "local"), os.path.join(root, "ck")
    eng, c = _raw("z2-fp32", local_root=local, keep_last=2)
    refs = {}
    for x in dj.batches(c)[:3]:
        dj.step(eng, x)
        eng.save_checkpoint(ck, client_state={"at": eng.global_steps})
        refs[eng.global_steps] = dj.full(eng, 2)
    eng.dckpt.wait()
    torch.distributed.barrier()
    names = sorted(n for n in os.listdir(ck) if not n.startswith("."))
    latest = open(os.path.join(ck, "latest")).read()
    if names != ["global_step2", "global_step3", "latest"] or latest != "global_step3":
        return f"durable: {names} latest={latest}"
    fresh, _ = _raw("z2-fp32", local_root=local)
    path, cs = fresh.load_checkpoint(ck)
    if cs.get("at") != 3 or _same(refs[3], dj.full(fresh, 2)):
        return f"fast tier load: {path} {cs}"
    torch.distributed.barrier()
    if r == 0:
        shutil.rmtree(os.path.join(ck, "global_step3"))  # the durable copy lost
    torch.distributed.barrier()
    other, _ = _raw("z2-fp32", local_root=local)
    path, cs = other.load_checkpoint(ck)
    if cs.get("at") != 3 or _same(refs[3], dj.full(other, 2)):
        return f"after the durable copy was lost: {path} {cs}"
    torch.distributed.barrier()
    shutil.rmtree(local, ignore_errors=True)  # every node lost its fast tier
    torch.distributed.barrier()
    last, _ = _raw("z2-fp32", local_root=local)
    path, cs = last.load_checkpoint(ck)
    if cs.get("at") != 2 or _same(refs[2], dj.full(last, 2)):
        return f"after the fast tier was lost: {path} {cs}"
    return None


SCENARIOS = {f.__name__: f for f in (fast_tier, export_llama, async_values, keep_last, damaged, other_model, excluded,
                                     client_value, refusals, round_robin, module_only,
                                     stock_tag, none_saved)}


def main() -> None:
    import deepspeed

    root, names = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    r = torch.distributed.get_rank()
    for name in names:
        d = os.path.join(root, name)
        try:
            why = SCENARIOS[name](d, r)
        except Exception as e:  # noqa: BLE001
            why = f"ERROR {type(e).__name__}: {str(e)[:400]}"
        say(f"CASE {name} rank {r} {'OK' if why is None else 'FAIL ' + why}")
        torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
