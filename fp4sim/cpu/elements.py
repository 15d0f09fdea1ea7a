"""Element conversion kernels (float32 bits -> codes), branch-light integer arithmetic.

The rounding core works on the float32 bit pattern: the significand (with its implicit bit) is shifted right
by the distance between the input's quantum and the target format's quantum in the target binade, and the
remainder decides the rounding. Every rule (RNE, RZ, RU, RD, SR with n random bits) is a comparison of that
remainder, so one helper serves every format with subnormals (E2M1, E4M3, E5M2, BF16).
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic

from ..rng import byte_of, philox_block_for

from ..ids import MODES, RD, RNE, RU, RZ, SR  # noqa: F401  (ids are defined once, in fp4sim.ids)

# rbits sources
RB_NONE, RB_GIVEN, RB_PHILOX = 0, 1, 2


@nb.njit(inline="always", cache=True)
def round_magnitude(a, neg, mode, r, nsr, mbits, emin, bias):
    """Magnitude code of |x| (float32 bits ``a`` without sign, finite) rounded to a format.

    Branch-free (every mode's decision is computed and one is selected by loop-invariant masks, so loops
    vectorise). Returns an int64 that may exceed the format's largest finite code: the caller decides
    overflow. ``emin`` is the unbiased exponent of the format's smallest normal; ``r`` the SR random integer
    (``nsr`` bits).
    """
    r, nsr = sr_bits(r, nsr)
    a = np.int32(a)
    E = a >> 23
    sig = (a & 0x7FFFFF) | (np.int32(E != 0) << 23)
    e = max(E, np.int32(1)) - 127
    eT = max(e, np.int32(emin))
    s = eT - e + np.int32(23 - mbits)
    # quantum more than 2^31 times the input's ulp: the significand shifted to a 2^-31 quantum with a sticky bit
    # (every mode then decides as for the exact value — SR's top remainder bits, up to 9 with the midpoint rule,
    # are those of the exact remainder — and the int32 shifts below stay in range)
    tiny = s > 31
    sig = (sig >> min(s - np.int32(31), np.int32(31))) | np.int32(sig != 0) if tiny else sig
    s = min(s, np.int32(31))
    q = sig >> s
    rem = sig - (q << s)
    half = np.int32(1) << (s - 1)
    inexact = rem != 0
    up_rne = (rem > half) | ((rem == half) & ((q & 1) == 1))
    up_sr = ((rem >> (s - np.int32(nsr))) + np.int32(r)) >= (np.int32(1) << np.int32(nsr))
    up = ((mode == 0) & up_rne) | ((mode == 2) & inexact & (not neg)) | ((mode == 3) & inexact & neg) | \
         ((mode == 4) & up_sr)
    return ((eT + np.int32(bias - 1)) << np.int32(mbits)) + q + np.int32(up)


@nb.njit(inline="always", cache=True)
def encode_one(u, mode, r, nsr, mbits, emin, bias, maxmag, sat, nosat_code, nan_code, sign_bit):
    """Full code (sign included) of one float32 given as its uint32 bit pattern ``u``.

    ``sign_bit`` says how a sign is written (``planning.kernel_params``): a positive bit is ORed in, except on a
    zero where the format's NaN is that bit alone (FNUZ, P3109: no -0); a negative ``-b`` stores the two's
    complement of the magnitude code modulo ``2b`` (INT8)."""
    u = np.uint32(u)
    a = np.int32(u & np.uint32(0x7FFFFFFF))
    neg = (u >> np.uint32(31)) != 0
    mag = round_magnitude(min(a, np.int32(0x7F7FFFFF)), neg, mode, r, nsr, mbits, emin, bias)
    over = (mag > maxmag) | (a == 0x7F800000)
    over_code = np.int32(maxmag) if (sat or mode == 4) else np.int32(nosat_code)
    m = np.int32(over_code if over else mag)
    sb = np.int32(sign_bit)
    keep = np.int32(neg & ((m != 0) | (nan_code != sign_bit)))      # (no sign on a zero without -0)
    tc = np.int32(np.int32(-m) & np.int32(np.int32(-2) * sb - np.int32(1)))      # the two's complement (sb < 0)
    code = (tc if sb < 0 else np.int32(m | sb)) if keep else m
    return np.int32(nan_code) if a > 0x7F800000 else code


@nb.njit(inline="always", cache=True)
def encode_ue8m0_one(u, mode, sat):
    """UE8M0 byte of one float32 (sign ignored), per SPEC §1.4; mode RNE/RZ/RU (RD = RZ)."""
    a = np.int64(u) & 0x7FFFFFFF
    if a > 0x7F800000:
        return np.int64(0xFF)
    E = a >> 23
    M = a & 0x7FFFFF
    if E == 0:
        if mode == 2:
            c = np.int64(1) if a > 0x00400000 else np.int64(0)
        elif mode == 0:
            c = np.int64(1) if a > 0x00600000 else np.int64(0)
        else:
            c = np.int64(0)
    elif E == 255:
        c = np.int64(255)
    elif mode == 2:
        c = E + (np.int64(1) if M != 0 else np.int64(0))
    elif mode == 0:
        c = E + (np.int64(1) if (M > 0x400000) | ((M == 0x400000) & ((E & 1) == 1)) else np.int64(0))
    else:
        c = E
    if c > 254:
        return np.int64(0xFE) if sat else np.int64(0xFF)
    return c


# E2M1 magnitudes by code and the distance to the next code (code 7 saturates)
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_STEPS = np.array([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 0.0], dtype=np.float32)


def _bitcast(src, dst):
    """A Numba intrinsic reinterpreting a ``src`` scalar's bits as ``dst`` (a register bitcast: no memory, and
    loops using it vectorise)."""
    @intrinsic
    def cast(typingctx, v):
        if v != src:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(dst))
        return dst(src), codegen
    return cast


f32_bits_i32 = _bitcast(types.float32, types.int32)    # float32 -> its bit pattern as int32
i32_bits_f32 = _bitcast(types.int32, types.float32)    # int32 bit pattern -> that float32
f64_bits_i64 = _bitcast(types.float64, types.int64)    # float64 -> its bit pattern as int64
i64_bits_f64 = _bitcast(types.int64, types.float64)    # int64 bit pattern -> that float64


@nb.njit(inline="always", cache=True)
def e2m1_value(c):
    """The float32 value of E2M1 code ``c`` (0..15) built from its bits, not looked up (a table gather per
    element does not vectorise): magnitude m = c & 7 is 0, 0.5 (bits 252 << 22), else (m + 252) << 22, since
    E2M1's exponent and mantissa bits are the code's (1.0 = code 2, 6.0 = code 7); code bit 3 is the sign."""
    i = np.int32                    # (Numba widens int32 arithmetic to int64: each result is cast back)
    c = i(c)
    m = i(c & i(7))
    b = i(i(i(m + i(252) - i(m == i(1))) << i(22)) & i(-i(m != i(0))))
    return i32_bits_f32(i(b | i(i(c & i(8)) << i(28))))


# E2M1's RNE midpoints as float32 bit patterns: 0.25 0x3E800000, 0.75 0x3F400000, 1.25 0x3FA00000,
# 1.75 0x3FE00000, 2.5 0x40200000, 3.5 0x40600000, 5 0x40A00000.
@nb.njit(inline="always", cache=True)
def e2m1_rne(v):
    """E2M1 RNE code of float32 ``v``: the count of midpoints below |v| (ties to even: ``>`` at midpoints
    whose lower neighbour has an even code, ``>=`` elsewhere), compared on the bit pattern (a non-negative
    float32 orders like its bits as int32, NaN above them all, so a NaN counts 7 and only loses its sign), so
    that it vectorises as integer compares and subtracts."""
    i = np.int32                    # (Numba widens int32 arithmetic to int64: each result is cast back)
    u = f32_bits_i32(v)
    a = i(u & i(0x7FFFFFFF))
    c = i(i(a > i(0x3E800000)) + i(a >= i(0x3F400000)) + i(a > i(0x3FA00000)) + i(a >= i(0x3FE00000))
          + i(a > i(0x40200000)) + i(a >= i(0x40600000)) + i(a > i(0x40A00000)))
    return i(c | i(i(u >> i(28)) & i(8) & i(-i(a <= i(0x7F800000)))))


@nb.njit(inline="always", cache=True)
def sr_bits(r, nsr):
    """The random integer and bit count a stochastic-rounding decision uses. ``nsr`` is the bit count n, plus
    ``ids.SR_MIDPOINT`` (16) for the midpoint rule (round up iff delta + (2r + 1) / 2^(n+1) >= 1), which is the
    truncating rule (up iff floor(delta * 2^m) + R >= 2^m) with m = n + 1 bits and R = 2r + 1."""
    mid = np.int32((nsr >> 4) & 1)
    return np.int32(r) * (np.int32(1) + mid) + mid, np.int32(nsr & 15) + mid


@nb.njit(inline="always", cache=True)
def sr_consts(nsr):
    """(2**(m + 1) as float32, nsr as given): the constants :func:`e2m1_sr` takes, computed once per loop (m: the
    bit count :func:`sr_bits` uses)."""
    m = (nsr & 15) + ((nsr >> 4) & 1)
    return np.float32(2 << m), np.int32(nsr)


@nb.njit(inline="always", cache=True)
def e2m1_sr(v, r, sc, nsr):
    """E2M1 code of float32 ``v`` rounded stochastically with the ``nsr``-bit random integer ``r`` (int32),
    ``sc, nsr = sr_consts(nsr)``: the same rule as :func:`encode_one` with mode 4 (up iff the ``nsr`` bits of the
    remainder below the target quantum plus r carry), on the bits so that the loop vectorises:

    - |v| >= 1 (E2M1's normal binades, one mantissa bit: the quantum is float32 bit 22): add r at the nsr bits
      below bit 22 and truncate; the carry moves the exponent as it should, 252 is 1.0's code subtracted from
      its bits >> 22, and anything past 6 saturates to code 7;
    - |v| < 1 (quantum 0.5): |v| * 2**(nsr + 1) is exact, its integer part is the quanta and the remainder's top
      nsr bits; adding r carries into the quanta (code 2 is 1.0);
    - NaN -> 7, else the sign in bit 3 (-0 -> 8)."""
    i = np.int32                    # (Numba widens int32 arithmetic to int64: each result is cast back)
    r, nsr = sr_bits(r, nsr)        # (the midpoint rule: 2r + 1 with one more bit)
    u = f32_bits_i32(v)
    a = i(u & i(0x7FFFFFFF))
    nrm = min(i(i(i(a + i(r << i(22 - nsr))) >> i(22)) - i(252)), i(7))
    sub = i(i(i(abs(v) * sc) + r) >> nsr)
    c = sub if a < i(0x3F800000) else nrm
    return i(7) if a > i(0x7F800000) else i(c | i(i(u >> i(28)) & i(8)))


@nb.njit(inline="always", cache=True)
def e2m1_code(v, mode, r, nsr, mags, steps):
    """E2M1 code of a float32 ``v`` as sums of comparison masks (vectorises; no integer shifts).

    Same result as :func:`encode_one` for E2M1: ties to even in RNE, satfinite, NaN -> 0x7, -0 -> 0x8.
    """
    f = np.float32
    r, nsr = sr_bits(r, nsr)
    ax = abs(v)
    rne = (np.int32(ax > f(0.25)) + np.int32(ax >= f(0.75)) + np.int32(ax > f(1.25)) + np.int32(ax >= f(1.75))
           + np.int32(ax > f(2.5)) + np.int32(ax >= f(3.5)) + np.int32(ax > f(5.0)))
    lo = (np.int32(ax >= f(0.5)) + np.int32(ax >= f(1.0)) + np.int32(ax >= f(1.5)) + np.int32(ax >= f(2.0))
          + np.int32(ax >= f(3.0)) + np.int32(ax >= f(4.0)) + np.int32(ax >= f(6.0)))
    lov = mags[lo]
    step = steps[lo]
    neg = math.copysign(f(1.0), v) < f(0.0)
    inexact = (ax > lov) & (lo < 7)
    up_sr = (ax - lov) >= f((1 << nsr) - r) * (step * f(1.0 / (1 << nsr)))
    up = ((mode == 2) & inexact & (not neg)) | ((mode == 3) & inexact & neg) | ((mode == 4) & inexact & up_sr)
    mag = rne if mode == 0 else lo + np.int32(up)
    code = mag | (np.int32(neg) << 3)
    return np.int32(7) if ax != ax else code


CHUNK = 4096  # elements per parallel task (a multiple of 16, so Philox blocks never straddle tasks)


@nb.njit(parallel=True, cache=True)
def encode_kernel(x, xb, out, mode, rb, rb_kind, k0, k1, stream, nsr, sat,
                  mbits, emin, bias, maxmag, nosat_code, nan_code, sign_bit, ue8m0, fast_e2m1):
    """Encode float32 bit patterns ``xb`` (uint32, 1-D) into ``out`` (uint8/uint16).

    ``rb_kind``: 0 no random bits, 1 given per element in ``rb``, 2 Philox from (k0, k1, stream).
    """
    n = xb.shape[0]
    nch = (n + CHUNK - 1) // CHUNK
    rmask = (np.int64(1) << (nsr & 15)) - 1         # (nsr may carry the midpoint flag, ids.SR_MIDPOINT)
    for c in nb.prange(nch):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        if ue8m0:
            for i in range(lo, hi):
                out[i] = encode_ue8m0_one(xb[i], mode, sat)
        elif mode != 4:
            if fast_e2m1 and mode == 0:
                for i in range(lo, hi):
                    out[i] = e2m1_rne(x[i])
            elif fast_e2m1:
                for i in range(lo, hi):
                    out[i] = e2m1_code(x[i], mode, 0, nsr, E2M1_MAGS, E2M1_STEPS)
            else:
                for i in range(lo, hi):
                    out[i] = encode_one(xb[i], mode, 0, nsr, mbits, emin, bias, maxmag, sat, nosat_code, nan_code,
                                        sign_bit)
        else:
            if rb_kind == 1:
                rsrc = rb[lo:hi]
            else:
                rsrc = np.empty(CHUNK, np.uint8)
                for b in range(lo, hi, 16):
                    rr = philox_block_for(b, k0, k1, stream)
                    for t in range(b, min(b + 16, hi)):
                        rsrc[t - lo] = byte_of(rr, t)
            if fast_e2m1:
                for i in range(lo, hi):
                    out[i] = e2m1_code(x[i], mode, np.int32(rsrc[i - lo]) & np.int32(rmask), nsr, E2M1_MAGS,
                                       E2M1_STEPS)
            else:
                for i in range(lo, hi):
                    out[i] = encode_one(xb[i], mode, np.int64(rsrc[i - lo]) & rmask, nsr, mbits, emin, bias,
                                        maxmag, sat, nosat_code, nan_code, sign_bit)


@nb.njit(parallel=True, cache=True)
def decode_kernel(codes, table, out):
    """``out[i] = table[codes[i]]`` (a gather from the format's value table)."""
    for i in nb.prange(codes.shape[0]):
        out[i] = table[codes[i]]
