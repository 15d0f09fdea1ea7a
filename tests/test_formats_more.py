"""The element formats beyond FP4 / OCP FP8: OCP FP6 (E2M3, E3M2) and INT8, E3M4, the FNUZ FP8 formats and IEEE
P3109's binary8pP, against independent oracles.

Coverage (format x oracle):
                   every code decoded     reference (1M, all modes)  gfloat (all modes, SR)  ml_dtypes (RNE)  other
  E2M3, E3M2       ml_dtypes, gfloat      sat / nosat                sat, RNE nosat          in range         CUDA cuda_fp6.h rn, rz; torchao
  E3M4             ml_dtypes, gfloat      sat / nosat                yes                     in range         -
  E4M3FNUZ,        ml_dtypes, gfloat      sat / nosat                yes                     in range         -
  E5M2FNUZ, B11
  INT8             gfloat                 sat                        yes, but -2 (below)     -                -
  binary8p2..p7    gfloat                 sat / nosat                yes                     -                -

gfloat ships OCP FP6, INT8 and P3109; for E3M4 and the FNUZ formats its FormatInfo is built here from their
definition (bias, no -0, NaN at 0x80), and the decode check against ml_dtypes vouches for that definition.
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from conftest import float32_sweep, oracle_missing
from fp4sim.formats import P3109
from fp4sim.reference import elements as ref

NEW = [fs.E2M3, fs.E3M2, fs.E3M4, fs.E4M3FNUZ, fs.E5M2FNUZ, fs.E4M3B11FNUZ, fs.INT8, *P3109]
ML = {"e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn, "e3m4": ml_dtypes.float8_e3m4,
      "e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
      "e4m3b11fnuz": ml_dtypes.float8_e4m3b11fnuz}
MODES = ["rne", "rz", "ru", "rd"]
SMALL = float32_sweep(per_binade=200, seed=4)   # 102k patterns: every exponent and sign, subnormals, specials
ids = {"ids": lambda f: f.name}


def gfloat_info(fmt):
    """gfloat's FormatInfo for ``fmt``."""
    import gfloat.formats as F
    from gfloat import Domain, FormatInfo
    if fmt.name in ("e2m3", "e3m2", "int8"):
        return getattr(F, f"format_info_ocp_{fmt.name}")
    if fmt.name.startswith("binary8p"):
        return F.format_info_p3109(8, int(fmt.name[len("binary8p"):]))
    if fmt.name == "e3m4":     # IEEE-style: Inf at exponent all-ones and mantissa 0, the other 15 codes NaN
        return FormatInfo("e3m4", k=8, precision=5, bias=3, is_signed=True, domain=Domain.Extended, has_nz=True,
                          num_high_nans=15, has_subnormals=True, is_twos_complement=False)
    p, bias = {"e4m3fnuz": (4, 8), "e5m2fnuz": (3, 16), "e4m3b11fnuz": (4, 11)}[fmt.name]
    return FormatInfo(fmt.name, k=8, precision=p, bias=bias, is_signed=True, domain=Domain.Finite, has_nz=False,
                      num_high_nans=0, has_subnormals=True, is_twos_complement=False)


def _diff(got, want, x):
    bad = np.flatnonzero(got.ravel() != want.ravel())
    rows = [f"x={x.ravel()[i]!r} (bits {x.ravel().view(np.uint32)[i]:#010x}) got {got.ravel()[i]:#x} "
            f"want {want.ravel()[i]:#x}" for i in bad[:8]]
    return f"{bad.size} mismatches:\n" + "\n".join(rows)


def _same_values(a, b):
    """Equal float values with equal signs of zero, NaN matching NaN."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (np.isnan(a) & np.isnan(b)) | ((a == b) & (np.signbit(a) == np.signbit(b)))


# ---------------------------------------------------------------------------------------------- definitions
def test_format_properties_from_first_principles():
    """Each format's numbers as the standards and ml_dtypes state them."""
    assert (fs.E2M3.max, fs.E2M3.min_normal, fs.E2M3.min_subnormal, fs.E2M3.bits) == (7.5, 1.0, 0.125, 6)
    assert (fs.E3M2.max, fs.E3M2.min_normal, fs.E3M2.min_subnormal, fs.E3M2.bits) == (28.0, 0.25, 0.0625, 6)
    for fmt, dt in ML.items():
        f, fi = fs.get_format(fmt), ml_dtypes.finfo(dt)
        assert (f.max, f.min_normal, f.min_subnormal, f.eps) == (float(fi.max), float(fi.smallest_normal),
                                                                 float(fi.smallest_subnormal), float(fi.eps)), fmt
    assert (fs.E4M3FNUZ.max, fs.E5M2FNUZ.max, fs.E4M3B11FNUZ.max, fs.E3M4.max) == (240.0, 57344.0, 30.0, 15.5)
    assert [fs.get_format(f"binary8p{p}").bias for p in range(2, 8)] == [32, 16, 8, 4, 2, 1]
    assert (fs.BINARY8P3.max, fs.BINARY8P4.max) == (49152.0, 224.0)
    assert fs.INT8.max == 127 / 64 and fs.INT8.value_of(0x80) == -2.0 and fs.INT8.value_of(0xFF) == -1 / 64
    for f in (fs.E4M3FNUZ, fs.E5M2FNUZ, fs.E4M3B11FNUZ, *P3109):
        assert math.isnan(f.value_of(0x80)) and not f.has_neg_zero           # 0x80 is NaN, not -0
    for f in P3109:
        assert f.value_of(0x7F) == math.inf and f.value_of(0xFF) == -math.inf
    assert all(f.always_saturates for f in (fs.E2M1, fs.E2M3, fs.E3M2, fs.INT8))
    assert not any(f.always_saturates for f in (fs.E3M4, fs.E4M3FNUZ, fs.BINARY8P3))


@pytest.mark.parametrize("fmt", NEW, **ids)
def test_every_code_decodes_as_the_oracles_decode_it(fmt):
    from gfloat import decode_ndarray
    codes = np.arange(fmt.n_codes)
    ours = fs.decode(codes.astype(fmt.code_dtype), fmt)
    assert np.all(_same_values(ours, decode_ndarray(gfloat_info(fmt), codes))), fmt.name
    if fmt.name in ML:
        theirs = codes.astype(np.uint8).view(ML[fmt.name]).astype(np.float32)
        assert np.all(_same_values(ours, theirs)), fmt.name
        assert np.array_equal(ours[~np.isnan(ours)].view(np.uint32), theirs[~np.isnan(theirs)].view(np.uint32))


@pytest.mark.parametrize("fmt", NEW, **ids)
def test_every_finite_code_roundtrips_in_every_mode(fmt):
    codes = np.arange(fmt.n_codes, dtype=fmt.code_dtype)
    vals = fs.decode(codes, fmt)
    fin = np.isfinite(vals)
    if fmt is fs.INT8:
        fin[0x80] = False              # -2 encodes as -1 63/64 (symmetric rule): test_int8_is_symmetric
    for mode in MODES + ["sr"]:
        for sat in ((True,) if mode == "sr" else (True, False)):
            back = fs.encode(vals[fin], fmt, rounding=mode, saturate=sat, **({"seed": 1} if mode == "sr" else {}))
            np.testing.assert_array_equal(back, codes[fin], err_msg=f"{fmt.name} {mode} {sat}")


@pytest.mark.parametrize("fmt", NEW, **ids)
def test_midpoints_and_their_neighbours(fmt):
    """Ties go to the even code (INT8: the even integer) and every directed mode picks its side, for both signs,
    at every midpoint between neighbouring magnitudes and one float32 ulp either side."""
    v = fmt.finite_values
    lo, hi = v[:-1], v[1:]
    mid = ((lo + hi) / 2).astype(np.float32)
    assert np.all(mid.astype(np.float64) == (lo + hi) / 2)
    below, above = np.nextafter(mid, np.float32(-np.inf)), np.nextafter(mid, np.float32(np.inf))
    lo_c = fs.encode(lo.astype(np.float32), fmt).astype(np.int64)
    hi_c = fs.encode(hi.astype(np.float32), fmt).astype(np.int64)
    even = np.where(lo_c % 2 == 0, lo_c, hi_c)
    for sign in (1, -1):
        def signed(c):
            return np.array([fmt.signed_code(int(k), sign < 0) for k in c])
        toward_pos, toward_neg = (hi_c, lo_c) if sign > 0 else (lo_c, hi_c)
        cases = {"rne": [(below, lo_c), (mid, even), (above, hi_c)], "rz": [(x, lo_c) for x in (below, mid, above)],
                 "ru": [(x, toward_pos) for x in (below, mid, above)],
                 "rd": [(x, toward_neg) for x in (below, mid, above)]}
        for mode, pairs in cases.items():
            for x, want in pairs:
                got = fs.encode(sign * x, fmt, rounding=mode)
                np.testing.assert_array_equal(got, signed(want), err_msg=f"{fmt.name} {mode} sign {sign}")


# ------------------------------------------------------------------------------------------ reference sweep
@pytest.mark.parametrize("fmt", NEW, **ids)
def test_against_reference_on_1M_patterns(sweep, fmt):
    r = np.random.default_rng(5).integers(0, 256, sweep.shape, dtype=np.uint8)
    for mode in MODES + ["sr"]:
        for sat in ((True,) if mode == "sr" else (True, False)):
            got = fs.encode(sweep, fmt, rounding=mode, saturate=sat, **({"rbits": r} if mode == "sr" else {}))
            want = ref.encode_array(sweep, fmt, mode, sat, r=r)
            assert np.array_equal(got, want), f"{fmt.name} {mode} sat={sat}: " + _diff(got, want, sweep)


# (the scalar reference vouches for the vectorised one: tests/test_elements.py::test_reference_twins_agree)


# ---------------------------------------------------------------------------------------------------- gfloat
def _gfloat(fmt, x, mode, sat, r=None, n=8):
    from gfloat import RoundMode, round_ndarray
    rm = {"rne": RoundMode.TiesToEven, "rz": RoundMode.TowardZero, "ru": RoundMode.TowardPositive,
          "rd": RoundMode.TowardNegative, "sr": RoundMode.StochasticFastest, "mid": RoundMode.StochasticFast}[mode]
    kw = {"srbits": r.astype(np.int64), "srnumbits": n} if r is not None else {}
    with np.errstate(invalid="ignore"):          # (gfloat casts its NaN results through an integer)
        return round_ndarray(gfloat_info(fmt), x.astype(np.float64), rm, sat=sat, **kw)


def _inputs(fmt):
    """The sweep, without NaN where the format has none (gfloat refuses to round NaN into such a format)."""
    return SMALL if fmt.has_nan else SMALL[~np.isnan(SMALL)]


def _int8_minus_two(fmt, x, theirs):
    """Where gfloat (full two's complement range) gives -2 and fp4sim's symmetric INT8 gives -1 63/64."""
    return (theirs == -2.0) if fmt is fs.INT8 else np.zeros(x.shape, bool)


@pytest.mark.parametrize("fmt", NEW, **ids)
def test_against_gfloat_every_mode_saturating(fmt):
    x = _inputs(fmt)
    for mode in MODES:
        theirs = _gfloat(fmt, x, mode, True)
        ours = fs.decode(fs.encode(x, fmt, rounding=mode, saturate=True), fmt)
        same = _same_values(ours, theirs)
        m2 = _int8_minus_two(fmt, x, theirs)
        assert np.all(same | m2), f"{fmt.name} {mode}: x={x[~(same | m2)][:6]}"
        assert np.all(ours[m2] == -fs.INT8.max)


@pytest.mark.parametrize("fmt", NEW, **ids)
def test_against_gfloat_stochastic_rounding_with_given_bits(fmt):
    """TE's truncating rule is gfloat's StochasticFastest, the midpoint rule its StochasticFast: 8 and 3 bits."""
    x = _inputs(fmt)
    rng = np.random.default_rng(12)
    for n in (8, 3):
        r = rng.integers(0, 1 << n, x.shape, dtype=np.uint8)
        for rule, mapping in (("sr", "te"), ("mid", "midpoint")):
            theirs = _gfloat(fmt, x, rule, True, r, n)
            ours = fs.decode(fs.encode(x, fmt, rounding="sr", rbits=r, sr_bits=n, rbits_mapping=mapping), fmt)
            ok = _same_values(ours, theirs) | _int8_minus_two(fmt, x, theirs)
            assert np.all(ok), f"{fmt.name} {rule} n={n}: x={x[~ok][:6]} r={r[~ok][:6]}"


@pytest.mark.parametrize("fmt", [f for f in NEW if not f.always_saturates], **ids)
def test_against_gfloat_non_saturating(fmt):
    """RNE without saturation is gfloat's exactly (overflow -> Inf, or NaN where the format has no Inf). In the
    directed modes fp4sim calls any value whose rounding lands above the maximum an overflow (docs/formats.md),
    where gfloat follows IEEE 754 (a mode rounding toward zero keeps +-max): the two differ exactly there."""
    x = _inputs(fmt)
    theirs = _gfloat(fmt, x, "rne", False)
    ours = fs.decode(fs.encode(x, fmt, rounding="rne", saturate=False), fmt)
    assert np.all(_same_values(ours, theirs)), f"{fmt.name}: x={x[~_same_values(ours, theirs)][:6]}"
    over = np.inf if fmt.has_inf else np.nan
    for mode in ("rz", "ru", "rd"):
        theirs = _gfloat(fmt, x, mode, False)
        ours = fs.decode(fs.encode(x, fmt, rounding=mode, saturate=False), fmt)
        diff = ~_same_values(ours, theirs)
        assert diff.any()
        xd = x[diff].astype(np.float64)
        assert np.all(np.isfinite(xd) & (np.abs(xd) > fmt.max)), fmt.name
        assert np.all(np.abs(theirs[diff]) == fmt.max) and np.all(np.sign(theirs[diff]) == np.sign(xd))
        assert np.all(_same_values(ours[diff], np.copysign(over, xd) if fmt.has_inf else over))


# ------------------------------------------------------------------------------------------------- ml_dtypes
@pytest.mark.parametrize("fmt", [fs.get_format(n) for n in ML], **ids)
def test_against_ml_dtypes_in_range(sweep, fmt):
    """ml_dtypes' casts (RNE) wherever |x| <= max; beyond it ml_dtypes gives NaN (FNUZ), Inf (E3M4) or saturates
    (FP6), as fp4sim does with saturate=False / True."""
    x = sweep[np.isfinite(sweep) & (np.abs(sweep) <= fmt.max)]
    got = fs.encode(x, fmt)
    want = x.astype(ML[fmt.name]).view(np.uint8)
    assert np.array_equal(got, want), _diff(got, want, x)
    big = sweep[np.isfinite(sweep) & (np.abs(sweep) > fmt.max * 1.07)]
    want = big.astype(ML[fmt.name]).view(np.uint8)
    got = fs.encode(big, fmt, saturate=fmt.always_saturates)
    assert np.array_equal(got, want), _diff(got, want, big)


def test_nan_and_zero_rules_where_the_oracles_part_ways():
    """NaN into a format without NaN gives +max, as cuda_fp6.h / cuda_fp4.h do (ml_dtypes gives -0 for FP6,
    gfloat refuses); -0 and results that round to zero are +0 where the format has no -0."""
    nan = np.array([np.nan, -np.nan], np.float32)
    for fmt in (fs.E2M3, fs.E3M2, fs.INT8):
        assert fs.encode(nan, fmt).tolist() == [fmt.max_code] * 2
    assert set(nan.astype(ml_dtypes.float6_e2m3fn).view(np.uint8).tolist()) <= {0x00, 0x20}   # a zero
    tiny = np.array([-0.0, -1e-30, -2.0**-149], np.float32)
    for fmt in (fs.E4M3FNUZ, fs.E5M2FNUZ, fs.E4M3B11FNUZ, fs.INT8, *P3109):
        assert fs.encode(tiny, fmt).tolist() == [0, 0, 0], fmt.name
        assert fs.encode(tiny, fmt, rounding="rd").tolist()[1:] == [fmt.signed_code(1, True)] * 2
        assert fs.encode(nan, fmt).tolist() == [fmt.nan_code if fmt.has_nan else fmt.max_code] * 2
    for fmt in (fs.E2M3, fs.E3M2, fs.E3M4):
        assert fs.encode(tiny[:1], fmt).tolist() == [fmt.sign_mask]                   # these keep -0


def test_int8_is_symmetric():
    """OCP MXINT8's INT8 is two's complement with an implicit 2^-6, so 0x80 decodes to -2; the MX specification's
    reference (and fp4sim) quantize symmetrically, clamping to +-1 63/64, so no encode gives 0x80."""
    x = np.array([-2.0, -1.99, -1.984375, -1.9921875, -3.0, -np.inf, 2.0, np.inf, 1.0, -1.0, 0.5, -1 / 64],
                 np.float32)
    assert fs.encode(x, fs.INT8).tolist() == [0x81, 0x81, 0x81, 0x81, 0x81, 0x81, 0x7F, 0x7F, 0x40, 0xC0, 0x20, 0xFF]
    for mode in MODES:
        assert 0x80 not in fs.encode(SMALL, fs.INT8, rounding=mode, saturate=False)
    assert fs.decode(np.array([0x80, 0x81, 0x7F], np.uint8), fs.INT8).tolist() == [-2.0, -127 / 64, 127 / 64]
    # codes are int8 values: a NumPy int8 view times 2^-6 is the decode
    c = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(fs.decode(c, fs.INT8), c.view(np.int8).astype(np.float32) / 64)


# ---------------------------------------------------------------------------------------- CUDA and torchao
def test_fp6_against_cuda_host_conversions(sweep, cuda_convert):
    """cuda_fp6.h's __nv_cvt_float_to_fp6 (round-to-nearest and toward zero, satfinite, NaN -> +max)."""
    cu = cuda_convert(sweep)
    for fmt in (fs.E2M3, fs.E3M2):
        for mode, tag in (("rne", "rn"), ("rz", "rz")):
            got = fs.encode(sweep, fmt, rounding=mode)
            want = cu[f"{fmt.name}_{tag}"]
            assert np.array_equal(got, want), f"{fmt.name} {mode}: " + _diff(got, want, sweep)


def test_fp6_against_torchao():
    """torchao's FP6 rounding (_f32_to_floatx_unpacked, RNE, saturating; no NaN handling) on finite values."""
    try:
        import torch
        from torchao.prototype.custom_fp_utils import _f32_to_floatx_unpacked
    except ImportError as e:
        oracle_missing(f"torchao is not installed ({e}): pip install '.[test]'")
    x = SMALL[np.isfinite(SMALL)]
    for fmt in (fs.E2M3, fs.E3M2):
        want = _f32_to_floatx_unpacked(torch.from_numpy(x.copy()), fmt.ebits, fmt.mbits).numpy()
        got = fs.encode(x, fmt)
        assert np.array_equal(got, want), _diff(got, want, x)


# ---------------------------------------------------------------------------------------------------- errors
def test_a_format_name_that_does_not_exist_lists_the_known_ones():
    with pytest.raises(ValueError, match="e2m3.*int8") as e:
        fs.get_format("e2m4")
    assert "binary8p3" in str(e.value) and "e4m3fnuz" in str(e.value)
    assert fs.get_format("float8_e4m3fnuz") is fs.E4M3FNUZ and fs.get_format("FLOAT6_E3M2FN") is fs.E3M2
    assert fs.get_format("p3109_k8p4se") is fs.BINARY8P4
    for f in NEW:
        assert fs.get_format(f.name) is f
    with pytest.raises(ValueError, match="outside 0..63"):
        fs.decode(np.array([64], np.uint8), fs.E2M3)
    with pytest.raises(ValueError, match="saturate=False"):
        fs.encode(np.ones(2, np.float32), fs.E4M3FNUZ, rounding="sr", seed=1, saturate=False)
    # formats without Inf or NaN always saturate, so SR with saturate=False is the same call
    np.testing.assert_array_equal(fs.encode(np.full(4, 9.0, np.float32), fs.E2M3, rounding="sr", seed=1,
                                            saturate=False), [0x1F] * 4)


# ----------------------------------------------------------------------------------------- MX block schemes
def _mx_cases(fmt):
    """Rows of 32-element blocks: real-looking values, midpoints of the element grid at several scales (ties),
    all-zero and all-equal blocks, power-of-two amaxes, float32 subnormals (scales clamped at 2^-127) and values
    near float32's top (scale bytes near 254)."""
    from blockcases import heavy
    rng = np.random.default_rng(21)
    rows = [heavy((4, 256), 3).reshape(-1, 32)]
    v = fmt.finite_values
    mids = np.concatenate([v, (v[:-1] + v[1:]) / 2])
    for k in (-3, 0, 5):
        blk = rng.choice(mids, (4, 32)) * rng.choice([-1, 1], (4, 32)) * 2.0**k
        blk[:, 0] = fmt.max * 2.0**k                      # the amax on the grid's top: scale 2^k
        rows.append(blk)
    rows += [np.zeros((1, 32)), np.full((1, 32), 3.3), np.full((1, 32), -0.7),
             rng.standard_normal((2, 32)) * 1e-39, rng.uniform(-3.4e38, 3.4e38, (2, 32)),
             np.concatenate([[2.0**-126], rng.standard_normal(31) * 1e-3])[None]]
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("fmt", [fs.E2M3, fs.E3M2, fs.INT8], **ids)
def test_mx_schemes_against_gfloat_blocks(fmt):
    """MXFP6 and MXINT8 with the OCP specification's scale (X = 2^(floor(log2 amax) - emax_elem), the "floor"
    mode) against gfloat's MX encoder: its compute_scale_amax and encode_block (RNE, saturating) for every block,
    scale byte and element codes; and fs.dequantize against gfloat's decode_block. INT8's one difference is
    gfloat's -2 (test_int8_is_symmetric)."""
    from gfloat import RoundMode, encode_block, decode_block
    from gfloat.block import compute_scale_amax
    from gfloat.formats import format_info_mxfp6_e2m3, format_info_mxfp6_e3m2, format_info_mxint8
    bfi = {"e2m3": format_info_mxfp6_e2m3, "e3m2": format_info_mxfp6_e3m2, "int8": format_info_mxint8}[fmt.name]
    x = _mx_cases(fmt)
    q = fs.quantize(x, fs.schemes.MX_ELEMS[fmt], scale_mode="floor")
    assert q.codes.shape == x.shape and q.scales.shape == (x.shape[0], 1)
    deq = fs.dequantize(q)
    for i, blk in enumerate(x.astype(np.float64)):
        scale = compute_scale_amax(bfi.etype.emax, blk)
        enc = list(encode_block(bfi, scale, blk / scale, RoundMode.TiesToEven))
        assert q.scales[i, 0] == enc[0], (i, blk[:4])
        want = np.array(enc[1:])
        if fmt is fs.INT8:
            want = np.where(want == 0x80, 0x81, want)                   # gfloat's -2, fp4sim's -1 63/64
        np.testing.assert_array_equal(q.codes[i], want, err_msg=f"block {i}")
        theirs = np.fromiter(decode_block(bfi, [int(q.scales[i, 0]), *map(int, q.codes[i])]), float)
        assert np.all(_same_values(deq[i], theirs.astype(np.float32))), i
    assert np.any(q.codes == fmt.max_code) and np.any(q.scales == 0) and np.any(q.scales >= 250)


def test_fp6_packing_against_compressed_tensors_and_known_bytes():
    """pack_fp6 / unpack_fp6: little-endian is compressed-tensors' mxfp6-pack-quantized packing (its own
    pack_fp6_to_uint8 on the decoded values, and back through its unpack); both orders by bytes worked out by
    hand; a length that is not a multiple of 3 bytes (or 4 codes) is named."""
    from fp4sim.layout import pack_fp6, unpack_fp6
    c = np.random.default_rng(3).integers(0, 64, (6, 64), dtype=np.uint8)
    try:
        import torch
        from compressed_tensors.compressors.mxfp6.helpers import pack_fp6_to_uint8, unpack_fp6_from_uint8
    except ImportError as e:
        oracle_missing(f"compressed-tensors is not installed ({e}): pip install '.[test]'")
    vals = fs.decode(c, fs.E2M3)
    theirs = pack_fp6_to_uint8(torch.from_numpy(vals)).numpy()
    np.testing.assert_array_equal(pack_fp6(c), theirs)
    np.testing.assert_array_equal(unpack_fp6(theirs), c)
    back = unpack_fp6_from_uint8(torch.from_numpy(pack_fp6(c)), 6, 64, torch.float32).numpy()
    assert np.all(_same_values(back, vals))
    one = np.array([0x3F, 0x01, 0x20, 0x15], np.uint8)
    # little: word = 0x3F | 0x01 << 6 | 0x20 << 12 | 0x15 << 18 = 0x3F + 0x40 + 0x20000 + 0x540000 = 0x56007F
    assert pack_fp6(one).tolist() == [0x7F, 0x00, 0x56]
    # big: 111111 000001 100000 010101 -> 11111100 00011000 00010101
    assert pack_fp6(one, order="big").tolist() == [0xFC, 0x18, 0x15]
    np.testing.assert_array_equal(unpack_fp6(pack_fp6(c, "big"), "big"), c)
    with pytest.raises(ValueError, match="multiple of 3"):
        unpack_fp6(np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_fp6(np.zeros(6, np.uint8))
    with pytest.raises(ValueError, match="above 63"):
        pack_fp6(np.full(4, 64, np.uint8))
    with pytest.raises(ValueError, match="order="):
        pack_fp6(one, order="middle")


def test_mx_element_errors_and_nan_warning():
    with pytest.raises(ValueError, match="mxfp6_e2m3"):
        fs.schemes.MX(fs.E4M3FNUZ)
    x = np.ones((1, 32), np.float32)
    x[0, 3] = np.nan
    for name, fmt in (("mxfp6_e2m3", fs.E2M3), ("mxint8", fs.INT8)):
        with pytest.warns(RuntimeWarning, match=f"{fmt.name.upper()} has no NaN, so it encodes as"):
            q = fs.quantize(x, name)
        assert q.codes[0, 3] == fmt.max_code


def test_analyze_takes_the_mx_formats():
    """analyze's scheme columns mxfp6_e2m3, mxfp6_e3m2 and mxint8: the error sums are those of fake_quantize (checked
    against torchao and gfloat above), an exactly representable MXINT8 tensor has no error at all."""
    from blockcases import heavy
    from fp4sim.analyze.metrics import SCHEMES_BY_LABEL, scheme_metrics
    x = heavy((64, 96), 8)
    for label in ("mxfp6_e2m3", "mxfp6_e3m2", "mxint8"):
        m, _, _ = scheme_metrics(x, SCHEMES_BY_LABEL[label], "weight")
        err = fs.fake_quantize(x, label).astype(np.float64) - x.astype(np.float64)
        assert m["mse"] == pytest.approx(np.mean(err**2), rel=1e-12) and m["max_abs_err"] == np.abs(err).max()
    k = np.random.default_rng(1).integers(-127, 128, (8, 64))
    k[:, ::32] = 127                                     # every block's amax on INT8's top: scale 2^0 under floor
    exact = (k / 64.0 * 2.0 ** np.random.default_rng(2).integers(-4, 4, (8, 1))).astype(np.float32)
    m, _, _ = scheme_metrics(exact, dataclasses.replace(SCHEMES_BY_LABEL["mxint8"], kwargs={"scale_mode": "floor"}),
                             "weight")
    assert m["mse"] == 0 and m["sqnr_db"] == np.inf


# ------------------------------------------------------------------------------------------------- validate
def test_validate_checks_mxfp6_mxint8_and_fnuz_kernel_outputs(tmp_path):
    """fp4sim.validate on the new formats: MXFP6 codes one per byte or packed four to three bytes (the little-endian
    order exact, the big-endian one named by the diagnosis); an MXINT8 kernel that rounds half away from zero (the
    MX specification's reference rounding, computed here in float64 with NumPy) named as such; FNUZ FP8 per-tensor
    codes given as an ml_dtypes array; the command line on a packed FP6 file."""
    import subprocess
    import sys
    from fp4sim.layout import pack_fp6
    from fp4sim.validate import compare
    rng = np.random.default_rng(50)
    x = (rng.standard_normal((8, 128)) * 3).astype(np.float32)
    q = fs.quantize(x, "mxfp6_e2m3")
    assert compare(x, q.codes, q.scales, "mxfp6_e2m3").verdict == "exact"
    assert compare(x, pack_fp6(q.codes), q.scales, "mxfp6_e2m3").verdict == "exact"
    rep = compare(x, pack_fp6(q.codes, "big"), q.scales, "mxfp6_e2m3")
    assert rep.verdict == "mismatch" and "big-endian" in rep.diagnosis["best"]["label"]
    assert rep.diagnosis["best"]["code_mismatches"] == 0
    with pytest.raises(ValueError, match="packed four codes to three"):
        compare(x, pack_fp6(q.codes)[:, :-3], q.scales, "mxfp6_e2m3")
    # MXINT8 rounding half away from zero: exact ties on the 1/64 lattice of each block's scale
    xi = (np.round(x * 64) / 64).astype(np.float64)
    xi[:, ::7] += np.sign(xi[:, ::7]) / 128
    xi = xi.astype(np.float32)
    qi = fs.quantize(xi, "mxint8")
    v = xi.astype(np.float64) / np.exp2(np.repeat(qi.scales.astype(np.int64) - 127, 32, axis=1))
    k = np.clip(np.sign(v) * np.floor(np.abs(v) * 64 + 0.5), -127, 127).astype(np.int64)
    rep = compare(xi, (k % 256).astype(np.uint8), qi.scales, "mxint8")
    assert rep.verdict == "mismatch" and rep.code_mismatches > 0
    assert "ties away from zero" in rep.diagnosis["best"]["label"] and rep.diagnosis["best"]["code_mismatches"] == 0
    xf = (rng.standard_normal((4, 64)) * 30).astype(np.float32)
    qf = fs.quantize(xf, "fp8_e4m3fnuz")
    assert compare(xf, qf.codes.view(ml_dtypes.float8_e4m3fnuz), qf.scales, "fp8_e4m3fnuz").verdict == "exact"
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "c.npy", pack_fp6(q.codes))
    np.save(tmp_path / "s.npy", q.scales)
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "--scheme", "mxfp6_e2m3", "--input",
                        str(tmp_path / "x.npy"), "--codes", str(tmp_path / "c.npy"), "--scales",
                        str(tmp_path / "s.npy")], capture_output=True, text=True)
    assert r.returncode == 0 and "EXACT" in r.stdout and "0 of 1024 differ" in r.stdout, r.stdout + r.stderr
