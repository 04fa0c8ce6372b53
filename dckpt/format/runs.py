"""A long integer array kept as its runs of arithmetic progressions, in memory too.

A manifest saved by 131,072 ranks stores an FSDP tensor's breakpoints and chunk files as
a few runs (``{"runs": [[first, step, count], ...]}``, :mod:`.intarray`). Decoded into
int64 arrays, 500 such tensors took 1 GB on every rank of a load, which reads a few of
their values (issue 47). :class:`Runs` keeps the runs: O(runs) memory, O(log runs)
indexing and, for a rising sequence, binary search. It expands (``np.asarray``) only
for the code that wants every value. Pure: numpy and bisect, no I/O.
"""
from __future__ import annotations

import bisect
from typing import Any, Iterator

import numpy as np

_LO, _HI = -(1 << 63), (1 << 63) - 1
# Runs are kept as runs only where that saves memory: at most one run per this many
# values (an FSDP grid: 1-3 runs for 131,072 values). Otherwise the caller decodes.
MIN_VALUES_PER_RUN = 8


class Runs:
    """A read-only int64 sequence given as runs ``(first, step, count)``. Indexing is
    O(log runs), :meth:`searchsorted` (rising sequences) O(log runs), :meth:`min` /
    :meth:`max` O(runs); ``np.asarray`` expands it, O(values). Equality, hashing and
    arithmetic are not defined: expand first."""

    __slots__ = ("first", "step", "count", "start", "_n", "_expanded")

    def __init__(self, runs: list[tuple[int, int, int]]) -> None:
        """``runs``: (first, step, count) with count >= 1 and every value, computed
        exactly, inside int64 (checked by :func:`from_json`, the one way a manifest
        makes one)."""
        self.first = [int(r[0]) for r in runs]
        self.step = [int(r[1]) for r in runs]
        self.count = [int(r[2]) for r in runs]
        self.start, n = [], 0  # index of each run's first value
        for c in self.count:
            self.start.append(n)
            n += c
        self._n = n
        self._expanded: np.ndarray | None = None

    def __len__(self) -> int:
        return self._n

    def _run(self, i: int) -> int:
        return bisect.bisect_right(self.start, i) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, (int, np.integer)):
            i = int(i)
            if i < 0:
                i += self._n
            if not 0 <= i < self._n:
                raise IndexError(f"index {i} out of range for {self._n} values")
            j = self._run(i)
            return self.first[j] + self.step[j] * (i - self.start[j])
        return np.asarray(self)[i]

    def take(self, idx: np.ndarray) -> np.ndarray:
        """The values at the (in-range, non-negative) indexes ``idx``. O(len(idx) log runs)."""
        idx = np.asarray(idx, np.int64)
        j = np.searchsorted(np.asarray(self.start, np.int64), idx, "right") - 1
        return (np.asarray(self.first, np.int64)[j]
                + np.asarray(self.step, np.int64)[j] * (idx - np.asarray(self.start, np.int64)[j]))

    def last(self, j: int) -> int:
        """The last value of run ``j``."""
        return self.first[j] + self.step[j] * (self.count[j] - 1)

    def min(self) -> int:
        return min(min(f, self.last(j)) for j, f in enumerate(self.first))

    def max(self) -> int:
        return max(max(f, self.last(j)) for j, f in enumerate(self.first))

    def rising(self) -> bool:
        """Whether the values rise strictly. O(runs)."""
        prev = None
        for j, f in enumerate(self.first):
            if self.count[j] > 1 and self.step[j] <= 0:
                return False
            if prev is not None and f <= prev:
                return False
            prev = self.last(j)
        return True

    def searchsorted(self, x: int, side: str = "left") -> int:
        """As ``np.searchsorted`` on the values, which must rise strictly (a breakpoint
        list): the index where ``x`` would go. O(log runs)."""
        j = bisect.bisect_right(self.first, x) - 1  # the run whose first value <= x
        if j < 0:
            return 0
        f, s, c = self.first[j], self.step[j], self.count[j]
        if c == 1 or s <= 0:  # one value (a rising sequence's runs of 2+ step up)
            return self.start[j] + (1 if x > f or side == "right" else 0)
        # values f + s*k: below x for k < ceil((x - f) / s); at most x for k <= (x - f) // s
        k = (x - f) // s + 1 if side == "right" else -((f - x) // s)
        return self.start[j] + min(k, c)

    def where(self, x: int) -> np.ndarray:
        """The indexes holding ``x``, rising. O(runs) plus the hits."""
        out = []
        for f, s, c, a in zip(self.first, self.step, self.count, self.start):
            if s == 0:
                if f == x:
                    out.extend(range(a, a + c))
            elif (x - f) % s == 0 and 0 <= (x - f) // s < c:
                out.append(a + (x - f) // s)
        return np.asarray(out, np.int64)

    def __iter__(self) -> Iterator[int]:
        for f, s, c in zip(self.first, self.step, self.count):
            yield from range(f, f + s * c, s) if s else (f for _ in range(c))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._expanded is None:
            out = np.empty(self._n, np.int64)
            for f, s, c, a in zip(self.first, self.step, self.count, self.start):
                out[a:a + c] = f + s * np.arange(c, dtype=np.int64)
            out.flags.writeable = False
            self._expanded = out  # cached: the caller wanted every value once already
        return self._expanded if dtype is None else self._expanded.astype(dtype)

    def tolist(self) -> list[int]:
        return list(self)

    def copy(self) -> np.ndarray:
        """An expanded, writable copy (as ``ndarray.copy``)."""
        return np.array(np.asarray(self))

    def replaced(self, i: int, value: int) -> "Runs":
        """A new sequence equal to this one but for ``value`` at index ``i`` (in
        range): the run holding ``i`` split around it. O(runs), nothing expanded."""
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} values")
        j = self._run(i)
        f, st, c, k = self.first[j], self.step[j], self.count[j], i - self.start[j]
        mid = [(f, st, k)] if k else []
        mid.append((int(value), 1, 1))
        if k + 1 < c:
            mid.append((f + st * (k + 1), st, c - k - 1))
        runs = list(zip(self.first, self.step, self.count))
        return Runs(runs[:j] + mid + runs[j + 1:])

    def encode(self) -> dict[str, list[list[int]]]:
        """The JSON runs form (:mod:`.intarray`), without expanding."""
        return {"runs": [[f, s, c] for f, s, c in zip(self.first, self.step, self.count)]}

    def __repr__(self) -> str:
        return f"Runs({self.encode()['runs']!r})"


def from_json(obj: Any, limit: int) -> Runs | None:
    """The runs of ``obj`` when it is a well-formed ``{"runs": ...}`` form of at most
    ``limit`` values that is worth keeping as runs (at least MIN_VALUES_PER_RUN values
    per run, every value inside int64 computed exactly, so nothing wraps); else None
    (the caller decodes it with :func:`.intarray.decode`, which raises for malformed
    input). O(runs); allocates nothing per value."""
    if not (type(obj) is dict and len(obj) == 1 and type(runs := obj.get("runs")) is list
            and runs):
        return None
    total = 0
    for r in runs:
        if not (type(r) is list and len(r) == 3 and all(type(x) is int for x in r)):
            return None
        f, s, c = r
        if c < 1 or not (_LO <= f <= _HI and _LO <= s <= _HI and _LO <= f + s * (c - 1) <= _HI):
            return None
        total += c
        if total > limit:
            return None
    if total < MIN_VALUES_PER_RUN * len(runs):
        return None
    return Runs(runs)
