"""Moving an axis to the end of an array with one cache-blocked copy (NumPy's strided copy of a large transpose
reads a new cache line per element)."""
from __future__ import annotations

import numba as nb
import numpy as np

TILE = 32


@nb.njit(parallel=True, cache=True)
def _swap_last2(a, out):
    """out[o, i, k] = a[o, k, i] for C-contiguous 3-D arrays, in TILE x TILE tiles."""
    O, K, I = a.shape
    nk = (K + TILE - 1) // TILE
    ni = (I + TILE - 1) // TILE
    for t in nb.prange(O * nk * ni):
        o = t // (nk * ni)
        rem = t - o * nk * ni
        k0 = (rem // ni) * TILE
        i0 = (rem % ni) * TILE
        k1 = min(k0 + TILE, K)
        i1 = min(i0 + TILE, I)
        for i in range(i0, i1):
            for k in range(k0, k1):
                out[o, i, k] = a[o, k, i]


def axis_last(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.ascontiguousarray(np.moveaxis(a, axis, -1))``, the same values, copied in tiles where a copy is
    needed (a view is returned when the moved array is already C-contiguous)."""
    m = np.moveaxis(a, axis, -1)
    if m.flags.c_contiguous:
        return m
    if not a.flags.c_contiguous or a.dtype not in (np.float32, np.uint8) or a.size < 4096:
        return np.ascontiguousarray(m)
    K = a.shape[axis]
    outer = int(np.prod(a.shape[:axis], dtype=np.int64))
    inner = a.size // (outer * K)
    out = np.empty((outer, inner, K), a.dtype)
    _swap_last2(a.reshape(outer, K, inner), out)
    return out.reshape(m.shape)
