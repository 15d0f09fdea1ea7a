"""Moving an axis to the end of an array with cache-blocked copies (NumPy's strided copy of a large transpose
reads a new cache line per element), either all at once or a chunk of rows at a time (:class:`MovedRows`: the
quantize kernels then need no tensor-sized copy of an input blocked along another axis than the last)."""
from __future__ import annotations

import numba as nb
import numpy as np

JT, KT = 64, 16   # a tile: JT rows of the output by KT of its columns (KT source rows, a power-of-two stride
                  # apart in large arrays, stay few: more of them share cache sets and evict each other)
CHUNK_BYTES = 2 << 20     # MovedRows: the rows gathered per chunk take about this much memory (at least 16 rows)


@nb.njit(parallel=True, cache=True)
def _gather_rows(a, r0, out):
    """out[j, k] = a[o, k, i] with (o, i) = divmod(r0 + j, I), for ``a`` a C-contiguous (O, K, I) array: rows
    r0 .. r0 + len(out) - 1 of ``a`` with its middle axis moved last, copied in JT x KT tiles."""
    O, K, I = a.shape
    n = out.shape[0]
    nj = (n + JT - 1) // JT
    nk = (K + KT - 1) // KT
    for t in nb.prange(nj * nk):
        j0 = (t // nk) * JT
        k0 = (t % nk) * KT
        k1 = min(k0 + KT, K)
        for j in range(j0, min(j0 + JT, n)):
            o = (r0 + j) // I
            i = (r0 + j) - o * I
            src = a[o, k0:k1, i]                      # (slices: offset indices are indexed with wraparound
            dst = out[j, k0:k1]                       # checks, which keep the loop from vectorising)
            for k in range(k1 - k0):
                dst[k] = src[k]


def _as3d(a: np.ndarray, axis: int) -> np.ndarray:
    K = a.shape[axis]
    outer = int(np.prod(a.shape[:axis], dtype=np.int64))
    return a.reshape(outer, K, a.size // (outer * K) if a.size else 0)


def axis_last(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.ascontiguousarray(np.moveaxis(a, axis, -1))``, the same values, copied in tiles where a copy is
    needed (a view is returned when the moved array is already C-contiguous)."""
    m = np.moveaxis(a, axis, -1)
    if m.flags.c_contiguous:
        return m
    if not a.flags.c_contiguous or a.dtype not in (np.float32, np.uint8) or a.size < 4096:
        return np.ascontiguousarray(m)
    out = np.empty(m.shape, a.dtype)
    _gather_rows(_as3d(a, axis), 0, out.reshape(-1, a.shape[axis]))
    return out


class MovedRows:
    """The (R, K) rows of ``a`` with ``axis`` moved last (R = all other axes flattened in C order), gathered a
    chunk at a time instead of copied whole: ``shape``, ``dtype``, :meth:`rows` and :func:`row_chunks`."""

    def __init__(self, a: np.ndarray, axis: int):
        self.a3 = _as3d(a, axis)
        self.K = a.shape[axis]
        self.shape = (a.size // self.K, self.K)
        self.dtype = a.dtype
        L = 1                                         # the same elements in their own order, in rows of at
        for d in reversed(a.shape):                   # least 1024 where the shape allows (for reductions)
            if L >= 1024:
                break
            L *= d
        self.flat = a.reshape(-1, L)

    def rows(self, r0: int, r1: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows r0 .. r1 - 1, C-contiguous (in ``out[:r1 - r0]`` when given)."""
        buf = np.empty((r1 - r0, self.K), self.dtype) if out is None else out[:r1 - r0]
        _gather_rows(self.a3, r0, buf)
        return buf


def moved_rows(a: np.ndarray, axis: int):
    """``a``'s rows along ``axis`` as the quantize kernels read them: a :class:`MovedRows` where moving the axis
    would copy a large C-contiguous float32 / uint8 array, else :func:`axis_last` as (R, K) (a view or a copy)."""
    if axis in (-1, a.ndim - 1) and a.flags.c_contiguous:     # the common case, without moveaxis's checks
        return a.reshape(-1, a.shape[-1])
    if (a.flags.c_contiguous and a.dtype in (np.float32, np.uint8) and a.nbytes > 2 * CHUNK_BYTES
            and not np.moveaxis(a, axis, -1).flags.c_contiguous):
        return MovedRows(a, axis)
    return axis_last(a, axis).reshape(-1, a.shape[axis])


def chunk_rows(K: int, itemsize: int = 4) -> int:
    """Rows per chunk of a :class:`MovedRows`: a multiple of 16 (a 16x16 tile, a 16-row Philox group), about
    CHUNK_BYTES of rows of length K, and at least 64 rows per thread (a task per 16-row group keeps every thread
    busy)."""
    rows = max(CHUNK_BYTES // max(K * itemsize, 1), 64 * nb.get_num_threads(), 16)
    return -(-rows // 16) * 16


def row_chunks(x2, rows: int | None = None):
    """(r0, r1, rows r0 .. r1 - 1 as a C-contiguous array) covering ``x2`` (an (R, K) array or a
    :class:`MovedRows`, whose chunks are gathered into one reused buffer) ``rows`` rows at a time (default: a
    MovedRows in chunks of :func:`chunk_rows`, an array whole)."""
    R = x2.shape[0]
    if rows is None:
        rows = chunk_rows(x2.K, x2.dtype.itemsize) if isinstance(x2, MovedRows) else R
    buf = np.empty((min(rows, R), x2.K), x2.dtype) if isinstance(x2, MovedRows) else None
    for r0 in range(0, R, rows):
        r1 = min(r0 + rows, R)
        yield r0, r1, (x2.rows(r0, r1, buf) if buf is not None else x2[r0:r1])
