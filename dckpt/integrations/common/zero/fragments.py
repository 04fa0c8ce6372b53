"""A parameter's ranges on the data-parallel ranks as one tensor dckpt stores: a 1-D
``ShardedTensor`` (FSDP1's type, which dckpt saves and loads by its shards' offsets)
whose global metadata is computed, not gathered, from :mod:`.layout`. Saved, each rank
writes its range; loaded into one, each rank reads exactly its range, in place, from
whatever ranges another world size or ZeRO stage wrote. No collective, no I/O."""
from __future__ import annotations

import warnings

import torch

from .layout import Fragment

with warnings.catch_warnings():  # torch.distributed._shard is deprecated upstream
    warnings.simplefilter("ignore")
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata, TensorProperties)


def sharded(local: torch.Tensor | None, frags: list[Fragment], numel: int,
            dtype: torch.dtype, rank: int) -> ShardedTensor:
    """The 1-D tensor of ``numel`` elements of which rank ``f.rank`` holds
    ``[f.start, f.start + f.numel)`` for each of ``frags`` (they tile it), this rank's
    range being ``local`` (a contiguous 1-D view; None when it holds none). Shares
    ``local``'s memory: a load fills it in place. O(len(frags)). Raises ValueError when
    ``local`` does not match this rank's fragment."""
    device = local.device if local is not None else torch.device("cpu")
    dev = f"{device.type}:{device.index}" if device.index is not None else device.type
    metas = [ShardMetadata(shard_offsets=[f.start], shard_sizes=[f.numel],
                           placement=f"rank:{f.rank}/{dev}") for f in frags if f.numel]
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format,
                             pin_memory=bool(local is not None and local.is_pinned()))
    md = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([numel]),
                               tensor_properties=props)
    shards = []
    for f, m in zip([f for f in frags if f.numel], metas):
        if f.rank == rank:
            if local is None or local.numel() != f.numel:
                raise ValueError(f"rank {rank}'s range of {f.numel} elements, local tensor "
                                 f"{None if local is None else local.numel()}")
            shards.append(Shard(local.detach(), m))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, md, init_rrefs=False)
