"""A checkpoint that is also a model folder: the index of its side files.

A save with :class:`dckpt.SideFile` stores model 0's tensors (tree key prefix
``models.0.``) in side files under their own names, in files holding nothing else; the
manifest lists and checksums them. Rank 0 then writes ``model.safetensors.index.json``
(name -> side file) into the committed folder before it is placed, so the name appears
loadable: ``from_pretrained`` (a Trainer's checkpoint), Accelerate's
``load_checkpoint_in_model``, vLLM and other readers of sharded safetensors folders
read the checkpoint's own bytes. Local folders only (the index is written with local
I/O)."""
from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

log = logging.getLogger(__name__)
PREFIX = "models.0."  # the tree's key prefix of model 0 (tree.build)
INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
WEIGHTS = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME


def is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def converts(model: Any) -> bool:
    """Whether transformers renames or reshapes ``model``'s weights between its
    ``state_dict`` and the files ``save_pretrained`` writes (transformers 5's weight
    conversions: MoE experts fused at load, split again at save). Such a model's
    state_dict names are not the folder's: its checkpoints get stock's plain copy (or,
    sharded, no model folder). No I/O."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: no conversions
        return False
    conv = getattr(model, "_weight_conversions", None)
    if conv is None:  # as revert_weight_conversion decides for a model built in code
        try:
            conv = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                    if not isinstance(c, PrefixChange)]
        except Exception:  # noqa: BLE001 - cannot tell: take the safe side
            return True
    return bool(conv)


def plain_params(model: Any) -> bool:
    """Whether every parameter of ``model`` is a plain tensor (whole on each rank: one
    process or DDP), not a DTensor or another subclass (FSDP2, TP). No I/O."""
    import torch

    return all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())


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
        if "@" in k:  # stored under its offsets: not a name the index can give
            log.warning("%s: tensor %r holds '@'; no %s is written (the checkpoint resumes; "
                        "from_pretrained cannot load it)", target, k, INDEX)
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
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` at ``path`` (replacing what is there in one step): a temporary
    name beside it, fsync, rename. Local I/O; raises OSError (the temporary file
    removed)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
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
