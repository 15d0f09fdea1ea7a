"""The exact NVFP4 / MXFP4 GEMM on the CPU: ``fp4sim.gemm``'s rule (module docstring there) without a BLAS call
and a full-size temporary per K block.

A is decoded to float32 values (rows padded to a multiple of MR); B is decoded into slabs: for each chunk of NCH
columns and each K block, the block's BK x NCH values with the columns contiguous, so that the tile kernels
(``gemm_tiles.py``) run a long, unit-stride column loop. A task is a group of row tiles x one column chunk; it
keeps its output tile in a small buffer, adds the K blocks in order (the same float32 operations, in the same
order, as the NumPy loop in ``fp4sim.gemm``) and writes the tile once.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from .gemm_tiles import MR, NCH, tile16, tile32

__all__ = ["e2m1_gemm_exact"]

_u = np.uint64
GROUP = 4           # row tiles per task: the B slab of a block (BK x NCH floats) is reused across them


@nb.njit(parallel=True, cache=True)
def _decode_rows(codes, tab, out):
    """out[i, 2j] = tab[codes[i, j] & 15], out[i, 2j + 1] = tab[codes[i, j] >> 4]; rows past len(codes) zero."""
    R, J = codes.shape
    for i in nb.prange(out.shape[0]):
        if i < R:
            for j in range(J):
                c = codes[i, j]
                out[i, 2 * j] = tab[c & 15]
                out[i, 2 * j + 1] = tab[c >> 4]
        else:
            for j in range(out.shape[1]):
                out[i, j] = 0


@nb.njit(parallel=True, cache=True)
def _decode_slabs(codes, tab, bk, out):
    """out[ch, b, k * NCH + c] = value of element b * bk + k of row ch * NCH + c (zero past the last row)."""
    R, J = codes.shape
    nch = out.shape[0]
    for ch in nb.prange(nch):
        for c in range(NCH):
            n = ch * NCH + c
            if n < R:
                for j in range(J):
                    v = codes[n, j]
                    k = 2 * j
                    b = k // bk
                    kk = k - b * bk
                    out[ch, b, kk * NCH + c] = tab[v & 15]
                    out[ch, b, (kk + 1) * NCH + c] = tab[v >> 4]
            else:
                for b in range(out.shape[1]):
                    for kk in range(bk):
                        out[ch, b, kk * NCH + c] = 0


@nb.njit(parallel=True, cache=True)
def _gemm(A, slabs, saT, sbc, bk, y):
    Mp, Kp = A.shape
    M, N = y.shape
    nblk = Kp // bk
    nch = slabs.shape[0]
    ntiles = Mp // MR
    ngroups = (ntiles + GROUP - 1) // GROUP
    for t in nb.prange(ngroups * nch):
        g = t // nch
        ch = t - g * nch
        t0 = g * GROUP
        t1 = min(t0 + GROUP, ntiles)
        Y = np.zeros((t1 - t0, MR * NCH), np.float32)
        for b in range(nblk):
            Bv = slabs[ch, b]
            sv = sbc[ch, b]
            for ti in range(t0, t1):
                i0 = ti * MR
                if bk == 16:
                    tile16(A, _u(i0), _u(b * 16), Bv, sv, saT[b, i0], saT[b, i0 + 1], saT[b, i0 + 2],
                           saT[b, i0 + 3], Y[ti - t0])
                else:
                    tile32(A, _u(i0), _u(b * 32), Bv, sv, saT[b, i0], saT[b, i0 + 1], saT[b, i0 + 2],
                           saT[b, i0 + 3], Y[ti - t0])
        c0 = ch * NCH
        nc = min(NCH, N - c0)
        for ti in range(t0, t1):
            for r in range(MR):
                i = ti * MR + r
                if i < M:
                    for c in range(nc):
                        y[i, c0 + c] = Y[ti - t0, r * NCH + c]


def e2m1_gemm_exact(ca: np.ndarray, sa: np.ndarray, cb: np.ndarray, sb: np.ndarray, bk: int,
                    values: np.ndarray) -> np.ndarray:
    """``y[i, j] = sum over K blocks, in order, of fl(fl(sa[i, b] * sb[j, b]) * dot_b(i, j))`` in float32 (no
    alpha), for packed E2M1 codes ``ca`` (M, Kp/2) and ``cb`` (N, Kp/2), decoded float32 block scales ``sa``
    (M, Kp/bk) and ``sb`` (N, Kp/bk), ``bk`` 16 or 32, ``values`` the 16 E2M1 values (float32)."""
    M, N = ca.shape[0], cb.shape[0]
    Kp = 2 * ca.shape[1]
    nblk = Kp // bk
    Mp = -(-M // MR) * MR
    nch = -(-N // NCH)
    A = np.empty((Mp, Kp), np.float32)
    _decode_rows(np.ascontiguousarray(ca), values, A)
    slabs = np.empty((nch, nblk, bk * NCH), np.float32)
    _decode_slabs(np.ascontiguousarray(cb), values, bk, slabs)
    saT = np.zeros((nblk, Mp), np.float32)
    saT[:, :M] = sa.T
    sbc = np.zeros((nch * NCH, nblk), np.float32)
    sbc[:N] = sb
    sbc = np.ascontiguousarray(sbc.reshape(nch, NCH, nblk).transpose(0, 2, 1))
    y = np.empty((M, N), np.float32)
    if M and N:
        _gemm(A, slabs, saT, sbc, bk, y)
    return y
