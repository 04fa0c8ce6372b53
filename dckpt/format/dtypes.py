"""The dtypes dckpt stores, named as safetensors names them.

``ITEMSIZE`` is pure (no torch); :func:`to_code` / :func:`to_torch` map torch dtypes.
torch is imported at their first call, not with this module: reading a manifest (the
CLI's ls, inspect, du) must not pay for importing torch.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..errors import UnsupportedValueError

if TYPE_CHECKING:
    import torch

# safetensors dtype code -> bytes per element. Sub-byte types (F4...) are not offered:
# their boxes cannot be cut at arbitrary element offsets.
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8,
}

# torch's name -> code; the last five exist since torch 2.1/2.3 (taken where present)
_NAMES = (("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
          ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"),
          ("uint8", "U8"), ("bool", "BOOL"), ("complex64", "C64"),
          ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
          ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"))


@functools.cache
def _maps() -> tuple[dict, dict]:
    """({torch dtype: code}, {code: torch dtype}); imports torch once."""
    import torch

    to_code_map = {getattr(torch, n): c for n, c in _NAMES if hasattr(torch, n)}
    return to_code_map, {c: d for d, c in to_code_map.items()}


def to_code(dtype: "torch.dtype", key: str = "?") -> str:
    """Return the safetensors code of ``dtype``; raises UnsupportedValueError naming ``key``."""
    codes = _maps()[0]
    try:
        return codes[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"tensor {key!r} has dtype {dtype}, which dckpt cannot store; "
            f"supported: {', '.join(str(d) for d in codes)}"
        ) from None


def to_torch(code: str) -> "torch.dtype":
    """Return the torch dtype of a safetensors code (already validated by the manifest)."""
    return _maps()[1][code]


def __getattr__(name: str):
    # _TORCH / _FROM_CODE: the maps under their former names (tests enumerate the dtypes)
    if name == "_TORCH":
        return _maps()[0]
    if name == "_FROM_CODE":
        return _maps()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
