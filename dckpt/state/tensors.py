"""Adapters between torch tensors / DTensors and the pure layout boxes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedValueError
from ..format.dtypes import to_code
from ..format.manifest import MAX_CHUNKS_PER_FILE
from ..layout.chunks import Box, local_box
from ..layout.strided import is_strided, local_boxes

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore
    from torch.distributed._tensor.placement_types import Partial  # type: ignore

try:  # FSDP2 over TP shards a dim TP already shards: a strided placement
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - a torch without it
    _StridedShard = None  # type: ignore

try:  # FSDP1's sharded state dicts (torch.distributed._shard, deprecated upstream)
    from torch.distributed._shard.sharded_tensor import Shard as _STShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover - a torch without it
    ShardedTensor = _STShard = None  # type: ignore


@dataclass
class LocalPiece:
    """What this rank holds of one tensor: its global description, its box, and the
    local torch tensor with exactly the box's shape (None when the box is empty)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    local: torch.Tensor | None


def _placements(dt: "DTensor", key: str) -> list[tuple]:
    out = []
    for p in dt.placements:
        # checked first: whether a _StridedShard is also a Shard differs between torch
        # versions, and it must never be taken for a plain one
        if _StridedShard is not None and isinstance(p, _StridedShard):
            out.append(("SS", p.dim if p.dim >= 0 else p.dim + dt.ndim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(("S", p.dim if p.dim >= 0 else p.dim + dt.ndim))
        elif isinstance(p, Replicate):
            out.append(("R",))
        elif isinstance(p, Partial):
            raise UnsupportedValueError(
                f"DTensor {key!r} has a Partial placement (pending reduction): its local "
                "values are not the tensor's values. Redistribute it to Replicate or Shard "
                "before saving (dt.redistribute(mesh, [Replicate()]))")
        else:
            raise UnsupportedValueError(f"DTensor {key!r} has unknown placement {p!r}")
    return out


def is_sharded_tensor(t: object) -> bool:
    return ShardedTensor is not None and isinstance(t, ShardedTensor)


def _describe_sharded(key: str, t: "ShardedTensor") -> LocalPiece:
    """A ShardedTensor (FSDP1): its global shape, and the one local shard this rank
    holds as a box (its offsets and sizes come from the shard's own metadata, so any
    layout that tiles the tensor works)."""
    md = t.metadata()
    code = to_code(md.tensor_properties.dtype, key)
    shape = tuple(int(x) for x in md.size)
    shards = t.local_shards()
    if not shards:
        return LocalPiece(key, code, shape, Box((0,) * len(shape), (0,) * len(shape)), None)
    if len(shards) > 1:
        raise UnsupportedValueError(
            f"ShardedTensor {key!r} has {len(shards)} local shards on this rank; dckpt "
            "stores one box per rank and tensor (FSDP1 makes one): use one shard per rank, "
            "or a DTensor")
    local, sm = shards[0].tensor, shards[0].metadata
    check_plain(key, local)
    box = Box(tuple(int(x) for x in sm.shard_offsets), tuple(int(x) for x in sm.shard_sizes))
    if tuple(local.shape) != box.sizes:
        raise UnsupportedValueError(
            f"ShardedTensor {key!r}: the local shard's shape {list(local.shape)} differs from "
            f"its metadata's sizes {list(box.sizes)}")
    return LocalPiece(key, code, shape, box, local)


def restage_sharded(t: "ShardedTensor", local: torch.Tensor) -> "ShardedTensor":
    """``t``'s global layout around ``local`` (a staged copy of its one local shard,
    or of nothing). No communication."""
    shards = [_STShard(local, s.metadata) for s in t.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, t.metadata(), process_group=t._process_group, init_rrefs=False)


def describe_all(key: str, t: torch.Tensor) -> list[LocalPiece]:
    """The pieces of ``t`` this rank holds: one per global box. A plain tensor, a
    ShardedTensor and a DTensor of Shard/Replicate placements give one piece whose
    ``local`` is the local tensor itself; a DTensor with a ``_StridedShard`` placement
    whose local tensor interleaves several boxes gives one piece per box, each ``local``
    a view of its region of the local tensor (a slab along the strided dim: no copy).
    Cheap (numpy over the runs, see dckpt.layout.strided); raises UnsupportedValueError
    for an unsupported dtype or placement, or a local shard whose shape does not match
    its placements' layout (DTensor) or its own metadata (ShardedTensor)."""
    if is_sharded_tensor(t):
        return [_describe_sharded(key, t)]
    code = to_code(t.dtype, key)
    local = t.to_local() if isinstance(t, DTensor) else t  # to_local is an autograd call
    check_plain(key, local)
    shape = tuple(t.shape)
    if not isinstance(t, DTensor):
        return [LocalPiece(key, code, shape, Box((0,) * len(shape), shape), t)]
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh: it holds nothing
        return [LocalPiece(key, code, shape, Box((0,) * len(shape), (0,) * len(shape)), None)]
    placements = _placements(t, key)
    if not is_strided(placements):  # one box: no arrays to build and unpack (per tensor)
        box = local_box(shape, tuple(mesh.shape), tuple(coord), placements)
        _check_layout(key, t, local, box.sizes)
        return [LocalPiece(key, code, shape, box, local)]
    lb = local_boxes(shape, tuple(mesh.shape), tuple(coord), placements)
    _check_layout(key, t, local, lb.local_shape)
    if len(lb) > MAX_CHUNKS_PER_FILE:
        raise UnsupportedValueError(
            f"DTensor {key!r}: its local tensor holds {len(lb)} separate boxes of the global "
            f"tensor (placements {list(t.placements)}); a shard file holds at most "
            f"{MAX_CHUNKS_PER_FILE} chunks of a tensor: redistribute it first")
    boxes = lb.boxes()
    if len(boxes) == 1:  # the whole local tensor (or nothing): no view
        return [LocalPiece(key, code, shape, boxes[0], local)]
    return [LocalPiece(key, code, shape, b, local[r]) for b, r in zip(boxes, lb.regions())]


def _check_layout(key: str, t: "DTensor", local: torch.Tensor, want: tuple) -> None:
    if tuple(local.shape) != want:
        raise UnsupportedValueError(
            f"DTensor {key!r}: local shard shape {list(local.shape)} differs from the "
            f"layout {list(want)} of its placements {list(t.placements)}")


def check_plain(key: str, t: torch.Tensor) -> None:
    """Refuse tensors that hold no plain strided data, naming the key."""
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"tensor {key!r} has layout {t.layout}: dckpt stores "
                                    "dense tensors; convert it with .to_dense() first")
    if t.device.type == "meta":
        raise UnsupportedValueError(f"tensor {key!r} is on the meta device and holds no "
                                    "data: materialize it (e.g. to_empty) before save or load")


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its own device (copied, on that device,
    only if non-contiguous, a conjugate or a negative view)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of ``t`` (copied only if non-contiguous, a conjugate or negative
    view, or not on the CPU). Blocking device-to-host copy for accelerator tensors."""
    b = byte_tensor(t)
    if b.device.type != "cpu":
        b = b.cpu()
    if b.numel() == 0:
        return memoryview(b"")
    return memoryview(b.numpy()).cast("B")
