"""The initial loads of :class:`dckpt.integrations.torchtitan.DckptCheckpointManager`
(a folder with no committed step yet): from another dckpt checkpoint, from a DCP
checkpoint, or from a Hugging Face safetensors directory through the model's state
dict adapter. Imports torch's DCP only for a DCP source; never imports torchtitan."""
from __future__ import annotations

from typing import Any

MODEL = "model"
DCP_METADATA = ".metadata"  # what makes a folder a DCP checkpoint
MANAGER_PREFIX = "state."  # CheckpointManager saves the state under this key


def _is_dcp(path: str) -> bool:
    from ..storage.fsspec_storage import make_storage

    storage, root = make_storage(path, None)
    return storage.exists(storage.join(root, DCP_METADATA))


def load_initial(target: dict[str, Any], path: str) -> None:
    """Load ``target`` (``{"model": ModelWrapper, ...}``: Statefuls and values) from
    the checkpoint at ``path``. Collective. A dckpt checkpoint: a step of a
    CheckpointManager (keys under "state.") or a plain ``dckpt.save`` directory;
    keys the checkpoint holds that ``target`` does not ask for are ignored (a
    model-only load of a full checkpoint), keys it lacks are an error. A DCP
    checkpoint (``.metadata``): loaded by DCP itself, its keys laid out as
    torchtitan's DCP manager saves them (the model's flattened to the top).
    Raises CheckpointError (dckpt) or DCP's CheckpointException."""
    if _is_dcp(path):
        import torch.distributed.checkpoint as torch_dcp

        flat = {k: v for k, v in target.items() if k != MODEL}
        if MODEL in target:
            flat.update(target[MODEL].state_dict())
        torch_dcp.load(flat, checkpoint_id=path)
        if MODEL in target:
            target[MODEL].load_state_dict(flat)
        return
    from ..protocol.restore import load
    from ..view.open import open as open_checkpoint

    with open_checkpoint(path) as ckpt:
        keys = ckpt.keys()
    managed = any(k.startswith(MANAGER_PREFIX) for k in keys)
    state = {"state": target} if managed else target
    load(state, path, strict=False)


def load_hf_model(model: Any, adapter: Any, path: str, quantized: bool) -> None:
    """Load the model (torchtitan's ModelWrapper) from the HF safetensors at
    ``path``, as torchtitan's DCP manager does: the adapter's ``to_hf`` names the
    tensors, they are filled in place, ``from_hf`` maps them back. dckpt's
    :func:`~dckpt.interop.hf_load.load_hf` reads each rank's byte ranges; quantized
    checkpoints go to the adapter's own DCP reader. Collective."""
    hf_sd = adapter.to_hf(model.state_dict())
    if quantized:
        import torch.distributed.checkpoint as torch_dcp

        torch_dcp.load(hf_sd, storage_reader=adapter.get_hf_storage_reader(path, True))
    else:
        from ..interop.hf_load import load_hf

        load_hf(hf_sd, path)
    model.load_state_dict(adapter.from_hf(hf_sd))
