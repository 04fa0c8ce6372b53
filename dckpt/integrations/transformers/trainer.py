"""``DckptTrainerMixin`` / ``DckptTrainer``: the transformers ``Trainer`` whose checkpoint
saves are dckpt commits under ``{output_dir}/checkpoint-{global_step}`` (staged under a
hidden name, placed only once committed, so ``get_last_checkpoint`` never sees a partial
one), sharded (no gather), without pickle, rotated in commit order after the commit, and
resumed from the newest *committed* checkpoint at any world size.

dckpt is the terminal step of the Trainer's own chains, not a replacement of them: a
save runs the base class's whole ``_save_checkpoint`` (a subclass's override, stock's
``save_model``, ``trainer_state.json``, the callbacks' states) into the staging folder
and commits what it wrote with the checkpoint; a resume runs a subclass's load
overrides, whose ``super()`` reaches dckpt's load (:mod:`.chain`).

The Trainer's own save writes each file in place into ``checkpoint-N`` and its resume
takes the highest number with a folder, complete or not; see docs/HF.md.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ...errors import CheckpointError
from ...protocol.collectives import Comm, agree
from ...protocol.settings import agree_settings
from ..common import resolve, tree
from ..common import fast
from ..common.commit import Committer
from ..common.place import durable_name, is_url
from ..common.tier import LocalTier
from ..common.verify import verify_shared
from . import ds, export
from . import folder as mfolder
from .background import FolderExport
from ..common import modelfolder
from . import resume as rs
from .chain import (DckptChainEnd, drop_landed_extras, fix_best, inner, rotation, settle,
                    with_chain_end)
from .resume import JIT_SENTINEL, META_KEY, NAME, STATE_FILE

log = logging.getLogger(__name__)
ARGS_FILE = "training_args.json"


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
                 model_folder: bool = True, **kwargs: Any) -> None:
        if storage_options is not None:
            raise CheckpointError(f"DckptTrainer: storage_options={storage_options!r} is not "
                                  "supported (the Trainer's checkpoints live on a local "
                                  "output_dir; use local_root for a node-local fast tier)")
        committer = Committer(None, async_save, compression,  # validates both
                              markers=(JIT_SENTINEL,))
        if not isinstance(model_folder, bool):
            raise CheckpointError(f"model_folder must be True or False, got {model_folder!r}")
        if isinstance(keep_last_local, bool) or not isinstance(keep_last_local, int) \
                or keep_last_local < 1:
            raise CheckpointError(f"keep_last_local must be an int >= 1, got {keep_last_local!r}")
        tier = None if local_root is None else LocalTier(local_root, keep_last_local, None,
                                                         compression)
        if tier is not None:
            tier.adopt = ()  # a copy keeps what scripts wrote at the name, as a direct save
        super().__init__(*args, **kwargs)
        if async_save and self.args.push_to_hub:
            raise CheckpointError("DckptTrainer: async_save=True with push_to_hub: the push "
                                  "reads the checkpoint before its background commit places it")
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
        self._dckpt_model_loaded: Any = None  # its model's load (objects, metadata)
        self._dckpt_copy = False  # a deep copy or unpickled copy (see __getstate__)
        self._dckpt_stage: str | None = None  # while dckpt saves: the chain's run_dir
        self._dckpt_push = False  # the chain asked for a push (run once placed)
        self._dckpt_state_json: str | None = None  # trainer_state.json of the save
        self._dckpt_extras: set[str] = set()  # names whose chain files sit beside a slot
        self._dckpt_model_folder = model_folder  # checkpoint-N loads with from_pretrained
        self._dckpt_side: Any = None  # while dckpt saves: its SideFile (folder.side_for)
        self._dckpt_export = FolderExport()  # a sharded model's folder, in the background
        if tier is not None:  # with the fast tier: once each durable copy is placed
            import weakref

            landed = weakref.WeakMethod(self._dckpt_landed)  # the tier outlives trainers
            tier.landed = lambda final: (landed() or (lambda f: None))(final)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # dckpt's load and the skipped stock pickles sit just above Trainer, so that a
        # subclass's overrides between this mixin and Trainer run whole (see .chain)
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer in mro and mro.index(Trainer) < mro.index(DckptTrainerMixin):
            # Trainer.__init__ would never reach the mixin's: stock checkpoints, silently
            raise TypeError(f"{cls.__name__}: DckptTrainerMixin must come before every "
                            "Trainer class in the bases, e.g. "
                            "class MySFT(DckptTrainerMixin, trl.SFTTrainer)")
        with_chain_end(cls)

    def __getstate__(self) -> dict:
        """Stock Trainers deep-copy and pickle where their objects do: so does this one.
        The copy has no save in flight, no process group and no fast tier (its threads
        and leases belong to this process): a save or resume through a copy made with
        ``local_root`` raises CheckpointError. Waits for the snapshot of an
        asynchronous save in flight (its fence's hooks do not pickle)."""
        self._dckpt.unfence()
        d = dict(self.__dict__)
        d["_dckpt_agreed"] = None
        d["_dckpt_rotation_fast"] = None
        d["_dckpt_export"] = None  # its thread stays with the original
        if d.get("_dckpt_tier") is not None:
            d["_dckpt_tier"], d["_dckpt_copy"] = None, True
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._dckpt_rotation_fast = fast.Rotation()
        self._dckpt_export = FolderExport()

    def _dckpt_usable(self) -> None:
        if getattr(self, "_dckpt_copy", False):
            raise CheckpointError("this DckptTrainer is a copy of one with local_root: its "
                                  "fast tier belongs to the original; save and resume there")

    # ------------------------------------------------------------------ saving
    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Stock's push; asked for by the chain while dckpt saves, deferred until the
        commit has placed the folder (:meth:`_save_checkpoint`). No I/O then."""
        if getattr(self, "_dckpt_stage", None) is not None:
            self._dckpt_push = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Run the base class's whole ``_save_checkpoint`` (a subclass's override;
        stock's ``save_model(_internal_call=True)``, so a ``save_model``/``_save``
        override runs and the model folder is written; ``trainer_state.json``; the
        stateful callbacks' states) into a hidden staging folder, then commit it with
        the model and optimizer (sharded as trained: FSDP2, FSDP1, DDP or one process),
        the lr_scheduler, the scaler and each rank's RNG as one dckpt commit placed at
        ``{run_dir}/checkpoint-{global_step}``; ``save_only_model``: the model only.
        Then, on rank 0, ``save_total_limit`` removes the oldest committed checkpoints
        (commit order, never the new one nor ``best_model_checkpoint``), and a push the
        chain asked for runs on the placed folder. Collective; blocking I/O (each rank
        writes its own shards; rank 0 the chain's files, renames and the removals; with
        ``async_save`` all but the chain and the snapshot run in the background, after
        waiting for the save before). Raises the same CheckpointError on every rank
        (nothing is placed then; a failing chain's error included),
        UnsupportedValueError for a scheduler value that cannot be stored."""
        self._dckpt_usable()
        comm = Comm()
        self._dckpt_agree(comm)
        # the save in flight first (its commit starts its model folder's export), then
        # that export: the rotation after this save may remove its folder
        self._dckpt.finish()
        self._dckpt_export.join()
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        final = os.path.abspath(output_dir)
        tier = self._dckpt_tier
        plan = None
        if tier is None:
            plan = self._dckpt.plan(output_dir)
            stage = plan.target
        else:
            self._dckpt_rotation_fast.flush()
            fast.check_name(self._dckpt, output_dir)
            stage = fast.prepare_extras(tier, output_dir)  # travels with the copy
            self._dckpt_extras.add(final)
        built, err, files, self._dckpt_push = None, None, {}, False
        self._dckpt_stage = stage
        # the model's tensors in side files under their HF names: the chain's _save
        # then writes everything save_pretrained writes but the weights (chain._save)
        self._dckpt_side = side = mfolder.side_for(self)
        # the chain's run_dir is the hidden staging folder (it writes
        # <staging>/checkpoint-N). An instance attribute: it wins over any subclass's
        # _get_output_dir override too, whose answer (run_dir above) is the real one
        self.__dict__["_get_output_dir"] = lambda trial=None: stage
        try:
            # stock's model folder creates it; not written under FSDP sharded state
            os.makedirs(os.path.join(stage, folder), exist_ok=True)
            super()._save_checkpoint(model, trial)
        except Exception as e:  # agreed below: every rank raises it, none hangs
            err = e
        finally:
            self._dckpt_stage = None
            self._dckpt_side = None
            self.__dict__.pop("_get_output_dir", None)
        try:
            if err is None:
                fix_best(self, run_dir, final, os.path.join(stage, folder))
                if comm.rank == 0:
                    settle(stage, folder)
                    files = self._dckpt_json_files(stage)
                self._dckpt_state_json = files.get(STATE_FILE)
                c = self._dckpt_contents(comm.rank)
                built = tree.build(c, comm.rank, META_KEY)
                if ds.enabled(self):  # the engine's state, nested (no model, no optimizer)
                    built[ds.ROOT] = ds.build(self)
        except Exception as e:
            err = e
        try:
            agree(comm, err, f"collect the state to save to {output_dir}")
        except BaseException:
            if plan is not None and comm.rank == 0:
                shutil.rmtree(plan.target, ignore_errors=True)  # ours, never placed
            raise
        if tier is not None:  # the fast tier: its copy takes the chain's files along
            fast.save(tier, self._dckpt, built, output_dir, self.state.global_step, files,
                      extras=stage)
            limit = self.args.save_total_limit
            if limit is not None and limit > 0:
                best = self.state.best_model_checkpoint
                self._dckpt_rotation_fast.after_save(
                    self._dckpt.async_save, tier, run_dir, NAME, final, limit, None,
                    durable_name(best) if best else None)
        else:
            self._dckpt.commit(built, plan, fence=tree.fence_targets(c),
                               after=rotation(self, run_dir, plan.final), side=side,
                               prepare=modelfolder.write_index if side is not None else None,
                               placed=(lambda sid: self._dckpt_export.start(final, sid))
                               if mfolder.exports(self) else None)
        if self._dckpt_push:  # the push reads the folder: once it is placed whole
            self._dckpt_push = False
            self._dckpt.finish()
            if tier is not None:
                tier.drain()
            self._push_from_checkpoint(output_dir)

    def _dckpt_landed(self, final: str) -> None:
        """The fast tier's copy thread (every rank), a durable copy placed at
        ``final``: a sharded model's folder is exported from it in the background."""
        if mfolder.exports(self):
            self._dckpt_export.start(final, None)

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
                              "keep_last_local": getattr(self._dckpt_tier, "keep", None),
                              "model_folder": self._dckpt_model_folder,
                              "deepspeed": ds.enabled(self)},
                       None, "DckptTrainer")
        self._dckpt_agreed = world

    def _dckpt_json_files(self, stage: str) -> dict[str, str]:
        """Rank 0, after the chain: {file name: text} of trainer_state.json (as
        ``TrainerState.save_to_json`` writes it; the chain's copy rewritten, naming the
        final folders), training_args.json and, when the chain wrote none (FSDP sharded
        state: no model folder), the model's config.json; each written into ``stage``.
        The stateful callbacks' states are the chain's (never appended again). Local
        I/O: up to three small files. Raises OSError."""
        import dataclasses

        files = {STATE_FILE: json.dumps(dataclasses.asdict(self.state), indent=2,
                                        sort_keys=True) + "\n",
                 ARGS_FILE: self.args.to_json_string()}
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if (config is not None and hasattr(config, "to_json_string")
                and not os.path.exists(os.path.join(stage, "config.json"))):
            files["config.json"] = config.to_json_string()
        for name, text in files.items():
            with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                f.write(text)
        return files

    def _dckpt_contents(self, rank: int) -> tree.Contents:
        """What a save commits: the model, the optimizer (not with save_only_model),
        and on rank 0 the scheduler, the scaler and the metadata (trainer_state.json
        again, :attr:`_dckpt_state_json`). No I/O."""
        only = bool(self.args.save_only_model)
        deep = ds.enabled(self)  # the engine's tree holds model and optimizer (ds.build)
        opts = [] if only or deep or self.optimizer is None else [(inner(self.optimizer), 0)]
        objects: dict[str, Any] = {}
        meta = None
        if rank == 0:
            if not only and self.lr_scheduler is not None and not (
                    deep and ds.scheduler_in_engine(self)):
                objects["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if not only and scaler is not None:
                objects["scaler"] = scaler.state_dict()
            import transformers

            meta = {"framework": "transformers", "transformers": transformers.__version__,
                    "global_step": int(self.state.global_step), "model_only": only,
                    # trainer_state.json again, checksummed with the manifest: what a
                    # resume from the fast tier (no such file there) hands the Trainer
                    "trainer_state": getattr(self, "_dckpt_state_json", None),
                    "scheduler": "scheduler" in objects, "scaler": "scaler" in objects,
                    "deepspeed": deep}
        # FSDP: self.model is the prepared (sharded) model; else the unwrapped one, whose
        # parameters are the optimizer's (DDP's own prefix never enters the keys)
        return tree.Contents([] if deep else [self.model], set(), opts, objects, meta)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``. Under FSDP with ``SHARDED_STATE_DICT`` (where stock
        writes no weights): HF safetensors + ``config.json`` (+ generation config,
        processing class, ``training_args.json``) that ``from_pretrained`` loads,
        without gathering the model on any rank (:mod:`.export`); the checkpoint
        chain's internal call writes nothing there (dckpt's shards hold the weights: no
        gather, no export per checkpoint; a ``save_model`` override of a class after
        this mixin is not run then). Collective there; blocking I/O. Any other setup:
        stock (inside a checkpoint: the model folder into its staging folder). Raises
        CheckpointError on every rank."""
        fsdp = getattr(self, "is_fsdp_enabled", False)
        if _internal_call and getattr(self, "_dckpt_stage", None) is not None and \
                ds.enabled(self):
            # DeepSpeed: no gather and no engine checkpoint of its own; the weights come
            # from the background export of the engine's masters (mfolder.exports);
            # config and processing class now (not for PEFT: see docs/DEEPSPEED.md)
            if self._dckpt_model_folder and output_dir is not None and not ds._peft(self):
                self._save(output_dir, state_dict={})
            return
        if _internal_call and getattr(self, "_dckpt_stage", None) is not None and \
                (fsdp or export.sharded(self)):
            # a checkpoint of a sharded model: no gather; its weights come from the
            # background export after the commit; config and processing class now
            if fsdp and self._dckpt_model_folder and output_dir is not None:
                self._save(output_dir, state_dict={})
            return
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
        self._dckpt_usable()
        call = dict(trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        self._dckpt.finish()  # an earlier train()'s save in flight (none: no collective)
        self._dckpt_export.join()
        tier = self._dckpt_tier
        if tier is not None:
            rs.sweep_resume_folders(tier.root)  # left by killed runs of this host
        path: str | None = None
        src: tuple[str, str | None] | None = None  # what the load reads (a fast-tier view)
        # a DeepSpeed tag on the fast tier serves its own layout only (ds.local_accept)
        accept = ds.local_accept(self) if ds.enabled(self) else None
        if resume_from_checkpoint is True:
            out = str(self.args.output_dir)
            rs.warn_leftovers(out)
            if tier is not None:
                path, src = rs.pick(tier, fast.candidates(tier, out, NAME, None)[0], accept)
            else:
                paths = resolve.listed(lambda: [c.path for c in resolve.committed_in(
                    out, NAME)], f"list {out}")
                if paths:
                    path, _ = resolve.load_newest(paths, lambda p: (rs.precheck(p),
                                                                    verify_shared(p)))
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            p = os.path.abspath(os.path.expanduser(os.fspath(resume_from_checkpoint)))
            if tier is not None:
                path, src = rs.pick(tier, fast.one(tier, p, None), accept)
            if path is None:
                path = rs.named(p)
        if ds.enabled(self):
            ds.install(self)
        if path is not None:
            self._dckpt_resume, self._dckpt_loaded = path, None
            self._dckpt_model_loaded = None
            self._dckpt_src = src or (path, None)
            if src is None and mfolder.exports(self):
                self._dckpt_export.resume(path)  # a folder a crash left incomplete
        try:
            result = super().train(resume_from_checkpoint if path is None else path, **call)
        except BaseException:
            self._dckpt.abandon()  # never a collective after a failure: its error shows
            if tier is not None:
                tier.abandon(60.0)
            raise
        finally:
            self._dckpt_resume = self._dckpt_loaded = self._dckpt_src = None
            self._dckpt_model_loaded = None
            if src is not None and src[1] is not None and path is not None:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        self._dckpt.finish()  # the last asynchronous save: placed, or its error raised
        if tier is not None:
            self._dckpt_rotation_fast.flush()
            tier.drain()  # every durable copy queued (a failed one is logged, stays local)
            drop_landed_extras(tier, self._dckpt_extras)
            self._dckpt_extras = set()
        self._dckpt_export.join()  # the last checkpoint's model folder (after its copy)
        return result

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: waits for the save in flight and the fast tier's
        copies (the best may be either), then the base chain (a subclass's override
        runs; its ``super()`` reaches dckpt's load of a dckpt best:
        :meth:`.chain.DckptChainEnd._load_best_model`). Collective; blocking I/O."""
        self._dckpt.finish()
        if self._dckpt_tier is not None:
            self._dckpt_rotation_fast.flush()
            self._dckpt_tier.drain()
        return super()._load_best_model()


class DckptTrainer(DckptTrainerMixin, DckptChainEnd):
    """``transformers.Trainer`` with dckpt checkpoints:
    ``from dckpt.integrations.transformers import DckptTrainer as Trainer``. See
    :class:`DckptTrainerMixin`."""


__all__ = ["DckptTrainer", "DckptTrainerMixin"]
