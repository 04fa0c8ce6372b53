"""Reading a stock DeepSpeed tag's files for :mod:`.stock`: which rank files a tag
folder holds (:func:`scan`), each read by ``torch.load(weights_only=True, mmap=True)``
with exactly the DeepSpeed globals a tag holds allowed (:data:`DEEPSPEED_GLOBALS`), each
mapped to a stand-in defined here (a plain record whose attributes the pickle fills, or
a function returning an int): no DeepSpeed code and no other global runs. Sizes are
bounded before a file is opened; the values read are checked before they are used
(:func:`need`, :func:`as_int`, :func:`shapes`, :func:`refusals`). Local I/O only."""
from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError

MAX_FILE = 1 << 40  # a rank file larger than this is refused before it is opened
MAX_PICKLE = 1 << 30  # the pickle record inside a file (its tensors are memory-mapped)

MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")

# the model-states keys DeepSpeed writes itself (``_common_checkpoint_state``); every
# other key is the user's client_state
DS_KEYS = frozenset((
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info"))


class _Record:
    """A stand-in for one of DeepSpeed's pickled data classes: the pickle's BUILD fills
    its ``__dict__`` (no method of DeepSpeed's runs)."""


class _LossScaler(_Record):
    pass


class _DynamicLossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    pass


def _zero_stage(value: Any) -> int:
    """Stand-in for ``ZeroStageEnum(value)``."""
    if type(value) is not int or not 0 <= value <= 3:
        raise ValueError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


# (stand-in, the DeepSpeed global it answers for): exactly what deepspeed 0.19's ZeRO
# tags reference beyond torch's own tensor globals (probed on stage 1/2/3, fp32/bf16,
# BF16_Optimizer tags; DynamicLossScaler is fp16's)
DEEPSPEED_GLOBALS = (
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)


def read_file(path: str, max_file: int = MAX_FILE) -> Any:
    """One DeepSpeed checkpoint file through the restricted unpickler (tensors
    memory-mapped). Checks the size and the zip structure before unpickling. Raises
    CheckpointError naming the file."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if size > max_file:
        raise CheckpointError(f"{path} is {size} bytes, over the {max_file}-byte bound of "
                              "a DeepSpeed checkpoint file (max_file_size=)")
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [i for i in z.infolist() if i.filename.endswith("data.pkl")]
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path} is not a torch.save (zip) file: {e}") from None
    if len(pkl) != 1:
        raise CheckpointError(f"{path} holds {len(pkl)} pickle records, not a torch.save's one")
    if pkl[0].file_size > MAX_PICKLE:
        raise CheckpointError(f"{path}: its pickle record is over {MAX_PICKLE} bytes")
    try:
        with torch.serialization.safe_globals(list(DEEPSPEED_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # UnpicklingError (a global not allowed), a corrupt record...
        msg = str(e)
        g = re.search(r"GLOBAL (\S+)", msg)
        why = (f"it references {g.group(1)}, which is not one of the DeepSpeed checkpoint "
               "globals dckpt allows; nothing of it was run" if g else
               " ".join(msg.split())[:300])
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint file dckpt can read: "
                              f"{type(e).__name__}: {why}") from None


@dataclass
class _Tag:
    src: str
    model: dict[int, str]  # rank -> model-states file (ZeRO-1/2: rank 0 only)
    optim: dict[int, str]  # rank -> optim-states file


def _scan(src: str) -> _Tag:
    """The tag's files by rank. Raises CheckpointError for what is not a plain ZeRO
    data-parallel tag (model/pipeline parallelism, MoE, a mix of prefixes, no files)."""
    try:
        names = sorted(os.listdir(src))
    except OSError as e:
        raise CheckpointError(f"cannot list the DeepSpeed tag {src}: {e}") from None
    model: dict[int, str] = {}
    optim: dict[int, str] = {}
    prefixes = set()
    for n in names:
        p = os.path.join(src, n)
        if "expert" in n or n.startswith("expp_rank_") or n.startswith("layer_"):
            raise CheckpointError(f"{p}: pipeline-parallel or MoE tags are not supported by "
                                  "the DeepSpeed import")
        m, o = MODEL.match(n), OPTIM.match(n)
        if m or o:
            if int((m or o).groups()[-1]) != 0:
                raise CheckpointError(f"{p}: a model-parallel tag (mp rank > 0) is not "
                                      "supported by the DeepSpeed import")
        if m:
            model[int(m.group(1) or 0)] = p
        elif o:
            prefixes.add(o.group(1) or "")
            optim[int(o.group(2))] = p
    if not model:
        raise CheckpointError(f"{src} holds no DeepSpeed *_model_states.pt file")
    if not optim:
        raise CheckpointError(f"{src} holds no ZeRO *_optim_states.pt file (ZeRO stage 0 "
                              "tags are not supported by the DeepSpeed import)")
    if len(prefixes) > 1:
        raise CheckpointError(f"{src} mixes bf16_ and plain ZeRO optimizer files")
    return _Tag(src, model, optim)


def _need(d: Any, key: str, types: Any, path: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{path} has no {key!r} entry: not a DeepSpeed ZeRO checkpoint "
                              "file dckpt knows")
    v = d[key]
    if not isinstance(v, types):
        raise CheckpointError(f"{path}: {key!r} is a {type(v).__name__}")
    return v


def _int(v: Any, what: str, path: str) -> int:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"{path}: {what} is {v!r}, not an int")
    return v


def _shapes(ps: Any, path: str, what: str) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(ps, dict):
        raise CheckpointError(f"{path}: {what} is a {type(ps).__name__}, not a dict")
    out = []
    for n, s in ps.items():
        if not isinstance(n, str) or not isinstance(s, (tuple, list)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise CheckpointError(f"{path}: {what} entry {n!r}: {s!r} is not a shape")
        out.append((n, tuple(int(x) for x in s)))
    return out


def _refusals(ms: dict, path: str) -> None:
    """What the import cannot map exactly, from the model-states file and its config."""
    if _int(ms.get("mp_world_size", 1), "mp_world_size", path) != 1:
        raise CheckpointError(f"{path}: model parallelism (mp_world_size "
                              f"{ms['mp_world_size']}) is not supported by the DeepSpeed import")
    dims = ms.get("checkpoint_parallel_dimensions") or {}
    if isinstance(dims, dict) and any(v not in (None, 1) for v in dims.values()):
        raise CheckpointError(f"{path}: a tag saved with pipeline/tensor parallelism {dims} "
                              "is not supported by the DeepSpeed import")
    for k in ("data_sampler", "random_ltd"):
        if ms.get(k) is not None:
            raise CheckpointError(f"{path}: its {k} state (curriculum learning / random-LTD) "
                                  "has no place in a dckpt DeepSpeed tag")
    if ms.get("optimizer") is not None:
        raise CheckpointError(f"{path}: a ZeRO stage 0 tag (the optimizer in the model-states "
                              "file) is not supported by the DeepSpeed import")
    cfg = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
    zc = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    if zc.get("round_robin_gradients"):
        raise CheckpointError(f"{path}: saved with round_robin_gradients (DeepSpeed's own "
                              "fragment mapping is wrong under it): not supported")
    if zc.get("elastic_checkpoint"):
        raise CheckpointError(f"{path}: saved with elastic_checkpoint: not supported")
    for k in ("offload_optimizer", "offload_param"):
        o = zc.get(k)
        if isinstance(o, dict) and o.get("device") == "nvme":
            raise CheckpointError(f"{path}: saved with NVMe offload ({k}): the optimizer "
                                  "state is not in the tag; not supported")
