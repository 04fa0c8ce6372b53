"""TrainingState: a model and its optimizer as one Stateful, FQN-keyed, sharded state."""
from __future__ import annotations

from typing import Any

import torch


class TrainingState:
    """Wraps ``model`` (plain, DDP, FSDP2 ``fully_shard``, FSDP1) and optionally its
    ``optimizer`` so that ``dckpt.save``/``dckpt.load`` store them by fully qualified
    parameter name in each parallelism's native layout (DTensor shards for FSDP2,
    ShardedTensor shards for FSDP1 ``FullyShardedDataParallel``, plain tensors for DDP
    and plain modules).

    It relies on torch's ``torch.distributed.checkpoint.state_dict`` helpers, so a
    checkpoint saved from one parallelism or world size loads into another: DDP ->
    FSDP2, FSDP1 -> FSDP2, FSDP2 at 2 ranks -> FSDP2 at 3 ranks, FSDP2 -> a single process. The
    optimizer state is flattened (``optim.state.<fqn>.exp_avg``,
    ``optim.param_groups.<fqn>.lr``), so it does not depend on parameter order.

    ``state_dict()`` may run collectives (FSDP1) and, on an optimizer that has not
    stepped yet, initialises its state with a zero-learning-rate step (torch's helper),
    so a fresh optimizer can be loaded into.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, strict: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainingState needs an nn.Module, got {type(model).__name__}")
        self.model, self.optimizer, self.strict = model, optimizer, strict

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True, strict=self.strict)

    def state_dict(self) -> dict[str, Any]:
        """``{"model": {fqn: tensor}, "optim": {flat key: value}}`` (no "optim" without
        an optimizer). Tensors are the live parameters and optimizer states (no copy)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self._options())}
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._options())
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a state_dict shaped like :meth:`state_dict`'s (dckpt fills that very
        dict in place first, so this mostly restores non-tensor optimizer settings)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self._options())
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self._options())


def fence_targets(state: Any) -> list:
    """What an overlapped async save of ``state`` must fence on: for every
    :class:`TrainingState` in it (nested in dicts, lists, tuples) that has an optimizer,
    the optimizer and the model. The model's fence makes the forward of each of its
    modules that can write a saved tensor in place wait for the snapshot, chosen
    without a list of classes (:mod:`dckpt.engine.writers`): a module with persistent
    buffers of its own (BatchNorm's running stats, in whatever mode it is now; spectral
    norm's ``u``/``v``; a custom buffer), or one seen writing its own parameters or
    buffers in a forward (``Embedding(max_norm=)``); at the model's first fenced save,
    every forward. The other forwards overlap the snapshot; a forward that writes for
    the first time fails that save (its version check) and waits from the next one on.
    A TrainingState without an optimizer gives nothing to fence on (what changes its
    tensors is unknown): it is copied in the call. No I/O; O(containers)."""
    out: list = []

    def walk(obj: Any) -> None:
        if isinstance(obj, TrainingState):
            if obj.optimizer is not None:
                out.extend((obj.optimizer, obj.model))
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif type(obj) in (list, tuple):
            for v in obj:
                walk(v)

    walk(state)
    return out
