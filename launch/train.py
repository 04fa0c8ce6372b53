"""A small but real training job for torchrun that checkpoints with dckpt.

    torchrun --standalone --nproc-per-node=2 launch/train.py --steps 50 --ckpt-root /tmp/run1

A tiny language model (embedding, MLP blocks with dropout, head) on synthetic tokens,
sharded with FSDP2 (gloo on CPU, NCCL on GPU), AdamW, a cosine LR schedule. Tokens come
from each rank's global RNG (--data rng; the checkpoint restores RNG states) or from a
resumable sampler over one global stream of samples (--data sampler, launch/data.py)
whose position is checkpointed: after a restart at another world size it continues with
the next unseen samples. A CheckpointManager saves every --every steps, keeps
--keep-last, restores on start-up (also after a restart at another world size) and, with
--save-on-sigterm, writes a final checkpoint when the job is preempted. With a fast tier
(--local-root), the last step is saved and staged durable (--no-final-durable: only as
the policy says); with --replicas, each node's fast-tier step is also copied to other
nodes (--node-id names this rank's node), and a lost node resumes from them ("peer
tier"). Rank 0 logs progress and, at the end, a SHA-256 of the full parameters (to
compare runs).

Under torchrun, ranks meet through a store of their rendezvous round (init_distributed),
so restarts and membership changes with several agents (--nnodes=1:2) reconnect cleanly;
launch/elastic_demo.py shows both.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import math
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import dckpt
from data import ResumableSampler  # launch/ is sys.path[0]: torchrun runs this as a script

log = logging.getLogger("train")


class TinyLM(nn.Module):
    """Embedding, residual MLP blocks, head. Works on one row per token, (batch * seq,
    width): a Linear on a 3-D input returns a *view* of its 2-D product, and FSDP2 warns
    when a module it wraps (each block, the model) returns a view, since an in-place op
    on it would skip the pre-backward all-gather. On 2-D inputs every output is fresh."""

    def __init__(self, vocab: int, width: int, depth: int, dropout: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Dropout(dropout), nn.Linear(4 * width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, seq) -> logits (batch * seq, vocab), row-major."""
        h = self.emb(tokens.reshape(-1))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--local-root", default=None,
                   help="node-local fast tier (e.g. /dev/shm/run1): every save commits there "
                        "first and is staged to --ckpt-root in the background")
    p.add_argument("--durable-every", type=int, default=None,
                   help="with --local-root: saves at least this many steps apart go durable "
                        "(default: every save)")
    p.add_argument("--keep-last-local", type=int, default=1)
    p.add_argument("--replicas", type=int, default=0,
                   help="with --local-root: copy each node's fast-tier step to this many other "
                        "nodes (a ring over the node ids), so a lost node restores from its "
                        "peers instead of --ckpt-root")
    # Not "--node": torchrun's argparse reads every argument, the script's too, and
    # rejects --node as an ambiguous abbreviation of its --node-rank/--node_rank.
    p.add_argument("--node-id", dest="node", default=None,
                   help="this rank's failure domain for --replicas (ranks with the same value "
                        "live and die together; default: the host name)")
    p.add_argument("--final-durable", action=argparse.BooleanOptionalAction, default=True,
                   help="with --local-root: save the last step with force=True, so it is "
                        "staged to --ckpt-root whatever --every/--durable-every say (a "
                        "manager's close() does not make the last local save durable)")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--dcp", action="store_true",
                   help="benchmark baseline: save the same state with DCP's async_save "
                        "(reused stager) every --every steps instead of dckpt; no restore")
    p.add_argument("--save-on-sigterm", action="store_true")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=("rng", "sampler"), default="rng",
                   help="tokens from each rank's global RNG, or from a checkpointed sampler")
    p.add_argument("--data-samples", type=int, default=4096,
                   help="synthetic data set size for --data sampler (one epoch)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (tests)")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    if args.replicas and args.local_root is None:
        p.error("--replicas needs --local-root: the replicas are copies of the fast tier")
    return args


def train_step(model: nn.Module, opt, sched, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """One optimizer step of next-token prediction on ``tokens``; returns the loss."""
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss


def params_sha256(model: nn.Module) -> str:
    """Collective: SHA-256 of every full parameter, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


ROUND_KEY = "train/round-store"  # in the agent's store: where this round's store is
NONCE_KEY = "train/nonce"         # in a round's store: proves it is the one announced


def _round_store(agent: dist.Store, rank: int, timeout: timedelta) -> dist.TCPStore:
    """A store of this round only, for init_process_group: rank 0 hosts a new TCPStore
    and announces it in the agent's store; other ranks connect to what is announced.

    Why not the agent's store itself: torchrun keeps one store for the whole job, so
    the previous round's gloo addresses are still in it, and a rank that reads one
    connects to a dead process ("connectFullMesh failed"). Prefixing keys by
    TORCHELASTIC_RESTART_COUNT is not enough: each agent counts its own restarts, and
    a membership change restarts without counting, so with several agents two ranks of
    one round can see different counts (observed: agent B restarts after its worker
    died, count 1; agent A restarts for B's re-join, count 0). No variable torchrun
    exports names the rendezvous round.

    A stale announcement is harmless: its rank 0 has exited (agents stop their
    workers before they rendezvous again), so connecting fails, or the port now
    belongs to another store that lacks the nonce; the rank then reads the
    announcement again until the new rank 0 has replaced it. Raises RuntimeError
    after ``timeout`` without a live announced store.
    """
    addr = os.environ["MASTER_ADDR"]  # torchrun's rank-0 host, where global rank 0 runs
    if rank == 0:
        own = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        nonce = f"{os.getpid()}-{time.time_ns()}-{os.urandom(4).hex()}"
        own.set(NONCE_KEY, nonce)  # before the announcement: a found store has its nonce
        agent.set(ROUND_KEY, f"{addr} {own.port} {nonce}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        host, port, nonce = agent.get(ROUND_KEY).decode().split()
        try:
            # A plain connect first: refused at once when the store is dead, where
            # TCPStore would retry for its timeout and log a stack trace per try.
            socket.create_connection((host, int(port)), timeout=5).close()
            peer = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
            if peer.check([NONCE_KEY]) and peer.get(NONCE_KEY).decode() == nonce:
                peer.set_timeout(timeout)
                return peer
        except (OSError, RuntimeError):  # refused, or gone meanwhile: a dead round's store
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no live store announced under {ROUND_KEY!r} in the torchrun agent's "
                       f"store at {addr}:{os.environ['MASTER_PORT']} after {timeout}")


def init_distributed(backend: str) -> None:
    """init_process_group; under torchrun's shared agent store (the default), through a
    store of this round only (see :func:`_round_store`)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(minutes=5)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=_round_store(agent, rank, timeout), rank=rank,
                            world_size=world)


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
    torch.manual_seed(args.seed * 1000 + rank + 1)  # per-rank dropout (and --data rng)

    state = {"train": dckpt.TrainingState(model, opt), "sched": sched, "step": 0}
    sampler = None
    if args.data == "sampler":
        sampler = ResumableSampler(args.data_samples, args.batch, seed=args.seed, rank=rank,
                                   world=world)
        state["data"] = sampler  # saved through its state_dict, restored in place
    if args.dcp:  # benchmarks/bench_manager.py's DCP column: the same loop, fresh
        mgr, start, restored = _DcpSaver(args), 0, None
    else:
        mgr = dckpt.CheckpointManager(
            args.ckpt_root, every_steps=args.every, keep_last=args.keep_last,
            async_save=args.async_save, save_on_sigterm=args.save_on_sigterm,
            local_root=args.local_root, keep_last_local=args.keep_last_local,
            durable_every_steps=args.durable_every, replicas=args.replicas, node=args.node)
        restored = mgr.restore(state)
        start = state["step"] if restored is not None else 0
    if restored is not None and sched.T_max != max(1, args.steps):
        # The restored schedule ends where the first run's --steps did; a rerun asking
        # for more (or fewer) steps re-targets it: the LR becomes the cosine's value at
        # this step of the longer schedule (the chained update cannot climb back from 0).
        log.info("LR schedule length %d -> %d steps", sched.T_max, max(1, args.steps))
        sched.T_max = max(1, args.steps)
        frac = min(1.0, sched.last_epoch / sched.T_max)
        for g, base in zip(opt.param_groups, sched.base_lrs):
            g["lr"] = sched.eta_min + (base - sched.eta_min) * (1 + math.cos(math.pi * frac)) / 2
    log.info("world %d, %s; %s", world, device.type,
             f"resumed from step {start} ({mgr.restored_from} tier)" if restored is not None
             else "starting fresh" + (" (saving with DCP)" if args.dcp else ""))
    if sampler is not None:
        log.info("data position %d (epoch %d), %d samples per step", sampler.consumed,
                 sampler.epoch, world * args.batch)
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        if sampler is None:
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
        else:
            tokens = sampler.next_tokens(args.vocab, args.seq + 1, device)
        loss = train_step(model, opt, sched, tokens, args.vocab)
        state["step"] = step
        if args.step_sleep:
            time.sleep(args.step_sleep)
        # With a fast tier, the run's end must outlive the node: close() does not stage
        # the last local save, so force it (saved, and staged durable).
        final = step == args.steps and args.final_durable and args.local_root is not None
        mgr.save(step, state, force=final)  # may exit cleanly here after SIGTERM
        if step % args.log_every == 0 or step == args.steps:
            log.info("step %d loss %.4f lr %.2e (%.3f s/step)", step, loss.item(),
                     sched.get_last_lr()[0], (time.perf_counter() - t0) / (step - start))
    mgr.close()
    digest = params_sha256(model)
    if rank == 0:
        print(f"final step {args.steps} params sha256 {digest}", flush=True)
    # Drop everything that holds the process groups (DTensors, the mesh, the manager)
    # while the interpreter is fully alive: a gloo group first destroyed during
    # interpreter shutdown can abort the process ("terminate called without an active
    # exception", seen once under load in CI).
    del state, mgr, opt, sched, model, mesh, sampler
    gc.collect()
    dist.destroy_process_group()


class _DcpSaver:
    """Saves with torch.distributed.checkpoint.async_save every ``--every`` steps, in
    place of the manager (a reused stager, as torchtitan does; one save in flight)."""

    def __init__(self, args) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.every, self.root = args.every, args.ckpt_root
        self.pg = dist.new_group(backend="gloo")  # DCP's background collectives
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.pending = None

    def save(self, step: int, state: dict, force: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        if step % self.every and not force:
            return
        if self.pending is not None:
            self.pending.result()
        r = dcp.async_save(state, checkpoint_id=os.path.join(self.root, f"step-{step:08d}"),
                           process_group=self.pg, async_stager=self.stager)
        self.pending = getattr(r, "upload_completion", r)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.stager.close()


if __name__ == "__main__":
    main()
    # Everything is saved, closed and flushed: leave without the interpreter's teardown,
    # where a gloo thread torch left behind still aborts the process now and then
    # ("terminate called without an active exception", CI under load, after the
    # cleanup above), which would turn a finished run into a failed one for torchrun.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
