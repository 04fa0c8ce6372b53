"""Checksummed, strict JSON documents: the envelope of a version-2 manifest.

Pure. A sealed document is ``{"checksum":"crc32:<8 hex>",`` followed by the compact JSON
of the document without its opening brace; the CRC32 covers exactly those following
bytes, so the file stays valid JSON (jq, any strict parser) while a flipped bit anywhere
is detected. JSON has no NaN or infinity: a non-finite float is written as the object
``{"$float": "nan" | "inf" | "-inf"}``. Nor has it bytes: a ``bytes`` value (a
framework's opaque, already-serialised state, such as torchtitan's dataloader) is the
object ``{"$bytes": "<base64>"}``, at most :data:`MAX_BYTES_VALUE` bytes decoded.
"""
from __future__ import annotations

import base64
import binascii
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
# A bytes value is {"$bytes": base64}. It stays in that form in the flattened state, the
# plans and Manifest.values (JSON all the way: plans are JSON-encoded, hashed and
# compared between ranks as JSON); only what hands a value to a user decodes it
# (:func:`user_value`). Bounded: every rank parses the whole manifest at load, so a
# large blob belongs in a uint8 tensor (sharded, checksummed per block, read by whoever
# needs it).
BYTES_TAG = "$bytes"
MAX_BYTES_VALUE = 1 << 20  # 1 MiB decoded per value
_MAX_B64 = 4 * -(-MAX_BYTES_VALUE // 3)  # its base64 length (padded)


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
    return seal_body(json.dumps({k: v for k, v in doc.items() if k != "checksum"},
                                separators=(",", ":"), allow_nan=False).encode())


def seal_body(body: bytes) -> bytes:
    """:func:`seal` of a document already serialised as compact JSON (``body``, an
    object without a "checksum" key): the manifest writer assembles it by parts, its
    tensor table's text reused between saves. O(len(body)) (one CRC32). Raises
    ValueError for an empty object."""
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


def tag_bytes(raw: bytes) -> dict[str, str]:
    """The {"$bytes": base64} tag of ``raw`` (standard alphabet, padded). O(len(raw));
    the caller bounds the length (:func:`dckpt.state.flatten.flatten` does)."""
    return {BYTES_TAG: base64.b64encode(raw).decode("ascii")}


def is_bytes_tag(v: Any) -> bool:
    """Whether ``v`` is an object that claims to be a bytes tag (has the "$bytes" key);
    :func:`check_bytes_tag` says whether it is a valid one. O(1)."""
    return isinstance(v, dict) and BYTES_TAG in v


def check_bytes_tag(v: dict, key: str) -> dict[str, str]:
    """Validate a {"$bytes": base64} value of a manifest read from storage (untrusted):
    exactly one key, a string of canonical padded base64 (what :func:`tag_bytes`
    writes; so a parsed manifest writes back byte for byte) of at most
    :data:`MAX_BYTES_VALUE` bytes decoded. Returns ``v``. The length is checked before
    anything is decoded; cost O(len) (a decode and a re-encode, in C). Raises
    ManifestError naming ``key``."""
    s = v.get(BYTES_TAG)
    if len(v) != 1 or not isinstance(s, str):  # not repr(v): it may be huge
        got = f"{len(v)} keys" if len(v) != 1 else f"a {type(s).__name__}"
        raise ManifestError(f'value {key!r}: a bytes value is {{"$bytes": "<base64>"}}, '
                            f"exactly one key with a string; got {got}")
    if len(s) > _MAX_B64:
        raise ManifestError(f"value {key!r}: a bytes value of about {len(s) * 3 // 4} bytes is "
                            f"over the {MAX_BYTES_VALUE}-byte limit for bytes values")
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):  # ValueError: a non-ASCII str
        raise ManifestError(f"value {key!r}: {short(s)} is not valid base64") from None
    if base64.b64encode(raw).decode("ascii") != s:  # unused bits set: not what we write
        raise ManifestError(f"value {key!r}: {short(s)} is not canonical base64")
    return v


def user_value(v: Any) -> Any:
    """What a value of a parsed manifest (or a plan) is to the user: the bytes a
    {"$bytes"} tag stands for, anything else itself. O(len) for a tag (a base64
    decode, at most MAX_BYTES_VALUE bytes), O(1) otherwise. A tag that
    :func:`check_bytes_tag` did not pass may raise binascii.Error."""
    if isinstance(v, dict) and BYTES_TAG in v:
        return base64.b64decode(v[BYTES_TAG], validate=True)
    return v


def bytes_text(raw: bytes, head: int = 8) -> str:
    """A bytes value for people: its length and the hex of its first ``head`` bytes,
    ``bytes[1234] 80049512a0000000...``, never the whole blob. O(head)."""
    if not raw:
        return "bytes[0]"
    return f"bytes[{len(raw)}] {raw[:head].hex()}{'...' if len(raw) > head else ''}"


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
