"""Every Trainer checkpoint is a model folder: ``from_pretrained("out/checkpoint-N")``.

Unsharded models (one process, DDP): the save stores the model's tensors in side files
(:class:`dckpt.SideFile`, ``model-<save_id>-<rank>.safetensors``) under the names
``from_pretrained`` looks up, in files holding nothing else; the manifest lists and
checksums them, so they are the checkpoint's own bytes, written once. Rank 0 then
writes ``model.safetensors.index.json`` (the weight map: name -> side file) into the
committed folder before it is placed, so the name appears loadable. ``config.json``,
``generation_config.json`` and the processing class come from stock's ``_save`` run
with an empty state dict (everything ``save_pretrained`` writes but the weights).

Not for: sharded models (FSDP, TP: a file holds a rank's shard of each tensor, not
whole tensors), compression (encoded blocks), the fast tier (its copy runs later), a
PEFT model (stock's ``save_pretrained`` writes the adapter, a few MiB, as stock does),
a model that is not a ``PreTrainedModel``; those are handled by :mod:`.export`'s
background export or by stock.
"""
from __future__ import annotations

from typing import Any

from ...protocol.commit import SideFile
from ..common.modelfolder import PREFIX, converts, is_peft, plain_params


def side_for(trainer: Any) -> SideFile | None:
    """The SideFile of a save of ``trainer``, or None when its checkpoint's model folder
    is not made of side files (see the module doc). No I/O."""
    from transformers import PreTrainedModel

    if not getattr(trainer, "_dckpt_model_folder", False) or trainer._dckpt.compression \
            or trainer._dckpt_tier is not None or getattr(trainer, "is_fsdp_enabled", False) \
            or getattr(trainer, "is_deepspeed_enabled", False):
        return None
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if not isinstance(model, PreTrainedModel) or is_peft(model):
        return None
    if not plain_params(model) or converts(model):
        # DTensor (TP) or another subclass: not whole tensors per rank; or names that
        # save_pretrained converts (stock's plain copy then, with its names)
        return None
    return SideFile(PREFIX)


def exports(trainer: Any) -> bool:
    """Whether ``trainer``'s checkpoints get their model folder from the background
    export (:mod:`.background`): the model folder on, a sharded model (FSDP, or
    DTensor parameters) whose names are the folder's (:func:`converts`); with the
    fast tier, once each durable copy is placed. No I/O."""
    if not getattr(trainer, "_dckpt_model_folder", False):
        return False
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if getattr(trainer, "is_deepspeed_enabled", False):
        # from the engine's masters (named by the module: save_pretrained's names unless
        # it converts them); a PEFT model gets none (its base is not saved)
        return not is_peft(model) and not converts(model)
    if getattr(trainer, "is_fsdp_enabled", False):
        # a model whose names save_pretrained converts gets no folder (as stock's
        # sharded state): the export would write the runtime names
        return not converts(model)
    return not is_peft(model) and not plain_params(model) and not converts(model)
