"""Element encode/decode against independent oracles.

Coverage matrix (format x oracle):
                    exhaustive codes  midpoints  reference (1M)  CUDA host (1M)       ml_dtypes   gfloat (SR)
  E2M1              yes               yes        all modes       rn, rz               rne finite  sr
  E4M3              yes               yes        all modes       sat, nosat           rne <=464   -
  E5M2              yes               yes        all modes       sat, nosat           rne <61440  -
  UE8M0             yes               yes        rz, rp, rne     rz, rp x sat, nosat  -           -
  BF16              yes               yes        all modes       rn, rz, ru, rd       rne         -
"""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim.reference import elements as ref

SIGNED = [fs.E2M1, fs.E4M3, fs.E5M2, fs.BF16]
MODES = ["rne", "rz", "ru", "rd"]


def _diff(got, want, x):
    """Readable first mismatches for an assertion message."""
    bad = np.flatnonzero(got.ravel() != want.ravel())
    rows = [f"x={x.ravel()[i]!r} (bits {x.ravel().view(np.uint32)[i]:#010x}) got {got.ravel()[i]:#x} "
            f"want {want.ravel()[i]:#x}" for i in bad[:8]]
    return f"{bad.size} mismatches:\n" + "\n".join(rows)


# ---------------------------------------------------------------------------------------------- formats
def test_format_properties_from_first_principles():
    assert (fs.E2M1.max, fs.E2M1.min_normal, fs.E2M1.min_subnormal) == (6.0, 1.0, 0.5)
    assert (fs.E4M3.max, fs.E4M3.min_normal, fs.E4M3.min_subnormal) == (448.0, 2.0**-6, 2.0**-9)
    assert (fs.E5M2.max, fs.E5M2.min_normal, fs.E5M2.min_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert fs.UE8M0.max == 2.0**127 and fs.UE8M0.value_of(0) == 2.0**-127 and math.isnan(fs.UE8M0.value_of(255))
    assert fs.BF16.max == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert list(fs.E2M1.values[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(fs.E2M1.values[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # value tables agree with ml_dtypes' own decoding of every code
    for fmt, dt in [(fs.E2M1, ml_dtypes.float4_e2m1fn), (fs.E4M3, ml_dtypes.float8_e4m3fn),
                    (fs.E5M2, ml_dtypes.float8_e5m2), (fs.UE8M0, ml_dtypes.float8_e8m0fnu)]:
        codes = np.arange(fmt.n_codes, dtype=np.uint8)
        theirs = codes.view(dt).astype(np.float32)
        np.testing.assert_array_equal(fs.decode(codes, fmt), theirs)
    codes = np.arange(1 << 16, dtype=np.uint16)
    np.testing.assert_array_equal(fs.decode(codes, fs.BF16), codes.view(ml_dtypes.bfloat16).astype(np.float32))


# --------------------------------------------------------------------------------- exhaustive / midpoints
@pytest.mark.parametrize("fmt", SIGNED + [fs.UE8M0], ids=lambda f: f.name)
@pytest.mark.parametrize("saturate", [True, False])
def test_every_finite_code_roundtrips_in_every_mode(fmt, saturate):
    codes = np.arange(fmt.n_codes, dtype=fmt.code_dtype)
    vals = fs.decode(codes, fmt)
    fin = np.isfinite(vals)
    modes = MODES + (["sr"] if fmt is not fs.UE8M0 else [])
    for mode in modes:
        if mode == "sr" and not saturate:
            continue
        kw = {"seed": 1} if mode == "sr" else {}
        back = fs.encode(vals[fin], fmt, rounding=mode, saturate=saturate, **kw)
        np.testing.assert_array_equal(back, codes[fin], err_msg=f"{fmt.name} {mode}")


def test_e2m1_sr_kernel_path_equals_the_generic_encoder():
    """NVFP4's SR inner loop (cpu.elements.e2m1_sr, arithmetic on the bits) against the generic integer encoder (checked
    exhaustively above and against the reference): every grid point and midpoint +-300 ulps with every random
    byte, random values with random bytes, specials; nsr 8, 3 and 1."""
    import numba as nb
    from fp4sim.cpu.elements import e2m1_sr, sr_consts

    @nb.njit
    def loop(x, r, nsr, out):
        sc, n32 = sr_consts(nsr)
        for i in range(x.shape[0]):
            out[i] = e2m1_sr(x[i], np.int32(r[i]), sc, n32)

    g = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 12], np.float32)
    u = g.view(np.int32)[:, None] + np.arange(-300, 301, dtype=np.int32)[None, :]
    edge = np.unique(u[u >= 0]).view(np.float32)
    rng = np.random.default_rng(3)
    specials = np.concatenate([np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, np.inf, -np.inf, np.nan, 3e38, -3e38],
                                        np.float32),
                               np.array([0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)])
    for nsr in (8, 3, 1):
        rs = np.arange(1 << nsr, dtype=np.uint8)
        x = np.concatenate([np.repeat(np.concatenate([edge, -edge, specials]), rs.size),
                            (rng.standard_normal(200_000) * 3).astype(np.float32)])
        r = np.concatenate([np.tile(rs, 2 * edge.size + specials.size),
                            rng.integers(0, 1 << nsr, 200_000).astype(np.uint8)])
        got = np.empty(x.size, np.int32)
        loop(x, r, nsr, got)
        want = fs.encode(x, fs.E2M1, rounding="sr", rbits=r, sr_bits=nsr, _generic=True)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (nsr, x[bad[:5]], r[bad[:5]], got[bad[:5]], want[bad[:5]])


def _neighbour_pairs(fmt):
    v = fmt.finite_values
    return v[:-1], v[1:]


@pytest.mark.parametrize("fmt", SIGNED, ids=lambda f: f.name)
def test_midpoints_and_their_neighbours(fmt):
    lo, hi = _neighbour_pairs(fmt)
    mid = ((lo + hi) / 2).astype(np.float32)
    assert np.all(mid.astype(np.float64) == (lo + hi) / 2), "midpoints must be exact in float32"
    below = np.nextafter(mid, np.float32(-np.inf))
    above = np.nextafter(mid, np.float32(np.inf))
    lo_c = fs.encode(lo.astype(np.float32), fmt)
    hi_c = fs.encode(hi.astype(np.float32), fmt)
    even = np.where(lo_c % 2 == 0, lo_c, hi_c)
    for sign in (1, -1):
        sbit = fmt.sign_mask if sign < 0 else 0
        cases = {
            "rne": [(below, lo_c), (mid, even), (above, hi_c)],
            "rz": [(below, lo_c), (mid, lo_c), (above, lo_c)],
            "ru": [(below, hi_c if sign > 0 else lo_c), (mid, hi_c if sign > 0 else lo_c),
                   (above, hi_c if sign > 0 else lo_c)],
            "rd": [(below, lo_c if sign > 0 else hi_c), (mid, lo_c if sign > 0 else hi_c),
                   (above, lo_c if sign > 0 else hi_c)],
        }
        for mode, triples in cases.items():
            for x, want in triples:
                got = fs.encode(sign * x, fmt, rounding=mode)
                np.testing.assert_array_equal(got, want | sbit, err_msg=f"{fmt.name} {mode} sign {sign}")


def test_ue8m0_midpoints_and_binade_edges():
    e = np.arange(1, 254)
    p = (2.0 ** (e - 127)).astype(np.float32)
    up = np.nextafter(p, np.float32(np.inf))
    dn = np.nextafter(p, np.float32(0))
    np.testing.assert_array_equal(fs.encode(p, fs.UE8M0, rounding="rz"), e)
    np.testing.assert_array_equal(fs.encode(p, fs.UE8M0, rounding="rp"), e)
    np.testing.assert_array_equal(fs.encode(up, fs.UE8M0, rounding="rz"), e)
    np.testing.assert_array_equal(fs.encode(up, fs.UE8M0, rounding="rp"), e + 1)
    np.testing.assert_array_equal(fs.encode(dn, fs.UE8M0, rounding="rz"), e - 1)
    np.testing.assert_array_equal(fs.encode(dn, fs.UE8M0, rounding="rp"), e)
    mid = (1.5 * p).astype(np.float32)  # halfway between 2^e and 2^(e+1): ties to the even code
    np.testing.assert_array_equal(fs.encode(mid, fs.UE8M0, rounding="rne"), np.where(e % 2 == 0, e, e + 1))
    # SPEC §1.4 example: log2-based code is off by one binade here
    a = np.float32(96.0000076) * np.float32(1 / 6)  # 16.0000013: just above 2^4
    assert fs.encode(a, fs.UE8M0, rounding="rp") == 132 and fs.encode(a, fs.UE8M0, rounding="rz") == 131


# ------------------------------------------------------------------------------------------ reference sweep
@pytest.mark.parametrize("fmt", SIGNED, ids=lambda f: f.name)
@pytest.mark.parametrize("mode,saturate", [(m, s) for m in MODES for s in (True, False)] + [("sr", True)])
def test_against_reference_on_1M_patterns(sweep, fmt, saturate, mode):
    # (SR with saturate=False raises: tested in test_errors)
    kw, r = {}, None
    if mode == "sr":
        r = np.random.default_rng(5).integers(0, 256, sweep.shape, dtype=np.uint8)
        kw = {"rbits": r}
    got = fs.encode(sweep, fmt, rounding=mode, saturate=saturate, **kw)
    want = ref.encode_array(sweep, fmt, mode, saturate, r=r)
    assert np.array_equal(got, want), _diff(got, want, sweep)


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("mode", ["rz", "rp", "rne"])
def test_ue8m0_against_reference(sweep, saturate, mode):
    sub = sweep[::37]  # the scalar reference is slow; every exponent field is still covered
    got = fs.encode(sub, fs.UE8M0, rounding=mode, saturate=saturate)
    want = np.array([ref.ue8m0_scalar(float(v), mode, saturate) for v in sub], dtype=np.uint8)
    assert np.array_equal(got, want), _diff(got, want, sub)


@pytest.mark.parametrize("fmt", SIGNED + [f for f in fs.FORMATS.values() if f not in SIGNED and f.bits <= 8 and f.signed],
                         ids=lambda f: f.name)
def test_reference_twins_agree(sweep, fmt):
    """The exact scalar reference (fractions) vouches for its vectorised twin used on 1M patterns."""
    sub = sweep[:: 331]
    r = np.random.default_rng(9).integers(0, 256, sub.shape, dtype=np.uint8)
    for mode in MODES + ["sr"]:
        for sat in (True, False):
            vec = ref.encode_array(sub, fmt, mode, sat, r=r)
            sca = [ref.encode_scalar(float(v), fmt, mode, sat, int(rr)) for v, rr in zip(sub, r)]
            assert list(vec) == sca, f"{fmt.name} {mode} sat={sat}"


# ---------------------------------------------------------------------------------------------- CUDA host
def test_against_cuda_host_conversions(sweep, cuda_convert):
    cu = cuda_convert(sweep)
    checks = {
        "e2m1_rn": fs.encode(sweep, fs.E2M1, "rne"),
        "e2m1_rz": fs.encode(sweep, fs.E2M1, "rz"),
        "e4m3_sat": fs.encode(sweep, fs.E4M3, "rne", saturate=True),
        "e4m3_nosat": fs.encode(sweep, fs.E4M3, "rne", saturate=False),
        "e5m2_sat": fs.encode(sweep, fs.E5M2, "rne", saturate=True),
        "e5m2_nosat": fs.encode(sweep, fs.E5M2, "rne", saturate=False),
        "e8m0_rz_sat": fs.encode(sweep, fs.UE8M0, "rz", saturate=True),
        "e8m0_rp_sat": fs.encode(sweep, fs.UE8M0, "rp", saturate=True),
        "e8m0_rz_nosat": fs.encode(sweep, fs.UE8M0, "rz", saturate=False),
        "e8m0_rp_nosat": fs.encode(sweep, fs.UE8M0, "rp", saturate=False),
    }
    for mode in ("rn", "rz", "ru", "rd"):
        got = fs.encode(sweep, fs.BF16, "rne" if mode == "rn" else mode, saturate=False)
        # CUDA keeps NaN as NaN but not canonical payload for every mode; compare NaN-ness for NaN inputs
        nan = np.isnan(sweep)
        want = cu[f"bf16_{mode}"]
        assert np.array_equal(got[~nan], want[~nan]), _diff(got[~nan], want[~nan], sweep[~nan])
        assert np.all((want[nan] & 0x7FFF) > 0x7F80)
        assert np.all(got[nan] == 0x7FFF)
    for name, got in checks.items():
        assert np.array_equal(got, cu[name]), f"{name}: " + _diff(got, cu[name], sweep)


def test_cuda_bf16_rn_nan_is_canonical(cuda_convert):
    x = np.array([np.nan, -np.nan], dtype=np.float32)
    assert list(cuda_convert(x)["bf16_rn"]) == list(fs.encode(x, fs.BF16))


# ------------------------------------------------------------------------------------------------ ml_dtypes
@pytest.mark.parametrize("fmt,dt,limit", [
    (fs.E2M1, ml_dtypes.float4_e2m1fn, np.inf),       # ml_dtypes saturates E2M1 too, but NaN -> -0/+0
    (fs.E4M3, ml_dtypes.float8_e4m3fn, 464.0),        # ml_dtypes: overflow -> NaN (fp4sim: 448, satfinite)
    (fs.E5M2, ml_dtypes.float8_e5m2, 61440.0),        # beyond: both Inf with saturate=False
    (fs.BF16, ml_dtypes.bfloat16, np.inf),
], ids=["e2m1", "e4m3", "e5m2", "bf16"])
def test_against_ml_dtypes_finite_in_range(sweep, fmt, dt, limit):
    x = sweep[np.isfinite(sweep) & (np.abs(sweep) <= limit) if np.isfinite(limit) else np.isfinite(sweep)]
    if fmt is fs.E5M2:
        x = x[np.abs(x) < limit]
    got = fs.encode(x, fmt, saturate=fmt is fs.E2M1)
    want = x.astype(dt).view(fmt.code_dtype)
    assert np.array_equal(got, want), _diff(got, want, x)


def test_ml_dtypes_differences_are_the_documented_ones():
    """Where ml_dtypes and SPEC §1.2 part ways, by design."""
    assert fs.encode(np.float32(np.nan), fs.E2M1) == 0x7  # ml_dtypes: signed zero
    assert np.float32(np.nan).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) in (0x0, 0x8)
    assert fs.encode(np.float32(500.0), fs.E4M3) == 0x7E  # ml_dtypes: NaN
    assert np.isnan(np.float32(500.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert fs.encode(np.float32(500.0), fs.E4M3, saturate=False) == 0x7F


# -------------------------------------------------------------------------------------- stochastic rounding
def test_philox_known_answers():
    from fp4sim.rng import philox4x32_10
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for c, k, want in kat:
        assert tuple(int(v) for v in philox4x32_10(c, k)) == want


def test_philox_byte_stream_matches_pure_python_reference():
    from fp4sim.reference.philox import philox_bytes_ref
    from fp4sim.rng import philox_bytes
    for seed, stream, start in [(0, 0, 0), (0x123456789ABCDEF0, 7, 2**36 + 16 * 1000), (2**64 - 1, 2**32 - 1, 16)]:
        got = philox_bytes(seed, 203, stream=stream, start=start)
        want = philox_bytes_ref(seed, range(start, start + 203), stream)
        assert list(got) == want


def test_in_kernel_philox_rows_and_columns_match_the_pure_python_reference():
    """The quantize kernels' own Philox bytes (rng.philox_bytes_row / philox_bytes_cols, which replace the
    tensor-sized byte array): ranges starting and ending inside a 16-element block, inside one block, at a
    byte offset that is not a word boundary (the path that cannot write whole words), 2**32-crossing block
    counters and masks; columns of a strided block axis."""
    import numba as nb
    from fp4sim.reference.philox import philox_bytes_ref
    from fp4sim.rng import philox_bytes_cols, philox_bytes_row, seed_key

    @nb.njit
    def row(out, base, n, k0, k1, stream, mask):
        philox_bytes_row(out, base, n, k0, k1, stream, mask)

    @nb.njit
    def cols(out, base, stride, n, k0, k1, stream, mask):
        philox_bytes_cols(out, base, stride, n, k0, k1, stream, mask)

    for seed, stream in [(0, 0), (0x123456789ABCDEF0, 7), (2**64 - 1, 2**32 - 1)]:
        k0, k1 = (np.uint64(k) for k in seed_key(seed))
        for base, n in [(0, 64), (16, 33), (3, 5), (5, 11), (7, 100), (2, 30), (12, 4), (2**36 - 5, 40),
                        (16 * (2**32 - 1), 48), (1, 1), (0, 15)]:
            for nsr in (8, 3):
                out = np.full(n + 2, 0xAB, np.uint8)
                row(out[1:n + 1], base, n, k0, k1, np.uint64(stream), np.uint8((1 << nsr) - 1))
                want = [b & ((1 << nsr) - 1) for b in philox_bytes_ref(seed, range(base, base + n), stream)]
                assert list(out[1:n + 1]) == want, (seed, base, n, nsr)
                assert out[0] == out[-1] == 0xAB                  # nothing written outside the range
        for base, stride, n in [(0, 16, 5), (32, 48, 7), (16 * 2**32, 16 * 3, 4)]:
            out = np.zeros((16, n), np.uint8)
            cols(out, base, stride, n, k0, k1, np.uint64(stream), np.uint8(0x1F))
            want = np.array([philox_bytes_ref(seed, [base + k * stride + t for k in range(n)], stream)
                             for t in range(16)]) & 0x1F
            np.testing.assert_array_equal(out, want)


def test_sr_exact_expectation_by_enumerating_all_rbits():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(300) * 3, rng.standard_normal(100) * 0.3, [0.1, 5.9, -5.99, 7.0]])
    x = x.astype(np.float32)
    grid = fs.E2M1.finite_values
    r = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, x.size)).copy()
    xx = np.broadcast_to(x, (256, x.size)).copy()
    vals = fs.decode(fs.encode(xx, fs.E2M1, rounding="sr", rbits=r), fs.E2M1).astype(np.float64)
    mean = vals.mean(axis=0)
    for i, v in enumerate(x):
        m = Fraction(float(abs(v)))
        if m >= 6:
            want = Fraction(6)
        else:
            lo = max(Fraction(float(g)) for g in grid if g <= m)
            hi = min(Fraction(float(g)) for g in grid if g > m)
            want = lo + (hi - lo) * math.floor((m - lo) / (hi - lo) * 256) / 256
        want = -want if v < 0 else want
        assert Fraction(mean[i]) * 256 == want * 256, (v, mean[i], float(want))


def test_sr_matches_gfloat_stochastic_fastest():
    from gfloat import RoundMode, round_ndarray
    from gfloat.formats import format_info_ocp_e2m1
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(20000) * np.exp(rng.standard_normal(20000))).astype(np.float32)
    r = rng.integers(0, 256, x.shape, dtype=np.uint8)
    ours = fs.decode(fs.encode(x, fs.E2M1, rounding="sr", rbits=r), fs.E2M1)
    theirs = round_ndarray(format_info_ocp_e2m1, x.astype(np.float64), RoundMode.StochasticFastest, sat=True,
                           srbits=r.astype(np.int64), srnumbits=8)
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))


def test_seeded_sr_is_deterministic_shape_independent_and_uses_philox_bytes():
    from fp4sim.rng import philox_bytes
    x = np.random.default_rng(0).standard_normal(12 * 37).astype(np.float32) * 2
    a = fs.encode(x, fs.E2M1, rounding="sr", seed=42)
    b = fs.encode(x.reshape(12, 37), fs.E2M1, rounding="sr", seed=42)
    c = fs.encode(x, fs.E2M1, rounding="sr", seed=42)
    np.testing.assert_array_equal(a, b.ravel())
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(a, fs.encode(x, fs.E2M1, rounding="sr", rbits=philox_bytes(42, x.size)))
    d = fs.encode(x, fs.E2M1, rounding="sr", seed=42, stream=1)
    np.testing.assert_array_equal(d, fs.encode(x, fs.E2M1, rounding="sr", rbits=philox_bytes(42, x.size, 1)))
    assert not np.array_equal(a, d)
    assert not np.array_equal(a, fs.encode(x, fs.E2M1, rounding="sr", seed=43))


def test_uint32_rbits_byte_mappings():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(4 * 100 + 3).astype(np.float32) * 2  # not a multiple of 4
    words = rng.integers(0, 2**32, (x.size + 3) // 4, dtype=np.uint32)
    per_te = np.array([(int(words[i // 4]) >> (8 * (i % 4))) & 0xFF for i in range(x.size)], dtype=np.uint8)
    per_msb = np.array([(int(words[i // 4]) >> (8 * (3 - i % 4))) & 0xFF for i in range(x.size)], dtype=np.uint8)
    np.testing.assert_array_equal(fs.encode(x, fs.E2M1, rounding="sr", rbits=words),
                                  fs.encode(x, fs.E2M1, rounding="sr", rbits=per_te))
    np.testing.assert_array_equal(fs.encode(x, fs.E2M1, rounding="sr", rbits=words, rbits_mapping="msb_first"),
                                  fs.encode(x, fs.E2M1, rounding="sr", rbits=per_msb))


def test_sr_bits_fewer_than_8():
    x = np.full(16, 0.75 + 0.25 * 0.3, dtype=np.float32)  # delta = 0.3 between 0.5 and 1.0... scaled below
    for n in (1, 3, 5):
        r = np.arange(16, dtype=np.uint8) % (1 << n)
        got = fs.encode(x, fs.E2M1, rounding="sr", rbits=r, sr_bits=n)
        want = ref.encode_array(x, fs.E2M1, "sr", True, r=r, n=n)
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------------ inputs
def test_input_dtypes_widen_exactly():
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32) * 10
    for dt in (np.float16, ml_dtypes.bfloat16, np.float64):
        xd = x.astype(dt)
        np.testing.assert_array_equal(fs.encode(xd, fs.E4M3), fs.encode(xd.astype(np.float32), fs.E4M3))
    # float64 is rounded to float32 (RNE) first: a value just above a float32 tie stays at the float32 value
    v = np.float64(1.0) + 2.0**-30
    assert fs.encode(np.array([v]), fs.BF16)[0] == fs.encode(np.float32(1.0), fs.BF16)
    assert fs.encode([0.5, 1.0], "e2m1").tolist() == [1, 2]
    be = x.astype(">f4")                                  # byte-swapped arrays read from files
    np.testing.assert_array_equal(fs.encode(be, fs.E4M3), fs.encode(x, fs.E4M3))
    np.testing.assert_array_equal(fs.encode(x[::2], fs.E4M3), fs.encode(x[::2].copy(), fs.E4M3))  # strided view
    assert fs.encode(np.zeros((0, 3), np.float32), fs.E2M1).shape == (0, 3)


def test_bfloat16_round_trip_of_encode_matches_astype():
    x = np.random.default_rng(4).standard_normal(5000).astype(np.float32)
    np.testing.assert_array_equal(fs.decode(fs.encode(x, fs.BF16), fs.BF16),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("call,exc,words", [
    (lambda: fs.encode(np.arange(4), fs.E2M1), None, None),
    (lambda: fs.encode(np.arange(4, dtype=np.int32), fs.E2M1), TypeError, "dtype int32"),
    (lambda: fs.encode(np.array([1.0], dtype=object), fs.E2M1), TypeError, "dtype object"),
    (lambda: fs.encode(np.ones(3, np.complex64), fs.E2M1), TypeError, "complex64"),
    (lambda: fs.encode("1.0", fs.E2M1), TypeError, "x must be"),
    (lambda: fs.encode(np.ones(3, np.float32), "e3m3"), ValueError, "fmt="),
    (lambda: fs.encode(np.ones(3, np.float32), 3), TypeError, "fmt must"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="nearest"), ValueError, "rounding="),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr"), ValueError, "rbits="),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", seed=1, rbits=np.zeros(3, np.uint8)),
     ValueError, "not both"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", rbits=np.zeros(4, np.uint8)),
     ValueError, "shape"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", rbits=np.zeros(3, np.int16)),
     TypeError, "dtype int16"),
    (lambda: fs.encode(np.ones(9, np.float32), fs.E2M1, rounding="sr", rbits=np.zeros(2, np.uint32)),
     ValueError, "3 are needed"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", rbits=np.full(3, 9, np.uint8), sr_bits=3),
     ValueError, "sr_bits=3"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", seed=-1), ValueError, "seed="),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", seed=1.5), TypeError, "seed must"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, rounding="sr", seed=1, sr_bits=9), ValueError, "sr_bits"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, seed=1), ValueError, "only used with rounding='sr'"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E4M3, rounding="sr", seed=1, saturate=False), ValueError,
     "saturate=False"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.UE8M0, rounding="sr", seed=1), ValueError, "UE8M0"),
    (lambda: fs.encode(np.ones(3, np.float32), fs.E2M1, saturate="yes"), TypeError, "saturate"),
    (lambda: fs.decode(np.array([16], np.uint8), fs.E2M1), ValueError, "packed"),
    (lambda: fs.decode(np.array([1.0]), fs.E2M1), TypeError, "codes has dtype"),
    (lambda: fs.decode([1, 2], fs.E2M1), TypeError, "codes must"),
])
def test_errors(call, exc, words):
    if exc is None:  # integer input from np.arange is a dtype error too, naming the fix
        with pytest.raises(TypeError, match="astype"):
            call()
        return
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        call()


@pytest.mark.parametrize("mode", MODES + ["sr"])
def test_e2m1_fast_path_equals_generic_integer_path(sweep, mode):
    """E2M1 has two kernels (comparison masks, used by default; integer bit arithmetic, shared with the
    other formats): both are checked against the reference above, and against each other here."""
    kw = {"rbits": np.random.default_rng(8).integers(0, 256, sweep.shape, dtype=np.uint8)} if mode == "sr" else {}
    for n in ((8, 3) if mode == "sr" else (8,)):
        if n != 8:
            kw = {"rbits": kw["rbits"] % (1 << n), "sr_bits": n}
        fast = fs.encode(sweep, fs.E2M1, rounding=mode, **kw)
        gen = fs.encode(sweep, fs.E2M1, rounding=mode, _generic=True, **kw)
        assert np.array_equal(fast, gen), _diff(fast, gen, sweep)


def test_e2m1_kernel_encoders_and_value_on_every_float32_pattern():
    """The E2M1 encoders the block kernels use (cpu.elements.e2m1_rne: integer compares on the bits; e2m1_sr:
    stochastic rounding on the bits) against the generic integer encoder (checked against the reference above) on
    all 2^32 float32 bit patterns (SR with an 8-bit random integer hashed from the pattern; fewer bits are checked
    at every grid point and midpoint above), and the decoder the fake-quantize and dequantize loops use
    (e2m1_value: the value built from the code's bits) against the format's value table for every code."""
    import numba as nb
    from fp4sim.cpu.elements import e2m1_rne, e2m1_sr, e2m1_value, encode_one, i32_bits_f32, sr_consts
    from fp4sim.planning import kernel_params

    mbits, emin, bias, maxmag, nosat, nanc, signbit = kernel_params(fs.E2M1)

    @nb.njit(parallel=True)
    def mismatches(lo_parts):
        bad = np.zeros((lo_parts, 2), np.int64)
        first = np.full((lo_parts, 2), -1, np.int64)
        for p in nb.prange(lo_parts):
            for low in range(1 << 16):
                u = np.uint32((p << 16) | low)
                v = i32_bits_f32(np.int32(np.int64(u) - (np.int64(1) << 32) if u >= np.uint32(1 << 31) else u))
                h = (np.uint64(u) * np.uint64(2654435761)) >> np.uint64(13)
                for m in range(2):
                    if m == 0:
                        got = e2m1_rne(v)
                        want = encode_one(u, 0, 0, 8, mbits, emin, bias, maxmag, True, nosat, nanc, signbit)
                    else:
                        r = np.int32(h & np.uint64(255))
                        sc, n32 = sr_consts(8)
                        got = e2m1_sr(v, r, sc, n32)
                        want = encode_one(u, 4, r, 8, mbits, emin, bias, maxmag, True, nosat, nanc, signbit)
                    if got != want:
                        bad[p, m] += 1
                        if first[p, m] < 0:
                            first[p, m] = u
        return bad, first

    bad, first = mismatches(1 << 16)
    for m, name in enumerate(("rne", "sr")):
        assert bad[:, m].sum() == 0, (name, [hex(v) for v in first[first[:, m] >= 0, m][:5]])

    @nb.njit
    def values(out):
        for c in range(16):
            out[c] = e2m1_value(np.uint8(c))

    got = np.empty(16, np.float32)
    values(got)
    assert np.array_equal(got.view(np.uint32), fs.E2M1.values.astype(np.float32).view(np.uint32))
