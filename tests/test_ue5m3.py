"""UE5M3: the unsigned E5M3 block-scale format (gfloat, with the format described to it, is the oracle: every
code decoded, every float32 at and around the rounding boundaries encoded in each mode), and NVFP4 with UE5M3
block scales (the rule written out here in torch float32 operations, gfloat rounding the scales and elements)
through quantize, fake_quantize, dequantize and a training operand."""
from __future__ import annotations

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.formats import UE5M3
from fp4sim.reference.elements import encode_array
from peers import torch_or_skip


def _fi():
    from gfloat import FormatInfo
    from gfloat.types import Domain
    return FormatInfo("ue5m3", k=8, precision=4, bias=15, is_signed=False, domain=Domain.Extended, has_nz=False,
                      num_high_nans=7, has_subnormals=True, is_twos_complement=False)


def test_every_code_decodes_as_gfloat_says():
    from gfloat import decode_float
    fi = _fi()
    for c in range(256):
        want = decode_float(fi, c).fval
        got = float(UE5M3.values[c])
        assert (np.isnan(want) and np.isnan(got)) or got == want, c
    assert UE5M3.max == 61440.0 and UE5M3.min_subnormal == 2.0**-17 and UE5M3.min_normal == 2.0**-14
    assert (UE5M3.inf_code, UE5M3.nan_code, UE5M3.max_code) == (0xF8, 0xFF, 0xF7)


def boundary_points():
    v = UE5M3.finite_values
    mids = (v[:-1] + v[1:]) / 2
    pts = np.concatenate([v, mids, [61440.0, 62000.0, 63488.0, 63489.0, 65536.0, 1e6, 2.0**-18, 2.0**-19]])
    x = pts.astype(np.float32)
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0)), [np.inf]])
    return np.unique(x).astype(np.float32)


@pytest.mark.parametrize("mode,gmode", [("rne", "TiesToEven"), ("rz", "TowardZero"), ("ru", "TowardPositive"),
                                        ("rd", "TowardNegative")])
@pytest.mark.parametrize("sat", [True, False])
def test_encode_matches_gfloat_at_every_boundary(mode, gmode, sat):
    from gfloat import RoundMode, round_ndarray
    x = boundary_points()
    want = round_ndarray(_fi(), x.astype(np.float64), getattr(RoundMode, gmode), sat=sat).astype(np.float32)
    if not sat and mode in ("rz", "rd"):
        # fp4sim's rule for every format (docs/formats.md): a value that rounds past the largest finite one gives
        # Inf without saturation, whatever the mode; IEEE 754 (and gfloat) keep the largest finite value for
        # directed rounding toward zero
        past = x.astype(np.float64) >= 65536.0
        want = np.where(past, np.float32(np.inf), want).astype(np.float32)
    codes = fs.encode(x, UE5M3, rounding=mode, saturate=sat)
    assert fs.decode(codes, UE5M3).tobytes() == want.tobytes()
    assert np.array_equal(codes, encode_array(x, UE5M3, mode, sat))
    assert np.array_equal(fs.encode(-x, UE5M3, rounding="rne"), fs.encode(x, UE5M3, rounding="rne"))  # sign ignored


@pytest.mark.parametrize("mapping,gmode", [("te", "StochasticFastest"), ("midpoint", "StochasticFast")])
def test_stochastic_rounding_matches_gfloat_for_every_byte(mapping, gmode):
    from gfloat import RoundMode, round_ndarray
    lo, hi = UE5M3.finite_values[:-1], UE5M3.finite_values[1:]
    pick = np.arange(0, lo.size, 5)
    x = (lo[pick, None] + (hi - lo)[pick, None] * np.arange(0, 513, 37) / 512).astype(np.float32).ravel()
    r = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, x.size)).copy()
    xx = np.broadcast_to(x, r.shape).copy()
    want = round_ndarray(_fi(), xx.astype(np.float64), getattr(RoundMode, gmode), sat=True, srbits=r.astype(np.int64),
                         srnumbits=8).astype(np.float32)
    got = fs.decode(fs.encode(xx, UE5M3, rounding="sr", rbits=r, rbits_mapping=mapping), UE5M3)
    assert got.tobytes() == want.tobytes()


def test_every_finite_code_round_trips():
    codes = np.arange(256, dtype=np.uint8)
    fin = np.isfinite(UE5M3.values)
    for mode in ("rne", "rz", "ru", "rd"):
        assert np.array_equal(fs.encode(UE5M3.values[fin], UE5M3, rounding=mode), codes[fin])


# ------------------------------------------------------------------------------------------------ the scheme
def oracle(x, tile, target, tensor_scale, rounding="rne", rbits=None):
    """UE5M3 NVFP4 of x (R, K), K a multiple of 16, along rows: the rule in torch float32, gfloat rounding.
    Returns (scale values (rows of blocks), element values), float32."""
    torch = torch_or_skip()
    from gfloat import RoundMode, round_ndarray
    from gfloat.formats import format_info_ocp_e2m1
    t = torch.from_numpy(x)
    R, K = t.shape
    f = torch.float32
    if tensor_scale:
        amax = t.abs().max()
        enc = torch.tensor(6.0 * target, dtype=f) / amax if amax > 0 else torch.tensor(1.0, dtype=f)
        enc = torch.clamp(enc, max=torch.finfo(f).max)
    else:
        enc = torch.tensor(1.0, dtype=f)
    dec = torch.reciprocal(enc)
    b = t.abs().reshape(R, K // 16, 16).amax(-1)
    if tile == 16:
        b = b.reshape(R // 16, 16, K // 16).amax(1).repeat_interleave(16, 0)
    ideal = torch.clamp(b * (enc * torch.tensor(1.0 / 6.0, dtype=f)), max=61440.0)
    s = torch.from_numpy(round_ndarray(_fi(), ideal.numpy().astype(np.float64), RoundMode.TiesToEven,
                                       sat=True).astype(np.float32))
    s = torch.where(s == 0, torch.ones_like(s), s)
    d = s * dec
    y = (t.reshape(R, -1, 16) * torch.reciprocal(d)[..., None]).reshape(R, K)
    mode = {"rne": RoundMode.TiesToEven, "sr": RoundMode.StochasticFast}[rounding]
    kw = dict(srbits=rbits.astype(np.int64), srnumbits=8) if rbits is not None else {}
    e = round_ndarray(format_info_ocp_e2m1, y.numpy().astype(np.float64), mode, sat=True, **kw).astype(np.float32)
    return s.numpy(), e


@pytest.mark.parametrize("tile", [1, 16])
@pytest.mark.parametrize("target,tensor_scale", [(448.0, True), (2048.0, True), (448.0, False)])
def test_quantize_follows_the_rule(tile, target, tensor_scale):
    rng = np.random.default_rng(tile + int(target))
    x = (rng.standard_normal((48, 96)) * np.exp(rng.uniform(-9, 6, (48, 1)))).astype(np.float32)
    x[5, :16] = 0                                               # a zero block: scale 1.0
    x[7, 16:32] *= 1e-12                                        # a block below UE5M3's range
    scheme = "nvfp4_ue5m3" if tile == 1 else "nvfp4_ue5m3_2d"
    q = fs.quantize(x, scheme, scale_target=target, per_tensor_scale=tensor_scale)
    s_want, e_want = oracle(x, tile, target, tensor_scale)
    s_got = UE5M3.values[q.scales if tile == 1 else np.repeat(q.scales, 16, axis=0)]
    assert s_got.tobytes() == s_want.tobytes()
    e_got = fs.E2M1.values[fs.layout.unpack_fp4(q.codes)]
    assert e_got.tobytes() == e_want.tobytes()
    y = fs.dequantize(q)
    s_dec = np.float32(1) / np.float32(np.float32(6 * target) / np.abs(x).max()) if tensor_scale else np.float32(1)
    d = (s_want * s_dec).astype(np.float32)
    assert y.tobytes() == (e_want.reshape(48, -1, 16) * d[:, :, None]).astype(np.float32).reshape(48, 96).tobytes()
    assert fs.fake_quantize(x, scheme, scale_target=target, per_tensor_scale=tensor_scale).tobytes() == y.tobytes()
    assert (q.global_amax is not None) == tensor_scale


def test_stochastic_rounding_and_other_axes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 80)).astype(np.float32)
    rb = rng.integers(0, 256, x.shape, dtype=np.uint8)
    q = fs.quantize(x, "nvfp4_ue5m3", rounding="sr", rbits=rb, rbits_mapping="midpoint")
    s_want, e_want = oracle(x, 1, 448.0, True, "sr", rb)
    assert fs.E2M1.values[fs.layout.unpack_fp4(q.codes)].tobytes() == e_want.tobytes()
    qt = fs.quantize(x.T.copy(), "nvfp4_ue5m3", axis=0, rounding="sr", rbits=rb.T.copy(), rbits_mapping="midpoint")
    assert np.array_equal(qt.codes, q.codes) and np.array_equal(qt.scales, q.scales)
    assert np.array_equal(fs.dequantize(qt), fs.dequantize(q).T)
    a = fs.quantize(x, "nvfp4_ue5m3", rounding="sr", seed=4)
    from fp4sim.rng import philox_bytes
    b = fs.quantize(x, "nvfp4_ue5m3", rounding="sr", rbits=philox_bytes(4, x.size).reshape(x.shape))
    assert np.array_equal(a.codes, b.codes)


def test_a_training_operand_with_ue5m3_scales():
    from fp4sim import emulate
    from fp4sim.training import Operand, Recipe
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    w = rng.standard_normal((32, 48)).astype(np.float32)
    rec = Recipe.preset("nvfp4_paper", scale_format="ue5m3", per_tensor_scale=False)
    assert rec.fprop_w == Operand("nvfp4_ue5m3", (16, 16), per_tensor_scale=False)
    assert rec.wgrad_dy.scheme == "nvfp4_ue5m3" and rec.wgrad_dy.rht == 16
    y, qw = emulate.fprop(x, w, rec)
    qx = fs.quantize(x, "nvfp4_ue5m3", per_tensor_scale=False)
    want = np.matmul(fs.dequantize(qx), fs.dequantize(fs.quantize(w, "nvfp4_ue5m3_2d", per_tensor_scale=False)).T)
    assert y.tobytes() == want.astype(np.float32).tobytes()
    with pytest.raises(ValueError, match="no hardware GEMM"):
        fs.gemm(qx, qw)
    with pytest.raises(ValueError, match="options of the 'nvfp4_ue5m3' scheme"):
        Operand("nvfp4", per_tensor_scale=False)
    with pytest.raises(ValueError, match="add scale_format='ue5m3'"):
        Recipe.preset("nvfp4_paper", per_tensor_scale=False)
    with pytest.raises(ValueError, match="scale_target=-1"):
        fs.quantize(x, "nvfp4_ue5m3", scale_target=-1)


def test_the_operation_order_is_the_kernels():
    """Inputs placed where another order of the same float32 operations rounds differently: a block amax whose
    fl(b · fl(s_enc · fl(1/6))) and fl(fl(b · s_enc) / 6) fall on either side of a UE5M3 midpoint, and an
    element whose fl(x · fl(1 / dec)) and fl(x / dec) fall on either side of an E2M1 midpoint. The oracle (the
    rule in torch) and fs.quantize agree on both; the other orders would not."""
    f = np.float32
    amax = f(3.7)
    s_enc = f(f(2688.0) / amax)
    mult = f(s_enc * f(1.0 / 6.0))
    v = UE5M3.finite_values
    mids = ((v[:-1] + v[1:]) / 2)[40:200].astype(np.float32)
    found_b = None
    for m in mids:
        b0 = f(m / mult)
        for k in range(-6, 7):
            b = f(b0 + k * np.spacing(b0))
            a1 = fs.encode(np.array([f(b * mult)], f), UE5M3)[0]
            a2 = fs.encode(np.array([f(f(b * s_enc) / f(6.0))], f), UE5M3)[0]
            if a1 != a2 and b < amax:
                found_b = b
                break
        if found_b is not None:
            break
    assert found_b is not None
    x = np.zeros((1, 64), f)
    x[0, 0] = amax
    x[0, 16] = found_b
    q = fs.quantize(x, "nvfp4_ue5m3")
    s_want, _ = oracle(x, 1, 448.0, True)
    assert UE5M3.values[q.scales[0, 1]] == s_want[0, 1]
    wrong = fs.encode(np.array([f(f(found_b * s_enc) / f(6.0))], f), UE5M3)[0]
    assert q.scales[0, 1] != wrong
    # an element: a block whose scale byte is c (amax b_c), x near an E2M1 midpoint times its decode scale
    s_dec = f(f(1.0) / s_enc)
    found = None
    for c in range(0x40, 0xC0):
        dec = f(UE5M3.values[c] * s_dec)
        b_c = f(UE5M3.values[c] / mult)
        if fs.encode(np.array([f(b_c * mult)], f), UE5M3)[0] != c or not b_c < amax:
            continue
        for t in (0.75, 1.25, 1.75, 2.5, 3.5):
            x0 = f(f(t) * dec)
            for k in range(-8, 9):
                xe = f(x0 + k * np.spacing(x0))
                c1 = fs.encode(np.array([f(xe * f(f(1.0) / dec))], f), fs.E2M1)[0]
                c2 = fs.encode(np.array([f(xe / dec)], f), fs.E2M1)[0]
                if c1 != c2 and xe < b_c:
                    found = (b_c, xe, dec)
                    break
            if found:
                break
        if found:
            break
    assert found is not None
    b_c, xe, dec = found
    x[0, 32], x[0, 33] = b_c, xe
    q = fs.quantize(x, "nvfp4_ue5m3")
    _, e_want = oracle(x, 1, 448.0, True)
    got = fs.E2M1.values[fs.layout.unpack_fp4(q.codes)][0, 33]
    assert got == e_want[0, 33] and got != fs.E2M1.values[fs.encode(np.array([f(xe / dec)], f), fs.E2M1)[0]]


def test_the_block_scale_multiplier_is_s_enc_times_the_rounded_sixth():
    """The block-scale multiplier is fl(s_enc · fl(1/6)), the source's constant, not fl(s_enc / 6): at a tensor amax
    of 7.1 the two multipliers differ by an ulp, and a block amax placed on a UE5M3 midpoint between them gets the
    byte of the first, as the oracle (the rule in torch) says."""
    f = np.float32
    amax = f(7.1)
    s_enc = f(f(2688.0) / amax)
    m_src, m_div = f(s_enc * f(1.0 / 6.0)), f(s_enc / f(6.0))
    assert m_src != m_div
    v = UE5M3.finite_values
    found = None
    for m in ((v[:-1] + v[1:]) / 2)[40:220].astype(np.float32):
        b0 = f(m / m_src)
        for k in range(-4, 5):
            b = f(b0 + k * np.spacing(b0))
            c1 = fs.encode(np.array([f(b * m_src)], f), UE5M3)[0]
            c2 = fs.encode(np.array([f(b * m_div)], f), UE5M3)[0]
            if c1 != c2 and b < amax:
                found = (b, c1, c2)
                break
        if found:
            break
    assert found is not None
    b, c_src, c_div = found
    x = np.zeros((1, 32), f)
    x[0, 0], x[0, 16] = amax, b
    q = fs.quantize(x, "nvfp4_ue5m3")
    s_want, _ = oracle(x, 1, 448.0, True)
    assert UE5M3.values[q.scales[0, 1]] == s_want[0, 1] == UE5M3.values[c_src]
    assert q.scales[0, 1] != c_div


def test_bad_input_is_refused_naming_it():
    x = np.ones((4, 32), np.float32)
    for g in (np.nan, -1.0):
        with pytest.raises(ValueError, match="global_amax=.* must be a non-negative number"):
            fs.quantize(x, "nvfp4_ue5m3", global_amax=g)
    with pytest.raises(ValueError, match="global_amax: the tensor amax is inf"):
        fs.quantize(x, "nvfp4_ue5m3", global_amax=np.inf)
    xi = x.copy()
    xi[1, 3] = np.inf
    with pytest.raises(ValueError, match="x: the tensor amax is inf"):
        fs.quantize(xi, "nvfp4_ue5m3")
    q = fs.quantize(xi, "nvfp4_ue5m3", per_tensor_scale=False)      # no tensor scale: the block saturates
    assert UE5M3.values[q.scales[1, 0]] == 61440.0 and np.isfinite(fs.dequantize(q)).all()
    with pytest.raises(ValueError, match="no elements"):
        fs.quantize(np.zeros((0, 16), np.float32), "nvfp4_ue5m3")
    xn = x.copy()
    xn[0, 0] = np.nan
    with pytest.warns(RuntimeWarning, match="NaN in the input"):
        q = fs.quantize(xn, "nvfp4_ue5m3")
    assert fs.layout.unpack_fp4(q.codes)[0, 0] == 7 and q.global_amax == 1.0     # +6, as E2M1 encodes NaN;
    assert np.isfinite(fs.dequantize(q)).all()                                   # NaN left out of the amax


def test_convert_says_which_operands_take_the_general_path():
    """UE5M3 block scales and a held amax have no fused fast-path kernel: convert warns (SlowPathWarning) naming
    the operands, and they are the ones fp4sim.emulate sends to the general path; the presets themselves and
    non-fast accumulation convert silently."""
    import warnings

    torch = torch_or_skip()
    from fp4sim import emulate, fastpath
    from fp4sim.torch import convert
    from fp4sim.training import OPERANDS, Recipe, SlowPathWarning

    def model():
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))

    ue = Recipe.preset("nvfp4_paper", scale_format="ue5m3", accumulate="fast")
    with pytest.warns(SlowPathWarning, match="UE5M3 block scales") as w:
        convert(model(), ue, quantize_head=True)
    assert len(w) == 1
    slow = ue.general_path_operands()
    assert set(slow) == set(OPERANDS)                  # all six of nvfp4_paper's operands are NVFP4
    for op in OPERANDS:
        kind = fastpath.operand_plan(getattr(ue, op), (64, 32), 1).kind
        assert (kind == "general") == (op in slow), op
    half = Recipe.preset("nvfp4_paper", scale_format="ue5m3", accumulate="fast",
                         fprop_w=Recipe.preset("nvfp4_paper").fprop_w)
    assert "fprop_w" not in half.general_path_operands() and "fprop_x" in half.general_path_operands()
    held = Recipe.preset("nvfp4_paper", delayed_amax=16, accumulate="fast")
    with pytest.warns(SlowPathWarning, match="delayed amax"):
        convert(model(), held, quantize_head=True)
    assert set(held.general_path_operands()) == set(OPERANDS)
    x = np.zeros((4, 32), np.float32)
    assert not emulate._fast(held, None, x) and emulate._fast(Recipe.preset("nvfp4_paper", accumulate="fast"), None, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        convert(model(), Recipe.preset("nvfp4_paper", accumulate="fast"), quantize_head=True)
        convert(model(), Recipe.preset("nvfp4_paper", scale_format="ue5m3"), quantize_head=True)    # exact rule
