"""Compare two checkpoints by value: ``dckpt.diff(a, b)`` and ``dckpt diff A B``.

Values, not layouts: each tensor is read through :meth:`dckpt.view.open.Checkpoint.get_slice`
from both checkpoints with the same slab bounds (a range of leading rows of at most
``slab_bytes`` per side), so a checkpoint saved by 2 ranks and the same values saved by
3 ranks compare equal. Per key the comparison keeps running accumulators (max |a-b|,
the L2 norms of a-b and of b in float64, a count of differing elements), never two whole
tensors: memory is two slabs, the reader's temporaries and float64 work blocks of
``WORK_ELEMS`` elements, whatever the checkpoints' size. See docs/DIFF.md.

The module is ``compare``, not ``diff``: importing a submodule ``dckpt.diff`` would
replace the function ``dckpt.diff`` on the package (as ``dckpt.view.open`` for ``open``).
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..errors import CheckpointError
from ..format.sealed import bytes_text
from ..progress import Progress
# the numeric comparison; public here, where callers import it
from .accumulate import WORK_ELEMS, Accumulator  # noqa: F401

if TYPE_CHECKING:
    from .open import Checkpoint

__all__ = ["diff", "DiffResult", "KeyDiff", "STATUSES", "slabs"]

log = logging.getLogger(__name__)

STATUSES = ("equal", "changed", "added", "removed", "shape", "dtype")
DEFAULT_SLAB = 64 << 20  # bytes per side per read
_READ_BUDGET = 32 << 20  # reader temporaries of the checkpoints diff opens itself


@dataclass(frozen=True)
class KeyDiff:
    """How one key compares. ``status`` is one of :data:`STATUSES`; ``max_abs_diff``
    (max |a-b|), ``rel_l2`` (||a-b||_2 / ||b||_2) and ``n_diff`` (elements outside the
    tolerance) are set for tensors of the same shape and dtype on both sides (``equal``
    or ``changed``), None otherwise. ``numel`` is the tensor's element count (None for a
    JSON value); ``detail`` a short human note (``"[4, 4] -> [4, 5]"``, ``"0.5 ->
    0.25"``) for the text table, not part of :meth:`DiffResult.to_json`."""

    key: str
    status: str
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    n_diff: int | None = None
    numel: int | None = None
    detail: str | None = None

    def as_dict(self) -> dict:
        """The five fields of the JSON output; non-finite floats as strings."""
        return {"key": self.key, "status": self.status,
                "max_abs_diff": _num(self.max_abs_diff), "rel_l2": _num(self.rel_l2),
                "n_diff": self.n_diff}


def _num(x: float | None) -> float | str | None:
    """JSON has no inf/NaN: they are written as the strings "inf" and "nan"."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


@dataclass
class DiffResult:
    """Every compared key (A's keys in A's order, then the keys only B has), with the
    tolerances used. ``equal`` is True when every key's status is ``"equal"``."""

    a: str
    b: str
    keys: list[KeyDiff] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def equal(self) -> bool:
        return all(k.status == "equal" for k in self.keys)

    def __bool__(self) -> bool:  # `if dckpt.diff(a, b):` would read as "differs?": refuse
        raise TypeError("a DiffResult has no truth value: test result.equal")

    def counts(self) -> dict[str, int]:
        """{status: how many keys}, in :data:`STATUSES` order, statuses present only."""
        out = {s: 0 for s in STATUSES}
        for k in self.keys:
            out[k.status] += 1
        return {s: n for s, n in out.items() if n}

    def summary(self) -> str:
        """``"12 keys: 10 equal, 1 changed, 1 added"``."""
        parts = ", ".join(f"{n} {s}" for s, n in self.counts().items())
        n = len(self.keys)
        return f"{n} key{'' if n == 1 else 's'}" + (f": {parts}" if parts else "")

    def to_dict(self) -> dict:
        return {"equal": self.equal, "keys": [k.as_dict() for k in self.keys]}

    def to_json(self) -> str:
        """``{"equal": bool, "keys": [{"key", "status", "max_abs_diff", "rel_l2",
        "n_diff"}, ...]}``: strict JSON (inf and NaN as strings)."""
        return json.dumps(self.to_dict(), allow_nan=False)


# ---------------------------------------------------------------------- pure parts
def slabs(shape: Sequence[int], itemsize: int, limit: int) -> Iterator[tuple]:
    """Basic indices that cut a tensor of ``shape`` into pieces of at most ``limit``
    bytes (at least one element each), in row-major order: ranges of leading rows where
    a row fits, else single rows cut further along the next dim, and so on. A 0-d tensor
    gives one ``(...)``; an empty one nothing. Pure."""
    shape = tuple(int(n) for n in shape)
    if any(n == 0 for n in shape):
        return
    if not shape:
        yield (...,)
        return
    inner, d = itemsize, len(shape) - 1
    # the outermost dim d whose rows (dims after d) fit the limit
    while d > 0 and inner * shape[d] <= limit:
        inner *= shape[d]
        d -= 1
    if inner * shape[d] <= limit:  # the whole tensor fits (d == 0)
        yield (...,)
        return
    step = max(1, limit // inner)
    outer = shape[:d]
    idx = [0] * len(outer)
    while True:
        for r in range(0, shape[d], step):
            yield (*idx, slice(r, min(r + step, shape[d])))
        for j in reversed(range(len(outer))):  # the next index of the dims before d
            idx[j] += 1
            if idx[j] < outer[j]:
                break
            idx[j] = 0
        else:
            return


def _short(v: Any, width: int = 40) -> str:
    """A JSON value for the table, cut to ``width``; bytes as their length and a hex
    prefix (``bytes[1234] 80049512...``), not the blob. O(width) for bytes."""
    text = (bytes_text(v) if isinstance(v, bytes) else repr(v) if isinstance(v, str)
            else json.dumps(v))
    return text if len(text) <= width else text[:width - 3] + "..."


def values_equal(x: Any, y: Any) -> bool:
    """JSON values compare with ``==``, except that a bool equals only a bool (True is
    not 1) and NaN equals NaN; bytes equal only bytes (b"a" is not "a"). Pure."""
    if isinstance(x, bool) != isinstance(y, bool):
        return False
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:
        return True
    return x == y


def under(key: str, prefixes: Sequence[str]) -> bool:
    """Whether ``key`` is one of ``prefixes`` or below one (dotted: ``model.l1`` holds
    ``model.l1.w``, not ``model.l10.w``). Pure."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


# ---------------------------------------------------------------------- the diff
def diff(a: "str | os.PathLike | Checkpoint", b: "str | os.PathLike | Checkpoint",
         atol: float = 0.0, rtol: float = 0.0, keys: str | Sequence[str] | None = None,
         storage_options: dict | Sequence[dict | None] | None = None, *,
         slab_bytes: int = DEFAULT_SLAB) -> DiffResult:
    """Compare checkpoint ``a`` (the old one) with ``b`` (the new one), key by key, by
    value. ``a``/``b``: paths or URLs (opened with :func:`dckpt.open` and closed
    after), or open :class:`dckpt.view.open.Checkpoint` views (left open).
    ``storage_options``: one dict for both, or a pair ``(options_a, options_b)``.
    ``keys``: a dotted prefix (or several) restricting the comparison to the keys under
    it. Elements differ when |a-b| > atol + rtol*|b| (see docs/DIFF.md).

    Cost: blocking I/O, no process group: both manifests, then every tensor present on
    both sides with the same shape and dtype read once from each, in slabs of at most
    ``slab_bytes`` per side. Memory: about 2 x slab_bytes + 32 MiB of reader temporaries
    + 12 MiB of float64 work. Logs a progress line (INFO, ``dckpt.view.diff``) past 10 s.
    Raises CheckpointError for bad arguments or when ``keys`` matches nothing on either
    side; NotCommittedError/ManifestError as :func:`dckpt.open`; IntegrityError naming
    the checkpoint and key when a chunk read is damaged."""
    atol, rtol = _tolerance("atol", atol), _tolerance("rtol", rtol)
    if int(slab_bytes) < 1:
        raise CheckpointError(f"slab_bytes must be at least 1, not {slab_bytes}")
    prefixes = _prefixes(keys)
    opts_a, opts_b = _pair(storage_options)
    ck_a, own_a = _opened(a, opts_a)
    try:
        ck_b, own_b = _opened(b, opts_b)
        try:
            return _compare(ck_a, ck_b, atol, rtol, prefixes, int(slab_bytes))
        finally:
            if own_b:
                ck_b.close()
    finally:
        if own_a:
            ck_a.close()


def _tolerance(name: str, x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise CheckpointError(f"{name} must be a number, not {x!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise CheckpointError(f"{name} must be a finite number >= 0, not {x!r}")
    return v


def _prefixes(keys: str | Sequence[str] | None) -> list[str] | None:
    if keys is None:
        return None
    items = [keys] if isinstance(keys, str) else list(keys)
    if not items or not all(isinstance(k, str) and k.strip(".") for k in items):
        raise CheckpointError(f"keys must be a dotted prefix (\"model\") or a list of them, "
                              f"not {keys!r}")
    return [k.rstrip(".") for k in items]


def _pair(opts: Any) -> tuple[dict | None, dict | None]:
    if opts is None or isinstance(opts, dict):
        return opts, opts
    if isinstance(opts, (list, tuple)) and len(opts) == 2 and all(
            o is None or isinstance(o, dict) for o in opts):
        return opts[0], opts[1]
    raise CheckpointError("storage_options must be a dict (for both checkpoints) or a pair "
                          f"(options_a, options_b) of dicts or None, not {opts!r}")


def _opened(x: Any, opts: dict | None) -> tuple["Checkpoint", bool]:
    from .open import Checkpoint, open as open_view

    if isinstance(x, Checkpoint):
        return x, False
    if not isinstance(x, (str, os.PathLike)):
        raise CheckpointError(f"diff compares checkpoints given as paths, URLs or "
                              f"dckpt.open views, not {type(x).__name__}")
    return open_view(x, opts, read_budget=_READ_BUDGET), True


def _compare(ck_a: "Checkpoint", ck_b: "Checkpoint", atol: float, rtol: float,
             prefixes: list[str] | None, slab: int) -> DiffResult:
    ka, kb = ck_a.keys(), ck_b.keys()
    if prefixes is not None:
        ka = [k for k in ka if under(k, prefixes)]
        kb = [k for k in kb if under(k, prefixes)]
        if not ka and not kb:
            raise CheckpointError(f"no key under {', '.join(map(repr, prefixes))} in "
                                  f"{ck_a.path} or {ck_b.path}")
    in_a, in_b = set(ka), set(kb)
    order = ka + [k for k in kb if k not in in_a]
    infos = {k: (_info(ck_a, k) if k in in_a else None, _info(ck_b, k) if k in in_b else None)
             for k in order}
    # Progress counts the bytes read on both sides, for the tensors whose values compare.
    total = sum(ia.nbytes + ib.nbytes for ia, ib in infos.values()
                if _comparable(ia, ib))
    progress = Progress(f"diff {ck_a.path} {ck_b.path}", total, log)
    out = DiffResult(ck_a.path, ck_b.path, atol=atol, rtol=rtol)
    for k in order:
        out.keys.append(_one(ck_a, ck_b, k, *infos[k], atol, rtol, slab, progress))
    return out


@dataclass(frozen=True)
class _Stored:
    """A bytes value stored in a data file (over 64 KiB): read when its key is compared,
    one pair at a time, not when every key's info is listed (a job's per-rank dataloader
    blobs would all be held at once)."""

    ck: Any
    key: str


def _info(ck: "Checkpoint", key: str):
    """``ck.info(key)``, without reading a bytes value stored in a data file. No I/O."""
    e = ck.manifest.tensors.get(key)
    if e is not None and e.bytes_value:
        from .open import ValueInfo

        return ValueInfo(key, _Stored(ck, key))
    return ck.info(key)


def _value(v: Any) -> Any:
    """A value to compare or show: a stored bytes value read (blocking I/O, verified)."""
    return v.ck[v.key] if isinstance(v, _Stored) else v


def _comparable(ia, ib) -> bool:
    return (ia is not None and ib is not None and ia.kind == ib.kind == "tensor"
            and ia.shape == ib.shape and ia.dtype == ib.dtype)


def _what(info) -> str:
    if info.kind == "value":
        return f"value {_short(_value(info.value))}"
    return f"tensor {str(info.dtype).replace('torch.', '')} {list(info.shape)}"


def _one(ck_a, ck_b, key: str, ia, ib, atol: float, rtol: float, slab: int,
         progress: Progress) -> KeyDiff:
    if ia is None:
        return KeyDiff(key, "added", detail=_what(ib))
    if ib is None:
        return KeyDiff(key, "removed", detail=_what(ia))
    if ia.kind != ib.kind:  # a tensor on one side, a JSON value on the other
        return KeyDiff(key, "dtype", detail=f"{_what(ia)} -> {_what(ib)}")
    if ia.kind == "value":
        va, vb = _value(ia.value), _value(ib.value)
        if values_equal(va, vb):
            return KeyDiff(key, "equal")
        return KeyDiff(key, "changed", detail=f"{_short(va)} -> {_short(vb)}")
    numel = math.prod(ia.shape)
    if ia.shape != ib.shape:
        return KeyDiff(key, "shape", numel=numel, detail=f"{list(ia.shape)} -> {list(ib.shape)}")
    if ia.dtype != ib.dtype:
        return KeyDiff(key, "dtype", numel=numel, detail=(
            f"{str(ia.dtype).replace('torch.', '')} -> {str(ib.dtype).replace('torch.', '')}"))
    acc = Accumulator(ia.dtype, atol, rtol)
    sa, sb = ck_a.get_slice(key), ck_b.get_slice(key)
    itemsize = ia.nbytes // numel if numel else 1
    for index in slabs(ia.shape, itemsize, slab):
        pa = sa[index]
        pb = sb[index]
        acc.update(pa, pb)
        progress.add(2 * pa.numel() * itemsize)
        del pa, pb
    status = "equal" if acc.n_diff == 0 else "changed"
    return KeyDiff(key, status, acc.max_abs, acc.rel_l2(), acc.n_diff, numel)
