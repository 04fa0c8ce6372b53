"""``DckptAccelerator``: ``accelerate.Accelerator`` whose ``save_state``/``load_state``
write and read dckpt checkpoints: one atomic commit per save (the name appears only
complete), sharded (no gather), no pickle, resumable at any world size, with the newest
*committed* checkpoint picked at resume and rotation in commit order after the commit.

Accelerate's own save writes in place and picks "the newest" by the number in the
folder name, so a killed save is picked at resume; see docs/HF.md for what changes.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from ...errors import CheckpointError, StateMismatchError
from ...view.open import MissingKeyError
from ...protocol.collectives import Comm, agree, on_rank0
from ...protocol.settings import agree_settings
from ..common import resolve, tree
from ..common.arrival import Arrival
from ..common.commit import Committer, broadcast_json
from ..common.place import is_url, join, kind, local_path, remove_whole
from ..common.rotation import to_remove
from ..common.tier import LocalTier
from ..common import fast, modelfolder
from . import contents as cn
from . import ds as dsa
from . import loading as ld

log = logging.getLogger(__name__)
NAME = ld.NAME
REFUSED = ("MEGATRON_LM", "XLA")


class DckptAccelerator(Accelerator):
    """``accelerate.Accelerator`` with dckpt checkpoints. Takes ``Accelerator``'s
    arguments, plus keyword-only ``storage_options`` (fsspec's, for an object-store
    ``project_dir``/``output_dir``), ``async_save`` (``save_state`` returns after the
    snapshot; the optimizers' next ``step()`` waits for the copy), ``compression``
    (None, "zstd", "lz4"), ``local_root`` (a node-local fast tier: a save commits
    there and its copy to the checkpoint's name runs in the background, see
    :mod:`.fast`), ``keep_last_local`` (the slots each node keeps there) and
    ``save_arrival_timeout`` (seconds a rank in ``save_state`` or ``load_state`` waits
    for the others before it fails: both are collectives, so calling one on the main
    process only raises a CheckpointError on it instead of hanging) and
    ``model_folder`` (default True: model 0's weights stored once, under their names,
    with ``model.safetensors.index.json`` beside them, so the checkpoint loads with
    ``accelerate.utils.load_checkpoint_in_model`` or ``from_pretrained`` readers of a
    sharded folder; off, sharded models, compression and object stores: dckpt's files
    only). Raises
    CheckpointError on a bad option, and for DeepSpeed, Megatron-LM and XLA (their
    engines write their own checkpoints: keep ``accelerate.Accelerator``)."""

    def __init__(self, *args: Any, storage_options: dict | None = None,
                 async_save: bool = False, compression: str | None = None,
                 local_root: str | None = None, keep_last_local: int = 2,
                 save_arrival_timeout: float = 60.0, model_folder: bool = True,
                 **kwargs: Any) -> None:
        arrival = Arrival("DckptAccelerator", save_arrival_timeout)  # validates
        if isinstance(keep_last_local, bool) or not isinstance(keep_last_local, int) \
                or keep_last_local < 1:
            raise CheckpointError(f"keep_last_local must be an int >= 1, got {keep_last_local!r}")
        if not isinstance(model_folder, bool):
            raise CheckpointError(f"model_folder must be True or False, got {model_folder!r}")
        committer = Committer(storage_options, async_save, compression)  # validates
        tier = None if local_root is None else LocalTier(
            local_root, keep_last_local, storage_options, compression)
        if tier is not None:
            tier.adopt = ()  # a copy keeps what scripts wrote at the name, as a direct save
        super().__init__(*args, **kwargs)
        dt = getattr(self.distributed_type, "name", str(self.distributed_type))
        if dt in REFUSED:
            raise CheckpointError(
                f"DckptAccelerator does not support DistributedType.{dt}: its engine writes "
                "its own checkpoints; use accelerate.Accelerator for it")
        if dt == "DEEPSPEED" and tier is not None:
            raise CheckpointError("DckptAccelerator under DeepSpeed does not support "
                                  "local_root yet")
        self._dckpt = committer
        self._dckpt_tier = tier
        self._dckpt_rotation_fast = fast.Rotation()  # total_limit with the fast tier
        self._dckpt_agreed: Any = None
        self._dckpt_warned = False
        self._dckpt_model_folder = model_folder  # model 0's weights loadable as a folder
        self._dckpt_arrival = arrival
        self._dckpt_load_arrival = Arrival("DckptAccelerator", save_arrival_timeout)
        self._dckpt_strict = True  # load_state(strict=...) of the load in progress
        self._dckpt_copy = False  # an unpickled copy (see __getstate__)

    def __getstate__(self) -> dict:
        """Stock accelerators pickle (dataloader workers, multiprocessing): so does
        this one. The copy carries the settings but no save in flight, no process
        group and no fast tier (its threads and leases belong to this process): a save
        or load through the copy with ``local_root`` raises CheckpointError. Waits for
        the snapshot of an asynchronous save in flight (its fence's hooks on the models
        are closures, which do not pickle)."""
        self._dckpt.unfence()
        d = dict(self.__dict__)
        d["_dckpt_agreed"] = None
        if d.get("_dckpt_tier") is not None:
            d["_dckpt_tier"] = None
            d["_dckpt_copy"] = True
        d["_dckpt_rotation_fast"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._dckpt_rotation_fast = fast.Rotation()

    def _dckpt_usable(self) -> None:
        if self._dckpt_copy:
            raise CheckpointError("this DckptAccelerator is an unpickled copy of one with "
                                  "local_root: its fast tier belongs to the original "
                                  "process; save and load there")

    # ------------------------------------------------------------------ helpers
    def _dckpt_agree(self, comm: Comm) -> None:
        """The settings that shape the collectives, the same on every rank (one
        all-gather, on the first call of each process group), else CheckpointError on
        every rank naming them."""
        import torch.distributed as dist

        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if self._dckpt_agreed is not None and self._dckpt_agreed is world:
            return
        pc = self.project_configuration
        bad = None
        if pc.total_limit is not None and (not isinstance(pc.total_limit, int)
                                           or pc.total_limit < 1):
            bad = f"total_limit must be None or an int >= 1, got {pc.total_limit!r}"
        agree_settings(comm, {"async_save": self._dckpt.async_save,
                              "compression": self._dckpt.compression,
                              "automatic_checkpoint_naming": pc.automatic_checkpoint_naming,
                              "total_limit": pc.total_limit,
                              "local_root": self._dckpt_tier is not None,
                              "keep_last_local": getattr(self._dckpt_tier, "keep", None),
                              "model_folder": self._dckpt_model_folder},
                       bad, "DckptAccelerator")
        self._dckpt_agreed = world

    def _checkpoints_dir(self) -> str:
        return ld.checkpoints_dir(self)

    # ------------------------------------------------------------------ saving
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Any:
        """Save everything stock ``save_state`` saves as one dckpt commit and return its
        path (a ``pathlib.Path`` as stock; a ``str`` for an object-store URL). Files
        written into that folder before the save, or after an asynchronous save
        returned, are kept in the placed checkpoint (never deleted). Collective; blocking I/O (each rank writes its own shards; rank 0 renames
        the staged folder into place and, with ``total_limit``, removes the oldest
        committed checkpoints after the commit). With ``async_save`` it returns after
        the snapshot and the rest runs in the background (the next save/load and
        ``end_training`` raise its error). ``safe_serialization`` is ignored (nothing
        is pickled). Raises on every rank alike: ValueError (automatic naming and the
        name exists, as stock), CheckpointError (the commit's, a hook's, a value that
        cannot be stored): the ``save_arrival_timeout`` one on a rank that called it
        while another did not."""
        self._dckpt_usable()
        self._dckpt_arrival.check("save_state")
        return _as_path(self._save_state(output_dir))

    def _save_state(self, output_dir: str | None) -> str:
        comm = Comm()
        self._dckpt_agree(comm)
        pc = self.project_configuration
        if pc.save_on_each_node and not self._dckpt_warned:
            self._dckpt_warned = True
            log.warning("save_on_each_node is ignored: every rank writes its own files of "
                        "one checkpoint (without shared storage, use an object store)")
        auto = pc.automatic_checkpoint_naming
        if auto:
            parent = self._checkpoints_dir()
            output_dir = join(parent, f"checkpoint_{self.save_iteration}")
            self._dckpt.finish()
            target = output_dir

            def look() -> bool:
                try:
                    return kind(target, self._dckpt.storage_options) != "none" or (
                        not is_url(target) and os.path.exists(local_path(target)))
                except Exception as e:
                    if self._dckpt_tier is None:
                        raise
                    # the durable store is down: the fast tier takes the save anyway
                    log.warning("cannot look up %s (%s): saving to the fast tier; its "
                                "copy will be tried in the background", target, e)
                    return False
            exists = on_rank0(comm, look, f"look up {output_dir}")
            if exists:
                raise ValueError(
                    f"Checkpoint directory {output_dir} ({self.save_iteration}) already "
                    "exists. Please manually override `self.save_iteration` with what "
                    "iteration to start with.")
        elif output_dir is None:
            raise CheckpointError("save_state needs output_dir without "
                                  "ProjectConfiguration(automatic_checkpoint_naming=True)")
        output_dir = os.fspath(output_dir)
        tier = self._dckpt_tier
        if tier is not None:
            self._dckpt_rotation_fast.flush()
            fast.check_name(self._dckpt, output_dir)
            # the hooks write beside the slot; the background copy takes their files
            extras = (fast.prepare_extras(tier, output_dir)
                      if self._save_model_state_pre_hook else None)
            skip = self._run_save_hooks(comm, extras or "")
        else:
            plan = self._dckpt.plan(output_dir)  # the hooks write into its staging folder
            skip = self._run_save_hooks(comm, plan.target)
        built, err = None, None
        try:
            c = cn.contents(self, skip, comm.rank)
            built = tree.build(c, comm.rank, cn.META_KEY)
            if dsa.enabled(self):  # the engines' state, nested (cn.contents skips them)
                built[dsa.ROOT] = dsa.build(self)
        except Exception as e:
            err = e
        agree(comm, err, f"collect the state to save to {output_dir}")
        if tier is not None:
            final = fast.save(tier, self._dckpt, built, output_dir, pc.iteration,
                              extras=extras)
            if auto and pc.total_limit is not None:
                self._dckpt_rotation_fast.after_save(
                    self._dckpt.async_save, tier, self._checkpoints_dir(), NAME, final,
                    pc.total_limit, self._dckpt.storage_options)
            pc.iteration += 1
            return final
        after = None
        if auto and pc.total_limit is not None:
            after = self._rotation(plan.final, pc.total_limit)
        side = cn.side_file(self, c, output_dir)
        self._dckpt.commit(built, plan, fence=tree.fence_targets(c), after=after, side=side,
                           prepare=modelfolder.write_index if side is not None else None)
        pc.iteration += 1
        return plan.final

    def _run_save_hooks(self, comm: Comm, target: str) -> set[int]:
        """Run the save pre-hooks with (models, weights, the staging folder) as stock
        does; return the models whose weights entry a hook removed on rank 0 (not saved
        by dckpt). Collective (errors agreed, then a broadcast)."""
        hooks = list(self._save_model_state_pre_hook.values())
        if not hooks:
            return set()
        fsdp = self.distributed_type == DistributedType.FSDP
        err, dropped = None, []
        try:
            weights, owners = [], []
            if not fsdp:
                for i, m in enumerate(self._models):
                    weights.append(self.get_state_dict(m, unwrap=False))
                    owners.append(i)
            before = list(weights)
            for hook in hooks:
                hook(self._models, weights, target)
            kept = {id(w) for w in weights}
            dropped = [owners[k] for k, w in enumerate(before) if id(w) not in kept]
        except Exception as e:
            err = e
        agree(comm, err, "the save_state pre-hooks")
        return set(broadcast_json(comm, dropped))

    def _rotation(self, just_saved: str, limit: int):
        opts = self._dckpt.storage_options
        parent = self._checkpoints_dir()

        def rotate() -> None:
            from ... import _faults

            entries = resolve.committed_in(parent, NAME, opts)
            for path in to_remove(entries, limit, just_saved):
                _faults.fault("rotate", 0)  # crash tests: a kill between removals
                remove_whole(path, opts)
                log.info("total_limit=%d: removed %s", limit, path)
        return rotate

    # ------------------------------------------------------------------ loading
    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Load a dckpt checkpoint saved by :meth:`save_state` at any world size:
        ``input_dir``, or with automatic naming the newest *committed*
        ``checkpoint_<i>`` in commit order (a damaged one is skipped with a warning and
        the one before it tried). Restores the models, optimizers, schedulers, scaler,
        dataloaders, registered objects, ``step``, ``project_configuration.iteration``
        (saved + 1) and each rank's RNG (rank r >= the saved world size: a stream
        derived from rank r mod N's). A folder without a dckpt manifest (a stock
        checkpoint) goes to ``accelerate.Accelerator.load_state``. Collective;
        blocking I/O. Raises on every rank alike: ValueError (a missing folder; no
        input_dir without automatic naming), NotCommittedError (nothing committed),
        IntegrityError, StateMismatchError, MissingKeyError. ``strict=False`` (stock's
        ``load_model_func_kwargs``): the models' missing and unexpected keys are left to
        their own ``load_state_dict(strict=False)``, as stock."""
        self._dckpt_usable()
        self._dckpt_load_arrival.check("load_state")
        map_location = load_model_func_kwargs.pop("map_location", None)
        if map_location not in (None, "cpu", "on_device"):  # stock's check and error
            raise TypeError("Unsupported optimizer map location passed, please choose one "
                            "of `None`, `'cpu'`, or `'on_device'`")
        # a dckpt load reads in place into the live tensors (each on its own device), so
        # every location stock allows ends as stock's: the optimizer's state beside its
        # parameters (torch's load_state_dict moves it there anyway)
        strict = load_model_func_kwargs.get("strict", True)
        if not isinstance(strict, bool):
            raise CheckpointError(f"load_state: strict must be a bool, got {strict!r}")
        self._dckpt_strict = strict
        try:
            ld.load(self, input_dir, load_kwargs, super().load_state,
                    **load_model_func_kwargs)
            if self.project_configuration.automatic_checkpoint_naming:
                ld.continue_run(self, Comm())
        except (MissingKeyError, StateMismatchError) as e:
            # the core's hint names its own keyword; load_state takes stock's
            msg = str(e).replace("allow_missing=True", "strict=False")
            if msg == str(e):
                raise
            raise type(e)(msg) from None

    def end_training(self) -> None:
        """Wait for an asynchronous save in flight (raising its error on every rank),
        then Accelerate's ``end_training``. Collective when a save was in flight, except
        when called while an exception propagates (``try: ... finally:
        accelerator.end_training()`` after this rank's training failed): then a bounded
        wait without any collective on the training's group, so this rank's own error is
        the one seen (a collective would wait for ranks still training)."""
        tier = self._dckpt_tier
        try:
            if sys.exc_info()[1] is not None:
                self._dckpt.abandon()
                if tier is not None:
                    tier.abandon(60.0)
            else:
                self._dckpt.finish()
                if tier is not None:
                    self._dckpt_rotation_fast.flush()
                    tier.drain()  # every durable copy queued (a failed one is logged)
        finally:
            super().end_training()


def _as_path(path: str) -> Any:
    """Stock returns a ``pathlib.Path``; a URL stays a ``str`` (a Path would fold its
    ``//``). Pure."""
    import pathlib

    return path if is_url(path) else pathlib.Path(path)
