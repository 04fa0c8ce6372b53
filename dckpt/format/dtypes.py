"""The dtypes dckpt stores, named as safetensors names them.

``ITEMSIZE`` is pure (no torch); :func:`to_code` / :func:`to_torch` map torch dtypes.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedValueError

# safetensors dtype code -> bytes per element. Sub-byte types (F4...) are not offered:
# their boxes cannot be cut at arbitrary element offsets.
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8,
}

_TORCH: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):  # present since torch 2.1/2.3
        _TORCH[getattr(torch, _name)] = _code
_FROM_CODE: dict[str, torch.dtype] = {code: dt for dt, code in _TORCH.items()}


def to_code(dtype: torch.dtype, key: str = "?") -> str:
    """Return the safetensors code of ``dtype``; raises UnsupportedValueError naming ``key``."""
    try:
        return _TORCH[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"tensor {key!r} has dtype {dtype}, which dckpt cannot store; "
            f"supported: {', '.join(str(d) for d in _TORCH)}"
        ) from None


def to_torch(code: str) -> torch.dtype:
    """Return the torch dtype of a safetensors code (already validated by the manifest)."""
    return _FROM_CODE[code]
