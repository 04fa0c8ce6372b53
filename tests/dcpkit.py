"""Shared objects of the DCP-compat tests, after DCP's own e2e tests (single-process and
multi-rank files use the same ones, so both run the same reference flow)."""
from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch


class Net(torch.nn.Module):
    """The e2e tests' small two-layer model, seeded so every rank builds the same one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = torch.nn.Linear(8, 16)
        self.net2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


class StatefulObj:
    """A Stateful that is neither a module nor an optimizer."""

    def __init__(self) -> None:
        self.data = torch.rand(10, 10)

    def state_dict(self):
        return {"data": self.data}

    def load_state_dict(self, state_dict) -> None:
        self.data = state_dict["data"]


@dataclass
class TrainState:
    """As in DCP's e2e test: tensors and a BytesIO of torch.save'd losses. The BytesIO
    round-trips as bytes under dckpt (never unpickled by dckpt itself)."""

    step: int = 0
    current_loss: float = -1.0
    losses: list = field(default_factory=list)

    def state_dict(self):
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "current_loss": torch.tensor(self.current_loss, dtype=torch.float32),
                "losses": buf}

    def load_state_dict(self, sd) -> None:
        self.step = sd["step"].item()
        self.current_loss = sd["current_loss"].item()
        sd["losses"].seek(0)
        self.losses = torch.load(sd["losses"], weights_only=True)

    def as_tuple(self):
        return self.step, self.current_loss, self.losses


def train(model, optim, steps: int) -> TrainState:
    """``steps`` steps on seeded random batches (the same batch on every rank, as
    upstream); returns the TrainState they leave."""
    torch.manual_seed(0)
    ts = TrainState()
    for _ in range(steps):
        model(torch.rand(8, 8)).sum().backward()
        ts.step += 1
        ts.current_loss = torch.rand(1).item()
        ts.losses.append(ts.current_loss)
        optim.step()
        optim.zero_grad()
    return ts
