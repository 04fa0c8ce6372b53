"""torchtitan's real components on CPU, for the integration tests and the benchmark:
a small llama-like model sharded with FSDP2 (optionally FSDP2+TP) and wrapped in
torchtitan's ModelWrapper by the managers, torchtitan's OptimizersContainer (AdamW),
LRSchedulersContainer (warmup), ParallelAwareDataloader and a Stateful train state,
driven the way torchtitan's Trainer drives its checkpointer (trainer.py: load before
training, save after every step, maybe_wait_for_staging before the optimizer step,
close at the end). torchtitan's own llama3 needs triton (no CPU build); its Trainer
needs a GPU."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.wq(self.norm(x))
        return x + self.w2(torch.relu(self.w1(x)))


class TinyLlama(nn.Module):
    """Embedding, blocks, norm, output: llama's parameter layout in miniature."""

    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class Tokens(torch.utils.data.IterableDataset):
    """An endless, deterministic stream of token sequences for one dp rank."""

    def __init__(self, rank: int, seq: int = 8, vocab: int = 64) -> None:
        self.rank, self.seq, self.vocab = rank, seq, vocab

    def __iter__(self):
        i = 0
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + i)
            yield torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
            i += 1


class TrainState:
    """torchtitan's Trainer as a Stateful: {"step", "ntokens_seen"}."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def shard(model: nn.Module, tp: int = 1) -> nn.Module:
    """FSDP2 over every rank (tp=1), or FSDP2 over world/tp ranks x TP over tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if tp == 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    for layer in model.layers.values():
        parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(),
                                               "w2": RowwiseParallel()})
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


class Parts:
    """One rank's training components, built as torchtitan's Trainer builds them."""

    def __init__(self, seed: int = 0, tp: int = 1, warmup: int = 2, steps: int = 20,
                 dp_rank: int | None = None, dp_world: int | None = None) -> None:
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import default_adamw
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

        torch.manual_seed(seed)
        self.model = shard(TinyLlama(), tp)
        self.model_parts = [self.model]
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=self.model_parts)
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=warmup).build(
            optimizers=self.optimizers, training_steps=steps)
        rank = dist.get_rank() if dp_rank is None else dp_rank
        world = dist.get_world_size() if dp_world is None else dp_world
        self.dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank,
                                                  dp_world_size=world, batch_size=2)
        self.train_state = TrainState()
        self._it = None
        self.drawn: list[torch.Tensor] = []  # every batch train_step drew

    def build_kwargs(self, base_folder: str) -> dict[str, Any]:
        """The keywords torchtitan's Trainer passes to ``config.checkpoint.build``."""
        return dict(dataloader=self.dataloader, model_parts=self.model_parts,
                    optimizers=self.optimizers, lr_schedulers=self.lr_schedulers,
                    states={"train_state": self.train_state}, sd_adapter=None,
                    base_folder=base_folder)

    def batch(self) -> torch.Tensor:
        if self._it is None:
            self._it = iter(self.dataloader)
        return next(self._it)

    def train_step(self, checkpointer: Any) -> None:
        """One step as torchtitan's Trainer.train_step: draw, forward/backward, wait
        for staging, optimizer and scheduler steps."""
        batch = self.batch()
        self.drawn.append(batch)
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.ntokens_seen += batch.numel()

    def train(self, checkpointer: Any, steps: int, before_save: Any = None,
              until: int | None = None, load_step: int = -1) -> None:
        """torchtitan's Trainer.train: load (``load_step``: checkpoint.load_step), then
        step/save until ``steps`` (the last step), or stop after step ``until``;
        ``before_save(step)`` runs before each save call."""
        checkpointer.load(step=load_step)
        while self.train_state.step < (until or steps):
            self.train_state.step += 1
            self.train_step(checkpointer)
            if before_save is not None:
                before_save(self.train_state.step)
            checkpointer.save(self.train_state.step,
                              last_step=self.train_state.step == steps)

    def snapshot(self, data: bool = True) -> dict[str, Any]:
        """Everything saved, as plain full tensors and values, for comparison; the
        dataloader's state as the next batch it yields (``data``; that draws it: call
        this last). Its pickled state_dict is not compared: torchdata counts a
        restored loader's fast-forward twice in it."""
        def full(t: Any) -> Any:
            if hasattr(t, "full_tensor"):
                return t.full_tensor().detach().clone()
            return t.detach().clone() if isinstance(t, torch.Tensor) else t

        opt = self.optimizers.state_dict()
        return {
            "model": {k: full(v) for k, v in self.model.state_dict().items()},
            "optimizer": {k: full(v) for k, v in opt.items()},
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "train_state": self.train_state.state_dict(),
            **({"next_batch": self.batch()} if data else {}),
        }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive equality of snapshots (tensors exactly)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(set(a) ^ set(b))[:5])
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", dist.get_world_size()))
