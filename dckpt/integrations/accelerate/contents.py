"""Accelerate's side of a checkpoint: what ``Accelerator.save_state`` saves, as a
:class:`dckpt.integrations.common.tree.Contents`, and its application back after a
load. No I/O, no collective (``state_dict()`` of a framework object may run its own)."""
from __future__ import annotations

from typing import Any

from ...errors import ManifestError, StateMismatchError
from ...view.open import MissingKeyError
from ..common.states import owner
from ..common.tree import Contents

META_KEY = "__accelerate__"


def side_file(acc: Any, c: Contents, output_dir: str) -> Any:
    """The SideFile of a save of ``acc`` into ``output_dir`` (model 0's weights stored
    once, under their names, with the index beside them: the folder loads as stock's
    ``model.safetensors`` would, see :mod:`..common.modelfolder`), or None: the model
    folder off, compression, an object store, no model 0 saved (a hook took it over),
    or a sharded model (FSDP, TP: no whole tensors per rank). No I/O."""
    from ...protocol.commit import SideFile
    from ..common.modelfolder import PREFIX, plain_params
    from ..common.place import is_url

    if not getattr(acc, "_dckpt_model_folder", False) or acc._dckpt.compression or \
            is_url(output_dir) or not c.models or 0 in c.skip:
        return None
    dt = getattr(acc.distributed_type, "name", str(acc.distributed_type))
    model = acc.unwrap_model(c.models[0])
    if "FSDP" in dt or not plain_params(model):
        return None
    return SideFile(PREFIX)


def inner_optimizer(opt: Any) -> Any:
    """The torch optimizer an ``AcceleratedOptimizer`` wraps (itself otherwise)."""
    return getattr(opt, "optimizer", opt)


def optimizers(acc: Any) -> list[tuple[Any, int]]:
    """(torch optimizer, index of its model) for each prepared optimizer: the model
    holding all its parameters; -1 when they span several prepared models or include
    parameters of none (DreamBooth's one optimizer over the UNet and the text encoder,
    a learnable scalar): keyed then across every model, and by position for the loose
    ones (:func:`..common.states.span`). An optimizer without parameters: the model of
    its index (stock pairs optimizer i with model i), else -1. No I/O."""
    models = list(acc._models)
    if any(hasattr(m, "zero_optimization_stage") for m in models):
        return []  # DeepSpeed: each engine's tree holds its optimizer (see .ds)
    out = []
    for j, opt in enumerate(acc._optimizers):
        inner = inner_optimizer(opt)
        out.append((inner, owner(inner, models, j if j < len(models) else -1)))
    return out


def _sampler(dl: Any) -> Any:
    from accelerate.data_loader import SeedableRandomSampler, get_sampler

    try:
        s = get_sampler(dl)
    except Exception:
        return None
    return s if isinstance(s, SeedableRandomSampler) else None


def objects(acc: Any) -> dict[str, Any]:
    """{name: state} of every scheduler, the GradScaler, every prepared dataloader
    (a stateful dataloader's ``state_dict()``; a ``SeedableRandomSampler``'s epoch and
    seed as values, not the sampler pickled) and every registered object. Calls their
    ``state_dict()``."""
    out: dict[str, Any] = {}
    for i, s in enumerate(acc._schedulers):
        out[f"scheduler_{i}"] = s.state_dict()
    if acc.scaler is not None:
        out["scaler"] = acc.scaler.state_dict()
    for i, dl in enumerate(acc._dataloaders):
        d: dict[str, Any] = {}
        s = _sampler(dl)
        if s is not None:
            d["sampler"] = {"epoch": int(s.epoch), "initial_seed": int(s.initial_seed)}
        if getattr(dl, "use_stateful_dataloader", False):
            d["stateful"] = dl.state_dict()
        out[f"dataloader_{i}"] = d
    for i, obj in enumerate(acc._custom_objects):
        out[f"custom_{i}"] = obj.state_dict()
    return out


def meta(acc: Any, saved_models: list[int]) -> dict[str, Any]:
    """The framework metadata a save records (JSON)."""
    import accelerate

    return {"framework": "accelerate", "accelerate": accelerate.__version__,
            "step": int(acc.step), "iteration": int(acc.save_iteration),
            "models": len(acc._models), "saved_models": saved_models,
            "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
            "dataloaders": len(acc._dataloaders), "custom": len(acc._custom_objects),
            "scaler": acc.scaler is not None,
            "distributed_type": str(acc.distributed_type)}


def contents(acc: Any, skip: set[int], rank: int) -> Contents:
    """The Contents of a save (objects and metadata on rank 0 only)."""
    models = list(acc._models)
    # a DeepSpeed engine is saved by .ds (nested), never as a model state dict
    skip = set(skip) | {i for i, m in enumerate(models) if hasattr(m, "zero_optimization_stage")}
    saved = [i for i in range(len(models)) if i not in skip]
    return Contents(models, set(skip), optimizers(acc),
                    objects(acc) if rank == 0 else {}, meta(acc, saved) if rank == 0 else None)


def check(acc: Any, path: str):
    """The load's check of a checkpoint's metadata and object names against what
    ``acc`` holds: MissingKeyError for a registered object, scheduler or dataloader
    the checkpoint lacks (stock's count check), StateMismatchError for registered
    objects it has in excess. Runs on every rank in the load (the same error
    everywhere)."""
    def run(m: dict, names: set) -> None:
        if m.get("framework") != "accelerate":
            raise StateMismatchError(f"{path} is a dckpt checkpoint of "
                                     f"{m.get('framework')!r}, not of Accelerate")
        for field in ("step", "iteration"):  # untrusted: checked before any byte is read
            v = m.get(field, 0)
            if type(v) is not int or not -1 <= v < 2**62:
                raise ManifestError(f"{path}: its Accelerate metadata field {field!r} is "
                                    f"{str(v)[:40]!r}, not an integer in range")
        want = [f"scheduler_{i}" for i in range(len(acc._schedulers))]
        want += [f"custom_{i}" for i in range(len(acc._custom_objects))]
        lacking = [n for n in want if n not in names]
        if lacking:
            raise MissingKeyError(
                f"checkpoint {path} lacks {lacking} ({m.get('schedulers')} scheduler(s), "
                f"{m.get('custom')} registered object(s) saved; {len(acc._schedulers)} and "
                f"{len(acc._custom_objects)} here): load it with the same set of "
                "prepared schedulers and registered objects")
        extra = sorted(n for n in names if n.startswith("custom_") and n not in want)
        if extra:
            raise StateMismatchError(
                f"checkpoint {path} holds {len(extra) + len(acc._custom_objects)} registered "
                f"objects, {len(acc._custom_objects)} are registered here: register the "
                "same objects as when it was saved")
    return run


def apply(acc: Any, objs: dict[str, Any]) -> None:
    """Load the decoded objects into ``acc``'s scaler, schedulers, dataloaders and
    registered objects (in that order; each ``load_state_dict`` raises its own error)."""
    if acc.scaler is not None and "scaler" in objs:
        acc.scaler.load_state_dict(objs["scaler"])
    for i, s in enumerate(acc._schedulers):
        s.load_state_dict(objs[f"scheduler_{i}"])
    for i, dl in enumerate(acc._dataloaders):
        d = objs.get(f"dataloader_{i}") or {}
        s = _sampler(dl)
        if s is not None and isinstance(d.get("sampler"), dict):
            s.epoch = int(d["sampler"]["epoch"])
            s.initial_seed = int(d["sampler"]["initial_seed"])
        if getattr(dl, "use_stateful_dataloader", False) and "stateful" in d:
            dl.load_state_dict(d["stateful"])
    for i, obj in enumerate(acc._custom_objects):
        obj.load_state_dict(objs[f"custom_{i}"])
