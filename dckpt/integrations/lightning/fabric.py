"""Lightning Fabric on dckpt: :class:`DckptModelParallelStrategy`, Fabric's
``ModelParallelStrategy`` whose ``fabric.save`` / ``fabric.load`` go through dckpt.

    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=DckptModelParallelStrategy(parallelize_fn=parallelize))
    fabric.save("ckpt/step-100", {"model": model, "optimizer": optimizer, "step": 100})
    remainder = fabric.load("ckpt/step-100", {"model": model, "optimizer": optimizer})

Saving (``lightning_fabric/strategies/model_parallel.py``'s contract): the state holds
exactly one module with DTensor parameters; its sharded state, each optimizer's
FQN-keyed state and every other value (a Stateful object as its ``state_dict()``) are
committed as one dckpt checkpoint (atomic: the path appears complete or not at all,
see :mod:`.committer`); ``filter`` works as Fabric's ``_apply_filter`` (the stock
strategy refuses it for sharded checkpoints), load such a checkpoint with
``strict=False``.

Loading reshards (saved on N processes, loaded on M) and follows Fabric's documented
``fabric.load(path, state, strict)``: the module and optimizers in ``state`` are
loaded in place; other requested keys are restored into their objects
(``load_state_dict`` for a Stateful object, otherwise ``state[key]`` is replaced); the
checkpoint's values that were not requested are returned. ``strict=True``: a requested
key the checkpoint lacks raises MissingKeyError (a KeyError, as Fabric's), and the
model's parameters must match the checkpoint's exactly (StateMismatchError); with
``strict=False`` missing keys and parameters are left as they are and extra ones
ignored. Entries of the checkpoint not asked for (an optimizer, a value) are never an
error: a partial load. Stock sharded or single-file checkpoints go to the stock code.

Requires ``pip install "dckpt[lightning]"``.
"""
from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Callable, Literal

import torch
from torch.nn import Module
from torch.optim import Optimizer

try:
    from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning_fabric.strategies import ModelParallelStrategy
    from lightning_fabric.strategies.model_parallel import _has_dtensor_modules
    from lightning_fabric.strategies.strategy import _apply_filter
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("dckpt.integrations.fabric needs lightning-fabric >= 2.6: "
                      'pip install "dckpt[lightning]"') from e

from . import committer as lio
from ...protocol.collectives import Comm


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


class DckptModelParallelStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with dckpt checkpoints: the same constructor,
    plus (keyword-only) ``storage_options`` (fsspec's, a dict), ``async_save`` (bool:
    ``fabric.save`` returns after the snapshot; the next save, load or the strategy's
    teardown waits for the commit), ``compression`` (None, "zstd", "lz4"),
    ``local_root`` (a node-local directory: ``fabric.save`` commits there and returns,
    the copy to ``path`` runs in the background, see :mod:`.tier`) and
    ``keep_last_local``. Raises CheckpointError for a bad option."""

    def __init__(self, parallelize_fn: Callable[[Any, Any], Any],
                 data_parallel_size: Literal["auto"] | int = "auto",
                 tensor_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, *,
                 storage_options: dict | None = None, async_save: bool = False,
                 compression: str | None = None, local_root: str | None = None,
                 keep_last_local: int = 2) -> None:
        super().__init__(parallelize_fn, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._dckpt = lio.Committer(storage_options, async_save, compression,
                                    local_root, keep_last_local)
        # Fabric never calls the strategy after the user's last fabric.save: a failed
        # asynchronous save nobody waited for fails the process at exit instead
        self._dckpt.watch()

    def save_checkpoint(self, path: Any, state: dict[str, Any],
                        storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Commit ``state`` as the dckpt checkpoint ``path`` (rank 0's path).
        Collective (``fabric.save`` calls it on every process). Raises BadStateError
        (no distributed module, two of them, the reserved key ``__lightning__``) and
        dckpt's CheckpointErrors, on every rank alike; nothing is placed then."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(path, state, storage_options, filter)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise lio.CheckpointError(f"storage_options must be a dict, got {storage_options!r}")
        module_key, module = _the_module(state, path)
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)

        tree: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        optimizers: list[str] = []
        for key, obj in state.items():
            if obj is module:
                converted, into = get_model_state_dict(module), tree
            elif isinstance(obj, Optimizer):
                converted, into = get_optimizer_state_dict(module, obj), tree
                optimizers.append(key)
            else:
                converted, into = (obj.state_dict() if _is_stateful(obj) else obj), meta
            _apply_filter(key, filter or {}, converted, into)
        if self.global_rank == 0:
            tree[lio.META_KEY] = lio.meta_entry(meta, [module_key], optimizers)
        fence = [state[k] for k in optimizers] + [module]
        self._dckpt.save(tree, str(path), fence=fence, storage_options=storage_options)

    def load_checkpoint(self, path: Any, state: Module | Optimizer | dict[str, Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore ``state`` from the checkpoint at ``path`` (any process count) and
        return the checkpoint's values not requested. Collective. ``state`` may be the
        distributed module alone (``fabric.load_raw``). Raises BadStateError (no
        state, no distributed module), MissingKeyError, StateMismatchError,
        NotCommittedError, IntegrityError: on every rank alike."""
        if not state:
            raise lio.BadStateError(
                f"load of {path}: give the state to restore, with at least the model: "
                "fabric.load(path, {'model': model, ...})")
        src = self._dckpt.resolve(str(path))
        spath = src.path
        if src.kind == "other":
            return super().load_checkpoint(path, state, strict, weights_only)
        if isinstance(state, Optimizer):
            raise lio.BadStateError(f"load of {path}: loading an optimizer alone is not "
                                    "supported; pass {'model': model, 'optimizer': opt}")
        whole = isinstance(state, Module)
        if whole:  # load_raw: the module under whatever key the checkpoint has it
            state = {None: state}
        module_key, module = _the_module(state, path)
        target: dict[Any, Any] = {}
        for key, obj in state.items():
            if obj is module:
                target[key] = lio.ModelState(module, strict)
            elif isinstance(obj, Optimizer):
                target[key] = lio.OptimizerState(module, obj)
        if whole:
            target = {_saved_module_key(src): target[None]}
        meta, _ = self._dckpt.load(target, src, strict=strict, modules=list(target)[:1]
                                   if whole else [module_key], weights_only=weights_only)
        if whole:
            return {}
        requested = [k for k, v in state.items() if v is not module and not isinstance(v, Optimizer)]
        missing = [k for k in requested if k not in meta]
        if strict and missing:
            raise lio.MissingKeyError(
                f"checkpoint {spath} has no entry {missing[0]!r} that the state asks for "
                "(pass strict=False to skip it)")
        for key in requested:
            if key not in meta:
                continue
            value = meta.pop(key)
            if _is_stateful(state[key]) and not isinstance(state[key], torch.Tensor):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return meta

    def teardown(self) -> None:
        """Wait for the saves in flight (raising a failed one's error), then the stock
        teardown. Called while an exception is propagating (the user's function
        failed on this rank): a bounded wait without any collective on the training's
        process group instead, so the user's error is the one seen (a collective would
        pair with the other ranks' and abort them)."""
        try:
            if sys.exc_info()[1] is not None:
                self._dckpt.abandon()
            else:
                self._dckpt.finish(drain=True)
        finally:
            super().teardown()


def _the_module(state: dict[Any, Any], path: Any) -> tuple[Any, Module]:
    """The one module of ``state`` with DTensor parameters (as Fabric requires), or
    BadStateError naming ``path``."""
    found = [(k, v) for k, v in state.items() if _has_dtensor_modules(v)]
    if len(found) != 1:
        raise lio.BadStateError(
            f"checkpoint {path}: the state must hold exactly one model set up by the "
            f"strategy (DTensor parameters), found {len(found)}: "
            f"{[k for k, _ in found] or list(state)}")
    if lio.META_KEY in state:
        raise lio.BadStateError(f"checkpoint {path}: the key {lio.META_KEY!r} is reserved")
    return found[0]


def _saved_module_key(src: "lio.Source") -> str:
    """The key under which the checkpoint ``src`` holds its module (rank 0 reads the
    metadata; every rank gets it). Collective."""
    import json

    comm = Comm()
    path = src.path
    key, err = None, None
    if comm.rank == 0:
        try:
            tree = json.loads(src.manifest(0).values[lio.META_KEY + ".tree"])
            key = dict(tree["dict"])["modules"]["list"][0]
        except Exception as e:
            err = lio.CheckpointError(f"{path}: no module recorded in its Lightning "
                                      f"metadata ({type(e).__name__}: {e})")
    lio.agree(comm, err, f"read the module's key in {path}")
    return lio._broadcast(comm, key)
