"""Accelerate under DeepSpeed (``DistributedType.DEEPSPEED``): each prepared model that
is a DeepSpeed engine saves into the ``checkpoint_<i>`` commit nested under
``engines.<i>.`` in the layout of :mod:`dckpt.integrations.deepspeed` (each rank its
ranges of the fp32 masters and optimizer states, frozen parameters, buffers, the
engine's scheduler and counters: no gather, no pickle), beside what the commit holds
without DeepSpeed (schedulers, registered objects, dataloaders, each rank's RNG). A load
restores each engine at any data-parallel size and ZeRO stage. No I/O here but the
load's; ``build`` is local, ``load`` collective."""
from __future__ import annotations

from typing import Any

ROOT = "engines"


def engines(acc: Any) -> list[tuple[int, Any]]:
    """(index among the prepared models, engine) of each DeepSpeed engine."""
    return [(i, m) for i, m in enumerate(acc._models) if hasattr(m, "zero_optimization_stage")]


def enabled(acc: Any) -> bool:
    return bool(engines(acc))


def build(acc: Any) -> dict[str, Any]:
    """``{"<i>": engine i's tree}`` (views of its live buffers: the commit copies them).
    Collective under ZeRO-3 (its epilogue's gather). Raises CheckpointError for an
    engine dckpt does not support."""
    from ..common.zero.tree import engine_tree

    return {str(i): engine_tree(eng, client_state={}, exclude_frozen=False,
                                tag=f"pytorch_model_{i}", with_rng=False)
            for i, eng in engines(acc)}


def load(acc: Any, path: str, strict: bool, storage_options: dict | None) -> None:
    """Restore every engine from the checkpoint at ``path``. Collective; blocking I/O
    (this rank's ranges). Raises on every rank alike: StateMismatchError,
    IntegrityError, CheckpointError (a checkpoint without DeepSpeed engines)."""
    from ..common.zero.restore import What, load_tag
    from ..common.zero.view import view

    for i, eng in engines(acc):
        load_tag(view(eng), path, What(strict=strict), storage_options,
                 root=f"{ROOT}.{i}")
