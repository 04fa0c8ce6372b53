"""Stock DeepSpeed tags imported into dckpt DeepSpeed tags, loaded through the adapter
(DS_ACCELERATOR=cpu, gloo, torchrun). Reuses jobs/deepspeed_job.py's engines.

    save ROOT CASE...      deepspeed_job's save: ROOT/CASE/{dckpt,stock,ref.pt}
    load ROOT SRC:DST...   a fresh engine of case DST loads ROOT/SRC/imported (the test
                           imported ROOT/SRC/stock/global_step3 there); compare with ref
    SRC:DST@job            the same, but rank 0 imports first, inside this job (its
                           process group up), into ROOT/SRC/imported_job

Prints one line per case and rank: ``CASE <spec> rank <r> OK ...`` or ``... FAIL <why>``."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_job as dj  # noqa: E402  (deepspeed, its shm-op stub, dckpt's adapter)

import deepspeed  # noqa: E402

from dckpt.integrations.deepspeed.stock import import_tag  # noqa: E402


def load(root: str, spec: str, r: int) -> None:
    spec_, _, where = spec.partition("@")
    src, dst = spec_.split(":")
    d = os.path.join(root, src)
    sub = "imported_job" if where == "job" else "imported"
    if where == "job":
        if r == 0:
            import_tag(os.path.join(d, "stock", "global_step3"),
                       os.path.join(d, sub, "global_step3"), overwrite=True)
        torch.distributed.barrier()
    eng, c = dj.engine(dst)
    ref = torch.load(os.path.join(d, "ref.pt"), weights_only=False)
    try:
        path, cs = eng.load_checkpoint(os.path.join(d, sub))
    except Exception as e:  # noqa: BLE001 - printed for the test
        dj.say(f"CASE {spec} rank {r} RAISED {type(e).__name__}: {str(e)[:300]}")
        return
    got = dj.full(eng, c["stage"])
    problems = []
    bad = [f"{n}[{i}]" for n in ref["full"] for i in range(3)
           if not torch.equal(ref["full"][n][i], got[n][i])]
    if bad or set(got) != set(ref["full"]):
        problems.append(f"differ {bad} {sorted(set(got) ^ set(ref['full']))}")
    if dj.steps_of(eng) != ref["steps"]:
        problems.append(f"steps {dj.steps_of(eng)} != {ref['steps']}")
    if [eng.global_steps, eng.global_samples, eng.skipped_steps] != ref["counters"]:
        problems.append(f"counters {[eng.global_steps, eng.global_samples, eng.skipped_steps]}"
                        f" != {ref['counters']}")
    if eng.lr_scheduler.state_dict() != ref["sched"]:
        problems.append(f"scheduler {eng.lr_scheduler.state_dict()} != {ref['sched']}")
    if cs.get("epoch") != 3 or not torch.equal(cs.get("t"), torch.arange(3)) or \
            cs.get("nested") != {"k": [1, 2.5, None]}:
        problems.append(f"client_state {cs}")
    if os.path.basename(path) != "global_step3":
        problems.append(f"path {path}")
    losses = [dj.step(eng, x) for x in dj.batches(c)[3:]]
    dj.say(f"CASE {spec} rank {r} {'FAIL ' + '; '.join(problems) if problems else 'OK'} "
           f"losses_equal={losses == ref['losses']} {losses} {ref['losses']}")


def main() -> None:
    mode, root, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    deepspeed.init_distributed(dist_backend="gloo")
    r = torch.distributed.get_rank()
    for case in cases:
        try:
            if mode == "save":
                dj.save(root, case, r)
            else:
                load(root, case, r)
        except Exception as e:  # noqa: BLE001
            import traceback
            dj.say(f"CASE {case} rank {r} ERROR {type(e).__name__}: {str(e)[:400]} "
                   + traceback.format_exc()[-1500:].replace("\n", " | "))
            sys.stdout.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (gloo's threads, as deepspeed_job)


if __name__ == "__main__":
    main()
