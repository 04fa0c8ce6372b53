"""The states a Lightning/Fabric dckpt checkpoint saves and loads: a (FSDP2/TP) module
and its optimizers as dckpt Statefuls, through torch's distributed state_dict helpers
(so any world size and sharding loads them). No I/O, no collective of their own.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import CheckpointError


class BadStateError(CheckpointError, ValueError):
    """A state that cannot be saved or loaded as asked (no distributed module, two of
    them, a reserved key); a ValueError as Lightning's own check is."""


def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=strict)


class ModelState:
    """A (FSDP2/TP) module as a dckpt Stateful: torch's ``get_model_state_dict`` (the
    live sharded parameters, no copy) and ``set_model_state_dict``. ``state_dict()`` is
    computed once per object (the load's strictness check and its fill share it)."""

    def __init__(self, module: torch.nn.Module, strict: bool = True) -> None:
        self.module, self.strict = module, strict
        self._sd: dict | None = None

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self._sd is None:
            self._sd = get_model_state_dict(self.module)
        return self._sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, sd, options=_options(self.strict))


class OptimizerState:
    """An optimizer of a (FSDP2/TP) module as a dckpt Stateful: its state keyed by
    parameter name (torch's ``get_optimizer_state_dict``; a fresh optimizer's state is
    initialised first, by a zero-learning-rate step) and ``set_optimizer_state_dict``."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, optim_state_dict=sd)
