"""PyTorch Lightning on dckpt: :class:`DckptModelParallelStrategy`, Lightning's
``ModelParallelStrategy`` (FSDP2 and tensor parallelism) whose sharded checkpoints are
dckpt checkpoints.

    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=DckptModelParallelStrategy(data_parallel_size=2,
                                                          tensor_parallel_size=1),
                      callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True)])
    trainer.fit(model, ckpt_path="last")

What changes against the stock strategy (read from pytorch_lightning 2.6's
``strategies/model_parallel.py`` and ``lightning_fabric/strategies/model_parallel.py``):

- ``save_checkpoint`` commits the model's shards, the optimizers' states and Lightning's
  metadata (loops, callbacks, hyper-parameters, schedulers, user keys: everything
  ``dump_checkpoint`` returns besides ``state_dict`` and ``optimizer_states``) in one
  dckpt two-phase commit. The stock strategy writes DCP files in place and then
  ``meta.pt`` (a pickle) from rank 0, so a save killed half-way leaves a folder that
  ``ckpt_path="last"`` picks and loads as a mix of two steps. Here the name appears only
  complete (:mod:`.committer`): killed at any moment, resume takes the previous
  complete checkpoint. The metadata is JSON in dckpt's manifest plus tensors; values
  that are neither (an ``argparse.Namespace`` in the hyper-parameters) are pickled
  into one byte tensor of the checkpoint, which dckpt checksums but does not control.
- ``load_checkpoint`` reshards: a checkpoint of N devices resumes on M, with every byte
  verified. It returns the metadata dict as the stock one returns ``meta.pt``'s
  contents, having loaded the model and the optimizers itself (this strategy restores
  after setup), honouring ``LightningModule.strict_loading``. A stock sharded
  checkpoint (a folder with ``meta.pt``) or a single-file one is loaded by the stock
  code, so a run can move from the stock strategy to this one.
- ``remove_checkpoint`` (``ModelCheckpoint``'s ``save_top_k``) removes a checkpoint whole,
  after the save in flight has committed.
- ``storage_options`` (fsspec's, for ``s3://`` and other URLs, or ``{"direct_io":
  False}``), ``async_save`` (the save returns after the snapshot; the optimizers' next
  ``step()`` waits for the copy; commit, rename and removals run in the background),
  ``compression`` ("zstd" / "lz4", ``pip install "dckpt[compress]"``) and
  ``local_root`` (a node-local directory: a save commits there and returns, the copy to
  the checkpoint's name runs in the background; a load reads the node-local copy when
  every rank holds it and it is not older than the name's; ``keep_last_local`` of them
  kept).

``save_distributed_checkpoint=False`` keeps the stock single-file behaviour.
Requires ``pip install "dckpt[lightning]"``; importing :mod:`dckpt` never imports
Lightning.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

try:
    from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy
    from pytorch_lightning.strategies.launchers.launcher import _Launcher
    from pytorch_lightning.utilities.rank_zero import rank_zero_warn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("dckpt.integrations.lightning needs pytorch-lightning >= 2.6: "
                      'pip install "dckpt[lightning]"') from e

from . import committer as lio

log = logging.getLogger(__name__)


class DckptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with dckpt checkpoints; the same
    constructor, plus (keyword-only) ``storage_options`` (a dict for fsspec, used by
    every save, load and removal), ``async_save`` (bool) and ``compression`` (None,
    "zstd", "lz4"), ``local_root`` (a node-local directory: the fast tier, see
    :mod:`.tier`) and ``keep_last_local`` (its checkpoints kept per rank).
    Raises CheckpointError for a bad option. See the module docstring for what each
    checkpoint method does differently."""

    def __init__(self, data_parallel_size: Literal["auto"] | int = "auto",
                 tensor_parallel_size: Literal["auto"] | int = "auto",
                 save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, *,
                 storage_options: dict | None = None, async_save: bool = False,
                 compression: str | None = None, local_root: str | None = None,
                 keep_last_local: int = 2) -> None:
        super().__init__(data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._dckpt = lio.Committer(storage_options, async_save, compression,
                                    local_root, keep_last_local)
        self._failed: BaseException | None = None  # the training's error (on_exception)

    # ModelCheckpoint's "last" is resolved by Lightning itself, per process, before the
    # process group exists (CheckpointConnector._parse_ckpt_path: the newest existing
    # last*.ckpt by mtime), so a save committed only in the fast tier, or a last.ckpt
    # link to a save that never committed, would start the fit from step 0. The
    # launcher is the first place that sees the trainer (Trainer.fit hands it over
    # before resolving the path): there the strategy makes "last" its own question,
    # answered collectively once the process group exists (resume_start).
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._launcher is None:  # torchrun: the processes exist already
            self._launcher = _InProcessLauncher()
        inner, strategy = self._launcher.launch, self

        def launch(function, *args, trainer=None, **kwargs):
            if trainer is not None:
                _own_last(strategy, trainer)
            return inner(function, *args, trainer=trainer, **kwargs)

        self._launcher.launch = launch

    # The states dump_checkpoint puts in the checkpoint dict: the live sharded tensors
    # (the stock strategy offloads copies to the CPU; dckpt copies what it writes
    # itself, and an asynchronous save fences on the live ones).
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict (live DTensors, no copy); the stock one with
        ``save_distributed_checkpoint=False``."""
        if not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer's FQN-keyed sharded state (live tensors); the stock one with
        ``save_distributed_checkpoint=False``."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Commit ``checkpoint`` (``Trainer.dump_checkpoint``'s dict) as the dckpt
        checkpoint ``filepath`` (rank 0's path), atomically. Collective (the Trainer
        calls it on every rank). ``storage_options`` adds to the constructor's.
        Raises CheckpointError on every rank alike; nothing is placed then."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise lio.CheckpointError(f"storage_options must be a dict, got {storage_options!r}")
        tree: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        optimizers = [f"optimizer_{i}" for i in range(len(checkpoint.get("optimizer_states", [])))]
        for key, osd in zip(optimizers, checkpoint.pop("optimizer_states", [])):
            tree[key] = osd
        if self.global_rank == 0:  # the stock strategy writes rank 0's meta.pt
            tree[lio.META_KEY] = lio.meta_entry(checkpoint, ["state_dict"], optimizers)
        fence = [*self.optimizers, self.model] if self.optimizers else None
        self._dckpt.save(tree, str(filepath), fence=fence, storage_options=storage_options,
                         step=int(checkpoint.get("global_step", 0) or 0))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model and the optimizers from the checkpoint at ``checkpoint_path``
        (any device count) and return Lightning's metadata dict (epoch, global_step,
        loops, callbacks, lr_schedulers...). Collective. A stock checkpoint goes to
        the stock code. Raises NotCommittedError (nothing complete there), dckpt's
        CheckpointErrors (MissingKeyError, StateMismatchError with
        ``strict_loading``, IntegrityError), on every rank alike."""
        src = self._dckpt.resolve(str(checkpoint_path))
        if src.kind == "other":
            return super().load_checkpoint(checkpoint_path, weights_only)
        assert self.lightning_module is not None and self.model is not None
        strict = self.lightning_module.strict_loading
        target: dict[str, Any] = {"state_dict": lio.ModelState(self.model, strict)}
        for i, opt in enumerate(self.optimizers):
            target[f"optimizer_{i}"] = lio.OptimizerState(self.model, opt)
        meta, _ = self._dckpt.load(target, src, strict=strict, modules=["state_dict"],
                                   weights_only=weights_only)
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the model (as the stock strategy)."""

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint at ``filepath`` whole, on rank 0 (after the save in
        flight commits, if any). Not collective; blocking I/O on rank 0."""
        self._dckpt.remove(str(filepath), self.is_global_zero)

    def on_exception(self, exception: BaseException) -> None:
        """Lightning's hook when the run fails on this rank: the teardown that follows
        then enters no collective (see :meth:`teardown`)."""
        self._failed = exception
        super().on_exception(exception)

    def teardown(self) -> None:
        """End of the run. Normally: wait for the saves in flight (committed, placed,
        and with the fast tier copied) and raise a failed save's error on every rank
        (the fit fails, as with a synchronous save), after the stock teardown. After a
        failure of this rank (``on_exception``): wait a bounded time for the save in
        flight, without any collective on the training's process group (the other
        ranks may still be training: a collective would pair with theirs and abort
        them, hiding this rank's error); the training's error is the one raised."""
        failed, self._failed = self._failed, None
        error = None
        if failed is not None or sys.exc_info()[1] is not None:
            self._dckpt.abandon()
        else:
            try:
                self._dckpt.finish(drain=True)
            except Exception as e:
                log.error("the last asynchronous checkpoint save failed: %s", e)
                error = e
        super().teardown()
        if error is not None:
            raise error


class _InProcessLauncher(_Launcher):
    """The launcher where the processes are started by someone else (torchrun): runs
    the function in this process (as Lightning does without a launcher)."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function, *args, trainer=None, **kwargs):
        return function(*args, **kwargs)

    def kill(self, signum) -> None:
        pass


class LastRequest(str):
    """``ckpt_path="last"`` as the strategy answers it: the str is Lightning's own pick
    (or the default last name); ``candidates`` are Lightning's ``last*.ckpt`` names
    (links included, dangling or not), ``dirs`` the directories of the
    ModelCheckpoints with ``save_last``. Resolved by :meth:`Committer.resolve_last`."""

    candidates: list[str]
    dirs: list[str]


def _own_last(strategy: DckptModelParallelStrategy, trainer: Any) -> None:
    """Make ``trainer`` ask ``strategy`` which checkpoint "last" is: its checkpoint
    connector's ``_parse_ckpt_path`` turns "last" into a :class:`LastRequest`, and its
    ``resume_start`` resolves that collectively (the process group exists by then).
    Idempotent; instance attributes of that trainer's connector only."""
    conn = trainer._checkpoint_connector
    if getattr(conn, "_dckpt_strategy", None) is strategy:
        return
    parse, resume = type(conn)._parse_ckpt_path, type(conn).resume_start

    def parse_ckpt_path(state_fn, ckpt_path, model_provided, model_connected):
        if ckpt_path == "last" and strategy._save_distributed_checkpoint:
            req = _last_request(trainer)
            if req is not None:
                return req
        return parse(conn, state_fn, ckpt_path, model_provided, model_connected)

    def resume_start(checkpoint_path=None, weights_only=None):
        if isinstance(checkpoint_path, LastRequest):
            checkpoint_path = strategy._dckpt.resolve_last(checkpoint_path.candidates,
                                                           checkpoint_path.dirs)
            if checkpoint_path is None:
                rank_zero_warn('ckpt_path="last" is set, but there is no complete last '
                               "checkpoint (in any tier). No checkpoint will be loaded.")
        return resume(conn, checkpoint_path, weights_only)

    conn._parse_ckpt_path = parse_ckpt_path
    conn.resume_start = resume_start
    conn._dckpt_strategy = strategy


def _last_request(trainer: Any) -> LastRequest | None:
    """Lightning's "last" lookup, kept whole for the strategy to decide on: the
    ``last*.ckpt`` names of every ModelCheckpoint (as ``_find_last_checkpoints``
    lists them, dangling links included) and an OnExceptionCheckpoint's path; None
    when no ModelCheckpoint could hold one (Lightning's own answer stands then).
    Blocking I/O: a listing per checkpoint directory (Lightning's own)."""
    from pytorch_lightning.callbacks.on_exception_checkpoint import OnExceptionCheckpoint

    candidates: set[str] = {p for p in (getattr(cb, "ckpt_path", None) for cb in
                                        trainer.callbacks
                                        if isinstance(cb, OnExceptionCheckpoint)) if p}
    dirs: list[str] = []
    for cb in trainer.checkpoint_callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        candidates |= cb._find_last_checkpoints(trainer)
        if cb.save_last:
            resolve = getattr(cb, "_ModelCheckpoint__resolve_ckpt_dir", None)
            d = cb.dirpath or (resolve(trainer) if resolve else None)
            if d:
                dirs.append(str(d))
    if not candidates and not dirs:
        return None
    req = LastRequest(lio.join(dirs[0], "last.ckpt") if dirs else sorted(candidates)[-1])
    req.candidates, req.dirs = sorted(map(str, candidates)), dirs
    return req
