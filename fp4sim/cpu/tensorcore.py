"""The block-FMA inner product of fp4sim.tensorcore on the CPU, exactly, in float64 arithmetic.

One step of the chain (the model's parameters: ``nfma``, ``frac``, ``frac_out``, ``min_exp``, ``late``):

    E  = max(min_exp, the exponents of the step's nonzero products, the exponent of c unless late)
    s  = sum of trunc(p_k * 2^(frac - E)) over the step's products p_k  (+ trunc(c * 2^(frac - E)) unless late)
    d  = s * 2^(E - frac), truncated toward zero to frac_out fraction bits below max(its own exponent, -126)
    c' = d + c rounded to nearest-even in float32 (late), else d (an exact zero is +0)

A product's exponent is the sum of its factors' exponents, each floor(log2|x|) clamped below at the input
format's smallest normal exponent (subnormal inputs keep a denormalised significand; the product itself is not
normalised). Every operation here is exact in float64: a product of two inputs has at most 22 significant bits,
scaling by a power of two is exact, each truncated term is an integer below 2^(frac + 2) and a step sums at most
33 of them (below 2^33 for frac <= 25), so the chain gives the same bits on any machine.

Inputs are float32 values (every FP8, FP16, BF16 and TF32 value is one) with their clamped exponents as int32
(zero values: a very negative exponent, never a maximum). Non-finite inputs are handled before and after by the
caller (the IEEE value of the sum replaces the chain's result wherever it is not finite).
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

__all__ = ["chain", "group_chain", "ZERO_EXP"]

ZERO_EXP = -(1 << 20)          # the exponent given to a zero input: below every min_exp, even summed


@nb.njit(parallel=True, cache=True)
def _chain(A, EA, B, EB, idx, nfma, frac, frac_out, min_exp, late, c_emin, C, out):
    M = A.shape[0]
    N = B.shape[0]
    L = idx.shape[0]
    for i in nb.prange(M):
        for j in range(N):
            c = np.float64(C[i, j])
            for k0 in range(0, L, nfma):
                if not math.isfinite(c):              # an overflowed accumulator stays infinite
                    break
                E = min_exp
                for t in range(k0, k0 + nfma):
                    k = idx[t]
                    if k >= 0:
                        ep = EA[i, k] + EB[j, k]
                        if ep > E:
                            E = ep
                if not late and c != 0.0:
                    ec = max(math.frexp(c)[1] - 1, c_emin)
                    if ec > E:
                        E = ec
                sc = math.ldexp(1.0, frac - E)
                s = 0.0
                for t in range(k0, k0 + nfma):
                    k = idx[t]
                    if k >= 0:
                        s += np.trunc(np.float64(A[i, k]) * np.float64(B[j, k]) * sc)
                if not late:
                    s += np.trunc(c * sc)
                d = s * math.ldexp(1.0, E - frac)
                if d != 0.0:
                    ed = math.frexp(d)[1] - 1
                    if ed < -126:
                        ed = -126
                    d = np.trunc(d * math.ldexp(1.0, frac_out - ed)) * math.ldexp(1.0, ed - frac_out)
                if late:
                    c = np.float64(np.float32(d) + np.float32(c))
                else:
                    c = np.float64(np.float32(d)) + 0.0
            out[i, j] = np.float32(c)


def chain(A, EA, B, EB, idx, nfma, frac, frac_out, min_exp, late, c_emin=ZERO_EXP, C=None):
    """float32 (M, N): the chain over the K indices ``idx`` (int64, length a multiple of ``nfma``, -1 a zero
    element) of A (M, K) and B (N, K) float32 (or float64) values with their int32 exponents EA, EB, starting from
    ``C`` (float32 (M, N); None: +0); the addend's exponent is clamped below at ``c_emin``."""
    M, N = A.shape[0], B.shape[0]
    out = np.empty((M, N), np.float32)
    if C is None:
        C = np.zeros((M, N), np.float32)
    if M and N:
        _chain(A, EA, B, EB, np.ascontiguousarray(idx, dtype=np.int64), int(nfma), int(frac), int(frac_out),
               int(min_exp), bool(late), int(c_emin), np.ascontiguousarray(C, dtype=np.float32), out)
    return out


@nb.njit(parallel=True, cache=True)
def _group_chain(A, B, SA, SB, ESA, ESB, L, G, bs, F, e_zero, out):
    M, K = A.shape
    N = B.shape[0]
    ng = L // G
    for i in nb.prange(M):
        v = np.empty(ng, np.float64)
        e = np.empty(ng, np.int64)
        for j in range(N):
            c = 0.0
            for k0 in range(0, K, L):
                if not math.isfinite(c):                  # an infinite or NaN accumulator stays so
                    break
                emax = e_zero
                if c != 0.0:
                    ec = math.frexp(c)[1] - 1
                    emax = max(emax, max(ec, -126))
                for g in range(ng):
                    p = 0.0
                    nz = False
                    for k in range(k0 + g * G, k0 + (g + 1) * G):
                        q = np.float64(A[i, k]) * np.float64(B[j, k])
                        p += q
                        nz = nz or q != 0.0
                    b = (k0 + g * G) // bs
                    s = SA[i, b] * SB[j, b]
                    v[g] = p * s
                    e[g] = ESA[i, b] + ESB[j, b] if (nz and s != 0.0) else e_zero
                    if e[g] > emax:
                        emax = e[g]
                sc = math.ldexp(1.0, F - emax)
                acc = 0.0
                for g in range(ng):
                    acc += np.trunc(v[g] * sc)
                acc += np.trunc(c * sc)
                d = acc * math.ldexp(1.0, emax - F)
                if d != 0.0 and math.isfinite(d):
                    ed = max(math.frexp(d)[1] - 1, -126)
                    d = np.trunc(d * math.ldexp(1.0, 23 - ed)) * math.ldexp(1.0, ed - 23)
                c = np.float64(np.float32(d)) + 0.0
            out[i, j] = np.float32(c)


def group_chain(A, B, SA, SB, ESA, ESB, L, G, bs, F, e_zero):
    """float32 (M, N): Blackwell's block-scaled instruction chain (MMA-Sim's model of tcgen05.mma
    kind::mxf4nvf4): per instruction of ``L`` elements, the exact sum of each group of ``G`` products times its
    two block scales (``bs`` elements per scale), aligned with the accumulator to the largest scale exponent
    (a group whose products are all zero, or whose scale is zero, counts as ``e_zero``; the accumulator's
    exponent is clamped below at -126), each term truncated to ``F`` fraction bits, the sum truncated to a
    float32 (23 bits below its exponent, at least -126) that is the next instruction's addend. A, B: (M, K),
    (N, K) float32 element values (K a multiple of L); SA, SB: float64 scale values (M, K/bs), (N, K/bs); ESA,
    ESB: int32 the scales' exponents (clamped below at their format's smallest normal exponent)."""
    M, N = A.shape[0], B.shape[0]
    out = np.empty((M, N), np.float32)
    if M and N:
        _group_chain(np.ascontiguousarray(A, np.float32), np.ascontiguousarray(B, np.float32),
                     np.ascontiguousarray(SA, np.float64), np.ascontiguousarray(SB, np.float64),
                     np.ascontiguousarray(ESA, np.int64), np.ascontiguousarray(ESB, np.int64),
                     int(L), int(G), int(bs), int(F), int(e_zero), out)
    return out
