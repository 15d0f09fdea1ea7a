"""Block-scaled quantization kernels (NVFP4 1x16 / 16x16 in four flavours, MX, FP8 per-tensor/blockwise).

All kernels take a 2-D float32 array (rows, K) with the block axis last; positions past K (and rows past R
inside a 16x16 tile) are the zero padding of SPEC §2. Every float operation is float32 (constants are
wrapped in np.float32) so results follow SPEC's fl(.) sequences exactly. One parallel task per row group.
"""
from __future__ import annotations


import numba as nb
import numpy as np

from ..rng import philox_bytes_cols, philox_bytes_row
from .elements import (E2M1_MAGS, E2M1_STEPS, e2m1_code, e2m1_rne, e2m1_sr, e2m1_value, encode_one, f32_bits_i32,
                       sr_consts)

from ..ids import FLAVOR_IDS, MODELOPT, PAPER, TE, TORCHAO  # noqa: F401  (ids are defined once, in fp4sim.ids)

FLT_MAX = np.float32(np.finfo(np.float32).max)
R6 = np.float32(1.0) / np.float32(6.0)
E4M3_PARAMS = (3, -6, 7, 0x7E, 0x7F, 0x7F, 0x80)  # mbits, emin, bias, maxmag, nosat, nan, sign


@nb.njit(parallel=True, cache=True)
def row_absmax_nan(x2, part, nans):
    """``part[r]`` = the bits of max |x2[r]| with NaN ignored, ``nans[r]`` = 1 where row r holds a NaN.

    Works on the bit patterns (|x| orders like its bits; NaN patterns are masked out), so the reduction is an
    integer max that vectorises.
    """
    R, K = x2.shape
    xb = x2.view(np.uint32)
    for r in nb.prange(R):
        m = np.uint32(0)
        nn = np.uint32(0)
        for k in range(K):
            a = xb[r, k] & np.uint32(0x7FFFFFFF)
            isnan = a > np.uint32(0x7F800000)
            m = max(m, np.uint32(0) if isnan else a)
            nn = max(nn, np.uint32(isnan))
        part[r] = m
        nans[r] = nn


def absmax_nan(x2):
    """(max |x| with NaN ignored, whether any NaN was seen) over a 2-D array."""
    R = x2.shape[0]
    part = np.zeros(R, np.uint32)
    nans = np.zeros(R, np.uint32)
    row_absmax_nan(x2, part, nans)
    return tensor_amax(part, nans)


def tensor_amax(part, nans):
    """The tensor's (max |x| with NaN ignored, whether a NaN was seen) from the per-row bits and NaN flags that
    :func:`row_absmax_nan`, :func:`absmax_blocks_kernel` and :func:`mx_kernel` leave."""
    if not part.shape[0]:
        return np.float32(0.0), False
    return part.max().view(np.float32), bool(nans.max())


@nb.njit(inline="always", cache=True)
def masked_amax_bits(xb, k0, k1):
    """max |x| bits over xb[k0:k1] (float32 bits as uint32), NaN patterns ignored."""
    m = np.uint32(0)
    for k in range(k0, k1):
        a = xb[k] & np.uint32(0x7FFFFFFF)
        m = max(m, np.uint32(0) if a > np.uint32(0x7F800000) else a)
    return m


@nb.njit(inline="always", cache=True)
def raw_max16(xb, j):
    """max of the |x| bit patterns of the 16 elements xb[16 j : 16 j + 16] (a NaN pattern, when one is there,
    is the max: callers mask it out where that happens). A constant trip count: the loop vectorises."""
    m = np.uint32(0)
    for t in range(16):
        m = max(m, xb[j * 16 + t] & np.uint32(0x7FFFFFFF))
    return m


@nb.njit(inline="always", cache=True)
def mask_nan_blocks(bm, xb, bk, K):
    """Given the raw maxima ``bm`` of a row's ``bk``-element blocks (:func:`raw_max16`), reduce the blocks whose
    max is a NaN pattern again with NaN masked out; returns (the row's max |x| bits, NaN ignored; 1 if the row
    holds a NaN, else 0)."""
    rm = np.uint32(0)
    for j in range(bm.shape[0]):
        rm = max(rm, bm[j])
    nn = np.uint32(0)
    if rm > np.uint32(0x7F800000):
        nn = np.uint32(1)
        rm = np.uint32(0)
        for j in range(bm.shape[0]):
            if bm[j] > np.uint32(0x7F800000):
                bm[j] = masked_amax_bits(xb, j * bk, min(j * bk + bk, K))
            rm = max(rm, bm[j])
    return rm, nn


@nb.njit(parallel=True, cache=True)
def absmax_blocks_kernel(x2, part, nans, store):
    """The tensor-amax pass of NVFP4 that also keeps each 16-element block's amax: ``part[r]``/``nans[r]`` as
    :func:`row_absmax_nan`, and the bits of max |x| (NaN ignored) of block j of row r (the zero padding of a last
    partial block adds nothing) in ``store``.

    ``store`` is the uint32 view of the quantize kernel's code array: a block's codes take 8 bytes, so block j's
    amax waits in ``store[r, 2 * j]`` until that kernel reads it and writes the codes over it (no buffer of its
    own).
    Each row's raw block maxima over the bit patterns go to a contiguous buffer first (a loop that vectorises;
    storing them strided inside it made the pass 1.5x slower); a block whose raw max is a NaN pattern (rare) is
    then reduced again with NaN masked out.
    """
    R, K = x2.shape
    nfull = K // 16
    nbk = (K + 15) // 16
    for rg in nb.prange((R + 15) // 16):
        bm = np.empty(nbk, np.uint32)
        for r in range(rg * 16, min(rg * 16 + 16, R)):
            xb = x2[r].view(np.uint32)
            for j in range(nfull):
                bm[j] = raw_max16(xb, j)
            if nbk > nfull:
                m = np.uint32(0)
                for k in range(nfull * 16, K):
                    m = max(m, xb[k] & np.uint32(0x7FFFFFFF))
                bm[nfull] = m
            rm, nn = mask_nan_blocks(bm, xb, 16, K)
            for j in range(nbk):
                store[r, 2 * j] = bm[j]
            part[r] = rm
            nans[r] = nn


@nb.njit(inline="always", cache=True)
def block_amax(x2, r0, r1, k0, k1):
    """max |x| over x2[r0:r1, k0:k1], NaN ignored."""
    amax = np.float32(0.0)
    for r in range(r0, r1):
        for k in range(k0, k1):
            a = abs(x2[r, k])
            amax = a if a > amax else amax
    return amax


@nb.njit(inline="always", cache=True)
def f32_bits(v, buf, bits):
    buf[0] = v
    return bits[0]


@nb.njit(inline="always", cache=True)
def e4m3_rne_array(sf, cb, out):
    """E4M3 RNE satfinite bytes of non-negative float32 values ``sf`` (NaN -> 0xFF, the sign torch keeps on
    x86's default NaN) into ``out``; ``sf`` is overwritten, ``cb`` is a uint32 work array of the same length.

    Rounds with the add-and-subtract trick: C = 2^(e - 3 + 23), e the exponent of v (at least E4M3's -6),
    has a float32 ulp equal to E4M3's quantum there, so fl(fl(v + C) - C) is v rounded to nearest-even on the
    E4M3 grid; the byte then comes from the result's bits. Plain loops over arrays, so they vectorise.
    """
    f = np.float32
    n = sf.shape[0]
    sfb = sf.view(np.uint32)
    cf = cb.view(np.float32)
    for j in range(n):
        v = sf[j]
        sf[j] = f(480.0) if v > f(480.0) else v  # >= 464 saturates anyway; keeps C finite
    for j in range(n):
        cb[j] = (max(sfb[j] >> np.uint32(23), np.uint32(121)) + np.uint32(20)) << np.uint32(23)
    for j in range(n):
        sf[j] = (sf[j] + cf[j]) - cf[j]
    for j in range(n):
        y = sf[j]
        c = np.int32(sfb[j] >> np.uint32(20)) - np.int32(960) if y >= f(0.015625) else np.int32(y * f(512.0))
        out[j] = np.uint8(0xFF) if y != y else np.uint8(min(c, np.int32(0x7E)))


@nb.njit(inline="always", cache=True)
def nvfp4_scales(amax, flavor, c0, c1, e4m3_vals, sf, cb, sbytes, fac):
    """Scale bytes and element factors of a row of blocks (SPEC §2.1 / §3.3, each flavour's float32 operations
    in its order) as loops over arrays, which vectorise; ``sf``/``cb`` are work arrays of the same length.
    The factor multiplies x (divides it for modelopt)."""
    n = amax.shape[0]
    f = np.float32
    if flavor == 0:
        for j in range(n):
            sf[j] = min(amax[j] * c0, FLT_MAX)
    elif flavor == 1:
        for j in range(n):
            sf[j] = min((amax[j] / f(6.0)) * c0, FLT_MAX)
    elif flavor == 2:
        for j in range(n):
            v = (amax[j] / f(6.0)) / c0
            sf[j] = min(max(v, f(0.015625)), f(448.0)) if v == v else v
    else:
        for j in range(n):
            v = amax[j] / c0
            v = f(1.0) if v == f(0.0) else v
            sf[j] = min(max(v, f(0.001953125)), f(448.0)) if v == v else v
    e4m3_rne_array(sf, cb, sbytes)
    for j in range(n):
        sval = e4m3_vals[sbytes[j]]
        if flavor <= 1:
            fac[j] = min(f(1.0) / (sval * c1), FLT_MAX)
        elif flavor == 2:
            fac[j] = c1 / sval
        else:
            fac[j] = sval * c1


@nb.njit(inline="always", cache=True)
def nvfp4_elem(v, fac, flavor, mode, r, nsr):
    """E2M1 code of one element given its block's factor, with the flavour's special-value rules."""
    if flavor == 3:
        y = v / fac
    else:
        y = v * fac
    c = e2m1_code(y, mode, r, nsr, E2M1_MAGS, E2M1_STEPS)
    if v != v:
        c = np.int32(7)                       # NaN element -> +6 (all flavours, SPEC §3.3)
    elif flavor == 2 and fac != fac:
        c = np.int32(0xC)                     # torchao's NaN chain of an all-zero tensor
    elif flavor == 3 and y == np.float32(0.0):
        c = np.int32(0)                       # modelopt: only x < 0 sets the sign, so -0 gives code 0
    return c


@nb.njit(inline="always", cache=True)
def row_padded(x2, r, K, Kp, buf):
    """Row r of x2, or its copy zero-padded to Kp in ``buf`` when K is not a multiple of the block."""
    if K == Kp:
        return x2[r]
    buf[:K] = x2[r]
    return buf


@nb.njit(inline="always", cache=True)
def sr_row_bytes(rb, ph, pk0, pk1, pstream, pmask, proff, r, K, Kp, rrow, rcols, c0):
    """Row r's random bytes for the kernels: ``ph`` 0: row r of ``rb`` (in place, or its zero-padded copy in
    ``rrow``); 1: Philox of flat indices (proff + r)*K + k into ``rrow`` (``proff``: the rows of the tensor
    before this call's first, when it quantizes a chunk of them); 2: row r - c0 of ``rcols`` (the 16-row Philox
    buffer of the row's group, filled by the caller)."""
    if ph == 1:
        philox_bytes_row(rrow, (np.int64(r) + proff) * K, K, pk0, pk1, pstream, pmask)
        return rrow
    if ph == 2:
        return rcols[r - c0]
    if K == Kp:
        return rb[r]
    rrow[:K] = rb[r]
    return rrow


@nb.njit(inline="always", cache=True)
def sr_fill_cols(ph, pk0, pk1, pstream, pmask, pstride, r0, K, rcols):
    """With ``ph`` 2, the random bytes of rows r0 .. r0+15 (r0 a multiple of 16) into ``rcols``: the block axis
    of the original tensor has stride ``pstride`` (a multiple of 16), rows are its other indices in C order."""
    if ph == 2:
        base = (np.int64(r0) // pstride) * K * pstride + np.int64(r0) % pstride
        philox_bytes_cols(rcols, base, pstride, K, pk0, pk1, pstream, pmask)


@nb.njit(inline="always", cache=True)
def scale_buffers(nbk):
    """A task's buffers for :func:`nvfp4_scales` and the dequantize factors of ``nbk`` blocks: (sf, cb, sbytes,
    fac, sdq)."""
    return (np.empty(nbk, np.float32), np.empty(nbk, np.uint32), np.empty(nbk, np.uint8), np.empty(nbk, np.float32),
            np.empty(nbk, np.float32))


@nb.njit(parallel=True, cache=True)
def nvfp4_kernel(x2, rb, ph, pk0, pk1, pstream, pmask, pstride, proff, mode, nsr, flavor, tile, c0v, c1v, dqv,
                 e4m3_vals, codes, scales, fake, do_fake, pre):
    """NVFP4 quantize. ``tile`` is 1 (1x16 blocks) or 16 (16x16 tiles, one scale per tile).

    codes: (R, Kp/2) packed; scales: (ceil(R/tile), Kp/16); fake: (R, K) dequantized values when do_fake,
    where ``dqv`` holds the flavour's dequantize constants. ``c0v``, ``c1v``, ``dqv`` hold one set of per-tensor
    constants, or one per row (row-scaled NVFP4, tile 1). Stochastic rounding's bytes (:func:`sr_row_bytes`):
    ``ph`` 0 from ``rb`` (R, K), 1 and 2 Philox generated per row or per 16 rows (key pk0/pk1, stream, masked by
    pmask; rows numbered from ``proff``). Each task handles 16 rows with ``ph`` 2, else one group of ``tile``
    rows, in phases that vectorise: block amax (integer max over bit patterns; with ``pre`` read from ``codes``,
    where :func:`absmax_blocks_kernel` left it), per-block scale (scalar), element codes over the whole padded
    row, nibble packing.
    """
    R, K = x2.shape
    nbk = (K + 15) // 16
    Kp = nbk * 16
    ngroups = (R + tile - 1) // tile
    per = 16 // tile if ph == 2 else 1             # groups per task
    sc, nsr32 = sr_consts(nsr)
    cu = codes.view(np.uint32)                            # with pre: block j's amax bits at cu[r, 2 * j]
    for sg in nb.prange((ngroups + per - 1) // per):
        xrow = np.zeros(Kp, np.float32)
        rrow = np.zeros(Kp, np.uint8)
        rcols = np.zeros((16, Kp) if ph == 2 else (1, 1), np.uint8)   # used with ph 2 only
        crow = np.empty(Kp, np.uint8)
        amaxb = np.zeros(nbk, np.uint32)
        sf, cb, sbytes, fac, sdq = scale_buffers(nbk)
        c0r = sg * per * tile
        if mode == 4:
            sr_fill_cols(ph, pk0, pk1, pstream, pmask, pstride, c0r + proff, K, rcols)
        for g in range(sg * per, min(sg * per + per, ngroups)):
            r0 = g * tile
            r1 = min(r0 + tile, R)
            ci = np.int64(g) if c0v.shape[0] > 1 else np.int64(0)
            c0, c1 = c0v[ci], c1v[ci]
            dq = dqv[ci]
            amaxb[:] = 0
            for r in range(r0, r1):                       # phase 1: block amax over the group's rows
                if pre:
                    for j in range(nbk):
                        amaxb[j] = max(amaxb[j], cu[r, 2 * j])
                    continue
                xr = row_padded(x2, r, K, Kp, xrow)
                xb = xr.view(np.uint32)
                for j in range(nbk):
                    amaxb[j] = max(amaxb[j], masked_amax_bits(xb, j * 16, j * 16 + 16))
            nvfp4_scales(amaxb.view(np.float32), flavor, c0, c1, e4m3_vals, sf, cb, sbytes, fac)  # phase 2
            nanfac = False
            for j in range(nbk):
                scales[g, j] = sbytes[j]
                nanfac |= fac[j] != fac[j]
            if do_fake:
                for j in range(nbk):
                    sdq[j] = nvfp4_dequant_factor(e4m3_vals[sbytes[j]], flavor, dq, c1)
            for r in range(r0, r1):
                xr = row_padded(x2, r, K, Kp, xrow)
                rr = rrow                                  # the row's random bytes (given ones read in place
                if mode == 4:                              # where possible: through a row copy SR was 2-5x slower)
                    rr = sr_row_bytes(rb, ph, pk0, pk1, pstream, pmask, proff, r, K, Kp, rrow, rcols, c0r)
                if mode == 0 and flavor <= 2 and not nanfac:  # phase 3: element codes (common paths first)
                    for j in range(nbk):
                        f = fac[j]
                        for t16 in range(16):
                            k = j * 16 + t16
                            crow[k] = e2m1_rne(xr[k] * f)
                elif mode == 4 and flavor <= 2 and not nanfac:
                    for j in range(nbk):
                        f = fac[j]
                        for t16 in range(16):
                            k = j * 16 + t16
                            crow[k] = e2m1_sr(xr[k] * f, np.int32(rr[k]), sc, nsr32)
                else:
                    for j in range(nbk):
                        f = fac[j]
                        for t16 in range(16):
                            k = j * 16 + t16
                            crow[k] = nvfp4_elem(xr[k], f, flavor, mode, np.int32(rr[k]), nsr)
                for t in range(Kp // 2):                   # phase 4: pack, element 2t in the low nibble
                    codes[r, t] = crow[2 * t] | (crow[2 * t + 1] << np.uint8(4))
                if do_fake:
                    fr = fake[r]
                    for j in range(K // 16):
                        f = sdq[j]
                        for t16 in range(16):
                            k = j * 16 + t16
                            fr[k] = e2m1_value(crow[k]) * f
                    for k in range(K // 16 * 16, K):
                        fr[k] = e2m1_value(crow[k]) * sdq[k // 16]


@nb.njit(inline="always", cache=True)
def nvfp4_dequant_factor(sval, flavor, dq, c1):
    """Per-block float32 factor that multiplies an E2M1 value on dequantize (SPEC §2.1 for te/paper)."""
    if flavor <= 1:
        return (sval * dq[0]) * dq[1]      # fl(fl(s * amax_g) * fl(1/2688))
    return sval * dq[0]                    # torchao / modelopt: fl(s * per-tensor scale)


# ------------------------------------------------------------------------------------------------- MX
@nb.njit(inline="always", cache=True)
def mx_scale_byte(amax, mode, emax, mbits, rcp, buf, bits):
    """UE8M0 byte from a block amax (float bits), SPEC §2.2; mode 0 rceil, 1 floor, 2 ceil, 3 even.

    ``even`` first rounds amax to the element's precision (adds 2^(22 - mbits) to its bits: 2^21 for E2M1).
    """
    if mode == 0:
        u = np.int64(f32_bits(amax * rcp, buf, bits))
        a = u & 0x7FFFFFFF
        E = a >> 23
        M = a & 0x7FFFFF
        if E == 0:
            c = np.int64(1) if a > 0x00400000 else np.int64(0)
        elif E == 255:
            c = np.int64(255)
        else:
            c = E + (np.int64(1) if M != 0 else np.int64(0))
        return min(c, np.int64(254))
    u = np.int64(f32_bits(amax, buf, bits))
    if amax == np.float32(0.0):
        return np.int64(0)
    if mode == 3:
        u = u + (np.int64(1) << (22 - mbits))
    E = (u >> 23) & 0xFF
    e = E - 127 - emax
    if mode == 2 and (u & 0x7FFFFF) != 0:
        e += 1
    return min(max(e, np.int64(-127)), np.int64(127)) + 127


@nb.njit(parallel=True, cache=True)
def mx_kernel(x2, rb, ph, pk0, pk1, pstream, pmask, pstride, proff, mode, nsr, scale_mode, emax, rcp, pow2_enc,
              pow2_dec, mbits, emin, bias, maxmag, nosat, nanc, signbit, is_fp4, elem_vals, codes, scales, fake,
              do_fake, part, nans):
    """MX quantize with 32-element blocks. codes: (R, Kp/2) packed for FP4, (R, Kp) for FP8. Stochastic
    rounding's bytes as in :func:`nvfp4_kernel` (``ph``; a task handles 16 rows with ``ph`` 2, else one).

    MX needs no tensor-wide amax, so the input is read once: each row's block amaxes come from its 16-element
    raw maxima (:func:`raw_max16`, NaN blocks reduced again), and ``part[r]`` / ``nans[r]`` get the row's max |x|
    bits (NaN ignored) and NaN flag, as :func:`row_absmax_nan` would, for the caller's warnings."""
    R, K = x2.shape
    nb_ = (K + 31) // 32
    Kp = nb_ * 32
    per = 16 if ph == 2 else 1
    sc, nsr32 = sr_consts(nsr)
    for sg in nb.prange((R + per - 1) // per):
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        xrow = np.zeros(Kp, np.float32)
        rrow = np.zeros(Kp, np.uint8)
        rcols = np.zeros((16, Kp) if ph == 2 else (1, 1), np.uint8)   # used with ph 2 only
        crow = np.empty(Kp, np.uint8)
        amaxr = np.empty(nb_, np.uint32)
        bm16 = np.empty(2 * nb_, np.uint32)
        sbyte = np.empty(nb_, np.int64)
        mul = np.empty(nb_, np.float32)
        fast = is_fp4 and mode == 0
        if mode == 4:
            sr_fill_cols(ph, pk0, pk1, pstream, pmask, pstride, sg * per + proff, K, rcols)
        for r in range(sg * per, min(sg * per + per, R)):
            xr = row_padded(x2, r, K, Kp, xrow)
            xb = xr.view(np.uint32)
            rr = rrow
            if mode == 4:
                rr = sr_row_bytes(rb, ph, pk0, pk1, pstream, pmask, proff, r, K, Kp, rrow, rcols, sg * per)
            for j16 in range(2 * nb_):                    # block amaxes over the zero-padded row, two halves each
                bm16[j16] = raw_max16(xb, j16)            # (a 32-long constant trip count vectorised worse: 2x)
            for j in range(nb_):
                amaxr[j] = max(bm16[2 * j], bm16[2 * j + 1])
            part[r], nans[r] = mask_nan_blocks(amaxr, xb, 32, Kp)
            for j in range(nb_):                          # the blocks' scale bytes and factors
                bits[0] = amaxr[j]
                e = mx_scale_byte(buf[0], scale_mode, emax, mbits, rcp, buf, bits)
                scales[r, j] = e
                sbyte[j] = e
                mul[j] = pow2_enc[e]
            if fast:                                      # RNE E2M1: integer compares over the whole row
                for j in range(nb_):
                    f = mul[j]
                    for t32 in range(32):
                        k = j * 32 + t32
                        crow[k] = e2m1_rne(xr[k] * f)
            elif is_fp4 and mode == 4:                    # SR E2M1, likewise
                for j in range(nb_):
                    f = mul[j]
                    for t32 in range(32):
                        k = j * 32 + t32
                        crow[k] = e2m1_sr(xr[k] * f, np.int32(rr[k]), sc, nsr32)
            else:
                for j in range(nb_):
                    f = mul[j]
                    for t32 in range(32):
                        k = j * 32 + t32
                        y = xr[k] * f
                        if is_fp4:
                            crow[k] = e2m1_code(y, mode, np.int32(rr[k]), nsr, E2M1_MAGS, E2M1_STEPS)
                        else:
                            crow[k] = encode_one(f32_bits(y, buf, bits), mode, np.int32(rr[k]), nsr, mbits, emin,
                                                 bias, maxmag, True, nosat, nanc, signbit)
            if do_fake:
                fr = fake[r]
                for j in range(nb_):
                    k0 = j * 32
                    dmul = pow2_dec[sbyte[j]]
                    if is_fp4 and k0 + 32 <= K:
                        for t32 in range(32):
                            fr[k0 + t32] = e2m1_value(crow[k0 + t32]) * dmul
                    else:
                        for k in range(k0, min(k0 + 32, K)):
                            fr[k] = elem_vals[crow[k]] * dmul
            if is_fp4:
                for t in range(Kp // 2):                  # element 2t in the low nibble
                    codes[r, t] = crow[2 * t] | (crow[2 * t + 1] << np.uint8(4))
            else:
                for k in range(Kp):
                    codes[r, k] = crow[k]


# ------------------------------------------------------------------------------------------------- FP8
@nb.njit(parallel=True, cache=True)
def fp8_kernel(x2, rb, use_rb, mode, nsr, tile, blk, per_tensor_scale, divide,
               mbits, emin, bias, maxmag, nosat, nanc, signbit, elem_vals, codes, scales, fake, do_fake):
    """FP8 per-tensor (blk = K, scale given) or blockwise (tile x blk blocks, scale = fl(amax_b / max))."""
    R, K = x2.shape
    nbk = (K + blk - 1) // blk
    ngroups = (R + tile - 1) // tile
    fmax = elem_vals[maxmag]
    for g in nb.prange(ngroups):
        r0 = g * tile
        r1 = min(r0 + tile, R)
        for j in range(nbk):
            k0 = j * blk
            k1 = min(k0 + blk, K)
            n = k1 - k0
            if divide:
                s = block_amax(x2, r0, r1, k0, k1) / fmax
                scales[g, j] = s
            else:
                s = per_tensor_scale
            dq = s if divide else np.float32(1.0) / s
            for r in range(r0, r1):
                xr = x2[r, k0:k1]                     # (row slices: offset indices are indexed with wraparound
                cr = codes[r, k0:k1]                  # checks, and the bits go through a register, not memory:
                rbr = rb[r, k0:k1] if use_rb else rb[0, :0]                       # the loop vectorises)
                for k in range(n):
                    v = xr[k]
                    rr = np.int32(rbr[k]) if use_rb else np.int32(0)
                    if divide:
                        y = v / s if s != np.float32(0.0) else v * np.float32(0.0)
                    else:
                        y = v * s
                    c = encode_one(np.uint32(f32_bits_i32(y)), mode, rr, nsr, mbits, emin, bias, maxmag, True,
                                   nosat, nanc, signbit)
                    cr[k] = np.uint8(c)
                if do_fake:
                    fr = fake[r, k0:k1]
                    for k in range(n):
                        fr[k] = elem_vals[cr[k]] * dq


# ------------------------------------------------------------------------------------------------- dequantize
@nb.njit(parallel=True, cache=True)
def fp4_dequant_kernel(codes, blockfac, bk, out):
    """out[r, k] = E2M1(code[r, k]) * blockfac[r, k // bk] for packed FP4 codes (element 2t low nibble).

    ``bk`` is a power of two (16 or 32): one vector loop over the code bytes, a byte's block by a shift.
    """
    R, K = out.shape
    sh = 0
    while (2 << sh) < bk:
        sh += 1                                   # byte t holds elements 2t, 2t + 1 of block t >> sh
    for r in nb.prange(R):
        for t in range(K // 2):
            b = codes[r, t]
            f = blockfac[r, t >> sh]
            out[r, 2 * t] = e2m1_value(b & np.uint8(15)) * f
            out[r, 2 * t + 1] = e2m1_value(b >> np.uint8(4)) * f
        if K & 1:
            out[r, K - 1] = e2m1_value(codes[r, K >> 1] & np.uint8(15)) * blockfac[r, (K - 1) // bk]


@nb.njit(parallel=True, cache=True)
def lut_dequant_kernel(codes, lut, fac, tile, bk, out):
    """out[r, k] = lut[codes[r, k]] * fac[r // tile, k // bk] for one-byte codes (FP8 elements: MXFP8, per-tensor
    and blockwise FP8), with ``codes`` (R, >= K) and the float32 product as NumPy's ``values[codes] * scale``.

    One pass instead of NumPy's gather, scale broadcast and product; a block's factor read once per row."""
    R, K = out.shape
    nbk = (K + bk - 1) // bk
    for r in nb.prange(R):
        cr = codes[r]
        orow = out[r]
        fr = fac[r // tile]
        for j in range(nbk):
            f = fr[j]
            k0 = j * bk
            k1 = min(k0 + bk, K)
            for k in range(k0, k1):
                orow[k] = lut[cr[k]] * f
