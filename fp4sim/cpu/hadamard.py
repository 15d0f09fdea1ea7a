"""Random Hadamard transform kernel: exact float64 accumulation in index order, one final rounding."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from .elements import encode_one


@nb.njit(inline="always", cache=True)
def f64_to_bf16_bits(v, buf, bits):
    """bfloat16 code of a float64, rounded once (RNE): round-to-odd to float32, then RNE to bf16 (exact
    because float32 keeps more than 8 + 2 significant bits)."""
    f = np.float32(v)
    if f == f and not math.isinf(v):
        if abs(np.float64(f)) > abs(v):
            f = np.nextafter(f, np.float32(0.0))
        buf[0] = f
        u = bits[0]
        if np.float64(f) != v:
            u |= np.uint32(1)
    else:
        buf[0] = f
        u = bits[0]
    return encode_one(u, 0, 0, 8, 7, -126, 127, 0x7F7F, False, 0x7F80, 0x7FFF, 0x8000)


@nb.njit(parallel=True, cache=True)
def rht_kernel(x2, signs_h, scale, to_bf16, out):
    """y[chunk, j] = round(scale * sum_i x[chunk, i] * signs_h[i, j]) for every d-long chunk of each row.

    ``signs_h`` = diag(s) @ H_d as float64 (+-1); the sum runs over i = 0..d-1 in float64.
    """
    R, K = x2.shape
    d = signs_h.shape[0]
    for r in nb.prange(R):
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        for c0 in range(0, K, d):
            for j in range(d):
                acc = 0.0
                for i in range(d):
                    acc += np.float64(x2[r, c0 + i]) * signs_h[i, j]
                v = acc * scale
                if to_bf16:
                    out[r, c0 + j] = np.uint32(f64_to_bf16_bits(v, buf, bits)) << np.uint32(16)
                else:
                    buf[0] = np.float32(v)
                    out[r, c0 + j] = bits[0]
