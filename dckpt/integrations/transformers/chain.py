"""The Trainer's checkpoint chains with dckpt as their terminal step.

A Trainer subclass (TRL's trainers, a user's) overrides ``_save_checkpoint``,
``_load_optimizer_and_scheduler`` or ``_load_from_checkpoint`` and calls ``super()``: the
stock ``Trainer`` method is the end of that chain. :class:`DckptChainEnd` sits just above
``transformers.Trainer`` in the MRO of every class made with ``DckptTrainerMixin``
(``DckptTrainerMixin.__init_subclass__`` puts it there), so a subclass's override runs
whole and its ``super()`` call reaches dckpt's load (a dckpt checkpoint) or the stock one
(any other folder), and the stock writes of optimizer, scheduler, scaler and RNG pickles
are skipped while dckpt saves (its commit holds them).

The save side: the mixin runs the stock ``_save_checkpoint`` with ``_get_output_dir``
answering a hidden staging folder ``S``; the chain writes ``S/checkpoint-N`` (model
folder, ``trainer_state.json``, a subclass's files), and :func:`settle` moves what it
wrote up into ``S``, the folder dckpt commits and places under ``checkpoint-N``.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from transformers import Trainer

from ...errors import CheckpointError, ManifestError, StateMismatchError
from ...protocol.collectives import Comm
from ...view.open import MissingKeyError
from ..common import resolve, tree
from . import ds
from .resume import META_KEY, NAME

log = logging.getLogger(__name__)


def inner(opt: Any) -> Any:
    """The torch optimizer under Accelerate's wrapper. Pure."""
    return getattr(opt, "optimizer", opt)


def manifest(path: str, view: str | None) -> Any:
    """The parsed manifest at ``path`` (``view``: a fast-tier rank's). Blocking I/O."""
    from ..common.place import read_manifest

    if view is None:
        return read_manifest(path)
    from ...format import manifest as mf
    from ...protocol.restore import read_manifest_bytes
    from ...storage.fsspec_storage import make_storage

    storage, root = make_storage(path)
    return mf.parse(read_manifest_bytes(storage, root, view), f"{path}/{view}")


# stock ``_save`` pickles the TrainingArguments (torch.save) beside the model; a dckpt
# checkpoint holds no pickle: training_args.json (written by the mixin) stands for it
ARGS_PICKLE = "training_args.bin"  # transformers.trainer.TRAINING_ARGS_NAME


def settle(stage: str, folder: str) -> None:
    """Rank 0, after the chain wrote ``stage/folder``: move each of its entries up into
    ``stage`` (what dckpt commits; a name already there is kept: dckpt's own files are
    never replaced) and remove the emptied folder; stock's ``training_args.bin`` pickle
    is dropped (``training_args.json`` holds the same arguments). Local I/O: a listing
    and a rename per entry (same file system). Raises OSError."""
    src = os.path.join(stage, folder)
    if not os.path.isdir(src) or os.path.islink(src):
        return
    from ...format.manifest import MANIFEST_NAME

    for n in os.listdir(src):
        if n == MANIFEST_NAME:  # dckpt's commit point: a file of that name cannot stay
            raise CheckpointError(
                f"the Trainer's checkpoint chain (a subclass or callback) wrote "
                f"{MANIFEST_NAME} into {folder}: dckpt's commit writes that name; give "
                "the file another name")
        if n == ARGS_PICKLE:
            os.remove(os.path.join(src, n))
            continue
        dst = os.path.join(stage, n)
        if os.path.lexists(dst):  # never over dckpt's intent or a file of the same name
            log.warning("the checkpoint chain wrote %s, which dckpt also holds: kept dckpt's",
                        os.path.join(src, n))
            continue
        os.rename(os.path.join(src, n), dst)
    try:
        os.rmdir(src)
    except OSError:  # a leftover entry: it stays (hidden, committed with the checkpoint)
        pass


def rotation(trainer: Any, run_dir: str, just_saved: str):
    """The after-commit step of a save under ``save_total_limit`` (None without one):
    rank 0 removes the oldest committed ``checkpoint-N`` of ``run_dir`` on the run's
    timeline, whole, never ``just_saved`` nor ``best_model_checkpoint`` (stock's rule:
    with a limit of 1 and an older best, 2 remain). Blocking I/O when it runs: a
    listing, a manifest read per checkpoint, the removals."""
    from ..common.place import durable_name, remove_whole
    from ..common.rotation import to_remove

    limit = trainer.args.save_total_limit
    if limit is None or limit <= 0:
        return None
    best = trainer.state.best_model_checkpoint
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


def fix_best(trainer: Any, run_dir: str, final: str, hidden: str) -> None:
    """``trainer.state.best_model_checkpoint`` as stock sets it for the real
    ``run_dir``: the chain ran with the staging folder as its run_dir, so a best that
    is this save (``final``) was named by its ``hidden`` path, and an older best was
    not looked up. Local I/O: a stat (every rank, as stock)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

    state = trainer.state
    if state.best_model_checkpoint is not None and \
            os.path.abspath(state.best_model_checkpoint) == os.path.abspath(hidden):
        state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(final))
    if trainer.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH,
                                      SaveStrategy.BEST) and state.best_global_step:
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if os.path.abspath(best) == final or os.path.exists(best):
            state.best_model_checkpoint = best


class DckptChainEnd(Trainer):
    """The terminal step of the Trainer's checkpoint chains under dckpt (see the module
    docstring). Only meaningful in a class made with ``DckptTrainerMixin``, whose state
    it reads (``_dckpt_stage``: a dckpt save is running; ``_dckpt_resume``: the dckpt
    checkpoint being resumed)."""

    # ------------------------------------------------------------ the save chain's leaves
    def _dckpt_saving(self) -> bool:
        return getattr(self, "_dckpt_stage", None) is not None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A dckpt save: nothing (its commit holds them); else stock."""
        if not self._dckpt_saving():
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        """A dckpt save: nothing (its commit holds it); else stock."""
        if not self._dckpt_saving():
            super()._save_scaler(output_dir)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Stock's ``_save`` (config, generation config, processing class); inside a
        dckpt save whose model goes to side files (:mod:`.folder`), with an empty state
        dict: ``save_pretrained`` writes everything but the weights, which the commit
        stores once, under their names. A state dict passed by a subclass is saved by
        stock as given (its weights are not the model's own)."""
        if not self._dckpt_saving() or state_dict is not None:
            return super()._save(output_dir, state_dict)
        if getattr(self, "_dckpt_side", None) is not None:
            return super()._save(output_dir, state_dict={})
        if getattr(self, "_dckpt_model_folder", True):
            return super()._save(output_dir, state_dict)  # a plain copy (see .folder)
        # model_folder=False: no weights; a PreTrainedModel's config and processing
        # class still (save_pretrained with an empty state dict writes no weights file)
        from transformers import PreTrainedModel

        from .folder import is_peft

        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(model, PreTrainedModel) and not is_peft(model):
            return super()._save(output_dir, state_dict={})
        return None

    def _save_rng_state(self, output_dir: str) -> None:
        """A dckpt save: nothing (its commit holds every rank's); else stock."""
        if not self._dckpt_saving():
            super()._save_rng_state(output_dir)

    # ------------------------------------------------------------ the load chain's end
    def _dckpt_ours(self, checkpoint: str | None) -> bool:
        resume = getattr(self, "_dckpt_resume", None)
        return checkpoint is not None and resume is not None and \
            os.path.abspath(checkpoint) == resume

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """A dckpt resume: the model's weights (resharded to this world size and
        parallelism; where stock loads them, so a subclass that skips the optimizer's
        load still resumes its weights), and the checkpoint's objects and RNG kept for
        the steps after it; else stock. Collective; blocking I/O. Raises on every rank
        alike: IntegrityError, StateMismatchError (another model, another framework's
        checkpoint), MissingKeyError (a scheduler the checkpoint lacks)."""
        if not self._dckpt_ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._dckpt_model_loaded = self._dckpt_load(resume_from_checkpoint, optimizer=False)

    def _dckpt_load(self, checkpoint: str, optimizer: bool) -> Any:
        """Load ``checkpoint``'s model (``optimizer``: its optimizer instead, the model
        being loaded already) and return the load (objects, RNG, metadata). Also sets
        the RNG to restore and the run's timeline. Collective; blocking I/O."""
        comm = Comm()
        spath, view = self._dckpt_src or (checkpoint, None)
        deep = ds.enabled(self)
        if deep:  # the engine's part is loaded by ds.load, below
            c, ignore = tree.Contents([]), (ds.PREFIX,)
        elif optimizer:
            c = tree.Contents([self.model], {0}, [(inner(self.optimizer), 0)])
            ignore = ()
        else:
            c, ignore = tree.Contents([self.model]), ("optimizers.",)
        loaded = tree.load(spath, c, META_KEY, check=self._dckpt_check(spath),
                           ignore=ignore, manifest_name=view)
        if deep:  # a model-only checkpoint holds the weights only (save_only_model)
            only = loaded.meta.get("model_only", False)  # a bool: checked (_dckpt_check)
            ds.load(self, spath, module_only=only, model_only=only, manifest_name=view)
        self._dckpt_loaded = None if loaded.meta.get("model_only") else loaded
        # the next commit continues this one, after every checkpoint present on the
        # run's timeline (only rank 0's values are recorded)
        self._dckpt.saw(loaded.timeline, loaded.save_id)
        if comm.rank == 0:
            newest = resolve.newest_time(str(self.args.output_dir), NAME)
            if newest is not None:
                self._dckpt.saw(newest, "")
            log.info("loaded the %s of %s (saved at %d ranks, global step %s)",
                     "optimizer" if optimizer else "model", checkpoint, loaded.world_size,
                     loaded.meta.get("global_step"))
        return loaded

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A dckpt resume: the optimizer (resharded to this world size and
        parallelism), lr_scheduler and scaler from ``checkpoint`` (the model was loaded
        by :meth:`_load_from_checkpoint`; a subclass that skipped it: loaded here);
        else stock. Collective; blocking I/O. Raises on every rank alike:
        IntegrityError, StateMismatchError, MissingKeyError."""
        if not self._dckpt_ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        comm = Comm()
        loaded = getattr(self, "_dckpt_model_loaded", None)
        if loaded is None:  # a subclass's _load_from_checkpoint did not reach dckpt's
            loaded = self._dckpt_model_loaded = self._dckpt_load(checkpoint, optimizer=False)
        if loaded.meta.get("model_only"):
            if not self.args.save_only_model and comm.rank == 0:
                log.warning("%s holds the model only (saved with save_only_model=True): "
                            "the optimizer, lr_scheduler, scaler and RNG start fresh in "
                            "this run", checkpoint)
            return
        spath, view = self._dckpt_src or (checkpoint, None)

        def holds_optimizer() -> bool:  # tensors, or only values (SGD: its groups)
            m = manifest(spath, view)
            return any(k.startswith("optimizers.") for keys in (m.tensors, m.values)
                       for k in keys)
        if self.optimizer is not None and resolve.listed(
                holds_optimizer, f"read the manifest of {spath}"):
            self._dckpt_load(checkpoint, optimizer=True)
        def apply() -> None:
            if self.lr_scheduler is not None and "scheduler" in loaded.objects:
                self.lr_scheduler.load_state_dict(loaded.objects["scheduler"])
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None and "scaler" in loaded.objects:
                scaler.load_state_dict(loaded.objects["scaler"])
        tree.apply_agreed(apply, f"load the scheduler and scaler of {checkpoint}")

    def _load_best_model(self) -> None:
        """The end of ``load_best_model_at_end``'s chain: a dckpt
        ``best_model_checkpoint`` loads the model only (resharded; with a fast tier,
        its node-local commit or its durable copy); else stock. Collective; blocking
        I/O."""
        from ..common import fast
        from ..common.place import kind

        best = self.state.best_model_checkpoint
        tier = getattr(self, "_dckpt_tier", None)
        choices = [] if best is None or tier is None else fast.one(tier, best, None)
        if ds.enabled(self) and best is not None and (choices or resolve.listed(
                lambda: kind(best), f"look up {best}") == "dckpt"):
            by = {c.shown(): c for c in choices} or {best: None}

            def one(k: str) -> None:  # the engine's weights (its node-local view, if any)
                path, view = (k, None) if by[k] is None else (by[k].path,
                                                              by[k].manifest_name)
                tree.load(path, tree.Contents([]), META_KEY, check=self._dckpt_check(path),
                          ignore=(ds.PREFIX,), manifest_name=view)
                ds.load(self, path, module_only=True, manifest_name=view)
            resolve.load_newest(list(by), one)
            if Comm().rank == 0:
                log.info("loaded the best model from %s (score: %s)", best,
                         self.state.best_metric)
            return
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

    def _dckpt_check(self, path: str):
        """The check of a checkpoint's metadata before its load (a Trainer's; holding a
        scheduler when one is trained). Raises StateMismatchError, MissingKeyError."""
        def run(meta: dict, names: set) -> None:
            if type(meta.get("model_only", False)) is not bool:
                raise ManifestError(f"{path}: its Trainer record's 'model_only' is "
                                    f"{meta.get('model_only')!r}, not true or false")
            if meta.get("framework") != "transformers":
                raise StateMismatchError(f"{path} is a dckpt checkpoint of "
                                         f"{meta.get('framework')!r}, not of the Trainer")
            if meta.get("deepspeed", False) != ds.enabled(self):
                raise StateMismatchError(
                    f"{path} was saved " + ("with" if meta.get("deepspeed") else "without")
                    + " DeepSpeed and this Trainer runs " + ("with" if ds.enabled(self)
                                                             else "without") + " it")
            if (not meta.get("model_only") and self.lr_scheduler is not None
                    and "scheduler" not in names
                    and not (ds.enabled(self) and ds.scheduler_in_engine(self))):
                raise MissingKeyError(f"checkpoint {path} holds no lr_scheduler state")
        return run

    def _load_scaler(self, checkpoint: str | None) -> None:
        """A dckpt resume: loaded with the optimizer; else stock."""
        if not self._dckpt_ours(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """A dckpt resume: this rank's saved generators (rank r >= the saved world size
        N: a stream derived from rank r mod N's and r); a model-only checkpoint holds
        none (as stock). Never raises. Else stock."""
        if not self._dckpt_ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        if self._dckpt_loaded is not None:
            self._dckpt_loaded.restore_rng()


def with_chain_end(cls: type) -> None:
    """Put :class:`DckptChainEnd` just above ``transformers.Trainer`` in ``cls``'s MRO
    (``cls`` made with ``DckptTrainerMixin``): a direct ``Trainer`` base is replaced by
    it, else it is added as the last base (C3 places it after every other subclass of
    ``Trainer``). Nothing when it is already there or ``cls`` is no Trainer. Raises
    TypeError when the MRO cannot take it (a base order C3 refuses)."""
    if DckptChainEnd in cls.__mro__ or Trainer not in cls.__mro__:
        return
    if Trainer in cls.__bases__:
        cls.__bases__ = tuple(DckptChainEnd if b is Trainer else b for b in cls.__bases__)
    else:
        cls.__bases__ = cls.__bases__ + (DckptChainEnd,)


def drop_landed_extras(tier: Any, names: set[str]) -> None:
    """At the end of ``train()`` (every copy drained): remove this node's chain folder
    (:func:`..common.fast.extras_dir`) of each of ``names`` whose durable copy is
    committed (it holds those files now; a resume from the fast tier links them from
    there) or whose slot is gone (rotated). A name whose copy failed keeps its folder:
    the fast tier is then its only copy. Local I/O on each node's local rank 0: a stat
    and a manifest check per name; never raises."""
    import shutil

    from ..common.fast import extras_dir
    from ..common.place import kind

    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    for name in names:
        try:
            if kind(name) == "dckpt" or not os.path.isdir(tier.slot(name)):
                shutil.rmtree(extras_dir(tier, name), ignore_errors=True)
        except OSError as e:  # a leftover folder costs disk only
            log.warning("could not remove the chain folder of %s: %s", name, e)
