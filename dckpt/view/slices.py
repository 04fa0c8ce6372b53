"""Basic indexing of a saved tensor without reading it: ``ck.get_slice(key)[i:j, ...]``.

:func:`region` turns an index (ints, slices with step 1, one Ellipsis) into the box of
the global tensor it selects and the dims an int index drops; pure, no torch.
:class:`TensorSlice` is the handle :meth:`dckpt.view.open.Checkpoint.get_slice` returns: it
knows the tensor's shape and dtype from the manifest, and an index reads only the chunks
(and, inside them, only the checksum blocks) that the box overlaps.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch


class SliceError(CheckpointError, IndexError):
    """An index ``get_slice`` cannot serve: a step other than 1, an int out of range,
    more indices than dims, a second Ellipsis, or an index that is not an int, slice or
    Ellipsis (tensors of any size or dtype, arrays, numpy bools, lists, None). Also an
    ``IndexError``, as numpy and torch raise."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def region(index: Any, shape: tuple[int, ...], key: str = "?"
           ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes, kept)`` of the box that ``index`` selects in a tensor of
    ``shape``: ``kept`` lists the dims of the box that stay in the result (an int index
    drops its dim, as in torch). Slices are clamped as Python clamps them (an empty
    slice gives a size of 0); negative ints and slice bounds count from the end. Pure.
    Raises SliceError naming ``key`` for what basic step-1 indexing cannot express."""
    items = index if isinstance(index, tuple) else (index,)
    n_ell = sum(1 for x in items if x is Ellipsis)
    if n_ell > 1:
        raise SliceError(f"tensor {key!r}: an index can only have a single Ellipsis (...)")
    n_dims = len(items) - n_ell
    if n_dims > len(shape):
        raise SliceError(f"tensor {key!r} has {len(shape)} dim(s) (shape {list(shape)}); "
                         f"the index {_show(index)} has {n_dims}")
    if n_ell:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - n_dims) + items[at + 1:]
    else:
        items = items + (slice(None),) * (len(shape) - n_dims)
    offsets, sizes, kept = [], [], []
    for d, (it, n) in enumerate(zip(items, shape)):
        if isinstance(it, slice):
            try:
                start, stop, step = it.indices(n)
            except TypeError:  # a bound that is not an int (nor has __index__)
                bad = [type(x).__name__ for x in (it.start, it.stop, it.step)
                       if x is not None and not isinstance(x, int)]
                raise SliceError(f"tensor {key!r}: a slice bound of type {bad[0]} at dim {d} "
                                 "is not supported (get_slice takes ints, slices with step 1 "
                                 "and one Ellipsis)") from None
            if step != 1:
                raise SliceError(
                    f"tensor {key!r}: dim {d} is sliced with step {step}; get_slice reads "
                    "only contiguous ranges (step 1): read the range and step it afterwards "
                    f"(sl[a:b][::{step}]), or read the whole tensor with ck[key]")
            offsets.append(start)
            sizes.append(max(0, stop - start))
            kept.append(d)
            continue
        if isinstance(it, bool) or it is None:
            raise SliceError(f"tensor {key!r}: index {it!r} at dim {d} is not supported "
                             "(get_slice takes ints, slices with step 1 and one Ellipsis)")
        if _array_like(it):
            # A one-element or 0-d tensor (bool ones too) has __index__, so
            # operator.index would take it as an int: torch.tensor([3]) would select
            # row 3 without the dim torch keeps, torch.tensor(True) row 1.
            raise SliceError(
                f"tensor {key!r}: index of type {type(it).__name__} at dim {d} is not "
                "supported (get_slice takes ints, slices with step 1 and one Ellipsis; no "
                "tensors, arrays, lists or None): use int(i) for one element")
        try:
            i = operator.index(it)
        except TypeError:
            raise SliceError(
                f"tensor {key!r}: index of type {type(it).__name__} at dim {d} is not "
                "supported (get_slice takes ints, slices with step 1 and one Ellipsis; no "
                "tensors, lists or None)") from None
        if not -n <= i < n:
            raise SliceError(f"tensor {key!r}: index {i} is out of range for dim {d} of "
                             f"size {n}")
        offsets.append(i + n if i < 0 else i)
        sizes.append(1)
    return tuple(offsets), tuple(sizes), tuple(kept)


def _array_like(x: Any) -> bool:
    """Whether ``x`` is a tensor, an array or a numpy scalar other than an integer (a
    numpy bool): things that index by value, not as a plain int. Pure."""
    if isinstance(x, (int, np.integer)):
        return False
    return hasattr(x, "shape") or isinstance(x, np.generic)


def _show(index: Any) -> str:
    text = repr(index)
    return text if len(text) <= 80 else text[:77] + "..."


class TensorSlice:
    """A saved tensor, sliceable without reading it (safetensors' ``get_slice``).

    ``sl[index]`` reads the region that basic indexing ``index`` selects (ints, slices
    with step 1, one Ellipsis; an int drops its dim) and returns it as a new CPU tensor.
    Only the chunks that overlap the region are touched, and in each only the checksum
    blocks (256 KiB) that hold part of it, plus one verified header per file read.
    ``shape``/``get_shape()`` and ``dtype``/``get_dtype()`` read nothing. The handle
    stays valid until its checkpoint is closed."""

    def __init__(self, ck: Any, key: str) -> None:  # a dckpt.view.open.Checkpoint
        self._ck, self.key = ck, key
        entry = ck._tensor(key)
        self._shape = tuple(entry.shape)
        self._code = entry.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's global shape (as saved, whatever the ranks that saved it)."""
        return self._shape

    def get_shape(self) -> list[int]:
        """The global shape as a list, as safetensors' ``get_shape``."""
        return list(self._shape)

    @property
    def dtype(self) -> "torch.dtype":
        """The torch dtype of the saved tensor."""
        from ..format.dtypes import to_torch

        return to_torch(self._code)

    def get_dtype(self) -> str:
        """The safetensors dtype code (``"F32"``, ``"BF16"``...), as safetensors'
        ``get_dtype``."""
        return self._code

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError(f"tensor {self.key!r} is a scalar (0-d): it has no len()")
        return self._shape[0]

    def __getitem__(self, index: Any) -> "torch.Tensor":
        """Read the region ``index`` selects. Blocking I/O of that region's checksum
        blocks only; memory: the result plus the reader's budget. Raises SliceError,
        CheckpointError (the checkpoint was closed), IntegrityError naming the key when
        a chunk the region touches is damaged."""
        offsets, sizes, kept = region(index, self._shape, self.key)
        out = self._ck._read_box(self.key, offsets, sizes)
        return out.reshape([sizes[d] for d in kept])

    def __repr__(self) -> str:
        return f"TensorSlice({self.key!r}, shape={list(self._shape)}, dtype={self._code})"
