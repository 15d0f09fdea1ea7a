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


@nb.njit(inline="always", cache=True)
def f64_to_bf16_bits_normal(v, b64, i64):
    """bfloat16 code of a float64 rounded once (RNE) on its bits (``b64`` / ``i64``: a one-element float64
    buffer and its int64 view), or -1 where ``v`` is not in float32's
    normal range (zero, subnormal, beyond 2^128, inf or NaN: :func:`f64_to_bf16_bits` handles those)."""
    b64[0] = v
    u = i64[0]
    a = u & np.int64(0x7FFFFFFFFFFFFFFF)
    e = a >> np.int64(52)
    if e < 1023 - 126 or e > 1023 + 127:
        return np.int64(-1)
    a = (a + np.int64((1 << 44) - 1) + ((a >> np.int64(45)) & np.int64(1))) >> np.int64(45)   # 1 + 11 + 7 bits
    e = a >> np.int64(7)
    ef = e - 1023 + 127                          # float32 / bfloat16 biased exponent after the rounding
    code = np.int64(0x7F80) if ef >= 255 else (ef << np.int64(7)) | (a & np.int64(0x7F))
    return code | (np.int64(0x8000) if u < 0 else np.int64(0))


# A chunk whose nonzero float32 inputs span at most 29 - log2(d) binades (biased exponents emin..emax,
# subnormals counted as 1) has an exact float64 sum in any order: every term is a multiple of 2^(emin-150), the
# sum and every partial sum is below d * 2^(emax-126), and log2(d) + (emax-126) - (emin-150) <= 53. Then the
# fast Walsh-Hadamard butterfly gives the index-order sum bit for bit (25 binades for d = 16, 22 for d = 128).
def spread_limit(d: int) -> int:
    return 29 - (int(d).bit_length() - 1)


@nb.njit(parallel=True, cache=True)
def rht_kernel(x2, xb, signs, signs_h, scale, to_bf16, out):
    """y[chunk, j] = round(scale * sum_i x[chunk, i] * signs_h[i, j]) for every d-long chunk of each row.

    ``signs_h`` = diag(signs) @ H_d as float64 (+-1, H_d Sylvester); the sum is the float64 sum over
    i = 0..d-1 in index order. Where that sum is exact (chunks within :func:`spread_limit` binades, all finite) the
    butterfly computes it in d log d additions; other chunks take the index-order loop.
    """
    R, K = x2.shape
    d = signs_h.shape[0]
    lim = 29
    h = d
    while h > 1:
        lim -= 1
        h //= 2
    for r in nb.prange(R):
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        z = np.empty(d, np.float64)
        b64 = np.empty(1, np.float64)
        i64 = b64.view(np.int64)
        for c0 in range(0, K, d):
            emax = 0
            emin = 255
            for i in range(d):
                b = np.int32(xb[r, c0 + i] & np.uint32(0x7FFFFFFF))
                e = b >> 23
                if b != 0:
                    emax = max(emax, e)
                    emin = min(emin, max(e, 1))
            if emax < 255 and emax - emin <= lim:     # lim = spread_limit(d)
                for i in range(d):
                    z[i] = np.float64(x2[r, c0 + i]) * signs[i]
                h = 1
                while h < d:
                    for i0 in range(0, d, 2 * h):
                        for i in range(i0, i0 + h):
                            p = z[i]
                            q = z[i + h]
                            z[i] = p + q
                            z[i + h] = p - q
                    h *= 2
                for j in range(d):
                    v = (0.0 + z[j]) * scale       # 0.0 + : an exact zero is +0, as the index-order sum's
                    if to_bf16:
                        c = f64_to_bf16_bits_normal(v, b64, i64)
                        if c < 0:
                            c = np.int64(f64_to_bf16_bits(v, buf, bits))
                        out[r, c0 + j] = np.uint32(c) << np.uint32(16)
                    else:
                        buf[0] = np.float32(v)
                        out[r, c0 + j] = bits[0]
                continue
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
