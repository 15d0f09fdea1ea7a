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


@nb.njit(inline="always", cache=True)
def _limit(d):
    """:func:`spread_limit` inside a kernel."""
    lim = 29
    h = d
    while h > 1:
        lim -= 1
        h //= 2
    return lim


@nb.njit(inline="always", cache=True)
def rht_columns(t, n, st, signs, signs_h, scale, to_bf16, w):
    """The RHT of ``n`` chunks held as columns: ``t[i * st + c]`` is element i (0..d-1) of chunk c, as float32
    bits (uint32); the output bits go to ``w`` in the same layout. Each column takes the butterfly where its
    float64 sum is exact in any order (:func:`spread_limit`), else the index-order loop; every step is a
    vector loop over the columns of one row view (flat offsets into one array kept LLVM from vectorising some
    of them). ``w`` must not alias ``t``."""
    d = signs.shape[0]
    lim = _limit(d)
    buf = np.empty(1, np.float32)
    bits = buf.view(np.uint32)
    t2 = t.reshape((d, st))
    tf2 = t.view(np.float32).reshape((d, st))
    z2 = np.empty((d, st), np.float64)
    zi2 = z2.view(np.int64)
    w2 = w.reshape((d, st))
    emax = np.zeros(st, np.int32)
    emin = np.full(st, 255, np.int32)
    for i in range(d):
        ti = t2[i]
        for c in range(n):
            b = np.int32(ti[c] & np.uint32(0x7FFFFFFF))
            e = b >> 23
            nz = b != 0
            emax[c] = max(emax[c], e if nz else np.int32(0))
            emin[c] = min(emin[c], max(e, np.int32(1)) if nz else np.int32(255))
    nslow = 0
    for c in range(n):
        nslow += np.int32((emax[c] >= 255) | (emax[c] - emin[c] > lim))
    for i in range(d):
        si = signs[i]
        tfi = tf2[i]
        zr = z2[i]
        for c in range(n):
            zr[c] = np.float64(tfi[c]) * si
    h = 1
    while h < d:                                  # the butterfly, each step a vector loop over the columns
        for i0 in range(0, d, 2 * h):
            for i in range(i0, i0 + h):
                za = z2[i]
                zb = z2[i + h]
                for c in range(n):
                    p = za[c]
                    q = zb[c]
                    za[c] = p + q
                    zb[c] = p - q
        h *= 2
    odd = 0
    for j in range(d):
        zr = z2[j]
        wr = w2[j]
        for c in range(n):
            zr[c] = (0.0 + zr[c]) * scale         # 0.0 + : an exact zero is +0, as the index-order sum's
        if to_bf16:                               # RNE on the float64 bits, for float32's normal range
            zir = zi2[j]
            for c in range(n):
                code, ok = bf16_of_f64_bits(zir[c])
                wr[c] = np.uint32(code) << np.uint32(16)
                odd += np.int32(not ok)
        else:
            wf = wr.view(np.float32)
            for c in range(n):
                wf[c] = np.float32(zr[c])
    if odd:                                       # zeros, subnormals, huge values, inf, NaN
        for j in range(d):
            zr = z2[j]
            zir = zi2[j]
            wr = w2[j]
            for c in range(n):
                if not bf16_of_f64_bits(zir[c])[1]:
                    wr[c] = f64_round_bits(zr[c], True, buf, bits)
    if nslow:                                     # columns whose sum may round: the index-order loop
        for c in range(n):
            if (emax[c] < 255) & (emax[c] - emin[c] <= lim):
                continue
            for j in range(d):
                acc = 0.0
                for i in range(d):
                    acc += np.float64(tf2[i, c]) * signs_h[i, j]
                w2[j, c] = f64_round_bits(acc * scale, to_bf16, buf, bits)


@nb.njit(parallel=True, cache=True)
def rht_kernel(xb, signs, signs_h, scale, to_bf16, out):
    """y[chunk, j] = round(scale * sum_i x[chunk, i] * signs_h[i, j]) for every d-long chunk of each row of the
    float32 bits ``xb`` (R, K).

    ``signs_h`` = diag(signs) @ H_d as float64 (+-1, H_d Sylvester); the sum is the float64 sum over
    i = 0..d-1 in index order (:func:`rht_columns` computes it). Each row is transposed into a (d, chunks)
    buffer first, so that the chunks are columns.
    """
    R, K = xb.shape
    d = signs_h.shape[0]
    nch = K // d
    for r in nb.prange(R):
        t = np.empty(d * nch, np.uint32)          # t[i * nch + c] = bits of x[r, c * d + i]
        w = np.empty(d * nch, np.uint32)
        for c in range(nch):
            for i in range(d):
                t[i * nch + c] = xb[r, c * d + i]
        rht_columns(t, nch, nch, signs, signs_h, scale, to_bf16, w)
        for j in range(d):
            for c in range(nch):
                out[r, c * d + j] = w[j * nch + c]


CB = 128        # columns per task of the strided kernel (its buffers stay in L1 / L2)


@nb.njit(parallel=True, cache=True)
def rht_axis_kernel(ab, signs, signs_h, scale, to_bf16, axis_last, out):
    """:func:`rht_kernel` along axis 1 of the C-contiguous (outer, K, inner) float32 bits ``ab``, written in the
    same layout, or with the transformed axis last (``axis_last``: ``out`` is (outer, inner, K)). Chunk g of
    column c is ab[o, g*d : g*d + d, c]: a chunk's rows are contiguous in memory, so CB columns at a time go to
    :func:`rht_columns` as they lie, without transposing. With the axis last, each column's d outputs are
    contiguous (what a quantize along that axis reads without a copy)."""
    O, K, I = ab.shape
    d = signs_h.shape[0]
    ng = K // d
    ncb = (I + CB - 1) // CB
    for task in nb.prange(O * ng * ncb):
        o = task // (ng * ncb)
        rem = task - o * ng * ncb
        g = rem // ncb
        c0 = (rem - g * ncb) * CB
        n = min(CB, I - c0)
        t = np.empty(d * CB, np.uint32)
        w = np.empty(d * CB, np.uint32)
        t2 = t.reshape((d, CB))
        w2 = w.reshape((d, CB))
        for i in range(d):                        # (slices: an offset index is indexed with wraparound checks,
            src = ab[o, g * d + i, c0:c0 + n]     # which keep these loops from vectorising)
            ti = t2[i]
            for c in range(n):
                ti[c] = src[c]
        rht_columns(t, n, CB, signs, signs_h, scale, to_bf16, w)
        if not axis_last:
            for j in range(d):
                dst = out[o, g * d + j, c0:c0 + n]
                wj = w2[j]
                for c in range(n):
                    dst[c] = wj[c]
        else:
            for c in range(n):
                dst = out[o, c0 + c, g * d:g * d + d]
                for j in range(d):
                    dst[j] = w2[j, c]
