"""``DckptTrainerMixin`` / ``DckptTrainer``: the transformers ``Trainer`` whose checkpoint
saves are dckpt commits under ``{output_dir}/checkpoint-{global_step}`` (staged under a
hidden name, placed only once committed, so ``get_last_checkpoint`` never sees a partial
one), sharded (no gather), without pickle, rotated in commit order after the commit, and
resumed from the newest *committed* checkpoint at any world size.

The Trainer's own save writes each file in place into ``checkpoint-N`` and its resume
takes the highest number with a folder, complete or not; see docs/HF.md.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from ...errors import CheckpointError, StateMismatchError
from ...protocol.collectives import Comm, agree
from ...protocol.settings import agree_settings
from ...view.open import MissingKeyError
from ..common import resolve, tree
from ..common import fast
from ..common.commit import Committer
from ..common.place import durable_name, is_url, kind, read_manifest, remove_whole
from ..common.rotation import to_remove
from ..common.tier import LocalTier
from ..common.verify import verify_shared
from . import export
from . import resume as rs
from .resume import JIT_SENTINEL, META_KEY, NAME, STATE_FILE

log = logging.getLogger(__name__)
ARGS_FILE = "training_args.json"


def _inner(opt: Any) -> Any:
    return getattr(opt, "optimizer", opt)


def _manifest(path: str, view: str | None) -> Any:
    """The parsed manifest at ``path`` (``view``: a fast-tier rank's). Blocking I/O."""
    if view is None:
        return read_manifest(path)
    from ...format import manifest as mf
    from ...protocol.restore import read_manifest_bytes
    from ...storage.fsspec_storage import make_storage

    storage, root = make_storage(path)
    return mf.parse(read_manifest_bytes(storage, root, view), f"{path}/{view}")


class DckptTrainerMixin:
    """Mix into a ``transformers.Trainer`` (sub)class, first:
    ``class MySFT(DckptTrainerMixin, trl.SFTTrainer)``. Takes the Trainer's arguments,
    plus keyword-only ``compression`` (None, "zstd", "lz4") and ``async_save`` (a save
    returns after the snapshot; the optimizer's next ``step()`` waits for the copy; the
    commit, placement and rotation run in the background; the next save, a load and
    the end of ``train()`` wait and raise its error on every rank), ``local_root`` (a
    node-local fast tier: a save commits there and its copy to ``checkpoint-N`` runs
    in the background, see :mod:`..common.fast`) and ``keep_last_local``.
    ``storage_options`` is accepted for symmetry with ``DckptAccelerator`` but not
    supported (the Trainer reads its checkpoints from a local ``output_dir``): a value
    raises. Raises CheckpointError on a bad option, an object-store ``output_dir``, and
    under DeepSpeed (its engine writes its own checkpoints: keep
    ``transformers.Trainer``)."""

    def __init__(self, *args: Any, storage_options: dict | None = None,
                 async_save: bool = False, compression: str | None = None,
                 local_root: str | None = None, keep_last_local: int = 2,
                 **kwargs: Any) -> None:
        if storage_options is not None:
            raise CheckpointError(f"DckptTrainer: storage_options={storage_options!r} is not "
                                  "supported (the Trainer's checkpoints live on a local "
                                  "output_dir; use local_root for a node-local fast tier)")
        committer = Committer(None, async_save, compression,  # validates both
                              markers=(JIT_SENTINEL,),
                              sidecars=(STATE_FILE, ARGS_FILE, "config.json"))
        if isinstance(keep_last_local, bool) or not isinstance(keep_last_local, int) \
                or keep_last_local < 1:
            raise CheckpointError(f"keep_last_local must be an int >= 1, got {keep_last_local!r}")
        tier = None if local_root is None else LocalTier(local_root, keep_last_local, None,
                                                         compression)
        super().__init__(*args, **kwargs)
        if async_save and self.args.push_to_hub:
            raise CheckpointError("DckptTrainer: async_save=True with push_to_hub: the push "
                                  "reads the checkpoint before its background commit places it")
        if getattr(self, "is_deepspeed_enabled", False):
            raise CheckpointError("DckptTrainer does not support DeepSpeed: its engine writes "
                                  "its own checkpoints; use transformers.Trainer for it")
        if is_url(str(self.args.output_dir)):
            raise CheckpointError(f"DckptTrainer: output_dir {self.args.output_dir!r} is a "
                                  "URL; the Trainer reads its checkpoints locally")
        self._dckpt = committer
        self._dckpt_tier = tier
        self._dckpt_rotation_fast = fast.Rotation()  # total_limit with the fast tier
        self._dckpt_src: tuple[str, str | None] | None = None  # (path, view) a resume reads
        self._dckpt_agreed: Any = None  # the process group the settings were agreed on
        self._dckpt_resume: str | None = None  # the dckpt checkpoint train() resumes
        self._dckpt_loaded: Any = None  # its load (the RNG, set at _load_rng_state)

    # ------------------------------------------------------------------ saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save the model and optimizer (sharded as trained: FSDP2, FSDP1, DDP or one
        process), the lr_scheduler, the scaler, each rank's RNG, ``trainer_state.json``,
        ``config.json`` and ``training_args.json`` as one dckpt commit placed at
        ``{run_dir}/checkpoint-{global_step}`` once committed; ``save_only_model``: the
        model only. Then, on rank 0, ``save_total_limit`` removes the oldest committed
        checkpoints (commit order, never the new one nor ``best_model_checkpoint``).
        Collective; blocking I/O (each rank writes its own shards; rank 0 the JSON
        files, one rename and the removals; with ``async_save`` all but the snapshot
        run in the background, after waiting for the save before). Raises the same
        CheckpointError on every rank (nothing is placed then), UnsupportedValueError
        for a scheduler value that cannot be stored."""
        comm = Comm()
        self._dckpt_agree(comm)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        tier = self._dckpt_tier
        plan = self._dckpt.plan(output_dir) if tier is None else None
        if tier is not None:
            self._dckpt_rotation_fast.flush()
            fast.check_name(self._dckpt, output_dir)
        final = os.path.abspath(output_dir)
        if (self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH,
                                        SaveStrategy.BEST] and self.state.best_global_step):
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.abspath(best) == final or os.path.exists(best):
                self.state.best_model_checkpoint = best
        built, err, files = None, None, {}
        try:
            if comm.rank == 0:
                files = self._dckpt_json_files()
                for name, text in files.items() if plan is not None else ():
                    with open(os.path.join(plan.target, name), "w", encoding="utf-8") as f:
                        f.write(text)
            c = self._dckpt_contents(comm.rank, files.get(STATE_FILE))
            built = tree.build(c, comm.rank, META_KEY)
        except Exception as e:
            err = e
        agree(comm, err, f"collect the state to save to {output_dir}")
        if tier is not None:  # the fast tier: its copy writes the JSON files when it begins
            fast.save(tier, self._dckpt, built, output_dir, self.state.global_step, files)
            limit = self.args.save_total_limit
            if limit is not None and limit > 0:
                best = self.state.best_model_checkpoint
                self._dckpt_rotation_fast.after_save(
                    self._dckpt.async_save, tier, run_dir, NAME, final, limit, None,
                    durable_name(best) if best else None)
        else:
            self._dckpt.commit(built, plan, fence=tree.fence_targets(c),
                               after=self._dckpt_rotation(run_dir, plan.final))
        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)

    def _dckpt_agree(self, comm: Comm) -> None:
        """The settings that decide what a save holds and how it is committed, the same
        on every rank (one all-gather, once per process group), else CheckpointError on
        every rank naming them (a model-only flag on one rank would commit another
        rank's optimizer under model-only metadata)."""
        import torch.distributed as dist

        world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if self._dckpt_agreed is not None and self._dckpt_agreed is world:
            return
        a = self.args
        agree_settings(comm, {"save_only_model": bool(a.save_only_model),
                              "async_save": self._dckpt.async_save,
                              "compression": self._dckpt.compression,
                              "save_total_limit": a.save_total_limit,
                              "has_optimizer": self.optimizer is not None,
                              "has_lr_scheduler": self.lr_scheduler is not None,
                              "local_root": self._dckpt_tier is not None,
                              "keep_last_local": getattr(self._dckpt_tier, "keep", None)},
                       None, "DckptTrainer")
        self._dckpt_agreed = world

    def _dckpt_json_files(self) -> dict[str, str]:
        """Rank 0: the stateful callbacks' states into ``self.state`` (as stock), then
        {file name: text} of trainer_state.json (as ``TrainerState.save_to_json``
        writes it), training_args.json and the model's config.json: written beside
        dckpt's files, they appear with the checkpoint. No I/O."""
        import dataclasses
        import json

        from transformers.trainer_callback import ExportableState

        for cb in [c for c in self.callback_handler.callbacks + [self.control]
                   if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        files = {STATE_FILE: json.dumps(dataclasses.asdict(self.state), indent=2,
                                        sort_keys=True) + "\n",
                 ARGS_FILE: self.args.to_json_string()}
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            files["config.json"] = config.to_json_string()
        return files

    def _dckpt_contents(self, rank: int, state_json: str | None = None) -> tree.Contents:
        only = bool(self.args.save_only_model)
        opts = [] if only or self.optimizer is None else [(_inner(self.optimizer), 0)]
        objects: dict[str, Any] = {}
        meta = None
        if rank == 0:
            if not only and self.lr_scheduler is not None:
                objects["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if not only and scaler is not None:
                objects["scaler"] = scaler.state_dict()
            import transformers

            meta = {"framework": "transformers", "transformers": transformers.__version__,
                    "global_step": int(self.state.global_step), "model_only": only,
                    # trainer_state.json again, checksummed with the manifest: what a
                    # resume from the fast tier (no such file there) hands the Trainer
                    "trainer_state": state_json,
                    "scheduler": "scheduler" in objects, "scaler": "scaler" in objects}
        # FSDP: self.model is the prepared (sharded) model; else the unwrapped one, whose
        # parameters are the optimizer's (DDP's own prefix never enters the keys)
        return tree.Contents([self.model], set(), opts, objects, meta)

    def _dckpt_rotation(self, run_dir: str, just_saved: str):
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return None
        best = self.state.best_model_checkpoint
        best = durable_name(best) if best else None

        def rotate() -> None:
            from ... import _faults

            entries = resolve.committed_in(run_dir, NAME)
            keep_best = best is not None and best != just_saved and any(
                c.path == best for c in entries)
            pool = [c for c in entries if not (keep_best and c.path == best)]
            for path in to_remove(pool, max(1, limit - int(keep_best)), just_saved):
                _faults.fault("rotate", 0)  # crash tests: a kill between removals
                remove_whole(path)
                log.info("save_total_limit=%d: removed %s", limit, path)
        return rotate

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``. Under FSDP with ``SHARDED_STATE_DICT`` (where stock
        writes no weights): HF safetensors + ``config.json`` (+ generation config,
        processing class, ``training_args.json``) that ``from_pretrained`` loads,
        without gathering the model on any rank (:mod:`.export`). Collective there;
        blocking I/O. Any other setup: stock. Raises CheckpointError on every rank."""
        if not export.sharded(self):
            return super().save_model(output_dir, _internal_call)
        export.save_sharded_model(self, output_dir if output_dir is not None
                                  else str(self.args.output_dir))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------ resuming
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any):
        """``Trainer.train``. ``resume_from_checkpoint=True``: the newest *committed*
        ``checkpoint-N`` of ``output_dir`` in commit order, verified by all ranks
        together before the Trainer reads it (a damaged one is skipped with a warning
        naming the cause, the one before it tried); no dckpt checkpoint there: the
        stock lookup (stock folders, migration). A path: a dckpt checkpoint loads at
        any world size (model, optimizer, scheduler, scaler, RNG by the r mod N rule;
        the step and the data skip from its trainer_state.json, as stock); any other
        folder goes to the stock ``Trainer.train``. Collective; blocking I/O (with
        ``True``: the verification reads the checkpoint once, spread over the ranks,
        then the load reads what each rank needs). Raises on every rank alike:
        CheckpointError when no candidate verifies (listing each), NotCommittedError,
        IntegrityError, StateMismatchError, MissingKeyError; ValueError when
        ``output_dir`` holds no checkpoint (as stock). ``async_save``: waits for the
        save in flight first and for the last one before returning (raising its error
        on every rank); after a failure of the training, waits without a collective."""
        call = dict(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        self._dckpt.finish()  # an earlier train()'s save in flight (none: no collective)
        tier = self._dckpt_tier
        if tier is not None:
            rs.sweep_resume_folders(tier.root)  # left by killed runs of this host
        path: str | None = None
        src: tuple[str, str | None] | None = None  # what the load reads (a fast-tier view)
        if resume_from_checkpoint is True:
            out = str(self.args.output_dir)
            rs.warn_leftovers(out)
            if tier is not None:
                path, src = rs.pick(tier, fast.candidates(tier, out, NAME, None)[0])
            else:
                paths = resolve.listed(lambda: [c.path for c in resolve.committed_in(
                    out, NAME)], f"list {out}")
                if paths:
                    path, _ = resolve.load_newest(paths, lambda p: (rs.precheck(p),
                                                                    verify_shared(p)))
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            p = os.path.abspath(os.path.expanduser(os.fspath(resume_from_checkpoint)))
            if tier is not None:
                path, src = rs.pick(tier, fast.one(tier, p, None))
            if path is None:
                path = rs.named(p)
        if path is not None:
            self._dckpt_resume, self._dckpt_loaded = path, None
            self._dckpt_src = src or (path, None)
        try:
            result = super().train(resume_from_checkpoint if path is None else path, **call)
        except BaseException:
            self._dckpt.abandon()  # never a collective after a failure: its error shows
            if tier is not None:
                tier.abandon(60.0)
            raise
        finally:
            self._dckpt_resume = self._dckpt_loaded = self._dckpt_src = None
            if src is not None and src[1] is not None and path is not None:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        self._dckpt.finish()  # the last asynchronous save: placed, or its error raised
        if tier is not None:
            self._dckpt_rotation_fast.flush()
            tier.drain()  # every durable copy queued (a failed one is logged, stays local)
        return result

    def _dckpt_ours(self, checkpoint: str | None) -> bool:
        return (checkpoint is not None and self._dckpt_resume is not None
                and os.path.abspath(checkpoint) == self._dckpt_resume)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """A dckpt resume: nothing here (the model loads with the optimizer, after the
        Trainer has prepared both: :meth:`_load_optimizer_and_scheduler`); else stock."""
        if self._dckpt_ours(resume_from_checkpoint):
            return
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A dckpt resume: load the model, optimizer (resharded to this world size and
        parallelism), lr_scheduler and scaler from ``checkpoint``; else stock.
        Collective; blocking I/O. Raises on every rank alike: IntegrityError,
        StateMismatchError (another model, another framework's checkpoint),
        MissingKeyError (a scheduler the checkpoint lacks)."""
        if not self._dckpt_ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        comm = Comm()
        spath, view = self._dckpt_src or (checkpoint, None)
        has_opt = resolve.listed(lambda: any(k.startswith("optimizers.") for k in
                                             _manifest(spath, view).tensors),
                                 f"read the manifest of {spath}")
        opts = [(_inner(self.optimizer), 0)] if has_opt and self.optimizer is not None else []
        c = tree.Contents([self.model], set(), opts)
        loaded = tree.load(spath, c, META_KEY, check=self._dckpt_check(spath),
                           ignore=() if opts else ("optimizers.",), manifest_name=view)
        err = None
        try:
            if not loaded.meta.get("model_only"):
                if self.lr_scheduler is not None:
                    self.lr_scheduler.load_state_dict(loaded.objects["scheduler"])
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None and "scaler" in loaded.objects:
                    scaler.load_state_dict(loaded.objects["scaler"])
        except Exception as e:
            err = e
        agree(comm, err, f"load the scheduler and scaler of {checkpoint}")
        self._dckpt_loaded = None if loaded.meta.get("model_only") else loaded
        if loaded.meta.get("model_only") and not self.args.save_only_model and comm.rank == 0:
            log.warning("%s holds the model only (saved with save_only_model=True): the "
                        "optimizer, lr_scheduler, scaler and RNG start fresh in this run",
                        checkpoint)
        if comm.rank == 0:
            log.info("loaded %s (saved at %d ranks, global step %s)", checkpoint,
                     loaded.world_size, loaded.meta.get("global_step"))

    def _dckpt_check(self, path: str):
        def run(meta: dict, names: set) -> None:
            if meta.get("framework") != "transformers":
                raise StateMismatchError(f"{path} is a dckpt checkpoint of "
                                         f"{meta.get('framework')!r}, not of the Trainer")
            if (not meta.get("model_only") and self.lr_scheduler is not None
                    and "scheduler" not in names):
                raise MissingKeyError(f"checkpoint {path} holds no lr_scheduler state")
        return run

    def _load_scaler(self, checkpoint: str | None) -> None:
        """A dckpt resume: loaded with the optimizer; else stock."""
        if self._dckpt_ours(checkpoint):
            return
        return super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """A dckpt resume: this rank's saved generators (rank r >= the saved world size
        N: a stream derived from rank r mod N's and r); a model-only checkpoint holds
        none (as stock). Never raises. Else stock."""
        if not self._dckpt_ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        if self._dckpt_loaded is not None:
            self._dckpt_loaded.restore_rng()

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: a dckpt ``best_model_checkpoint`` loads the model
        only (resharded); else stock. Collective; blocking I/O."""
        self._dckpt.finish()  # the best may be the save in flight
        if self._dckpt_tier is not None:
            self._dckpt_rotation_fast.flush()
            self._dckpt_tier.drain()  # ... or a copy still queued
        best = self.state.best_model_checkpoint
        choices = [] if best is None or self._dckpt_tier is None else fast.one(
            self._dckpt_tier, best, None)
        if choices:  # the fast tier's commit of it, or its durable copy
            by = {c.shown(): c for c in choices}
            resolve.load_newest(list(by), lambda k: tree.load(
                by[k].path, tree.Contents([self.model]), META_KEY,
                check=self._dckpt_check(by[k].path), ignore=("optimizers.",),
                manifest_name=by[k].manifest_name))
        elif best is None or resolve.listed(lambda: kind(best), f"look up {best}") != "dckpt":
            return super()._load_best_model()
        else:
            tree.load(best, tree.Contents([self.model]), META_KEY,
                      check=self._dckpt_check(best), ignore=("optimizers.",))
        if Comm().rank == 0:
            log.info("loaded the best model from %s (score: %s)", best, self.state.best_metric)


class DckptTrainer(DckptTrainerMixin, Trainer):
    """``transformers.Trainer`` with dckpt checkpoints:
    ``from dckpt.integrations.transformers import DckptTrainer as Trainer``. See
    :class:`DckptTrainerMixin`."""


__all__ = ["DckptTrainer", "DckptTrainerMixin"]
