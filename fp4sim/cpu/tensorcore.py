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

from .elements import f32_bits_i32, f64_bits_i64, i64_bits_f64

__all__ = ["chain", "chain_runs", "group_chain", "ZERO_EXP"]

ZERO_EXP = -(1 << 20)          # the exponent given to a zero input: below every min_exp, even summed


_TILE = 64                     # outputs of one row computed side by side (the vectorised lanes of a pass)
_ROWS = 16                     # rows that take each step's operand block of B while it is in the L1 cache


@nb.njit(parallel=True, cache=True)
def _chain(A, EA, BT, EBT, starts, nfma, frac, frac_out, min_exp, late, c_emin, C, out):
    """A (M, L) float64 and EA (M, L) int32, BT (L, N) float64 and EBT (L, N) int32: the operands in chain order
    (zero elements padded in with ZERO_EXP), cut into runs [starts[q], starts[q + 1]) (each a multiple of nfma
    long), each chained from C into out[q] (R, M, N). A task takes _ROWS rows by _TILE outputs; each
    output goes through each step beside its row's other outputs, so that every loop below runs over contiguous
    lanes and vectorises, and a step's (nfma, _TILE) block of B serves all the task's rows from the L1 cache. The
    powers of two and the truncations are built from the float64 bits (exact, and no libm call)."""
    M, L = A.shape
    N = BT.shape[1]
    nt = (N + _TILE - 1) // _TILE
    nr = (M + _ROWS - 1) // _ROWS
    for task in nb.prange(nr * nt):
        i0 = (task // nt) * _ROWS
        j0 = (task % nt) * _TILE
        h = min(_ROWS, M - i0)
        w = min(_TILE, N - j0)
        c = np.empty((_ROWS, _TILE))
        E = np.empty(_TILE, np.int64)
        sc = np.empty(_TILE)
        s = np.empty(_TILE)
        for q in range(len(starts) - 1):
            for r in range(h):
                cin = C[i0 + r, j0:j0 + w]
                for jj in range(w):
                    c[r, jj] = np.float64(cin[jj])
            for k0 in range(starts[q], starts[q + 1], nfma):
                for r in range(h):
                    i = i0 + r
                    cr = c[r]
                    for jj in range(w):
                        e = min_exp
                        if not late:              # the addend's exponent (c is a float32, so a normal float64;
                            # an infinite or NaN c gets a meaningless step, discarded below)
                            ec = max(((f64_bits_i64(cr[jj]) >> 52) & 0x7FF) - 1023, c_emin)
                            if cr[jj] != 0.0 and ec > e:
                                e = ec
                        E[jj] = e
                    for t in range(k0, k0 + nfma):
                        ea = np.int64(EA[i, t])
                        eb = EBT[t, j0:j0 + w]    # (a view: j0 + jj would be indexed with wraparound)
                        for jj in range(w):
                            E[jj] = max(E[jj], ea + eb[jj])
                    for jj in range(w):           # s starts with the addend's term (0 when late)
                        sc[jj] = i64_bits_f64((frac - E[jj] + 1023) << 52)
                        s[jj] = 0.0 if late else np.trunc(cr[jj] * sc[jj])
                    for t in range(k0, k0 + nfma):
                        a = A[i, t]
                        b = BT[t, j0:j0 + w]
                        for jj in range(w):
                            s[jj] += np.trunc(a * b[jj] * sc[jj])
                    for jj in range(w):
                        d = s[jj] * i64_bits_f64((E[jj] - frac + 1023) << 52)
                        db = f64_bits_i64(d)
                        ed = ((db >> 52) & 0x7FF) - 1023          # d is 0 or a normal float64
                        drop = 52 - frac_out + max(ed, -126) - ed  # fraction bits below the kept ones
                        if drop > 52:             # below the last kept bit: a zero of d's sign
                            drop = 63
                        f = np.float32(i64_bits_f64(db & ~((np.int64(1) << drop) - 1)))
                        if late:
                            cn = np.float64(f + np.float32(cr[jj]))
                        else:
                            cn = np.float64(f) + 0.0
                        if math.isfinite(cr[jj]):  # an overflowed accumulator stays infinite
                            cr[jj] = cn
            for r in range(h):
                o = out[q, i0 + r, j0:j0 + w]
                for jj in range(w):
                    o[jj] = np.float32(c[r, jj])


def chain(A, EA, B, EB, idx, nfma, frac, frac_out, min_exp, late, c_emin=ZERO_EXP, C=None):
    """float32 (M, N): the chain over the K indices ``idx`` (int64, -1 a zero element) of A (M, K) and B (N, K)
    float32 (or float64) values with their int32 exponents EA, EB, starting from ``C`` (float32 (M, N); None:
    +0); the addend's exponent is clamped below at ``c_emin``."""
    return chain_runs(A, EA, B, EB, [idx], nfma, frac, frac_out, min_exp, late, c_emin, C)[0]


@nb.njit(inline="always", cache=True)
def _exp32(x, emin):
    """floor(log2|x|) of a float32 from its exponent field, clamped below at emin >= -126 (so a subnormal, whose
    field is 0, gets emin); ZERO_EXP for a zero."""
    e = max(((f32_bits_i32(x) >> 23) & 0xFF) - 127, emin)
    return ZERO_EXP if x == 0 else e


@nb.njit(parallel=True, cache=True)
def _gather_a(A, idx, emin, V, E):
    """V (M, L) float64 = A[:, idx] (float32 (M, K)) and E its exponents; -1 in idx: a zero element."""
    for i in nb.prange(A.shape[0]):
        for t in range(idx.shape[0]):
            k = idx[t]
            x = A[i, k] if k >= 0 else np.float32(0)
            V[i, t] = x
            E[i, t] = _exp32(x, emin)


@nb.njit(parallel=True, cache=True)
def _gather_bt(B, idx, emin, VT, ET):
    """VT (L, N) float64 = B[:, idx].T (float32 (N, K)) and ET its exponents, 64 chain positions per task (the
    task's rows of VT take consecutive j together)."""
    L = idx.shape[0]
    for t0 in nb.prange((L + 63) // 64):
        for j in range(B.shape[0]):
            for t in range(t0 * 64, min(L, t0 * 64 + 64)):
                k = idx[t]
                x = B[j, k] if k >= 0 else np.float32(0)
                VT[t, j] = x
                ET[t, j] = _exp32(x, emin)


def _gathered(X, EX, idx):
    """X[:, idx] as float64 and EX[:, idx] as int32 (-1 in idx: a zero element, exponent ZERO_EXP), for values
    whose exponents are given."""
    pad, k = idx < 0, np.maximum(idx, 0)
    return (np.ascontiguousarray(np.where(pad, 0.0, np.asarray(X, np.float64)[:, k])),
            np.ascontiguousarray(np.where(pad, ZERO_EXP, np.asarray(EX)[:, k]), dtype=np.int32))


def chain_runs(A, EA, B, EB, runs, nfma, frac, frac_out, min_exp, late, c_emin=ZERO_EXP, C=None):
    """float32 (R, M, N): :func:`chain` over each of the R index runs (each padded with zero elements to a
    multiple of ``nfma``), every run from ``C``, in one pass over the operands. ``EA`` / ``EB``: the exponents
    (int32 arrays), or an int, the operand's format's smallest normal exponent, for float32 values whose
    exponents are read from their bits."""
    M, N = A.shape[0], B.shape[0]
    out = np.empty((len(runs), M, N), np.float32)
    if C is None:
        C = np.zeros((M, N), np.float32)
    if not (M and N and runs):
        return out
    runs = [np.asarray(r, dtype=np.int64) for r in runs]
    runs = [np.concatenate([r, np.full((-len(r)) % nfma, -1, np.int64)]) for r in runs]
    starts = np.cumsum([0] + [len(r) for r in runs]).astype(np.int64)
    idx = np.concatenate(runs)
    L = len(idx)
    if isinstance(EA, int):
        Ag, EAg = np.empty((M, L)), np.empty((M, L), np.int32)
        _gather_a(np.ascontiguousarray(A, np.float32), idx, EA, Ag, EAg)
    else:
        Ag, EAg = _gathered(A, EA, idx)
    if isinstance(EB, int):
        BT, EBT = np.empty((L, N)), np.empty((L, N), np.int32)
        _gather_bt(np.ascontiguousarray(B, np.float32), idx, EB, BT, EBT)
    else:
        BT, EBT = (np.ascontiguousarray(v.T) for v in _gathered(B, EB, idx))
    _chain(Ag, EAg, BT, EBT, starts, int(nfma), int(frac), int(frac_out), int(min_exp), bool(late), int(c_emin),
           np.ascontiguousarray(C, dtype=np.float32), out)
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
