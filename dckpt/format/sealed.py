"""Checksummed, strict JSON documents: the envelope of a version-2 manifest.

Pure. A sealed document is ``{"checksum":"crc32:<8 hex>",`` followed by the compact JSON
of the document without its opening brace; the CRC32 covers exactly those following
bytes, so the file stays valid JSON (jq, any strict parser) while a flipped bit anywhere
is detected. JSON has no NaN or infinity: a non-finite float is written as the object
``{"$float": "nan" | "inf" | "-inf"}``. Nor has it bytes: a small ``bytes`` value (a
framework's opaque, already-serialised state, such as torchtitan's dataloader) is the
object ``{"$bytes": "<base64>"}``, at most :data:`MAX_BYTES_TAG` bytes decoded; a save
writes one over :data:`INLINE_BYTES` into its rank's data file instead (a tensor entry
marked as bytes, manifest version 5: :func:`check_bytes_entry`).
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
# A small bytes value is {"$bytes": base64}. It stays in that form in the flattened
# state, the plans and Manifest.values (JSON all the way: plans are JSON-encoded, hashed
# and compared between ranks as JSON); only what hands a value to a user decodes it
# (:func:`user_value`). Every rank parses the whole manifest at load (and every plan
# passes through rank 0), so a save keeps only values up to INLINE_BYTES there: a larger
# one is a 1-D uint8 entry in the data file of a rank that holds it (checksummed per
# block, read only by the ranks that ask for its key), marked as bytes in the manifest.
BYTES_TAG = "$bytes"
INLINE_BYTES = 64 << 10  # a save inlines bytes values up to this size
# The largest tag a reader accepts: what saves before version 5 inlined (and what
# flatten still inlines for callers that want no data-file entries; saves and imports
# store larger ones in data files).
MAX_BYTES_TAG = 1 << 20
_MAX_B64 = 4 * -(-MAX_BYTES_TAG // 3)  # its base64 length (padded)
# The largest bytes value at all (a data-file entry): a load allocates it whole, so a
# size a manifest declares is checked against this before anything is allocated.
MAX_BYTES_VALUE = 4 << 30
BYTES_DTYPE = "U8"  # a bytes entry's safetensors dtype: 1-D, one element per byte


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
    :data:`MAX_BYTES_TAG` bytes decoded. Returns ``v``. The length is checked before
    anything is decoded; cost O(len) (a decode and a re-encode, in C). Raises
    ManifestError naming ``key``."""
    s = v.get(BYTES_TAG)
    if len(v) != 1 or not isinstance(s, str):  # not repr(v): it may be huge
        got = f"{len(v)} keys" if len(v) != 1 else f"a {type(s).__name__}"
        raise ManifestError(f'value {key!r}: a bytes value is {{"$bytes": "<base64>"}}, '
                            f"exactly one key with a string; got {got}")
    if len(s) > _MAX_B64:
        raise ManifestError(f"value {key!r}: a bytes value of about {len(s) * 3 // 4} bytes is "
                            f"over the {MAX_BYTES_TAG}-byte limit for inline bytes values")
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
    decode, at most MAX_BYTES_TAG bytes), O(1) otherwise. A tag that
    :func:`check_bytes_tag` did not pass may raise binascii.Error."""
    if isinstance(v, dict) and BYTES_TAG in v:
        return base64.b64decode(v[BYTES_TAG], validate=True)
    return v


def check_bytes_entry(key: str, flag: Any, dtype: Any, shape: list) -> bool:
    """Validate the ``"bytes"`` field of a manifest's tensor entry (untrusted): absent
    (``flag`` None: an ordinary tensor) or ``true``, and then the entry must be what a
    save writes for a bytes value: dtype U8, one dim, at most :data:`MAX_BYTES_VALUE`
    elements, so a reader never allocates more than that for it. Returns whether the
    entry is a bytes value. O(1). Raises ManifestError naming ``key``."""
    if flag is None:
        return False
    if flag is not True:
        raise ManifestError(f"tensor {key!r}: \"bytes\" must be true when present, got "
                            f"{short(flag)}")
    if dtype != BYTES_DTYPE or not isinstance(shape, list) or len(shape) != 1:
        raise ManifestError(f"tensor {key!r}: a bytes value is stored as a 1-D U8 entry, "
                            f"got dtype {short(dtype)} shape {short(shape)}")
    n = shape[0]
    if type(n) is not int or not 0 <= n <= MAX_BYTES_VALUE:
        raise ManifestError(f"tensor {key!r}: a bytes value of {short(n)} bytes is over the "
                            f"{MAX_BYTES_VALUE}-byte limit for bytes values (or not a size)")
    return True


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
