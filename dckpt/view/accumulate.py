"""The numeric core of :func:`dckpt.diff`: a running comparison of one tensor fed slab by
slab, in reused float64 work buffers (split from :mod:`dckpt.view.diff`, which
re-exports it). torch is imported at first use: the CLI imports the diff module
torch-free."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WORK_ELEMS = 1 << 18  # float64 work block: 2 MiB per temporary


class Accumulator:
    """Running comparison of one tensor fed piece by piece (same pieces, same order on
    both sides). Floating and complex dtypes: NaN equals NaN; an element differs when
    |a-b| > atol + rtol*|b| (an inf equals only the same inf; a NaN against a number is
    a difference of inf). Integers and bool: exact (the tolerances do not apply);
    differences computed in float64 (exact below 2**53). Work happens in reused
    float64 buffers of WORK_ELEMS elements: allocating fresh ones per block (fresh
    pages, faulted in) was measured 10-50x slower than the arithmetic."""

    def __init__(self, dtype: "torch.dtype", atol: float, rtol: float) -> None:
        import torch

        self.exact = not (dtype.is_floating_point or dtype.is_complex)
        self.complex = dtype.is_complex
        work = torch.complex128 if dtype.is_complex else torch.float64
        self.atol, self.rtol = atol, rtol
        self.max_abs, self.norm_d, self.norm_b, self.n_diff = 0.0, 0.0, 0.0, 0
        self._a = torch.empty(WORK_ELEMS, dtype=work)
        self._b = torch.empty(WORK_ELEMS, dtype=work)
        self._d = torch.empty(WORK_ELEMS, dtype=torch.float64)
        self._eq = torch.empty(WORK_ELEMS, dtype=torch.bool)
        self._m1 = torch.empty(WORK_ELEMS, dtype=torch.bool)
        self._m2 = torch.empty(WORK_ELEMS, dtype=torch.bool)

    def update(self, a: "torch.Tensor", b: "torch.Tensor") -> None:
        """Fold the pieces ``a`` and ``b`` (same shape and dtype) in. CPU work, in
        blocks of WORK_ELEMS elements."""
        a, b = a.reshape(-1), b.reshape(-1)
        for s in range(0, a.numel(), WORK_ELEMS):
            self._block(a[s:s + WORK_ELEMS], b[s:s + WORK_ELEMS])

    def _block(self, a: "torch.Tensor", b: "torch.Tensor") -> None:
        import torch

        n = a.numel()
        if n == 0:
            return
        a64, b64 = self._a[:n].copy_(a), self._b[:n].copy_(b)
        d, eq, m1, m2 = self._d[:n], self._eq[:n], self._m1[:n], self._m2[:n]
        if self.exact:
            torch.eq(a, b, out=eq)  # in the native dtype: exact where float64 rounds
        elif self.complex:  # NaN == NaN part by part: nan+1j is not nan+2j
            ra, rb = torch.view_as_real(a64), torch.view_as_real(b64)
            torch.all(ra.eq(rb).logical_or_(ra.isnan().logical_and_(rb.isnan())), dim=-1,
                      out=eq)
        else:  # float dtypes widen to float64 exactly; NaN == NaN
            torch.eq(a64, b64, out=eq)
            torch.ne(a64, a64, out=m1)
            torch.ne(b64, b64, out=m2)
            eq.logical_or_(m1.logical_and_(m2))
        if self.complex:
            torch.abs(a64.sub_(b64), out=d)
            babs = b64.abs()
        else:
            torch.sub(a64, b64, out=d).abs_()
            babs = b64.abs_()
        d.masked_fill_(eq, 0.0)  # inf - inf is NaN: but equal
        if not self.exact:
            d.nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN against a number
        babs.nan_to_num_(nan=0.0, posinf=math.inf)  # a NaN in b adds nothing to ||b||
        self.norm_b = math.hypot(self.norm_b, _norm(babs))
        if not self.exact and (self.atol or self.rtol):
            thr = babs.mul_(self.rtol).add_(self.atol)
            torch.le(d, thr, out=m1)
            eq.logical_or_(m1.logical_and_(torch.lt(d, math.inf, out=m2)))  # inf: never close
        self.n_diff += n - int(torch.count_nonzero(eq))
        self.max_abs = max(self.max_abs, float(d.max()))
        self.norm_d = math.hypot(self.norm_d, _norm(d))

    def rel_l2(self) -> float:
        """||a-b||_2 / ||b||_2; 0 where a == b (||a-b|| == 0), inf where ||b|| == 0 and
        a != b."""
        if self.norm_d == 0.0:
            return 0.0
        if self.norm_b == 0.0 or not math.isfinite(self.norm_b):
            return math.inf if self.norm_b == 0.0 or math.isinf(self.norm_d) else 0.0
        r = self.norm_d / self.norm_b
        return math.inf if math.isnan(r) else r


def _norm(x: "torch.Tensor") -> float:
    """||x||_2 of non-negative ``x``: vector_norm squares without scaling, so float64
    values past ~1e154 overflow to inf; such a block is scaled by its max first."""
    import torch

    n = float(torch.linalg.vector_norm(x))
    if math.isinf(n):
        top = float(x.max())
        if math.isfinite(top) and top > 0:
            n = top * float(torch.linalg.vector_norm(x / top))
    return n
