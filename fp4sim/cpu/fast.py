"""Kernels of the training fast path (``accumulate="fast"``): an operand's float32 values as the GEMM reads them,
without materialising codes and scale bytes.

- :func:`nvfp4_values_kernel`: NVFP4 (te / paper flavour, 1x16 or 16x16 scaling, RNE or SR) of a C-contiguous
  (R, K) operand whose tensor amax is known and finite and which holds no NaN: block amax, scale byte, element
  code and its dequantized value in one read of the operand, with the same float32 operations in the same order
  as :func:`fp4sim.cpu.blocks.nvfp4_kernel` (its ``fake`` output), so the values are those of
  ``dequantize(quantize(...))`` bit for bit. Buffers are allocated once per task of many 16-row groups.
- :func:`bf16_round_kernel`: float32 -> bfloat16 round-to-nearest-even (Inf past the range, as the BF16 scheme's
  RNE), written back as float32 values; NaN becomes the BF16 format's NaN code 0x7FFF, as its encoder.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from .blocks import nvfp4_dequant_factor, nvfp4_scales, scale_buffers, sr_fill_cols, sr_row_bytes
from .elements import e2m1_sr, e2m1_value, f32_bits_i32, i32_bits_f32, sr_consts


@nb.njit(inline="always", cache=True)
def e2m1_rne_value(v):
    """The E2M1 value ``e2m1_value(e2m1_rne(v))`` of a float32 ``v`` that is not NaN, by float operations that
    vectorise: |v| + C - C with C = 2^22, 2^23, 2^24 (float32 ulps 0.5, 1, 2: E2M1's quanta in [0, 2), [2, 4),
    [4, 6]) rounds to the E2M1 grid, ties to even (an even multiple of the quantum is an even code), saturating
    at 6; the sign is v's (-0 stays -0)."""
    f = np.float32
    a = abs(v)
    c = f(4194304.0) if a < f(2.0) else (f(8388608.0) if a < f(4.0) else f(16777216.0))
    return np.float32(np.copysign(min((a + c) - c, f(6.0)), v))


@nb.njit(parallel=True, cache=True)
def nvfp4_values_kernel(x2, rb, ph, pk0, pk1, pstream, pmask, pstride, mode, nsr, flavor, tile, c0, c1, dq,
                        e4m3_vals, out, ntasks):
    """``out`` (R, K) = the dequantized NVFP4 values of ``x2`` (R, K), C-contiguous, no NaN, finite tensor amax.

    ``flavor`` 0 (te) or 1 (paper), ``tile`` 1 or 16, ``mode`` 0 (RNE) or 4 (SR, random bytes as
    :func:`fp4sim.cpu.blocks.sr_row_bytes` with ``ph`` 0 / 1 / 2), ``c0``, ``c1`` the per-tensor encode constants,
    ``dq`` the two dequantize constants. ``ntasks`` tasks take consecutive 16-row groups each."""
    R, K = x2.shape
    nbk = (K + 15) // 16
    nfull = K // 16
    Kp = nbk * 16
    ngroups = (R + 15) // 16
    per_task = (ngroups + ntasks - 1) // ntasks
    sc, nsr32 = sr_consts(nsr)
    for task in nb.prange(ntasks):
        rrow = np.zeros(Kp, np.uint8)
        rcols = np.zeros((16, Kp) if ph == 2 else (1, 1), np.uint8)
        amaxf = np.zeros(nbk, np.float32)
        sf, cb, sbytes, fac, sdq = scale_buffers(nbk)
        for g16 in range(task * per_task, min(task * per_task + per_task, ngroups)):
            r16 = g16 * 16
            if mode == 4:
                sr_fill_cols(ph, pk0, pk1, pstream, pmask, pstride, r16, K, rcols)
            for sub in range(16 // tile):                   # scale groups: 16 rows (tile 16) or one row
                r0 = r16 + sub * tile
                r1 = min(r0 + tile, R)
                if r0 >= R:
                    break
                amaxf[:] = 0.0
                for r in range(r0, r1):                  # block amax: float |x| (no NaN here) orders as
                    xr = x2[r]                              # its bits; block views, since flat j * 16 + t
                    xf = xr[:nfull * 16].reshape((nfull, 16))      # indices and uint32 max kept the loops
                    for j in range(nfull):                         # from vectorising (3-8x slower)
                        blk = xf[j]
                        m = np.float32(0.0)
                        for t in range(16):
                            m = max(m, abs(blk[t]))
                        amaxf[j] = max(amaxf[j], m)
                    if nbk > nfull:
                        m = np.float32(0.0)
                        for k in range(nfull * 16, K):
                            m = max(m, abs(xr[k]))
                        amaxf[nfull] = max(amaxf[nfull], m)
                nvfp4_scales(amaxf, flavor, c0, c1, e4m3_vals, sf, cb, sbytes, fac)
                for j in range(nbk):
                    sdq[j] = nvfp4_dequant_factor(e4m3_vals[sbytes[j]], flavor, dq, c1)
                for r in range(r0, r1):
                    xr = x2[r]
                    orow = out[r]
                    xf = xr[:nfull * 16].reshape((nfull, 16))
                    of = orow[:nfull * 16].reshape((nfull, 16))
                    if mode == 4:
                        rr = sr_row_bytes(rb, ph, pk0, pk1, pstream, pmask, np.int64(0), r, K, Kp, rrow, rcols,
                                          r16)
                        rf = rr[:nfull * 16].reshape((nfull, 16))
                        for j in range(nfull):
                            f = fac[j]
                            d = sdq[j]
                            xj, oj, rj = xf[j], of[j], rf[j]
                            for t in range(16):
                                oj[t] = e2m1_value(e2m1_sr(xj[t] * f, np.int32(rj[t]), sc, nsr32)) * d
                        for k in range(nfull * 16, K):
                            orow[k] = e2m1_value(e2m1_sr(xr[k] * fac[nfull], np.int32(rr[k]), sc, nsr32)) * sdq[nfull]
                    else:
                        for j in range(nfull):
                            f = fac[j]
                            d = sdq[j]
                            xj, oj = xf[j], of[j]
                            for t in range(16):
                                oj[t] = e2m1_rne_value(xj[t] * f) * d
                        for k in range(nfull * 16, K):
                            orow[k] = e2m1_rne_value(xr[k] * fac[nfull]) * sdq[nfull]


@nb.njit(parallel=True, cache=True)
def bf16_round_kernel(xb, out):
    """``out`` (uint32 bits of float32) = each float32 of ``xb`` (its bits, flat) rounded to bfloat16, RNE: the
    carry of ``0x7FFF`` plus the kept lowest bit into bit 16 rounds to nearest-even and overflows into Inf past
    bfloat16's range; NaN becomes the BF16 format's NaN code 0x7FFF, as its encoder."""
    n = xb.shape[0]
    for i in nb.prange(n):
        u = xb[i]
        a = u & np.uint32(0x7FFFFFFF)
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        out[i] = np.uint32(0x7FFF0000) if a > np.uint32(0x7F800000) else r


@nb.njit(inline="always", cache=True)
def e4m3_rne_value(y):
    """The E4M3 value of a float32 ``y`` that is not NaN, rounded to nearest-even and saturated at 448 (the
    FP8 schemes' satfinite RNE encoder followed by its decoder): below 2^-6 (E4M3's subnormals, quantum 2^-9)
    |y| + 2^14 - 2^14; above, the float32 bits rounded to 3 mantissa bits (the carry of 0x7FFFF plus the kept
    lowest bit, as BF16's rounding with 20 dropped bits; Inf stays Inf); then min(., 448) and y's sign."""
    a = abs(y)
    if a < np.float32(0.015625):
        r = (a + np.float32(16384.0)) - np.float32(16384.0)
    else:
        i = np.int32
        u = f32_bits_i32(a)                                  # a >= 0: no sign bit, no overflow below
        u = i(i(u + i(0x7FFFF) + i(i(u >> i(20)) & i(1))) & i(-0x100000))
        r = i32_bits_f32(u)
    return np.float32(np.copysign(min(r, np.float32(448.0)), y))


@nb.njit(parallel=True, cache=True)
def fp8_blockwise_values_kernel(x2, tile, out):
    """``out`` (R, K) = the FP8 E4M3 blockwise values (tile x 128 blocks, scale s = fl(amax_b / 448), elements
    fl(x / s) rounded to nearest-even with satfinite, value = E4M3 * s; an all-zero block: x * 0) of ``x2`` (R, K),
    C-contiguous and without NaN: the float32 operations of :func:`fp4sim.cpu.blocks.fp8_kernel` in its order,
    with the element rounding done on registers (:func:`e4m3_rne_value`)."""
    R, K = x2.shape
    nbk = (K + 127) // 128
    ngroups = (R + tile - 1) // tile
    for g in nb.prange(ngroups):
        r0 = g * tile
        r1 = min(r0 + tile, R)
        for j in range(nbk):
            k0 = j * 128
            k1 = min(k0 + 128, K)
            m = np.float32(0.0)
            for r in range(r0, r1):
                xr = x2[r, k0:k1]
                for k in range(k1 - k0):
                    m = max(m, abs(xr[k]))
            s = m / np.float32(448.0)
            for r in range(r0, r1):
                xr = x2[r, k0:k1]
                orow = out[r, k0:k1]
                if s != np.float32(0.0):
                    for k in range(k1 - k0):
                        orow[k] = e4m3_rne_value(xr[k] / s) * s
                else:
                    for k in range(k1 - k0):
                        orow[k] = e4m3_rne_value(xr[k] * np.float32(0.0)) * s
