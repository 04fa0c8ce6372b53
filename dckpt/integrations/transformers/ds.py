"""The Trainer under DeepSpeed (``TrainingArguments(deepspeed=...)``): the engine the
Trainer builds saves into the ``checkpoint-N`` commit, nested under ``engine.`` in the
layout of :mod:`dckpt.integrations.deepspeed` (each rank its ranges of the fp32 masters
and optimizer states, frozen parameters, buffers, the engine's scheduler and counters),
next to what the commit holds without DeepSpeed (the Trainer's scheduler when the
engine has none of its own, each rank's RNG, ``trainer_state.json``, the chain's
files). A resume loads it at any data-parallel size and ZeRO stage. No ``global_step<N>``
folder and no pickle: stock's ``deepspeed_load_checkpoint`` is told to leave a dckpt
resume to the chain's end (:func:`install`)."""
from __future__ import annotations

import weakref
from typing import Any

from ...errors import CheckpointError

ROOT = "engine"
PREFIX = ROOT + "."
_active: Any = None  # weakref to the DckptTrainer whose train() runs (one per process)


def enabled(trainer: Any) -> bool:
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def engine_of(trainer: Any) -> Any:
    """The DeepSpeed engine the Trainer built (``model_wrapped`` once ``train()``
    prepared it). Raises CheckpointError before that."""
    for eng in (getattr(trainer, "model_wrapped", None), getattr(trainer, "deepspeed", None)):
        if eng is not None and hasattr(eng, "zero_optimization_stage"):
            return eng
    raise CheckpointError("DckptTrainer under DeepSpeed: the engine does not exist yet (a "
                          "checkpoint is saved or resumed from within train())")


def scheduler_in_engine(trainer: Any) -> bool:
    """Whether the Trainer's lr_scheduler is the engine's (a DeepSpeed config
    ``scheduler``: Accelerate's DeepSpeedSchedulerWrapper): then the engine's tree holds
    it, as stock's engine checkpoint does."""
    return type(getattr(trainer, "lr_scheduler", None)).__name__ == "DeepSpeedSchedulerWrapper"


def _peft(trainer: Any) -> bool:
    from ..common.modelfolder import is_peft

    return is_peft(trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False))


def build(trainer: Any) -> dict[str, Any]:
    """The engine's part of a save (views of its live buffers: the commit copies them).
    A PEFT model's frozen base weights are left out (stock's
    ``exclude_frozen_parameters=True``); ``save_only_model``: the weights only (no
    optimizer state, no engine scheduler). Collective under ZeRO-3 (its epilogue's
    gather); no I/O. Raises CheckpointError for an engine dckpt does not support."""
    from ..common.zero.tree import engine_tree

    eng = engine_of(trainer)
    return engine_tree(eng, client_state={}, exclude_frozen=_peft(trainer),
                       tag=f"global_step{eng.global_steps}", with_rng=False,
                       model_only=bool(trainer.args.save_only_model))


def _configured(trainer: Any) -> tuple[int, str | None]:
    """(the ZeRO stage, the low precision: "bfloat16", "float16" or None) this run's
    DeepSpeed config asks for, before the engine exists (the Trainer resolves "auto"
    values into ``args.hf_deepspeed_config``). Pure."""
    cfg = getattr(getattr(trainer.args, "hf_deepspeed_config", None), "config", None) or {}
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    low = next((dt for key, dt in (("bf16", "bfloat16"), ("fp16", "float16"))
                if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") is True), None)
    return (stage if type(stage) is int else -1), low


def local_accept(trainer: Any) -> Any:
    """The check of a fast-tier commit before a resume reads it from this node: a view
    holds this node's ranges only, so its engine tag must have been saved at this
    world size (the tier checks it), ZeRO stage and precision; else CheckpointError
    (the resume then takes the durable copy, which any layout reads). Pure check of a
    manifest; no I/O."""
    from ..common.zero.tree import read_meta

    stage, low = _configured(trainer)

    def accept(m: Any) -> None:
        meta = read_meta(m, PREFIX)
        saved_low = {dt for dt in meta["dtypes"].values() if dt in ("bfloat16", "float16")}
        if meta.get("zero_stage") != stage or saved_low != ({low} if low else set()):
            raise CheckpointError(
                f"saved under ZeRO stage {meta.get('zero_stage')} "
                f"({', '.join(sorted(saved_low)) or 'float32'}), this run's config is "
                f"stage {stage} ({low or 'float32'}): its ranges on this node do not "
                "serve this layout; its durable copy does")
    return accept


def load(trainer: Any, path: str, module_only: bool = False,
         model_only: bool | None = None, manifest_name: str | None = None) -> None:
    """Load the engine's part of the dckpt checkpoint at ``path`` (``module_only``: the
    weights only, for ``load_best_model_at_end`` and a checkpoint saved with
    ``save_only_model``: the optimizer and the engine's counters start fresh;
    ``model_only``: the Trainer record's flag, which the tag's must equal). Collective; blocking I/O (this rank's
    ranges). Raises on every rank alike: StateMismatchError, IntegrityError."""
    from ..common.zero.restore import What, load_tag
    from ..common.zero.view import view

    peft = _peft(trainer)
    what = What(optimizer=not module_only, scheduler=not module_only,
                module_only=module_only, strict=not peft, model_only=model_only)
    v = view(engine_of(trainer))
    if manifest_name is not None:  # a fast-tier view: only the saved layout reads it
        from ...format import manifest as mf
        from ...protocol.restore import read_manifest_bytes
        from ...storage.fsspec_storage import make_storage
        from ..common.zero.tree import read_meta

        storage, root = make_storage(path)
        meta = read_meta(mf.parse(read_manifest_bytes(storage, root, manifest_name),
                                  f"{path}/{manifest_name}"), PREFIX)
        saved = (meta.get("zero_stage"), meta.get("dp_world_size"), meta.get("kind"))
        if saved != (v.stage, v.world, v.kind):
            raise CheckpointError(
                f"the fast tier's commit {path} holds a ZeRO stage {saved[0]} ({saved[2]}) "
                f"tag of {saved[1]} ranks; this engine is stage {v.stage} ({v.kind}) at "
                f"{v.world} ranks: this node holds only its own ranges of it; resume from "
                "its durable copy")
    load_tag(v, path, what, root=ROOT, manifest_name=manifest_name)


def install(trainer: Any) -> None:
    """Make ``trainer`` the one whose dckpt resume stock's ``deepspeed_load_checkpoint``
    leaves alone (it needs a ``global_step*`` folder and loads DeepSpeed's pickles; the
    chain's end loads the engine from the commit instead), and wrap that function once
    per process (any other call goes to the original)."""
    global _active
    import transformers.trainer as tt

    _active = weakref.ref(trainer)
    # the model folder comes from the engine's fp32 masters, in the model's dtype
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    trainer._dckpt_export.prefix = PREFIX
    trainer._dckpt_export.dtype = getattr(model, "dtype", None)
    if getattr(tt.deepspeed_load_checkpoint, "_dckpt", False):
        return
    original = tt.deepspeed_load_checkpoint

    def deepspeed_load_checkpoint(engine: Any, checkpoint_path: str,
                                  load_module_strict: bool = True) -> Any:
        t = _active() if _active is not None else None
        if t is not None and t._dckpt_ours(checkpoint_path):
            return None  # the chain's end loads it (DckptChainEnd)
        return original(engine, checkpoint_path, load_module_strict=load_module_strict)

    deepspeed_load_checkpoint._dckpt = True  # type: ignore[attr-defined]
    tt.deepspeed_load_checkpoint = deepspeed_load_checkpoint
