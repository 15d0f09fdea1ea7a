"""Tensors read from their files a few rows at a time.

A checkpoint's largest tensors do not fit in memory widened to float32: a gpt-oss-120b expert weight is 4.8 G
values, 2.4 GB stored as MXFP4 and 19 GB as float32. :func:`fp4sim.analyze.inputs.load` gives such a tensor as a
:class:`LazyTensor`: its shape, and a reader of row ranges (a safetensors entry's rows, or a quantized weight's
codes and scales of those rows, dequantized). Every study of :mod:`fp4sim.analyze` already works in row chunks,
and takes a chunk of a lazy tensor as it takes a slice of an array; what the studies take over the whole tensor
(its amax, its NaN and Inf counts) is taken here chunk by chunk, with the same results: maxima and counts do not
depend on the order. So an analysis holds one chunk of the tensor at a time, and gives the bits it gives on the
tensor loaded whole (tests/test_analyze_lazy.py).
"""
from __future__ import annotations

import numpy as np

__all__ = ["LazyTensor", "LAZY_ELEMS", "is_lazy", "specials", "absmax"]

LAZY_ELEMS = 1 << 26
"""Tensors of at least this many elements (256 MB as float32) are read in row ranges where their layout allows."""

READ_ELEMS = 1 << 22
"""Elements per read where this module walks a lazy tensor itself (its amax, its NaN and Inf counts)."""


class LazyTensor:
    """A float32 tensor of ``shape`` (two or more axes) whose (rows, last axis) view is read by ``read(r0, r1)``
    -> float32 (r1 - r0, K). ``rows_view()`` is that view as a LazyTensor; indexing the view with a slice of rows
    reads those rows. ``np.asarray`` reads the whole tensor (what the device path does)."""

    dtype = np.dtype(np.float32)

    def __init__(self, shape, read, what: str = ""):
        self.shape = tuple(int(d) for d in shape)
        if len(self.shape) < 2:
            raise ValueError("a LazyTensor has two axes or more (rows are read along the first ones)")
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nrows = self.size // self.shape[-1] if self.shape[-1] else 0
        self.read = read
        self.what = what

    def rows_view(self) -> "LazyTensor":
        """The (rows, K) view."""
        return self if self.ndim == 2 else LazyTensor((self.nrows, self.shape[-1]), self.read, self.what)

    def __getitem__(self, key) -> np.ndarray:
        if self.ndim != 2 or not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a LazyTensor reads slices of rows of its (rows, K) view: x.rows_view()[r0:r1]")
        r0, r1, _ = key.indices(self.nrows)
        a = self.read(r0, max(r0, r1))
        if a.dtype != np.float32 or a.shape != (max(r1 - r0, 0), self.shape[-1]):
            raise ValueError(f"{self.what}: a read of rows {r0}..{r1} gave {a.dtype} {a.shape}")
        return np.ascontiguousarray(a)

    def __array__(self, dtype=None, copy=None):
        a = self.rows_view()[:].reshape(self.shape)
        return a if dtype is None else a.astype(dtype)

    def pieces(self, elems: int = READ_ELEMS):
        """The (rows, K) view in pieces of about ``elems`` elements."""
        v = self.rows_view()
        step = max(1, elems // max(self.shape[-1], 1))
        for r0 in range(0, self.nrows, step):
            yield v[r0:r0 + step]


def is_lazy(x) -> bool:
    return isinstance(x, LazyTensor)


def specials(x) -> tuple:
    """(NaN count, Inf count) of an array or a LazyTensor."""
    parts = x.pieces() if is_lazy(x) else (x,)
    nan = inf = 0
    for p in parts:
        nan += int(np.count_nonzero(np.isnan(p)))
        inf += int(np.count_nonzero(np.isinf(p)))
    return nan, inf


def absmax(x) -> np.float32:
    """The largest magnitude of a (rows, K) array or LazyTensor, NaN ignored (0 for an all-NaN tensor), by the CPU
    kernel."""
    from ..cpu.backend import CPU
    if not is_lazy(x):
        return CPU.absmax(x)[0]
    return np.float32(max((CPU.absmax(p)[0] for p in x.pieces()), default=np.float32(0)))
