"""A small but real training job for torchrun that checkpoints with dckpt.

    torchrun --standalone --nproc-per-node=2 launch/train.py --steps 50 --ckpt-root /tmp/run1

A tiny language model (embedding, MLP blocks with dropout, head) on synthetic tokens
drawn from the global RNG, sharded with FSDP2 (gloo on CPU, NCCL on GPU), AdamW, a
cosine LR schedule. A CheckpointManager saves every --every steps, keeps --keep-last,
restores on start-up (also after a restart at another world size) and, with
--save-on-sigterm, writes a final checkpoint when the job is preempted. Rank 0 logs
progress and, at the end, a SHA-256 of the full parameters (to compare runs).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import dckpt

log = logging.getLogger("train")


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, dropout: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Dropout(dropout), nn.Linear(4 * width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--save-on-sigterm", action="store_true")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (tests)")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def params_sha256(model: nn.Module) -> str:
    """Collective: SHA-256 of every full parameter, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def init_distributed(backend: str) -> None:
    """init_process_group, with keys prefixed by torchrun's restart count: after a
    restart the agent's store still holds the previous round's addresses, and a gloo
    rank that read one would connect to a dead process ("connectFullMesh failed")."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=5))
    dist.init_process_group(backend, store=dist.PrefixStore(f"train/restart-{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    init_distributed("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyLM(args.vocab, args.width, args.depth, args.dropout).to(device)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
    torch.manual_seed(args.seed * 1000 + rank + 1)  # each rank draws its own data

    state = {"train": dckpt.TrainingState(model, opt), "sched": sched, "step": 0}
    mgr = dckpt.CheckpointManager(args.ckpt_root, every_steps=args.every,
                                  keep_last=args.keep_last, async_save=args.async_save,
                                  save_on_sigterm=args.save_on_sigterm)
    restored = mgr.restore(state)
    start = state["step"] if restored is not None else 0
    log.info("world %d, %s; %s", world, device.type,
             f"resumed from step {start}" if restored is not None else "starting fresh")
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        state["step"] = step
        if args.step_sleep:
            time.sleep(args.step_sleep)
        mgr.save(step, state)  # may exit cleanly here after SIGTERM, checkpoint written
        if step % args.log_every == 0 or step == args.steps:
            log.info("step %d loss %.4f lr %.2e (%.3f s/step)", step, loss.item(),
                     sched.get_last_lr()[0], (time.perf_counter() - t0) / (step - start))
    mgr.close()
    digest = params_sha256(model)
    if rank == 0:
        print(f"final step {args.steps} params sha256 {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
