"""Accelerate's custom loop under DeepSpeed ZeRO (CPU, gloo) with stock's Accelerator or
DckptAccelerator: ``python -m torch.distributed.run ... accelerate_ds_job.py IMPL ROOT
STAGE save|load``. save: 3 steps, save_state, record the full fp32 masters (ROOT/full3.pt),
3 more steps (``DONE <rank> <losses>``); load: load_state, compare the masters (``LOADED
<rank> ok|FAIL|RAISED``), 3 steps."""
import importlib, os, sys, torch
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration
from deepspeed.utils import safe_get_full_fp32_param
impl, root, stage, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if impl == "dckpt":
    from dckpt.integrations.accelerate import DckptAccelerator as Accelerator
else:
    from accelerate import Accelerator
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
       "zero_optimization": {"stage": stage}}
acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg),
                  project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=2))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
from accelerate.utils import DummyOptim
opt = DummyOptim(model.parameters())
model, opt = acc.prepare(model, opt)
g = torch.Generator().manual_seed(1)
xs = [torch.randn(2, 5, generator=g) for _ in range(6)]
def step(x):
    loss = model(x).pow(2).mean(); acc.backward(loss); opt.step(); opt.zero_grad(); return round(loss.item(), 7)
def full():
    return {n: safe_get_full_fp32_param(p).clone() for n, p in model.module.named_parameters()}
r = acc.process_index


def say(*parts) -> None:  # one write per line: the ranks share the pipe
    os.write(1, (" ".join(str(p) for p in parts) + "\n").encode())


if mode == "save":
    out = [step(x) for x in xs[:3]]
    acc.save_state()
    f = full()
    if r == 0: torch.save(f, os.path.join(root, "full3.pt"))
    out += [step(x) for x in xs[3:]]
    say("DONE", r, out)
else:
    try:
        acc.load_state()
    except Exception as e:  # noqa: BLE001 - stock's refusal of a resize, printed
        say("LOADED", r, "RAISED", type(e).__name__, str(e)[:200])
        os._exit(0)  # no interpreter teardown (gloo's threads abort it now and then)
    want = torch.load(os.path.join(root, "full3.pt")); got = full()
    bad = [n for n in want if not torch.equal(want[n], got[n])]
    out = [step(x) for x in xs[3:]]
    say("LOADED", r, "ok" if not bad else f"FAIL {bad}", out)
os._exit(0)  # no interpreter teardown (gloo's threads abort it now and then)
