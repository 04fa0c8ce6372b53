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

import json
import logging
import os
import uuid
from typing import Any

from ...protocol.commit import SideFile

log = logging.getLogger(__name__)
PREFIX = "models.0."  # the tree's key prefix of the Trainer's model (tree.build)
INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
WEIGHTS = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME


def is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def side_for(trainer: Any) -> SideFile | None:
    """The SideFile of a save of ``trainer``, or None when its checkpoint's model folder
    is not made of side files (see the module doc). No I/O."""
    from transformers import PreTrainedModel

    if not getattr(trainer, "_dckpt_model_folder", False) or trainer._dckpt.compression \
            or trainer._dckpt_tier is not None or getattr(trainer, "is_fsdp_enabled", False):
        return None
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if not isinstance(model, PreTrainedModel) or is_peft(model):
        return None
    import torch

    if any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in model.parameters()):
        return None  # DTensor (TP) or another subclass: not whole tensors per rank
    return SideFile(PREFIX)


def exports(trainer: Any) -> bool:
    """Whether ``trainer``'s checkpoints get their model folder from the background
    export (:mod:`.background`): the model folder on, a sharded model (FSDP, or
    DTensor parameters), no fast tier (its durable copy lands later; documented). No
    I/O."""
    if not getattr(trainer, "_dckpt_model_folder", False) or trainer._dckpt_tier is not None:
        return False
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    return isinstance(model, torch.nn.Module) and not is_peft(model) and any(
        type(p) not in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())


def write_index(target: str) -> None:
    """Rank 0, after the commit of ``target`` with side files: write its
    ``model.safetensors.index.json`` (every model tensor -> its side file), atomically
    (a temporary name, fsync, rename). When a model tensor is not one whole chunk in a
    side file (a layout this module does not make), no index is written and a warning
    says why: the checkpoint still resumes. Local I/O: the manifest read, one small
    file. Raises OSError, CheckpointError (an unreadable manifest)."""
    from ..common.place import read_manifest

    m = read_manifest(target)
    weight_map: dict[str, str] = {}
    total = 0
    for k, e in m.tensors.items():
        if not k.startswith(PREFIX) or len(k) == len(PREFIX):
            continue
        fi = int(e.chunks.file_of([0])[0]) if len(e.chunks) == 1 else -1
        f = m.files[fi] if fi >= 0 else None
        if f is None or f.dir or not f.name.startswith("model-") or e.bytes_value or \
                tuple(e.chunks.box(0)[1]) != tuple(e.shape):
            log.warning("%s: tensor %r is not stored whole in a side file; no %s is "
                        "written (the checkpoint resumes; from_pretrained cannot load it)",
                        target, k, INDEX)
            return
        weight_map[k[len(PREFIX):]] = f.name
        total += e.nbytes
    if not weight_map:
        return
    write_json_atomic(os.path.join(target, INDEX),
                      {"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))})


def write_json_atomic(path: str, doc: dict) -> None:
    """Write ``doc`` as JSON at ``path``: a temporary name beside it, fsync, rename.
    Local I/O; raises OSError (the temporary file removed)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def check_loadable(path: str) -> list[str]:
    """The problems that keep ``path`` (a committed checkpoint) from loading with
    ``from_pretrained`` ([] when none): no index nor weights file, an index naming a
    file the folder lacks. Local I/O. Raises nothing."""
    idx = os.path.join(path, INDEX)
    if os.path.exists(os.path.join(path, WEIGHTS)):
        return []
    if not os.path.exists(idx):
        return [f"no {WEIGHTS} nor {INDEX}"]
    try:
        with open(idx, encoding="utf-8") as f:
            files = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{INDEX} unreadable ({e})"]
    return [f"{INDEX} names {n}, which is missing" for n in sorted(files)
            if not os.path.exists(os.path.join(path, n))]
