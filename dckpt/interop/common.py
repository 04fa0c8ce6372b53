"""Small helpers shared by the export and the import: size strings, key prefixes, row
slabs of a tensor, and releasing the pages of a memory-mapped source.

Pure Python (plus torch for dtypes and ctypes for ``madvise``); no I/O.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import re
import sys

import torch

from ..errors import CheckpointError

log = logging.getLogger("dckpt.interop")

# The same unit rules as transformers' ``max_shard_size`` ("5GB" is 5 * 10**9 bytes,
# "5GiB" 5 * 2**30), so a size written for save_pretrained means the same here.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

# Floating-point dtypes that ``--dtype`` converts. FP8 tensors are left as they are:
# their values only mean something with the scales stored beside them.
CONVERTIBLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
          "float32": torch.float32, "float": torch.float32}


def parse_size(size: int | str, what: str = "max_shard_size") -> int:
    """Bytes of ``size``: an int, or a string like ``"5GB"`` or ``"500MiB"`` (units as
    transformers reads them: KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, none for
    bytes). Pure. Raises CheckpointError naming ``what`` for anything else or a size
    under 1 byte."""
    if isinstance(size, bool):
        raise CheckpointError(f"{what} must be a size like '5GB', not {size!r}")
    if isinstance(size, int):
        n = size
    elif isinstance(size, str) and _SIZE.match(size):
        num, unit = _SIZE.match(size).groups()
        if unit.upper() not in _UNITS:
            raise CheckpointError(f"{what} {size!r}: unknown unit {unit!r} (use B, KB, MB, "
                                  "GB, TB or KiB, MiB, GiB, TiB)")
        n = int(float(num) * _UNITS[unit.upper()])
    else:
        raise CheckpointError(f"{what} must be a size like '5GB' or an int, not {size!r}")
    if n < 1:
        raise CheckpointError(f"{what} must be at least 1 byte, got {size!r}")
    return n


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The torch dtype of ``"bf16"``/``"fp16"``/``"fp32"`` (or a floating torch dtype);
    None stays None. Raises CheckpointError for anything else."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in CONVERTIBLE):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise CheckpointError(f"dtype must be one of bf16, fp16, fp32, not {dtype!r}")


def norm_prefix(prefix: str | None) -> str:
    """``prefix`` as a key prefix: "" for None, else ending with one ".", so that
    ``train.model`` means the keys under ``train.model.`` and never
    ``train.model_ema.*``. Raises CheckpointError for a non-string."""
    if prefix is None or prefix == "":
        return ""
    if not isinstance(prefix, str):
        raise CheckpointError(f"prefix must be a string, not {type(prefix).__name__}")
    return prefix if prefix.endswith(".") else prefix + "."


def slab_rows(shape: tuple[int, ...], itemsize: int, budget: int) -> int:
    """How many leading-dim rows of a tensor of ``shape`` fit in ``budget`` bytes: at
    least 1 (a row over the budget is read whole), all of them for a 0-d tensor. A
    slab of rows is contiguous in C order, in the checkpoint and in a safetensors file,
    which is what lets the export and import cut big tensors. Pure."""
    if not shape:
        return 1
    row = math.prod(shape[1:]) * itemsize
    return shape[0] if row == 0 else max(1, min(shape[0], budget // row))


_MADV_DONTNEED = 4  # Linux's value; the call is only made on Linux
_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def trim_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim``). Called
    after each output file: glibc raises its mmap threshold as large blocks are freed,
    so the next file's buffers (16-32 MiB tensors) come from the heap, and the pages
    the previous file freed there would otherwise stay resident, adding up to another
    file's worth to the peak. A few milliseconds; a no-op off glibc; never raises."""
    if not sys.platform.startswith("linux"):
        return
    try:
        fn = getattr(_c(), "malloc_trim", None)
        if fn is not None:
            fn(ctypes.c_size_t(0))
    except Exception as e:  # an optimisation only
        log.debug("malloc_trim failed: %s", e)


def file_mappings(path: str) -> list[tuple[int, int]]:
    """The address ranges at which this process maps the file ``path`` (from
    /proc/self/maps); empty off Linux or when it cannot be read. Reads one small
    procfs file; never raises."""
    import os

    try:
        real = os.path.realpath(path)
        out = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
        return out
    except (OSError, ValueError):
        return []


def drop_pages(t: torch.Tensor, mappings: list[tuple[int, int]]) -> None:
    """Let the kernel drop the resident pages of a tensor that maps a file (a torch.save
    file loaded with ``mmap=True``), so they stop counting in this process's RSS: a file-backed
    page that was read stays mapped, and resident, until the mapping goes away, so an
    import that walks a whole mmap'd file would otherwise end up holding all of it.

    Only whole pages of the tensor's storage that lie inside one of ``mappings`` (see
    :func:`file_mappings`) are dropped: on anonymous memory MADV_DONTNEED would zero
    the data, so anything not provably file-backed is left alone. Dropped pages are
    re-read from the file if touched again (torch maps the file private and nothing
    writes to it, so no data is lost). A no-op off Linux. One system call; never
    raises."""
    if not mappings or not sys.platform.startswith("linux"):
        return
    try:
        st = t.untyped_storage()
        start, n = st.data_ptr(), st.nbytes()
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, (start + n) // page * page
        if hi <= lo or not any(a <= lo and hi <= b for a, b in mappings):
            return
        _c().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
    except Exception as e:  # an optimisation only
        log.debug("madvise failed: %s", e)
