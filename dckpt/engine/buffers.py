"""Host buffers for the engine: one place for the aligned allocation that both the
staging pool and the GPU bounce buffers use (the direct-I/O writer sends an aligned
buffer to the device without a bounce copy)."""
from __future__ import annotations

import math

import torch

from ..storage.direct import ALIGN


def aligned_empty(shape, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data starts on a 4 KiB boundary: a
    direct-I/O writer sends it to the device without a bounce copy. Costs up to 4 KiB
    (pinned: nothing when the allocation is page aligned, as CUDA's host allocations
    are; 4 KiB more would push a power-of-two size to twice its size, see
    :func:`pinned_waste`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if pinned:
        exact = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if exact.data_ptr() % ALIGN == 0:
            return exact.view(dtype).view(shape)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)
