"""ggml's two FP4 quantizer rules stated in exact rational arithmetic (Python's Fraction, a 60-digit log2 for the
MXFP4 exponent) and compared with fp4sim.gguf's NumPy implementations, byte for byte, on real weights, on the
rules' ties and on the edges where their float32 steps decide: an amax just below a power of two (the exponent's
log2 rounded to float32), scales on UE4M3's half-up ties, its subnormals and its top. Each reference is
independent of the code under test: it rounds to float32 by its own integer rule where the rule does, and nowhere
else. A reference with one detail changed (ties to even, an exact log2, round-to-nearest-even UE4M3) is seen to
disagree, so the comparisons can fail."""
from __future__ import annotations

from decimal import Decimal, getcontext
from fractions import Fraction as Q
from pathlib import Path

import numpy as np
import pytest

from fp4sim.gguf import ggml_mxfp4_quantize, ggml_nvfp4_quantize
from fp4sim.layout import unpack_fp4

ROOT = Path(__file__).resolve().parents[1]
E2M1 = [Q(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
E2M1 = E2M1 + [-v for v in E2M1]                       # codes 0..15; code 8 is -0, the value 0


def floor_log2(a: Q) -> int:
    """floor(log2 a) of a positive rational, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Q(2) ** e > a:
        e -= 1
    while Q(2) ** (e + 1) <= a:
        e += 1
    return e


def f32(q: Q) -> Q:
    """q rounded to the nearest float32, ties to even (subnormals from 2^-126 down; no overflow in these tests)."""
    if q == 0:
        return Q(0)
    a = abs(q)
    e = max(floor_log2(a), -126)
    ulp = Q(2) ** (e - 23)
    n, r = divmod(a / ulp, 1)
    if r > Q(1, 2) or r == Q(1, 2) and n % 2:
        n += 1
    return (n * ulp) if q > 0 else -(n * ulp)


def log2_f32(a: Q) -> Q:
    """log2 a rounded to float32: the log to 60 digits, then rounded (it is never exactly on a float32 midpoint:
    log2 of a rational that is no power of two is irrational)."""
    getcontext().prec = 60
    d = Decimal(a.numerator).ln() - Decimal(a.denominator).ln()
    return f32(Q(d / Decimal(2).ln()))


def first_nearest(x: Q, cands) -> int:
    """The code the rules choose: the first candidate whose |candidate - x|, rounded to float32, is least."""
    errs = [abs(f32(c - x)) for c in cands]
    return errs.index(min(errs))


def ref_mxfp4_block(xs, exact_log=False, ties_even=False):
    """(codes, scale byte) of one 32-element block under ggml's MXFP4 rule: e = floor(fl32(log2 amax)) - 2 + 127
    (0 for an all-zero block), each element the first nearest E2M1 x 2^(e - 127)."""
    amax = max(abs(v) for v in xs)
    if amax == 0:
        e = 0
    else:
        lg = floor_log2(amax) if exact_log else log2_f32(amax)
        e = int(np.floor(float(lg))) - 2 + 127 if not exact_log else lg - 2 + 127
    scale = Q(2) ** (e - 127)
    cands = [v * scale for v in E2M1]
    codes = []
    for x in xs:
        c = first_nearest(x, cands)
        if ties_even:                                  # the mutant: ties to the even code, -0 for negatives
            errs = [abs(f32(v - x)) for v in cands]
            best = [i for i, er in enumerate(errs) if er == min(errs)]
            c = next((i for i in best if i % 2 == 0 and (i >= 8) == (x < 0)), best[0])
        codes.append(c)
    return codes, e


def ue4m3_ggml(s: Q, rne=False) -> int:
    """ggml's float32 -> UE4M3 byte of a float32 s >= 0, as a rational rule: s clamped to 448; below 2^-6 the
    subnormal trunc(fl32(fl32(s x 512) + 1/2)) at most 7; else s = 2^E (1 + f) keeps m = floor(8 f + 1/2) eighths
    (the fourth bit rounds half up), a carry moving into E, and E + 7 >= 15 gives 448 (0x7E)."""
    s = min(s, Q(448))
    if s <= 0:
        return 0
    E = floor_log2(s)
    if E + 7 <= 0:
        return min(7, int(f32(f32(s * 512) + Q(1, 2))))
    f = s / Q(2) ** E - 1
    if rne:                                            # the mutant: round to nearest, ties to even
        n, r = divmod(8 * f, 1)
        m = int(n + (1 if r > Q(1, 2) or r == Q(1, 2) and n % 2 else 0))
    else:
        m = int((8 * f + Q(1, 2)) // 1)
    if m == 8:
        m, E = 0, E + 1
    if E + 7 >= 15:
        return 0x7E
    return ((E + 7) << 3) | m


def e4m3_value(b: int) -> Q:
    e, m = (b >> 3) & 15, b & 7
    return Q(m, 8) * Q(2) ** -6 if e == 0 else (1 + Q(m, 8)) * Q(2) ** (e - 7)


def ref_nvfp4_sub(xs, rne=False, no_half=False):
    """(codes, scale byte) of one 16-element sub-block under llama.cpp's NVFP4 rule: the byte ue4m3(fl32(amax /
    6)), each element the first nearest E2M1 x E4M3(byte). ``no_half`` is the mutant whose scale is amax / 12
    (the 0.5 factor applied to the scale choice as well as to the stored values)."""
    amax = max(abs(v) for v in xs)
    b = ue4m3_ggml(f32(amax / (12 if no_half else 6)), rne)
    d = e4m3_value(b)
    cands = [v * d for v in E2M1]
    return [first_nearest(x, cands) for x in xs], b


def _by_blocks(x, n, rule, **kw):
    """(codes (rows, K), scale bytes (rows, K / n)) of x under a per-block reference ``rule``."""
    R, K = x.shape
    codes = np.zeros((R, K), np.uint8)
    sc = np.zeros((R, K // n), np.uint8)
    for r in range(R):
        for j in range(K // n):
            c, b = rule([Q(float(v)) for v in x[r, n * j:n * j + n]], **kw)
            codes[r, n * j:n * j + n], sc[r, j] = c, b
    return codes, sc


def _mx_ref(x, **kw):
    return _by_blocks(x, 32, ref_mxfp4_block, **kw)


def _nv_ref(x, **kw):
    return _by_blocks(x, 16, ref_nvfp4_sub, **kw)


def _real():
    z = np.load(ROOT / "fp4sim" / "data" / "sample_dump.npz")
    w = z["minilm.encoder.layer.5.intermediate.dense.weight"]
    return np.ascontiguousarray(w[::97, :128])                          # 16 rows of a real FFN weight


def _mx_edges():
    """Blocks on the MXFP4 rule's ties at three scales, small negatives rounding to zero, an all-zero block, and
    amaxes one to four float32 ulps below powers of two from 2^-3 to 2^12 (where the float32 log2 decides)."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = []
    for e in (-3, 0, 5):
        b = (mids + [-m for m in mids] + [-0.1, -0.2, 0.2, -1e-3, 4.0, 7.9, -7.5, 6.0, 3.0, 0.5, -0.5, 1.0, -1.0,
                                          2.0, -2.0, 0.0, -0.0, 1.5])[:32]
        rows.append(np.float32(np.array(b) * 2.0 ** e))
    rows.append(np.zeros(32, np.float32))
    for k in range(-3, 13):
        b = np.linspace(-1, 1, 32).astype(np.float32) * np.float32(2.0 ** k) / 3
        for u in (1, 2, 4):
            b = b.copy()
            b[5] = np.float32(2.0 ** k)
            for _ in range(u):
                b[5] = np.nextafter(b[5], np.float32(0))
            rows.append(b)
    return np.stack(rows).astype(np.float32)


def _nv_edges():
    """Sub-blocks whose amax / 6 falls on UE4M3's half-up ties (1.0625 x 2^k), just off them, in its subnormals
    (including the trunc(x + 1/2) edge just below 7.5 x 2^-9), from 248 up (448), and on the element ties."""
    rows = []
    base = np.linspace(-1, 1, 16).astype(np.float32)
    for amax6 in (1.0625, 1.0625 * 4, 1.1875 / 8, 1.0625 * (1 + 2 ** -20), 240.0, 247.9, 248.0, 255.9, 300.0,
                  2.0 ** -8, 3.5 / 512, 7.4999 / 512, 7.5 / 512, 7.9 / 512, 2.0 ** -6, 0.0):
        b = base * np.float32(amax6 * 6)
        rows.append(b.astype(np.float32))
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    rows.append(np.concatenate([mids, -mids]).astype(np.float32))
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("case", ["real", "edges"])
def test_ggml_mxfp4_against_its_rational_rule(case):
    x = _real() if case == "real" else _mx_edges()
    codes, scales = ggml_mxfp4_quantize(x)
    rc, rs = _mx_ref(x)
    assert np.array_equal(scales, rs)
    assert np.array_equal(unpack_fp4(codes), rc)


@pytest.mark.parametrize("case", ["real", "edges"])
def test_ggml_nvfp4_against_its_rational_rule(case):
    x = _real() if case == "real" else _nv_edges()
    codes, scales = ggml_nvfp4_quantize(x)
    rc, rs = _nv_ref(x)
    assert np.array_equal(scales, rs)
    assert np.array_equal(unpack_fp4(codes), rc)


def test_the_references_tell_the_rules_from_their_neighbours():
    """One detail changed in a reference makes it disagree with the rule: the exact floor(log2) for the float32
    one (just below 8), ties to even for the first nearest, round-to-nearest-even UE4M3 for ggml's half up, the
    0.5 factor applied to the scale choice."""
    x = _mx_edges()
    codes, scales = ggml_mxfp4_quantize(x)
    assert not np.array_equal(_mx_ref(x, exact_log=True)[1], scales)
    assert not np.array_equal(_mx_ref(x, ties_even=True)[0], unpack_fp4(codes))
    x = _nv_edges()
    codes, scales = ggml_nvfp4_quantize(x)
    assert not np.array_equal(_nv_ref(x, rne=True)[1], scales)
    assert not np.array_equal(_nv_ref(x, no_half=True)[1], scales)
