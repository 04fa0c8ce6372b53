"""A prepared model and an optimizer of it as dckpt Statefuls, FQN-keyed through
torch's distributed state_dict helpers (as :class:`dckpt.TrainingState`), so FSDP2,
FSDP1, DDP and plain modules save sharded and load at any world size and parallelism.
No I/O; ``state_dict()``/``load_state_dict()`` may run collectives (FSDP1)."""
from __future__ import annotations

from typing import Any

import torch


def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)


class ModelState:
    """``module``'s sharded state (torch's ``get_model_state_dict``: the live
    parameters, no copy) and ``set_model_state_dict``."""

    def __init__(self, module: torch.nn.Module, strict: bool = True) -> None:
        self.module, self.strict = module, strict

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module, options=_options(self.strict))

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, sd, options=_options(self.strict))


class OptimizerState:
    """``optimizer``'s state keyed by parameter name (flattened: independent of the
    parameter order; a fresh optimizer's state is initialised first by torch's helper,
    with a zero-learning-rate step) and ``set_optimizer_state_dict``."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer, options=_options())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, optim_state_dict=sd,
                                 options=_options())


def owner(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module],
          default: int | None) -> int | None:
    """The index of the model in ``models`` that holds ``optimizer``'s parameters
    (the first one of its first group found), else ``default``. O(parameters)."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    if first is not None:
        for i, m in enumerate(models):
            if any(p is first for p in m.parameters()):
                return i
    return default
