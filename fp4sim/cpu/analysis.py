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

from .blocks import (masked_amax_bits, mx_scale_byte, nvfp4_dequant_factor, nvfp4_elem, nvfp4_scales, raw_max16,
                     scale_buffers)
from .elements import e2m1_rne, e2m1_value

LEAF = 128                 # NumPy's PW_BLOCKSIZE
LEAVES_PER_TASK = 64       # chunk_sums: runs per parallel task

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


@nb.njit(parallel=True, cache=True)
def chunk_sums(xf, yf, which):
    """``np.sum`` over the flat chunk of the squared errors (which 0: ``np.sum(err ** 2)``) or of the squared
    inputs (which 1: ``np.sum(x64 ** 2)``, equal to ``np.sum(x64[fin] ** 2)`` when every input is finite), bit
    for bit: each run of the tree's values goes to a small buffer and :func:`_buf_leaf` sums it. A task takes
    ``LEAVES_PER_TASK`` runs with one buffer, the values computed without branches from row slices (so that the
    loop vectorises)."""
    n = xf.size
    los = np.empty(n // 64 + 2, np.int64)
    lens = np.empty(n // 64 + 2, np.int64)
    m = pairwise_leaves(n, los, lens)
    vals = np.empty(m, np.float64)
    ntask = (m + LEAVES_PER_TASK - 1) // LEAVES_PER_TASK
    for task in nb.prange(ntask):
        buf = np.empty(LEAF, np.float64)
        for t in range(task * LEAVES_PER_TASK, min(m, (task + 1) * LEAVES_PER_TASK)):
            lo = los[t]
            ln = lens[t]
            xs = xf[lo:lo + ln]
            if which == 0:
                ys = yf[lo:lo + ln]
                for i in range(ln):
                    xd = np.float64(xs[i])
                    yd = np.float64(ys[i])
                    e = yd - xd
                    buf[i] = e * e if (abs(xd) < np.inf) & (abs(yd) < np.inf) else 0.0
            else:
                for i in range(ln):
                    xd = np.float64(xs[i])
                    buf[i] = xd * xd if abs(xd) < np.inf else 0.0
            vals[t] = _buf_leaf(buf, 0, ln)
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
    0 no g_amax window (the dead-zone counter stays 0), 1 the tensor's (``g_tensor``), 2 the row's.

    A block is read in loops without branches (selects and masks, the maxima of non-negative float64 values
    taken on their bit patterns), so that they vectorise; the last, partial block goes through zero-padded
    copies, its elements beyond K masked out of every counter."""
    R, K = x.shape
    nb_ = eb.shape[1]
    for r in nb.prange(R):
        n_fin = n_lost = n_nz = n_under = n_zy = n_zero = n_sat = n_dead = 0
        me_b = np.int64(0)
        ra_b = np.int64(0)
        e2 = np.empty(B, np.float64)
        ab = np.empty(B, np.float64)
        dd = np.empty(B, np.float64)
        abi = ab.view(np.int64)
        ddi = dd.view(np.int64)
        xb = np.zeros(B, np.float32)
        yb = np.zeros(B, np.float32)
        xr = x[r]
        yr = y[r]
        for b in range(nb_):
            k0 = b * B
            n = min(B, K - k0)
            if n == B:
                xs = xr[k0:k0 + B]
                ys = yr[k0:k0 + B]
            else:                                 # the partial last block: zero-padded copies
                for i in range(n):
                    xb[i] = xr[k0 + i]
                    yb[i] = yr[k0 + i]
                xs = xb
                ys = yb
            for i in range(B):
                xd = np.float64(xs[i])
                yd = np.float64(ys[i])
                fin = (i < n) & (abs(xd) < np.inf)
                finy = abs(yd) < np.inf
                ok = fin & finy
                d = yd - xd
                e2[i] = d * d if ok else 0.0
                dd[i] = abs(d) if ok else 0.0
                ab[i] = abs(xd) if fin else 0.0
                nzv = fin & (xd != 0.0)
                n_fin += np.int64(fin)
                n_lost += np.int64(fin & (not finy))
                n_nz += np.int64(nzv)
                n_under += np.int64(nzv & (yd == 0.0))
                n_zy += np.int64(fin & (yd == 0.0))
            bb = np.int64(0)
            for i in range(B):
                bb = max(bb, abi[i])
                me_b = max(me_b, ddi[i])
            ra_b = max(ra_b, bb)
            arg = 0
            while abi[arg] != bb:
                arg += 1
            best = ab[arg]
            xm[r, b] = best
            ym[r, b] = abs(np.float64(ys[arg]))
            eb[r, b] = _buf_leaf(e2, 0, B) if B <= LEAF else pairwise_sum(e2)
            if window:
                lim = best / 24.0
                for i in range(B):
                    n_dead += np.int64((ab[i] > 0.0) & (ab[i] < lim))
            if fp4:
                cs = codes[r, k0:k0 + B]
                top = 0
                used = 0
                for i in range(B):
                    mag = np.int64(cs[i] & 7)
                    top = max(top, mag)
                    used |= (np.int64(1) << (mag >> 1)) if mag >= 2 else mag
                    v = i < n
                    n_zero += np.int64(v & (mag == 0))
                    xd = np.float64(xs[i])
                    yd = np.float64(ys[i])
                    n_sat += np.int64(v & (mag == 7) & (abs(xd) < np.inf) & (abs(xd) > abs(yd) * (1 + 1e-7)))
                for i in range(n):
                    code_hist[r, cs[i]] += 1
                blk_max[r, b] = top == 7
                binades[r, b] = (used & 1) + ((used >> 1) & 1) + ((used >> 2) & 1) + ((used >> 3) & 1)
        if not fp4:
            n_zero = n_zy
        c = counts[r]
        c[FIN], c[LOST], c[NZ], c[UNDER], c[ZERO], c[SAT], c[DEAD] = n_fin, n_lost, n_nz, n_under, n_zero, n_sat, n_dead
        mrow = np.empty(2, np.int64)
        mrow[0] = me_b
        mrow[1] = ra_b
        mf = mrow.view(np.float64)
        max_err[r] = mf[0]
        row_amax[r] = mf[1]


# ------------------------------------------------------------------------------------------- the studies' sums
# The outlier and Hadamard studies need a handful of float64 sums over a chunk's finite elements (moments, squared
# errors under NVFP4 and MXFP4). One pass of :func:`moments1` / :func:`err_moments` takes them all: each task sums a
# segment of SEG elements (of the flat chunk) in the CPU's float64 vector lanes (the segment's sums may be
# reassociated: their last bits depend on the vector width, as a BLAS dot's do), and :func:`_combine` adds the
# segments' sums with Neumaier's compensation. The result is within a few units in the
# last place of the exactly rounded sum (tested against math.fsum); NumPy's float64 reductions of the masked copies,
# the reference path of :mod:`fp4sim.analyze.studies`, are within n * 2^-53 of it, so the two agree to ~1e-13.
SEG = 1024
N_M1 = 4                     # moments1's columns: count, sum, sum of squares, max |v| (finite v)
N_EM = 6                     # err_moments's: sum x^2, sum (ya - x)^2, sum (yb - x)^2, sum d^2, sum d^4, count


@nb.njit(cache=True)
def _combine(part, q):
    """Neumaier's compensated sum of column q of the segments' sums ``part`` (nseg, ncols); the plain sum where
    that is not finite (an infinite term would make the compensation NaN)."""
    s = 0.0
    c = 0.0
    for i in range(part.shape[0]):
        v = part[i, q]
        t = s + v
        if abs(s) >= abs(v):
            c += (s - t) + v
        else:
            c += (v - t) + s
        s = t
    return s + c if np.isfinite(s) else s


@nb.njit(cache=True)
def _combine_cols(part):
    """:func:`_combine` of every column of ``part``."""
    out = np.zeros(part.shape[1])
    for q in range(part.shape[1]):
        out[q] = _combine(part, q)
    return out


@nb.njit(fastmath={"reassoc"}, inline="never", cache=True)
def _seg_m1(xs, bs):
    """:func:`moments1` of one segment (``bs``: the bits of ``xs``). The float64 sums may be reassociated, so
    that the compiler sums the segment in vector lanes (the order is the CPU's vector width's, not Python's;
    the NaN / Inf selection is not touched by it)."""
    c = 0.0
    s = 0.0
    q = 0.0
    amax = np.uint32(0)
    fmax = np.uint32(0)
    inf = np.uint32(0x7F800000)
    for i in range(xs.size):
        a = bs[i] & np.uint32(0x7FFFFFFF)
        fin = a < inf
        v = np.float64(xs[i]) if fin else 0.0
        c += 1.0 if fin else 0.0
        s += v
        q += v * v
        amax = max(amax, a if a <= inf else np.uint32(0))
        fmax = max(fmax, a if fin else np.uint32(0))
    return c, s, q, amax, fmax


@nb.njit(fastmath={"reassoc"}, inline="never", cache=True)
def _seg_em(xs, bs, ys, zs, nerr, mean):
    """:func:`err_moments` of one segment, its sums in vector lanes as in :func:`_seg_m1`."""
    s0 = s1 = s2 = s3 = s4 = s5 = 0.0
    inf = np.uint32(0x7F800000)
    for i in range(xs.size):
        fin = (bs[i] & np.uint32(0x7FFFFFFF)) < inf
        x = np.float64(xs[i]) if fin else 0.0
        ea = np.float64(ys[i]) - x if fin and nerr > 0 else 0.0
        eb = np.float64(zs[i]) - x if fin and nerr > 1 else 0.0
        d = x - mean if fin else 0.0
        d2 = d * d
        s0 += x * x
        s1 += ea * ea
        s2 += eb * eb
        s3 += d2
        s4 += d2 * d2
        s5 += 1.0 if fin else 0.0
    return s0, s1, s2, s3, s4, s5


@nb.njit(parallel=True, cache=True)
def moments1(xf):
    """(count, sum, sum of squares, max |v|) over the finite float32 elements v of the flat chunk ``xf`` (sums in
    float64), and the bits of max |x| with NaN ignored (Inf counts), as :func:`fp4sim.cpu.blocks.absmax_nan` takes
    it; one read of the chunk."""
    n = xf.size
    nseg = (n + SEG - 1) // SEG
    part = np.zeros((max(nseg, 1), N_M1))
    abits = np.zeros(max(nseg, 1), np.uint32)
    fbits = np.zeros(max(nseg, 1), np.uint32)
    xb = xf.view(np.uint32)
    for t in nb.prange(nseg):
        lo = t * SEG
        hi = min(lo + SEG, n)
        part[t, 0], part[t, 1], part[t, 2], abits[t], fbits[t] = _seg_m1(xf[lo:hi], xb[lo:hi])
    out = np.zeros(N_M1)
    for q in range(3):
        out[q] = _combine(part, q)
    ab = np.uint32(0)
    fb = np.uint32(0)
    for t in range(nseg):
        ab = max(ab, abits[t])
        fb = max(fb, fbits[t])
    out[3] = np.float64(np.array([fb], np.uint32).view(np.float32)[0])
    return out, ab


@nb.njit(parallel=True, cache=True)
def err_moments(xf, ya, yb, nerr, mean):
    """Over the finite elements x of the flat float32 chunk ``xf``: (sum x^2, sum (ya - x)^2, sum (yb - x)^2,
    sum d^2, sum d^4, count) in float64, d = x - ``mean``; ``nerr`` (0, 1 or 2) of the dequantized chunks ``ya``,
    ``yb`` (flat, as long as ``xf``; pass ``xf`` for one not read) are read. An error term is
    (float64(y) - float64(x))^2 whatever y is, as the reference's masked copies give it. One read of each array."""
    n = xf.size
    nseg = (n + SEG - 1) // SEG
    part = np.zeros((max(nseg, 1), N_EM))
    xb = xf.view(np.uint32)
    for t in nb.prange(nseg):
        lo = t * SEG
        hi = min(lo + SEG, n)
        r = _seg_em(xf[lo:hi], xb[lo:hi], ya[lo:hi], yb[lo:hi], nerr, mean)
        for q in range(N_EM):
            part[t, q] = r[q]
    return _combine_cols(part)


@nb.njit(parallel=True, cache=True)
def outlier_sums(c, y, thr, col_err, col_x2, col_big, row_big, eb, bb):
    """One chunk's share of the outlier study (:func:`fp4sim.analyze.studies.outliers`) from the chunk ``c``
    (R, K) float32 and its NVFP4 values ``y``: with err = (float64(y) - float64(x))^2 where x is finite (else 0)
    and big = |x| > ``thr`` (float32; NaN is not big), ``col_err`` / ``col_x2`` get the column sums of err and
    of x^2 (finite x) in NumPy's ``sum(0)`` order (row after row), ``col_big`` / ``row_big`` whether a column /
    row holds a big value, ``eb`` (R, nbk) each 16-element block's err summed as NumPy sums a run of 16 (the
    zero-padded last block included) and ``bb`` whether the block holds a big value. The arrays are filled, not
    added to."""
    R, K = c.shape
    nbk = (K + 15) // 16
    ntile = (K + 63) // 64
    for ct in nb.prange(ntile):
        k0 = ct * 64
        w = min(k0 + 64, K) - k0
        ce = np.zeros(w)
        cx = np.zeros(w)
        cb = np.zeros(w, np.bool_)
        for r in range(R):
            cr = c[r, k0:k0 + w]
            yr = y[r, k0:k0 + w]
            for kk in range(w):
                x = cr[kk]
                xd = np.float64(x)
                fin = np.isfinite(xd)
                e = np.float64(yr[kk]) - xd
                ce[kk] += e * e if fin else 0.0
                cx[kk] += xd * xd if fin else 0.0
                cb[kk] |= abs(x) > thr
        col_err[k0:k0 + w] = ce
        col_x2[k0:k0 + w] = cx
        col_big[k0:k0 + w] = cb
    for r in nb.prange(R):
        buf = np.zeros(16)
        anyb = False
        for j in range(nbk):
            k0 = j * 16
            w = min(k0 + 16, K) - k0
            big = False
            for t in range(16):
                if t < w:
                    x = c[r, k0 + t]
                    xd = np.float64(x)
                    e = np.float64(y[r, k0 + t]) - xd
                    buf[t] = e * e if np.isfinite(xd) else 0.0
                    big |= abs(x) > thr
                else:
                    buf[t] = 0.0
            eb[r, j] = _buf_leaf(buf, 0, 16)
            bb[r, j] = big
            anyb |= big
        row_big[r] = anyb


@nb.njit(parallel=True, cache=True)
def fq_err_moments(xf, flavor, c0, c1, dq, e4m3_vals, scale_mode, emax, mbits, rcp, pow2_enc, pow2_dec, mean):
    """:func:`err_moments` of the flat chunk ``xf`` (rows of a multiple of 32 elements, C order) with ``ya`` its
    NVFP4 fake quantization (1x16 blocks, round to nearest even, flavour ``flavor`` < 2 with its per-tensor
    constants ``c0``, ``c1``, ``dq``) and ``yb`` its MXFP4 one (UE8M0 ``scale_mode``, E2M1 round to nearest
    even), without either: each 1024-element segment's dequantized values are made in task-local buffers by the
    quantize kernels' own steps (:func:`fp4sim.cpu.blocks.nvfp4_kernel`'s and ``mx_kernel``'s block amaxes,
    scale bytes and element codes) and summed by the same :func:`_seg_em`, so the sums are err_moments's bit for
    bit. A segment holds whole blocks of both formats (1024 and the row length are multiples of 32)."""
    n = xf.size
    nseg = (n + SEG - 1) // SEG
    part = np.zeros((max(nseg, 1), N_EM))
    xb = xf.view(np.uint32)
    nan_bits = np.uint32(0x7F800000)
    for t in nb.prange(nseg):
        lo = t * SEG
        hi = min(lo + SEG, n)
        m = hi - lo
        xs = xf[lo:hi]
        bs = xb[lo:hi]
        ya = np.empty(m, np.float32)
        yb = np.empty(m, np.float32)
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        n16 = m // 16
        bm = np.empty(n16, np.uint32)
        sf, cb, sbytes, fac, sdq = scale_buffers(n16)
        for j in range(n16):
            bm[j] = raw_max16(bs, j)
        am = np.empty(n16, np.uint32)                 # NVFP4: each 16-block's max |x|, NaN ignored
        for j in range(n16):
            am[j] = bm[j] if bm[j] <= nan_bits else masked_amax_bits(bs, j * 16, j * 16 + 16)
        nvfp4_scales(am.view(np.float32), flavor, c0, c1, e4m3_vals, sf, cb, sbytes, fac)
        for j in range(n16):
            sdq[j] = nvfp4_dequant_factor(e4m3_vals[sbytes[j]], flavor, dq, c1)
        for j in range(n16):
            f = fac[j]
            g = sdq[j]
            if f == f:
                for t16 in range(16):
                    k = j * 16 + t16
                    ya[k] = e2m1_value(e2m1_rne(xs[k] * f)) * g
            else:                                     # the kernel's general path (a NaN factor)
                for t16 in range(16):
                    k = j * 16 + t16
                    ya[k] = e2m1_value(nvfp4_elem(xs[k], f, flavor, 0, np.int32(0), 0)) * g
        for j in range(m // 32):                      # MXFP4: 32-blocks from the two 16-maxima
            a = max(bm[2 * j], bm[2 * j + 1])
            if a > nan_bits:
                a = masked_amax_bits(bs, j * 32, j * 32 + 32)
            bits[0] = a
            e = mx_scale_byte(buf[0], scale_mode, emax, mbits, rcp, buf, bits)
            mul = pow2_enc[e]
            dmul = pow2_dec[e]
            for t32 in range(32):
                k = j * 32 + t32
                yb[k] = e2m1_value(e2m1_rne(xs[k] * mul)) * dmul
        r = _seg_em(xs, bs, ya, yb, 2, mean)
        for q in range(N_EM):
            part[t, q] = r[q]
    return _combine_cols(part)


@nb.njit(parallel=True, cache=True)
def operand_stats(a, y, codes, top_code, codes_t):
    """The operand statistics of :func:`fp4sim.emulate._operand_stats` in one read of each array: ``a`` (R, K)
    the operand as quantized, ``y`` (R, K) its dequantized values (either may be a transposed view), ``codes``
    its packed FP4 codes (low nibble first), read when ``top_code`` is set: one row of codes per row of ``a``, or
    per column where ``codes_t`` is set (an operand quantized along its other axis). Returns float64 (sum a^2,
    sum (y - a)^2, max |a|: NaN if any element is NaN, as NumPy's max) and int64 (nonzero a, nonzero a with
    y == 0, codes of magnitude 7 (+-6), those of them with |a| > |y|). The arrays are read in tiles of 32 rows x
    256 columns (whatever their layout, a tile's lines stay in the cache); each row's sums are taken in float64
    in element order, the rows added in order."""
    R, K = a.shape
    nt = (R + 31) // 32
    s2 = np.zeros(R)
    e2 = np.zeros(R)
    mx = np.zeros(R)
    cnt = np.zeros((max(nt, 1), 4), np.int64)
    for t in nb.prange(nt):
        r0 = t * 32
        r1 = min(R, r0 + 32)
        nz = 0
        un = 0
        tp = 0
        cl = 0
        for k0 in range(0, K, 256):
            k1 = min(K, k0 + 256)
            for r in range(r0, r1):
                sa = s2[r]
                se = e2[r]
                m = mx[r]
                for k in range(k0, k1):
                    x = np.float64(a[r, k])
                    v = np.float64(y[r, k])
                    sa += x * x
                    d = v - x
                    se += d * d
                    ax = abs(x)
                    m = ax if not ax <= m else m   # NaN sticks, as in NumPy's max
                    z = x != 0.0
                    nz += z
                    un += z & (v == 0.0)
                s2[r] = sa
                e2[r] = se
                mx[r] = m
                if top_code:
                    for k in range(k0, k1):
                        if codes_t:
                            b = np.int64(codes[k, r >> 1]) >> (4 * (r & 1))
                        else:
                            b = np.int64(codes[r, k >> 1]) >> (4 * (k & 1))
                        if (b & 7) == 7:
                            tp += 1
                            cl += abs(a[r, k]) > abs(y[r, k])
        cnt[t, 0] = nz
        cnt[t, 1] = un
        cnt[t, 2] = tp
        cnt[t, 3] = cl
    out = np.zeros(3)
    n = np.zeros(4, np.int64)
    for r in range(R):
        out[0] += s2[r]
        out[1] += e2[r]
        out[2] = mx[r] if not mx[r] <= out[2] else out[2]
    for t in range(nt):
        for q in range(4):
            n[q] += cnt[t, q]
    return out, n


@nb.njit(parallel=True, cache=True)
def gradient_sums(q, r):
    """(sum r^2, sum (q - r)^2, sum q^2, sum q r) in float64 of two float32 arrays of one length (flat), for the
    weight-gradient SNR and cosine: each 1024-element segment summed in element order, the segments added with
    Neumaier's compensation (:func:`_combine`); one read of each array, no float64 copy."""
    n = q.size
    nseg = (n + SEG - 1) // SEG
    part = np.zeros((max(nseg, 1), 4))
    for t in nb.prange(nseg):
        lo = t * SEG
        hi = min(lo + SEG, n)
        a0 = a1 = a2 = a3 = 0.0
        for i in range(lo, hi):
            x = np.float64(q[i])
            y = np.float64(r[i])
            d = x - y
            a0 += y * y
            a1 += d * d
            a2 += x * x
            a3 += x * y
        part[t, 0] = a0
        part[t, 1] = a1
        part[t, 2] = a2
        part[t, 3] = a3
    return _combine_cols(part)
