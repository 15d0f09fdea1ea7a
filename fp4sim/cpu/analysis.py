"""Kernels of ``fp4sim.analyze``: every error statistic of one row chunk under one scheme in one read of the chunk,
its dequantized values and (FP4 schemes) its codes.

The numbers are those of the NumPy expressions they replace (:func:`fp4sim.analyze.metrics.scheme_metrics`'s
reference path), bit for bit: counts and extrema need no care, and every float64 sum is taken in the order
NumPy takes it. ``np.sum`` of a contiguous float64 array is a pairwise sum (runs of at most 128 elements
summed in 8 interleaved accumulators, longer runs split in two at half the length rounded down to a multiple
of 8); :func:`pairwise_leaves` lists the runs of that tree, :func:`chunk_sums` sums each run in parallel and
:func:`combine_leaves` adds the runs' sums up the same tree. A block's squared error (``sum(-1)`` over a block
of B elements) is the same tree over B values.
"""
from __future__ import annotations

import numba as nb
import numpy as np

LEAF = 128                 # NumPy's PW_BLOCKSIZE

# per-row counters of block_stats: the columns of ``counts``
FIN, LOST, NZ, UNDER, ZERO, SAT, DEAD = range(7)
N_COUNTS = 7


@nb.njit(cache=True)
def pairwise_leaves(n, lo_out, len_out):
    """The runs (start, length), left to right, that NumPy's pairwise sum of ``n`` elements sums directly;
    returns how many (``lo_out`` / ``len_out`` must hold n // 64 + 2)."""
    stack_lo = np.empty(128, np.int64)
    stack_n = np.empty(128, np.int64)
    top = 0
    stack_lo[0], stack_n[0] = 0, n
    top = 1
    m = 0
    while top:
        top -= 1
        lo, k = stack_lo[top], stack_n[top]
        if k <= LEAF:
            lo_out[m], len_out[m] = lo, k
            m += 1
            continue
        k2 = k // 2
        k2 -= k2 % 8
        stack_lo[top], stack_n[top] = lo + k2, k - k2          # the right half, popped after the left one
        stack_lo[top + 1], stack_n[top + 1] = lo, k2
        top += 2
    return m


@nb.njit(cache=True)
def combine_leaves(vals, n):
    """The pairwise sum of ``n`` elements from its runs' sums ``vals`` (in :func:`pairwise_leaves`'s order): the
    tree's additions, left before right, by an explicit stack (Numba's cache does not hold recursive functions
    reliably)."""
    if n == 0:
        return 0.0
    ns = np.empty(128, np.int64)
    st = np.empty(128, np.int8)
    left = np.empty(128, np.float64)
    top = 0
    ns[0], st[0] = n, 0
    k = 0
    ret = 0.0
    while top >= 0:
        m = ns[top]
        if m <= LEAF:
            ret = vals[k]
            k += 1
            top -= 1
        elif st[top] == 0:                    # descend left
            st[top] = 1
            m2 = m // 2
            top += 1
            ns[top], st[top] = m2 - m2 % 8, 0
        elif st[top] == 1:                    # the left sum is back: descend right
            left[top] = ret
            st[top] = 2
            m2 = m // 2
            top += 1
            ns[top], st[top] = m - (m2 - m2 % 8), 0
        else:                                 # both back
            ret = left[top] + ret
            top -= 1
    return ret


@nb.njit(inline="always", cache=True)
def _sq_err(x, y):
    """The squared error of one element as the reference computes it: (y - x)^2 in float64, 0 where x is not
    finite or y is not while x is."""
    xd, yd = np.float64(x), np.float64(y)
    if np.isfinite(xd) and np.isfinite(yd):
        e = yd - xd
        return e * e
    return 0.0


@nb.njit(inline="always", cache=True)
def _sq(x):
    xd = np.float64(x)
    return xd * xd if np.isfinite(xd) else 0.0


@nb.njit(parallel=True, cache=True)
def chunk_sums(xf, yf, which):
    """``np.sum`` over the flat chunk of the squared errors (which 0: ``np.sum(err ** 2)``) or of the squared
    inputs (which 1: ``np.sum(x64 ** 2)``, equal to ``np.sum(x64[fin] ** 2)`` when every input is finite), bit
    for bit: each run of the tree's values goes to a small buffer and :func:`_buf_leaf` sums it."""
    n = xf.size
    los = np.empty(n // 64 + 2, np.int64)
    lens = np.empty(n // 64 + 2, np.int64)
    m = pairwise_leaves(n, los, lens)
    vals = np.empty(m, np.float64)
    for t in nb.prange(m):
        buf = np.empty(LEAF, np.float64)
        lo = los[t]
        for i in range(lens[t]):
            buf[i] = _sq_err(xf[lo + i], yf[lo + i]) if which == 0 else _sq(xf[lo + i])
        vals[t] = _buf_leaf(buf, 0, lens[t])
    return combine_leaves(vals, n)


@nb.njit(inline="always", cache=True)
def _buf_leaf(a, lo, n):
    """NumPy's direct sum (n <= 128) of a[lo:lo + n]."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3, r4, r5, r6, r7 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3], a[lo + 4], a[lo + 5], a[lo + 6], \
        a[lo + 7]
    i = 8
    m = n - n % 8
    while i < m:
        b = lo + i
        r0 += a[b]
        r1 += a[b + 1]
        r2 += a[b + 2]
        r3 += a[b + 3]
        r4 += a[b + 4]
        r5 += a[b + 5]
        r6 += a[b + 6]
        r7 += a[b + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@nb.njit(cache=True)
def pairwise_sum(a):
    """``np.sum`` of a float64 vector, bit for bit (its pairwise tree)."""
    n = a.size
    if n <= LEAF:
        return _buf_leaf(a, 0, n)
    los = np.empty(n // 64 + 2, np.int64)
    lens = np.empty(n // 64 + 2, np.int64)
    m = pairwise_leaves(n, los, lens)
    vals = np.empty(m, np.float64)
    for t in range(m):
        vals[t] = _buf_leaf(a, los[t], lens[t])
    return combine_leaves(vals, n)


@nb.njit(parallel=True, cache=True)
def block_stats(x, y, codes, B, fp4, window, g_tensor, counts, max_err, row_amax, eb, xm, ym, blk_max, binades,
                code_hist):
    """Per row of the chunk ``x`` (R, K) float32 with its dequantized values ``y`` (R, K) float32 and, for FP4
    schemes (``fp4``), its unpacked codes (R, >= nb * B) uint8: the counters of :data:`FIN` ... (``counts``
    (R, N_COUNTS)), the largest |error| (``max_err``), the largest finite |x| (``row_amax``), the code
    histogram (``code_hist`` (R, 16)), and per block of B elements (nb = ceil(K / B), zero-padded): its squared
    error ``eb``, its largest finite |x| ``xm`` (the first one) and |y| there ``ym``, and for FP4 whether a code
    of magnitude 7 is in it (``blk_max``) and how many of the E2M1 binades it uses (``binades``). ``window``:
    0 no g_amax window (the dead-zone counter stays 0), 1 the tensor's (``g_tensor``), 2 the row's."""
    R, K = x.shape
    nb_ = eb.shape[1]
    for r in nb.prange(R):
        c = counts[r]
        for j in range(N_COUNTS):
            c[j] = 0
        me = 0.0
        ra = 0.0
        for k in range(K):
            xd = np.float64(x[r, k])
            yd = np.float64(y[r, k])
            fin = np.isfinite(xd)
            if fin:
                c[FIN] += 1
                ra = max(ra, abs(xd))
                if not np.isfinite(yd):
                    c[LOST] += 1
                else:
                    me = max(me, abs(yd - xd))
                if xd != 0.0:
                    c[NZ] += 1
                    if yd == 0.0:
                        c[UNDER] += 1
            if fp4:
                code = codes[r, k]
                code_hist[r, code] += 1
                mag = code & 7
                if mag == 0:
                    c[ZERO] += 1
                elif mag == 7 and fin and abs(xd) > abs(yd) * (1 + 1e-7):
                    c[SAT] += 1
            elif yd == 0.0 and fin:
                c[ZERO] += 1
        max_err[r] = me
        row_amax[r] = ra
        e2 = np.empty(B, np.float64)
        ab = np.empty(B, np.float64)
        for b in range(nb_):
            k0 = b * B
            best = -1.0
            arg = 0
            top = 0
            used = 0
            for i in range(B):
                k = k0 + i
                a = 0.0
                e = 0.0
                if k < K:
                    xd = np.float64(x[r, k])
                    yd = np.float64(y[r, k])
                    if np.isfinite(xd):
                        a = abs(xd)
                        if np.isfinite(yd):
                            e = (yd - xd) * (yd - xd)
                e2[i] = e
                ab[i] = a
                if a > best:
                    best = a
                    arg = i
                if fp4:
                    mag = codes[r, k] & 7
                    top = max(top, mag)
                    if mag >= 2:
                        used |= 1 << (mag >> 1)
                    elif mag == 1:
                        used |= 1
            xm[r, b] = best
            ym[r, b] = abs(np.float64(y[r, k0 + arg])) if k0 + arg < K else 0.0
            eb[r, b] = _buf_leaf(e2, 0, B) if B <= LEAF else pairwise_sum(e2)
            if window:
                lim = best / 24.0
                for i in range(B):
                    if ab[i] > 0.0 and ab[i] < lim:
                        c[DEAD] += 1
            if fp4:
                blk_max[r, b] = top == 7
                binades[r, b] = (used & 1) + ((used >> 1) & 1) + ((used >> 2) & 1) + ((used >> 3) & 1)


# ------------------------------------------------------------------------------------------- the studies' inputs
@nb.njit(parallel=True, cache=True)
def all_finite(c):
    """Whether every element of the (R, K) float32 chunk is finite."""
    R, K = c.shape
    bad = np.zeros(R, np.bool_)
    for r in nb.prange(R):
        for k in range(K):
            if not np.isfinite(c[r, k]):
                bad[r] = True
                break
    return not bad.any()


@nb.njit(parallel=True, cache=True)
def x_and_err_f64(c, y, x_out, e_out):
    """x_out = float64(c) and e_out = float64(y) - float64(c), flat in row-major order (what ``c.astype(f8)``
    and ``y.astype(f8) - x`` give for a finite chunk), in one pass."""
    R, K = c.shape
    for r in nb.prange(R):
        for k in range(K):
            xd = np.float64(c[r, k])
            x_out[r * K + k] = xd
            e_out[r * K + k] = np.float64(y[r, k]) - xd


@nb.njit(parallel=True, cache=True)
def centred_sq_f64(c, mean, out):
    """out = (float64(c) - mean)^2, flat in row-major order (``d = v - mean; d * d`` for a finite chunk)."""
    R, K = c.shape
    for r in nb.prange(R):
        for k in range(K):
            d = np.float64(c[r, k]) - mean
            out[r * K + k] = d * d


@nb.njit(parallel=True, cache=True)
def err_f64(c, y, e_out):
    """e_out = float64(y) - float64(c), flat in row-major order (:func:`x_and_err_f64` without x)."""
    R, K = c.shape
    for r in nb.prange(R):
        for k in range(K):
            e_out[r * K + k] = np.float64(y[r, k]) - np.float64(c[r, k])


@nb.njit(parallel=True, cache=True)
def to_f64(c, out):
    """out = float64(c), flat in row-major order (``c.astype(np.float64).ravel()`` into a kept buffer)."""
    R, K = c.shape
    for r in nb.prange(R):
        for k in range(K):
            out[r * K + k] = np.float64(c[r, k])
