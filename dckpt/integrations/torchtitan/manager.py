"""torchtitan on dckpt: :class:`DckptCheckpointManager`, the checkpoint manager a
torchtitan trainer config selects (``checkpoint=DckptCheckpointManager.Config(...)``).

torchtitan (>= 0.3.0) builds its checkpointer from ``config.checkpoint.build(...)``
and drives it from its ``Trainer``: ``load(step=config.checkpoint.load_step)`` before
training, ``save(step, last_step=...)`` after every step,
``maybe_wait_for_staging()`` before each optimizer step and ``close()`` at the end.
This manager keeps that contract and torchtitan's meaning of every base ``Config``
field (read from ``torchtitan/components/checkpointer/{base,dcp}.py``), and saves
through :class:`dckpt.CheckpointManager`: every step is a two-phase commit (a save
killed at any moment leaves no ``step-N`` that resume could pick), no pickle in the
format (the dataloader's pickled bytes are stored as opaque bytes, never
unpickled), every byte checksummed, any world size on resume, remote roots through
fsspec, and with ``local_root`` a node-local fast tier (optionally replicated to peer
nodes) with durable copies every ``durable_interval`` steps (torchtitan's ``interval``
decides which steps are saved, ``durable_interval`` which of those are copied to the
folder, the last step always: see :class:`DckptCheckpointManager`).

Requires ``pip install "dckpt[torchtitan]"``; importing :mod:`dckpt` never imports
torchtitan, only importing this module does.

Differences from torchtitan's DCP manager, on purpose:

- The states are saved nested (``model``, ``optimizer``, ``lr_scheduler``,
  ``dataloader``, ``train_state`` and any other ``states`` key, under the manager's
  ``state.`` prefix), not with the model's keys flattened to the top: ``dckpt open``
  shows ``state.model.<fqn>``.
- ``close()`` waits for the last asynchronous save (torchtitan's Trainer never calls
  ``maybe_wait_for_saving()``; DCP's manager can lose that save at exit).
- ``async_mode="async"`` is dckpt's fenced asynchronous save: ``save()`` returns
  once the state is captured (the dataloader's and schedulers' state, read in the
  call; the tensors are copied in the background) and the optimizers' next
  ``step()`` (and a forward that writes a saved buffer) waits for that copy, so
  ``maybe_wait_for_staging()`` costs nothing more than that wait. ``"async_with_pinned_mem"`` is accepted as the same mode
  (dckpt stages into reused, pinned on CUDA, buffers in both).
- ``last_save_in_hf`` writes the final model-only checkpoint ``step-N`` (in the
  adapter's HF naming) and then exports it with dckpt's bounded-memory exporter,
  on rank 0, to ``step-N-hf`` beside it (DCP writes the HF files into ``step-N``).
- ``initial_load_path`` may be a dckpt checkpoint (one ``step-N`` of another run,
  or any ``dckpt.save`` directory) or a DCP checkpoint (a folder with
  ``.metadata``, loaded by DCP itself: a run moving from DCP starts from its last
  DCP checkpoint); ``initial_load_in_hf`` reads the HF safetensors directly with
  :func:`dckpt.load_hf` (each rank reads only its byte ranges, no conversion step).
  A model-only initial load converts floating dtypes (a bf16 ``last_save_model_only``
  step starts an fp32 job, as with DCP's manager); a resume of the folder's own steps
  and a full initial load keep dckpt's strict dtype check.
- A folder holding torchtitan's DCP steps (``step-N`` with ``.metadata``: a run that
  switched from DCP's manager) resumes the newest commit of the folder, whichever
  manager wrote it, on one timeline (:mod:`.resume`: a dckpt step's manifest
  time, a DCP step's ``.metadata`` time; a step committed before a lower one was, as
  after a rewind with ``load_step``, is abandoned; a damaged step falls back to the
  next newest of either manager; dckpt's wins a tie). A DCP step is loaded by DCP as
  DCP's manager lays it out (the model's keys at the top; optimizer, lr_scheduler,
  dataloader, train_state nested), with a log line saying so, and ``load_step=N``
  may name one. Later saves are dckpt's, beside DCP's folders, which dckpt never
  removes (nor counts in ``keep_latest_k``). A DCP step that cannot be resumed (a
  model-only last step, an HF-only export) raises a CheckpointError saying what to
  do, never a silent fresh start nor an older step.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, BaseCheckpointManager, ModelWrapper)
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
    from torchtitan.tools.logging import logger
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("dckpt.integrations.torchtitan needs torchtitan >= 0.3.0: "
                      'pip install "dckpt[torchtitan]"') from e

from ...errors import CheckpointError
from ...manager.core import CheckpointManager
from ...protocol.collectives import Comm, on_rank0
from ...protocol.settings import agree_settings
from . import load, resume

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
HF_SUFFIX = "-hf"  # the HF export of step N goes to step-N-hf beside step-N
# The Config fields that decide when each rank saves, what it saves and keeps, and what
# it loads: a rank that differs would skip (or enter alone) a collective save or load,
# a hang, or keep and load other steps. Agreed at construction (one all-gather).
SHARED = ("interval", "keep_latest_k", "load_only", "enable_first_step_checkpoint",
          "last_save_model_only", "last_save_in_hf", "export_dtype", "async_mode",
          "exclude_from_loading", "initial_load_path", "initial_load_model_only",
          "initial_load_in_hf", "initial_load_in_hf_quantized")


class DckptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager on dckpt; the constructor takes the keywords of
    torchtitan's DCP ``CheckpointManager`` (the Trainer builds it through
    ``config.build(...)``). Construction is collective (call it on every rank, as
    the Trainer does): the ranks agree on the settings and the folder's identity.

    Checkpoints go to ``{base_folder}/{folder}/step-{N}``, one dckpt checkpoint per
    step (``dckpt ls``/``dckpt verify`` read them); ``keep_latest_k`` keeps the newest
    k committed steps. With ``local_root``, torchtitan's rule (every ``interval``-th
    step, step 1 with ``enable_first_step_checkpoint``, the last step) decides which
    steps are saved, each committed in the fast tier; ``durable_interval=D`` decides
    which of them are also copied to the folder: a step that is a multiple of D, or at
    least D steps after the last copied one, and always the last step (its copy is
    never skipped; an earlier one may be, for a newer one, when the copies cannot keep
    up: docs/TIERS.md). Raises ValueError for a bad config (as torchtitan's), and
    CheckpointError (dckpt's) for a failed save or load, for config fields that
    differ between ranks (at construction) and for a save after close(), on every
    rank alike."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"disabled": save() returns after the commit; "async": once the state is
        captured (the optimizers' next step, and forwards writing saved buffers, wait
        for the copy); the pinned-memory name of torchtitan's DCP manager is accepted
        as "async"."""

        local_root: str | None = None
        """A node-local directory (NVMe) for dckpt's fast tier: every save commits
        there, and every ``durable_interval``-th is copied to the folder in the
        background; restore prefers the newest tier that loads."""

        durable_interval: int | None = None
        """With ``local_root``: which saved steps are copied to the folder: a multiple
        of N, or a step at least N steps after the last copied one, and the last step
        always (None: every saved step). ``interval`` still decides which steps are
        saved (to the fast tier)."""

        replicas: int = 0
        """With ``local_root``: copies of each node's files kept on other nodes, so a
        lost node's state is restored from its peers."""

        incremental: bool = False
        """Store only the chunks that changed since the previous saved step."""

        compression: str | None = None
        """None, "zstd" or "lz4" (``pip install "dckpt[compress]"``)."""

        @classmethod
        def from_config(cls, other: Any, **overrides: Any) -> "DckptCheckpointManager.Config":
            """This Config with every field ``other`` (any torchtitan checkpoint Config,
            e.g. the DCP manager's of a stock trainer config) shares, then
            ``overrides``: ``config.checkpoint = DckptCheckpointManager.Config.
            from_config(config.checkpoint, local_root="/nvme/ckpt")``. Pure."""
            mine = {f.name for f in dataclasses.fields(cls)}
            kw = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                  if f.name in mine and f.init}
            if kw.get("async_mode") not in (None, *ASYNC_MODES):
                kw.pop("async_mode")
            kw.update(overrides)
            return cls(**kw)

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = str(self.async_mode).lower()
            if mode not in ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode!r} "
                                 f"(one of {', '.join(ASYNC_MODES)})")
            self.async_mode = mode
            if self.durable_interval is not None and self.durable_interval < 1:
                raise ValueError("durable_interval must be at least 1 step (or None)")
            if (self.durable_interval is not None or self.replicas) and not self.local_root:
                raise ValueError("durable_interval and replicas need local_root (the fast tier)")
            if self.replicas < 0:
                raise ValueError("replicas cannot be negative")
            if self.compression not in (None, "zstd", "lz4"):
                raise ValueError(f"compression must be None, 'zstd' or 'lz4', "
                                 f"got {self.compression!r}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list,
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.optimizers = optimizers
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        self.initial_load_in_hf_quantized = config.initial_load_in_hf_quantized
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if self.last_save_in_hf and self.sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.async_mode = "disabled" if config.async_mode == "disabled" else "async"
        self.keep_latest_k = config.keep_latest_k
        self.save_future: Future | None = None
        self._closed = False
        self._prepared = False  # async: the staging buffers are allocated (see _save)
        self.model_parts = list(model_parts)
        shared = {f: getattr(config, f) for f in SHARED} | {"async_mode": self.async_mode}
        shared["exclude_from_loading"] = sorted(map(str, self.exclude_from_loading))
        agree_settings(Comm(None), {k: v if not isinstance(v, list) else ",".join(v)
                                    for k, v in shared.items()},
                       None, "DckptCheckpointManager settings (checkpoint config)")
        self.manager = CheckpointManager(
            self.folder, keep_last=config.keep_latest_k or None,
            async_save=self.async_mode == "async",
            # torchtitan seeds its RNGs itself and DCP's manager saves none: the same here
            capture_rng=False, local_root=config.local_root,
            durable_every_steps=config.durable_interval, replicas=config.replicas,
            incremental=config.incremental, compression=config.compression)
        # close() once: called by close(), by the garbage collector, or at exit (atexit
        # runs it before the interpreter tears its modules down, so the last async save
        # commits and keep_latest_k's cleanup runs in a script that never closes; a late
        # __del__ would meet half-torn-down modules).
        self._finalizer = weakref.finalize(self, CheckpointManager.close, self.manager)
        logger.info("Checkpointing active (dckpt). Checkpoints will be loaded from and saved "
                    f"to {self.folder}" + (f", fast tier {config.local_root}"
                                           if config.local_root else ""))

    # ------------------------------------------------------------------ saving
    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan's rule: step 1 with enable_first_step_checkpoint, the last step,
        every ``interval``-th; never with load_only. Pure."""
        if not self.enable or self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return bool(last_step or curr_step % self.interval == 0)

    def _fence(self) -> list:
        """What waits for an async save's copy: the optimizers (the container's own:
        they change the parameters and their state) at their next step, and the model
        parts at the forwards that write saved tensors in place (persistent buffers:
        BatchNorm's running stats, a load-balancing bias; dckpt.engine.fence), which
        torchtitan's Trainer runs right after save() returns."""
        opts = self.optimizers
        # The container's step calls each inner optimizer's: hooking those is enough (a
        # hook on the container too armed and ran a second wait per save).
        inner = [o for o in (opts if hasattr(opts, "__iter__") else [])
                 if isinstance(o, torch.optim.Optimizer)]
        found = inner or ([opts] if isinstance(opts, torch.optim.Optimizer) else [])
        return found + [m for m in self.model_parts if isinstance(m, torch.nn.Module)]

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` when torchtitan's rule says so; returns whether it did.
        Collective. Sync: returns after the commit; async: once the state is
        captured. The last step is always synchronous (and flushes any async save)."""
        if self._closed:  # its threads are stopped: nothing would flush this save
            raise CheckpointError(f"save(step={curr_step}) after close(): the checkpoint "
                                  "manager is closed; build a new one to save again")
        if not self._should_save(curr_step, last_step):
            if self.async_mode == "async" and not self._prepared and not self.load_only:
                # The first async save's staging buffers, allocated and touched now, after
                # an optimizer step (not in load(): a fresh optimizer's state_dict() runs a
                # zero-lr step, Adam's count would be off by one), so the first save
                # blocks no longer than later ones. Collective, as this call is.
                self._prepared = True
                self.manager._prepare(dict(self.states))
            return False
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
        else:
            async_ = self.async_mode == "async"
            # torchtitan's interval has decided to save this step (force); whether its
            # fast-tier commit is also copied to the folder is durable_interval's call
            # (force_durable=False), not every forced save's
            self.manager.save(curr_step, dict(self.states), force=True, force_durable=False,
                              fence=self._fence() if async_ else None)
            if async_:
                self.save_future = Future()
        logger.info(f"Finished {'staging' if self.save_future else 'saving'} the checkpoint "
                    f"of step {curr_step} in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _save_last_step(self, curr_step: int) -> None:
        """The final save, synchronous: the model only in ``export_dtype`` (and the HF
        export) with ``last_save_model_only``, else the whole state. Always durable
        (``force=True``: with ``local_root`` it is copied to the folder whatever
        ``durable_interval``, and the copy is never skipped), so the run's end outlives
        the node."""
        if not self.last_save_model_only:
            logger.info(f"Saving a full checkpoint at last step, step {curr_step}.")
            self.manager.save(curr_step, dict(self.states), force=True)
            self.manager.wait()
            self.save_future = None
            return
        dtype = self.export_dtype
        sd = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
              and v.dtype != dtype else v for k, v in self.states[MODEL].state_dict().items()}
        logger.info(f"Saving a model only checkpoint in {dtype} at last step, step {curr_step}.")
        if not self.last_save_in_hf:
            self.manager.save(curr_step, {MODEL: sd}, force=True)
            self.manager.wait()
            self.save_future = None
            return
        hf = self.sd_adapter.to_hf(sd)
        self.manager.save(curr_step, {"hf": hf}, force=True)
        self.manager.wait()
        self.save_future = None
        self._export_hf(curr_step)

    def _export_hf(self, step: int) -> None:
        """Rank 0 exports the committed ``step`` to ``step-N-hf``; every rank gets its
        result or error. Collective; reads the model once, memory bounded."""
        from ...interop.hf_export import export

        src = self.manager.path(step)
        out = src + HF_SUFFIX

        def run() -> str:
            export(src, out, prefix="state.hf.", overwrite=True)
            return out

        on_rank0(Comm(None), run, f"export step {step} to Hugging Face safetensors at {out}")
        logger.info(f"Exported the last step's model to Hugging Face safetensors at {out}.")

    # ------------------------------------------------------------------ loading
    def _load(self, step: int = -1) -> bool:
        """Restore ``step`` (-1: the newest that loads: dckpt's restore, falling back
        past damaged steps; in a folder where torchtitan's DCP manager saved too, the
        newest commit of either manager, by :mod:`.resume`'s timeline rule) or,
        in a folder without a committed step, the initial checkpoint; returns whether
        anything was loaded. ``step`` is exact (dckpt's step N, else DCP's step-N).
        Collective (rank 0 lists the folder and broadcasts; then the loads). Raises
        FileNotFoundError for a ``step`` that is neither (as torchtitan's), ValueError
        for a bad initial_load_path, and CheckpointError for a step that cannot be
        resumed (a failed load; a DCP step lacking the training state: an HF export,
        a model-only last step)."""
        has_folder = filesystem.exists(self.folder)
        if step != -1 and not has_folder:
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found because "
                                    f"checkpoint.folder {self.folder} does not exist")
        theirs = resume.dcp_steps(self.folder) if has_folder else []
        kinds = {s: k for s, k, _ in theirs}
        mine = resume.dckpt_candidates(self.manager) if theirs else []
        steps = sorted({c.step for c in mine}) if theirs else \
            self._steps() if has_folder else []
        if step != -1 and step not in steps and step not in kinds:
            raise FileNotFoundError(
                f"--checkpoint.load_step={step} not found at {self.manager.path(step)} "
                f"(committed steps: {steps or 'none'}"
                + (f"; DCP steps: {sorted(kinds)}" if kinds else "") + ")")
        if not steps and not kinds:
            return self._initial_load()
        if not kinds:  # dckpt's steps alone: the manager's restore, with its fallback
            return self._restore(step if step != -1 else 0 if steps[-1] == 0 else None)
        if step == -1:
            wanted = None
        elif step in steps:  # at a tie, dckpt's own step (checksummed) wins
            wanted = resume.Choice(resume.DCKPT, step)
        else:
            wanted = resume.Choice(resume.DCP, step, kinds[step])
        resume.resume_folder(
            self.manager, mine, theirs, self.folder, wanted,
            lambda c: self._restore(c.step) if c.source == resume.DCKPT
            else self._load_dcp(c.step, c.kind))
        return True

    def _restore(self, step: int | None) -> bool:
        """dckpt's ``step`` (None: the newest that loads, with the manager's fallback)
        through :meth:`dckpt.CheckpointManager.restore`; returns whether a step was
        loaded. Step 0 is a seed checkpoint (the model only). Collective."""
        begin = time.monotonic()
        if step == 0:  # step 0 is the seed checkpoint: the model only
            got = self.manager.restore({MODEL: self.states[MODEL]}, step=0, strict=False)
        else:
            # strict=False: what the state does not ask for is ignored, as DCP's load
            # does (exclude_from_loading; per-rank keys of ranks gone after a resize)
            got = self.manager.restore(self._states_to_load(), step=step, strict=False)
            self._prepared = True  # the restore prepared the whole state's buffers
        logger.info(f"Loaded the checkpoint of step {got} ({self.manager.restored_from}) "
                    f"from {self.folder} in {time.monotonic() - begin:.2f} seconds.")
        return got is not None

    def _load_dcp(self, step: int, kind: str) -> bool:
        """Resume ``step-{step}`` that torchtitan's DCP CheckpointManager saved in the
        folder, as that manager resumes it (:func:`load.resume_dcp`): the whole
        state (what exclude_from_loading leaves), the model only for step 0 (a seed
        checkpoint). Collective. Raises, saying what to do, StateMismatchError when the
        step lacks what the state asks for, CheckpointError when it is damaged."""
        begin = time.monotonic()
        target = {MODEL: self.states[MODEL]} if step == 0 else self._states_to_load()
        path = load.resume_dcp(target, self.folder, step, kind)
        logger.info(f"Resumed the DCP checkpoint step-{step} at {path} (written by "
                    "torchtitan's DCP CheckpointManager; dckpt saves the next steps "
                    f"beside it) in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _steps(self) -> list[int]:
        """The committed steps of either tier, ascending. Collective."""
        try:
            found = set(self.manager.steps())
        except CheckpointError:
            if self.manager.tier is None:
                raise
            found = set()  # the durable root is down: the fast tier still restores
        if self.manager.tier is not None:
            found |= set(self.manager.steps("local"))
        return sorted(found)

    def _states_to_load(self) -> dict[str, Any]:
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}

    def _initial_load(self) -> bool:
        """torchtitan's initial load, for a folder without a committed step."""
        model_only, from_hf = self.initial_load_model_only, self.initial_load_in_hf
        if self.initial_load_path:
            path = self.initial_load_path
            if not filesystem.isdir(path):
                raise ValueError(f"Checkpoint.initial_load_path is invalid: {path}")
        elif from_hf:
            path = getattr(self.sd_adapter, "hf_assets_path", None) if self.sd_adapter else None
            if not path or not filesystem.isdir(path):
                raise ValueError(
                    "model.hf_assets_path is being used to load HF weights but the path is "
                    "not valid. Either make sure hf_assets_path is correct or provide a "
                    "valid checkpoint.initial_load_path")
        else:
            logger.info("No checkpoint was provided, this is a fresh start.")
            return False
        begin = time.monotonic()
        if from_hf:
            if self.sd_adapter is None:
                raise ValueError("initial_load_in_hf needs the model's sd_adapter")
            load.load_hf_model(self.states[MODEL], self.sd_adapter, path,
                                     self.initial_load_in_hf_quantized)
        else:
            target = {MODEL: self.states[MODEL]} if model_only else self._states_to_load()
            # A model-only start converts floating dtypes, as DCP's load does: the source
            # is often a bf16 last_save_model_only export and this job trains in fp32. A
            # full initial load (and a resume of this folder's steps) stays dtype-strict:
            # an optimizer state in another dtype is a different job, not an export.
            load.load_initial(target, path, cast=model_only)
        logger.info(f"Loaded the initial checkpoint {path} in "
                    f"{time.monotonic() - begin:.2f} seconds.")
        return True

    # ------------------------------------------------------------------ waits, close
    def _maybe_wait_for_staging(self) -> None:
        """Wait for the async save's copy of the state (what the optimizers' step
        waits for anyway); no-op in sync mode or when it is done. Not collective."""
        self.manager.wait_snapshot()

    def _wait_for_saving(self) -> None:
        """Wait for every save so far to commit (in every tier); raises the first
        error. Not collective."""
        fut, self.save_future = self.save_future, None
        try:
            self.manager.wait()
        except BaseException as e:
            if fut is not None and not fut.done():
                fut.set_exception(e)
            raise
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _close(self) -> None:
        """Flush the last async save (and the fast tier's durable copies), then stop
        dckpt's threads. Raises the save's error if it failed."""
        if self._closed:
            return
        self._closed = True
        self.save_future = None
        fin = getattr(self, "_finalizer", None)  # None: __init__ raised before the manager
        if fin is not None:
            fin()  # manager.close(), at most once
