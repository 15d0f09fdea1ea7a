"""The NVFP4 accumulation models of ``fp4sim.gemm`` other than TE's reference (``exact_sum``, ``kG_rne``,
``kG_rtz``) on the CPU, exactly, in integer arithmetic.

The operands arrive as integers on one lattice: each element as twice its E2M1 value (int8: 0, ±1, ±2, ±3, ±4,
±6, ±8, ±12) and each block scale as 512 times its decoded E4M3 value (int64: 1 ... 229,376; the smallest E4M3
subnormal is 2^-9). A product of two decoded elements (E2M1 value x E4M3 block scale on each side) is then an
integer in units of 2^-20 of magnitude below 2^43, so a group's sum (64 products: below 2^49) and the whole dot
product (K below 2^20) are exact int64s, and one conversion to float32 rounds them once to nearest-even.
Partials are added in physical K order with float32 additions that round to nearest-even (``kG_rne``) or toward
zero (``kG_rtz``: the float32 sum, its exact error by TwoSum, and one step toward zero when the sum overshot).

Speed: the 16-element dot products of the integer elements (before the block scales) are integers of magnitude
at most 16 x 12 x 12 = 2,304, so a float32 matrix product computes them exactly in any summation order; they come
from one BLAS product per K block on a chunk of rows, and only the scaling, grouping and rounding run in the
Numba loop, per block rather than per element.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from ..ids import ACC_EXACT as MODE_EXACT
from ..ids import ACC_RNE as MODE_RNE
from ..ids import ACC_RTZ as MODE_RTZ
from .._xp import matmul

__all__ = ["nvfp4_models", "MODE_EXACT", "MODE_RNE", "MODE_RTZ", "UNIT"]
UNIT = np.float32(2.0 ** -20)               # the product lattice of the integer operands
_PRED = np.float32(1.0 - 2.0 ** -24)        # fl(|s| * (1 - 2^-24)) is the float32 just below |s| (s normal)


@nb.njit(cache=True, inline="always")
def add_rtz(a, b):
    """fl32(a + b) rounded toward zero, for float32 a and b whose sum is normal or zero (TwoSum: s + e is the
    exact sum; an RNE sum that overshot the exact one in magnitude steps back one ulp)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    if e != 0 and (e > 0) != (s > 0):
        m = abs(s) * _PRED
        s = m if s > 0 else -m
    return s


@nb.njit(parallel=True, cache=True)
def _models(D, SA, SBt, gb, mode, grid, out):
    """D (nblk, M, N) float32: the block dot products (exact integers); SA (M, nblk), SBt (nblk, N) int64."""
    nblk, M, N = D.shape
    unit = UNIT
    for i in nb.prange(M):
        acc = np.zeros(N, np.float32)
        g = np.zeros(N, np.int64)
        tot = np.zeros(N, np.int64)
        for b in range(nblk):
            sa = SA[i, b]
            for j in range(N):
                g[j] += np.int64(D[b, i, j]) * (sa * SBt[b, j])
            if (b + 1) % gb == 0 or b == nblk - 1:
                if mode == MODE_EXACT:
                    for j in range(N):
                        tot[j] += g[j]
                elif mode == MODE_RNE:
                    for j in range(N):
                        acc[j] = acc[j] + np.float32(g[j]) * unit
                else:
                    for j in range(N):
                        acc[j] = add_rtz(acc[j], np.float32(g[j]) * unit)
                g[:] = 0
        for j in range(N):
            a = np.float32(tot[j]) * unit if mode == MODE_EXACT else acc[j]
            if grid > 0:
                a = np.float32(np.rint(a * np.float32(grid))) / np.float32(grid)
            out[i, j] = a


_CHUNK = 1 << 22        # float32 block dot products held at once (16 MiB)


def nvfp4_models(A: np.ndarray, B: np.ndarray, SA: np.ndarray, SB: np.ndarray, group: int, mode: int,
                 grid: int = 0) -> np.ndarray:
    """The accumulator before alpha, float32 (M, N), of integer operands ``A`` (M, Kp) and ``B`` (N, Kp) int8
    (twice the E2M1 values), ``SA`` (M, Kp/16) and ``SB`` (N, Kp/16) int64 (512 x the E4M3 block scales), in
    groups of ``group`` products (a multiple of 16; MODE_EXACT ignores it), ``grid`` > 0: the accumulator
    rounded to the nearest multiple of 1/grid (ties to even) at the end."""
    M, N = A.shape[0], B.shape[0]
    out = np.empty((M, N), np.float32)
    if not (M and N):
        return out
    nblk = A.shape[1] // 16
    Bt = np.ascontiguousarray(B.reshape(N, nblk, 16).astype(np.float32).transpose(1, 2, 0))   # (nblk, 16, N)
    SA = np.ascontiguousarray(SA, dtype=np.int64)
    SBt = np.ascontiguousarray(np.asarray(SB, dtype=np.int64).T)
    rows = max(1, _CHUNK // max(1, nblk * N))
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        Ac = np.ascontiguousarray(A[r0:r1].reshape(r1 - r0, nblk, 16).astype(np.float32).transpose(1, 0, 2))
        D = matmul(Ac, Bt)                                                     # (nblk, rows, N), exact
        _models(D, SA[r0:r1], SBt, group // 16, mode, grid, out[r0:r1])
    return out
