"""Checksummed, strict JSON documents: the envelope of a version-2 manifest.

Pure. A sealed document is ``{"checksum":"crc32:<8 hex>",`` followed by the compact JSON
of the document without its opening brace; the CRC32 covers exactly those following
bytes, so the file stays valid JSON (jq, any strict parser) while a flipped bit anywhere
is detected. JSON has no NaN or infinity: a non-finite float is written as the object
``{"$float": "nan" | "inf" | "-inf"}``.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from ..errors import ManifestError
from .checksum import crc32

# Version 2 starts with exactly these bytes; the CRC32 covers every byte after them.
CHECKSUM_HEAD = b'{"checksum":"crc32:'
_CHECKSUM_PREFIX = re.compile(rb'\{"checksum":"crc32:([0-9a-f]{8})",')
_PREFIX_LEN = len(CHECKSUM_HEAD) + len('01234567",')
MISMATCH = ("manifest checksum mismatch: the manifest was modified or damaged after it was "
            "written; the checkpoint is corrupt (load an older one)")
# JSON has no NaN or infinity: a non-finite float among the values or in meta is written
# as {"$float": name}. Values are otherwise scalars, so an object there is unambiguous.
_FLOAT_TAG = "$float"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def tag_floats(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its {"$float": name} tag. O(size)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT_TAG: "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"}
    if isinstance(obj, dict):
        return {k: tag_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tag_floats(v) for v in obj]
    return obj


def seal(doc: dict[str, Any]) -> bytes:
    """Serialise a manifest document (the dict :func:`to_json` builds; a "checksum" key
    is dropped) as version-2 bytes: ``{"checksum":"crc32:<8 hex>",`` then the compact
    JSON of the document without its opening brace, which the CRC32 covers. For tools
    and tests that rewrite a manifest on purpose. O(size), no I/O. Raises ValueError on
    NaN/infinity (JSON has none), TypeError on values JSON cannot encode."""
    body = json.dumps({k: v for k, v in doc.items() if k != "checksum"},
                      separators=(",", ":"), allow_nan=False).encode()
    rest = body[1:]
    if rest == b"}":
        raise ValueError("an empty manifest document cannot be sealed")
    return b'{"checksum":"crc32:%08x",' % crc32(rest) + rest


def untag_float(v: Any) -> float | None:
    """The float a {"$float": "nan" | "inf" | "-inf"} tag stands for, else None."""
    if isinstance(v, dict) and len(v) == 1:
        name = v.get(_FLOAT_TAG)
        if isinstance(name, str) and name in _NON_FINITE:
            return _NON_FINITE[name]
    return None


def short(x: Any, limit: int = 60) -> str:
    """repr of a (possibly huge, hostile) value, cut for an error message."""
    r = repr(x)
    return r if len(r) <= limit else r[:limit] + "..."


def load_json(data: bytes) -> tuple[Any, list[str]]:
    """The decoded document and the NaN/Infinity constants it used (not JSON; version 1
    wrote them for non-finite values)."""
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name)  # float() reads NaN, Infinity and -Infinity

    try:
        return json.loads(data, parse_constant=constant), constants
    except RecursionError:
        raise ManifestError("not valid JSON (nested too deeply to decode); the checkpoint "
                            "is corrupt") from None
    except ValueError as e:  # also UnicodeDecodeError and integers over 4300 digits
        raise ManifestError(f"not valid JSON ({short(str(e), 200)}); the checkpoint is "
                            "corrupt") from None


def check_checksum(data: bytes) -> None:
    m = _CHECKSUM_PREFIX.match(data)
    if m is None or int(m.group(1), 16) != crc32(memoryview(data)[_PREFIX_LEN:]):
        raise ManifestError(MISMATCH)
