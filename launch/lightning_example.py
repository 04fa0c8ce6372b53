"""PyTorch Lightning with dckpt's checkpoints: a small FSDP2 model trained on CPU with
2 devices, then resumed with 3 (the checkpoint reshards on load).

    python launch/lightning_example.py --devices 2 --steps 20 --root /tmp/pl-run
    python launch/lightning_example.py --devices 3 --steps 40 --root /tmp/pl-run --resume
    dckpt ls /tmp/pl-run/ckpts

Lightning's launcher starts the other processes itself (it re-executes this script once
per extra device), so run it with ``python``, not ``torchrun``. Kill the first run at any
moment (Ctrl-C, SIGKILL): ``--resume`` (``ckpt_path="last"``) continues from the last
checkpoint that committed, never from a half-written one. Needs
``pip install "dckpt[lightning]"``.
"""
from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from dckpt.integrations.lightning import DckptModelParallelStrategy


class TinyRegressor(pl.LightningModule):
    """Two linear layers; ``configure_model`` shards each over the data-parallel mesh."""

    def __init__(self, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--root", default="/tmp/pl-run")
    p.add_argument("--resume", action="store_true", help='ckpt_path="last"')
    p.add_argument("--async-save", action="store_true")
    args = p.parse_args()

    torch.manual_seed(0)
    x = torch.randn(512, 16)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    strategy = DckptModelParallelStrategy(data_parallel_size=args.devices,
                                          tensor_parallel_size=1,
                                          async_save=args.async_save)
    checkpoint = ModelCheckpoint(dirpath=os.path.join(args.root, "ckpts"),
                                 filename="{step}", every_n_train_steps=args.every,
                                 save_top_k=2, monitor="step", mode="max", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                         max_steps=args.steps, callbacks=[checkpoint], logger=False,
                         enable_progress_bar=False, default_root_dir=args.root)
    trainer.fit(TinyRegressor(), DataLoader(data, batch_size=16),
                ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        print(f"done at global step {trainer.global_step} on {args.devices} devices; "
              f"checkpoints: {sorted(os.listdir(checkpoint.dirpath))}")


if __name__ == "__main__":
    main()
