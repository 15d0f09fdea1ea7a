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
def bf16_of_f64_bits(u):
    """(bfloat16 code of the float64 with bits ``u`` rounded once, RNE, on its bits; whether ``u`` lies in
    float32's normal range, where that code is right: elsewhere use :func:`f64_to_bf16_bits`)."""
    a = u & np.int64(0x7FFFFFFFFFFFFFFF)
    e = a >> np.int64(52)
    ok = (e >= 1023 - 126) & (e <= 1023 + 127)
    a = (a + np.int64((1 << 44) - 1) + ((a >> np.int64(45)) & np.int64(1))) >> np.int64(45)   # 1 + 11 + 7 bits
    ef = (a >> np.int64(7)) - 896                 # float32 / bfloat16 biased exponent after the rounding
    code = np.int64(0x7F80) if ef >= 255 else (ef << np.int64(7)) | (a & np.int64(0x7F))
    return code | (np.int64(0x8000) if u < 0 else np.int64(0)), ok


@nb.njit(inline="always", cache=True)
def f64_round_bits(v, to_bf16, buf, bits):
    """float32 bit pattern of ``v`` rounded once to bfloat16 (``to_bf16``) or to float32."""
    if to_bf16:
        return np.uint32(f64_to_bf16_bits(v, buf, bits)) << np.uint32(16)
    buf[0] = np.float32(v)
    return bits[0]


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
    butterfly computes it in d log d additions; other chunks take the index-order loop. Each row is transposed
    into a (d, chunks) buffer first, so that every butterfly stage and the rounding run as vector loops over the
    row's chunks.
    """
    R, K = x2.shape
    d = signs_h.shape[0]
    nch = K // d
    lim = 29
    h = d
    while h > 1:
        lim -= 1
        h //= 2
    for r in nb.prange(R):
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        t = np.empty(d * nch, np.uint32)          # t[i * nch + c] = bits of x[r, c * d + i]
        z = np.empty(d * nch, np.float64)
        zi = z.view(np.int64)
        fast = np.empty(nch, np.bool_)
        emax = np.empty(nch, np.int32)
        emin = np.empty(nch, np.int32)
        for c in range(nch):
            for i in range(d):
                t[i * nch + c] = xb[r, c * d + i]
        emax[:] = 0
        emin[:] = 255
        for i in range(d):
            o = i * nch
            for c in range(nch):
                b = np.int32(t[o + c] & np.uint32(0x7FFFFFFF))
                e = b >> 23
                nz = b != 0
                emax[c] = max(emax[c], e if nz else np.int32(0))
                emin[c] = min(emin[c], max(e, np.int32(1)) if nz else np.int32(255))
        nslow = 0
        for c in range(nch):
            fast[c] = (emax[c] < 255) & (emax[c] - emin[c] <= lim)      # lim = spread_limit(d)
            nslow += np.int32(not fast[c])
        tf = t.view(np.float32)
        for i in range(d):
            o = i * nch
            si = signs[i]
            for c in range(nch):
                z[o + c] = np.float64(tf[o + c]) * si
        h = 1
        while h < d:                              # the butterfly, each step a vector loop over the chunks
            for i0 in range(0, d, 2 * h):
                for i in range(i0, i0 + h):
                    o, o2 = i * nch, (i + h) * nch
                    for c in range(nch):
                        p = z[o + c]
                        q = z[o2 + c]
                        z[o + c] = p + q
                        z[o2 + c] = p - q
            h *= 2
        for k in range(d * nch):
            z[k] = (0.0 + z[k]) * scale           # 0.0 + : an exact zero is +0, as the index-order sum's
        odd = 0
        if to_bf16:                               # RNE on the float64 bits, for float32's normal range
            for j in range(d):
                o = j * nch
                for c in range(nch):
                    code, ok = bf16_of_f64_bits(zi[o + c])
                    out[r, c * d + j] = np.uint32(code) << np.uint32(16)
                    odd += np.int32(not ok)
            if odd:                               # zeros, subnormals, huge values, inf, NaN
                for j in range(d):
                    for c in range(nch):
                        if not bf16_of_f64_bits(zi[j * nch + c])[1]:
                            out[r, c * d + j] = f64_round_bits(z[j * nch + c], True, buf, bits)
        else:
            for j in range(d):
                o = j * nch
                for c in range(nch):
                    buf[0] = np.float32(z[o + c])
                    out[r, c * d + j] = bits[0]
        if nslow:                                 # chunks whose sum may round: the index-order loop
            for c in range(nch):
                if fast[c]:
                    continue
                c0 = c * d
                for j in range(d):
                    acc = 0.0
                    for i in range(d):
                        acc += np.float64(x2[r, c0 + i]) * signs_h[i, j]
                    out[r, c0 + j] = f64_round_bits(acc * scale, to_bf16, buf, bits)


CB = 128        # columns per task of the strided kernel (its float64 buffer stays in L1 / L2)


@nb.njit(parallel=True, cache=True)
def rht_axis_kernel(a3, ab, signs, signs_h, scale, to_bf16, out):
    """:func:`rht_kernel` along axis 1 of a C-contiguous (outer, K, inner) array, written in the same layout:
    chunk g of column c is a3[o, g*d : g*d + d, c]. Rows of a chunk are contiguous in memory, so the butterfly
    runs as vector loops over CB columns at a time without transposing anything; the same exactness rule
    picks the butterfly or the index-order loop per column."""
    O, K, I = a3.shape
    d = signs_h.shape[0]
    ng = K // d
    ncb = (I + CB - 1) // CB
    lim = 29
    h = d
    while h > 1:
        lim -= 1
        h //= 2
    for task in nb.prange(O * ng * ncb):
        o = task // (ng * ncb)
        rem = task - o * ng * ncb
        g = rem // ncb
        c0 = (rem - g * ncb) * CB
        n = min(CB, I - c0)
        k0 = g * d
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        z = np.empty(d * CB, np.float64)
        zi = z.view(np.int64)
        fast = np.empty(CB, np.bool_)
        emax = np.zeros(CB, np.int32)
        emin = np.full(CB, 255, np.int32)
        for i in range(d):
            for c in range(n):
                b = np.int32(ab[o, k0 + i, c0 + c] & np.uint32(0x7FFFFFFF))
                e = b >> 23
                nz = b != 0
                emax[c] = max(emax[c], e if nz else np.int32(0))
                emin[c] = min(emin[c], max(e, np.int32(1)) if nz else np.int32(255))
        nslow = 0
        for c in range(n):
            fast[c] = (emax[c] < 255) & (emax[c] - emin[c] <= lim)      # lim = spread_limit(d)
            nslow += np.int32(not fast[c])
        for i in range(d):
            si = signs[i]
            for c in range(n):
                z[i * CB + c] = np.float64(a3[o, k0 + i, c0 + c]) * si
        h = 1
        while h < d:
            for i0 in range(0, d, 2 * h):
                for i in range(i0, i0 + h):
                    p0, q0 = i * CB, (i + h) * CB
                    for c in range(n):
                        p = z[p0 + c]
                        q = z[q0 + c]
                        z[p0 + c] = p + q
                        z[q0 + c] = p - q
            h *= 2
        for j in range(d):
            for c in range(n):
                z[j * CB + c] = (0.0 + z[j * CB + c]) * scale     # 0.0 + : an exact zero is +0
        odd = 0
        if to_bf16:
            for j in range(d):
                for c in range(n):
                    code, ok = bf16_of_f64_bits(zi[j * CB + c])
                    out[o, k0 + j, c0 + c] = np.uint32(code) << np.uint32(16)
                    odd += np.int32(not ok)
            if odd:
                for j in range(d):
                    for c in range(n):
                        if not bf16_of_f64_bits(zi[j * CB + c])[1]:
                            out[o, k0 + j, c0 + c] = f64_round_bits(z[j * CB + c], True, buf, bits)
        else:
            for j in range(d):
                for c in range(n):
                    buf[0] = np.float32(z[j * CB + c])
                    out[o, k0 + j, c0 + c] = bits[0]
        if nslow:
            for c in range(n):
                if fast[c]:
                    continue
                for j in range(d):
                    acc = 0.0
                    for i in range(d):
                        acc += np.float64(a3[o, k0 + i, c0 + c]) * signs_h[i, j]
                    out[o, k0 + j, c0 + c] = f64_round_bits(acc * scale, to_bf16, buf, bits)
