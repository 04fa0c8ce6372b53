"""DeepSpeed ZeRO on dckpt: ``engine.save_checkpoint`` / ``load_checkpoint`` write and
read dckpt checkpoints, atomic, verified, without pickle, that load at any
data-parallel size and across ZeRO stages 0-3.

    from dckpt.integrations import deepspeed as dckpt_ds
    engine, optimizer, loader, scheduler = dckpt_ds.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config,
        async_save=True, keep_last=3)
    engine.load_checkpoint("ckpts")          # the newest committed tag, at any size
    ...
    engine.save_checkpoint("ckpts")          # ckpts/global_step<N>, then ckpts/latest

``attach(engine, **options)`` does the same for an engine someone else built. Nothing
here is imported by ``import dckpt``; DeepSpeed is imported only by :func:`initialize`.
"""
from __future__ import annotations

from typing import Any

from .engine import Checkpointer, attach

__all__ = ["initialize", "attach", "Checkpointer"]


def initialize(*args: Any, async_save: bool = False, keep_last: int | None = None,
               storage_options: dict | None = None, compression: str | None = None,
               local_root: str | None = None, keep_last_local: int = 2,
               **kwargs: Any) -> tuple:
    """``deepspeed.initialize(*args, **kwargs)`` (its arguments, unchanged) whose engine
    is :func:`attach`-ed with dckpt's options; returns the same tuple. Collective (as
    DeepSpeed's). Raises what DeepSpeed raises, and CheckpointError for an engine dckpt
    does not support (see :func:`attach`)."""
    import deepspeed

    out = deepspeed.initialize(*args, **kwargs)
    attach(out[0], async_save=async_save, keep_last=keep_last,
           storage_options=storage_options, compression=compression,
           local_root=local_root, keep_last_local=keep_last_local)
    return out
