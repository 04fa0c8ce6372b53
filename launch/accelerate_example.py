"""dckpt with Hugging Face Accelerate, on CPU: train at 2 ranks, resume at 3.

    torchrun --standalone --nproc-per-node=2 launch/accelerate_example.py --root /tmp/acc --steps 6
    torchrun --standalone --nproc-per-node=3 launch/accelerate_example.py --root /tmp/acc --steps 10

The one change from a stock script is the import. CPU note: Accelerate runs FSDP only
on accelerators, so on CPU (gloo) the model is wrapped in DDP; set
``ACCELERATE_USE_CPU=1`` or pass ``cpu=True`` (as here) so torchrun's ranks form a
gloo group. Each save is one atomic dckpt commit under
ROOT/checkpoints/checkpoint_<i>; the second run loads the newest committed one,
resharded to 3 ranks (rank 2 gets an RNG stream derived from rank 0's).
"""
from __future__ import annotations

import argparse
import os

import torch
from accelerate.utils import ProjectConfiguration
from torch import nn

from dckpt.integrations.accelerate import DckptAccelerator as Accelerator

p = argparse.ArgumentParser()
p.add_argument("--root", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--every", type=int, default=2)
a = p.parse_args()

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=a.root, automatic_checkpoint_naming=True, total_limit=2))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
model, opt, sched = acc.prepare(model, opt, sched)

if os.path.isdir(os.path.join(a.root, "checkpoints")):
    acc.load_state()  # the newest committed checkpoint, at any world size
    acc.print(f"resumed at step {acc.step} on {acc.num_processes} ranks")

while acc.step < a.steps:
    x = torch.randn(8, 16)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    acc.step += 1
    if acc.step % a.every == 0:
        path = acc.save_state()
        acc.print(f"step {acc.step} loss {loss.item():.4f} saved {path}")
acc.end_training()
