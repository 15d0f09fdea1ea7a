"""The CPU kernels of the exact NVFP4 / MXFP4 GEMM (fp4sim/cpu/gemm.py), bit for bit, against an oracle written
here from the rule with ml_dtypes' decoders (float4_e2m1fn, float8_e4m3fn, float8_e8m0fnu) and NumPy's float32
operations, and fs.gemm against its own per-block matmul loop, at the shapes and scale values where a tiled
kernel can go wrong: rows not a multiple of the 4-row tile, columns past one 256-column chunk, K not a multiple
of the block, block-scale products that underflow, round in the subnormal range or overflow, and NaN scales.
(TransformerEngine's reference qgemm, with the NVFP4 alpha, is in test_training.py.)"""
from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from fp4sim.cpu import _gen_gemm_tiles
from fp4sim.cpu.gemm import e2m1_gemm_exact

gemm_mod = importlib.import_module("fp4sim.gemm")      # the module (fp4sim.gemm is also the function)


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    diff = np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff == 0, f"{diff} of {a.size} output bits differ"


def _kind(q):
    return "nvfp4" if isinstance(q.scheme, fs.schemes.NVFP4) else "mxfp4"


E2M1_ML = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _ml_values(q):
    """Element values (rows, Kp) from the packed codes (low nibble first), decoded by ml_dtypes."""
    c = q.codes.reshape(q.lead[0], -1)
    nib = np.stack([c & 15, c >> 4], axis=-1).reshape(c.shape[0], -1)
    return nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _ml_scales(q):
    """Decoded block scales (rows, blocks) from the scale bytes, decoded by ml_dtypes."""
    if _kind(q) == "nvfp4":
        return q.scales_per_row().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q.linear_scales().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _oracle(va, sa, vb, sb, bk):
    """The rule before alpha: per K block, the exact dot (float64, rounded to float32: exact for E2M1 values),
    times fl(s_a * s_b), added to the float32 sum in block order (NumPy float32 operations, no FMA)."""
    y = np.zeros((va.shape[0], vb.shape[0]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(va.shape[1] // bk):
            blk = slice(j * bk, (j + 1) * bk)
            dot = (va[:, blk].astype(np.float64) @ vb[:, blk].astype(np.float64).T).astype(np.float32)
            y = y + (sa[:, j, None] * sb[None, :, j]) * dot
    return y


def _check(qa, qb):
    bk = 16 if _kind(qa) == "nvfp4" else 32
    sa, sb = _ml_scales(qa), _ml_scales(qb)
    pre = e2m1_gemm_exact(qa.codes.reshape(qa.lead[0], -1), sa, qb.codes.reshape(qb.lead[0], -1), sb, bk, E2M1_ML)
    _same(pre, _oracle(_ml_values(qa), sa, _ml_values(qb), sb, bk))
    y = fs.gemm(qa, qb)
    _same(y, gemm_mod._blockwise(qa, qb, _kind(qa), np))
    return y


def test_committed_tiles_are_the_generators_output():
    assert Path(_gen_gemm_tiles.__file__).with_name("gemm_tiles.py").read_text() == _gen_gemm_tiles.source()


SHAPES = [(1, 1, 16), (3, 5, 37), (4, 256, 64), (37, 301, 200), (70, 600, 160), (261, 9, 1000)]
SCHEMES = {
    "nvfp4": dict(scheme="nvfp4"),
    "nvfp4_2d": dict(scheme="nvfp4_2d"),
    "nvfp4_row_scaled": dict(scheme="nvfp4", row_scaled=True),
    "nvfp4_torchao": dict(scheme="nvfp4", flavor="torchao"),
    "nvfp4_4over6": dict(scheme="nvfp4", four_over_six="mse", four_over_six_e4m3_max=256),
    "nvfp4_2d_swizzled": dict(scheme="nvfp4_2d", scale_layout="swizzled"),
    "mxfp4": dict(scheme="mxfp4"),
    "mxfp4_floor": dict(scheme="mxfp4", scale_mode="floor"),
}


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_cpu_kernel_equals_the_blockwise_loop(name, M, N, K):
    kw = dict(SCHEMES[name])
    scheme = kw.pop("scheme")
    cols = np.exp(3 * np.random.default_rng(K).standard_normal((2, K))).astype(np.float32)  # block scales over
    qa = fs.quantize(heavy((M, K), M + K) * cols[0], scheme, **kw)                           # many binades: the
    qb = fs.quantize(heavy((N, K), N + 2 * K) * cols[1], scheme, **kw)                       # float32 sum rounds
    y = _check(qa, qb)
    ref = fs.dequantize(qa).astype(np.float64) @ fs.dequantize(qb).astype(np.float64).T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()      # and it is the product, not just equal code


def test_cpu_kernel_on_operands_quantized_along_axis_zero():
    A, B = heavy((96, 37), 3), heavy((96, 300), 4)                   # Wgrad: the dot runs over the 96 rows
    for scheme in ("nvfp4", "mxfp4"):
        _check(fs.quantize(A, scheme, axis=0), fs.quantize(B, scheme, axis=0))


def test_mx_scale_products_that_underflow_round_subnormally_or_overflow():
    """UE8M0 scales 2^-127 .. 2^127: fl(s_a * s_b) underflows to 0 or to a subnormal, fl(. * dot) then loses
    bits, and 2^125 * 2^125 overflows to inf (inf * 0 = NaN where a block's dot is 0)."""
    rng = np.random.default_rng(5)
    A = rng.standard_normal((9, 96)).astype(np.float32)
    A[0] *= np.float32(1e-38)           # scale 2^-127 (the smallest)
    A[1] *= np.float32(3e-36)
    A[2] *= np.float32(1e38)            # scale 2^125
    A[3, :32] = 0                       # a zero block: dot 0 against an inf scale product
    A[3] *= np.float32(1e38)
    B = rng.standard_normal((300, 96)).astype(np.float32)
    B[:100] *= np.float32(1e-7)
    B[100:200] *= np.float32(2e37)
    B[250, 32:64] = 0
    qa, qb = fs.quantize(A, "mxfp4"), fs.quantize(B, "mxfp4")
    sa = qa.linear_scales()
    assert sa.min() == 0 and sa.max() >= 252                       # the extreme exponents are really there
    y = _check(qa, qb)
    assert np.isinf(y).any() and np.isnan(y).any() and (y == 0).any()
    tiny = np.abs(y[np.isfinite(y) & (y != 0)]).min()
    assert tiny < np.finfo(np.float32).tiny                        # a subnormal result


def test_nan_scale_bytes_propagate_like_the_blockwise_loop():
    A, B = heavy((6, 64), 1), heavy((270, 64), 2)
    for scheme, nan in (("nvfp4", 0x7F), ("mxfp4", 0xFF)):
        qa, qb = fs.quantize(A, scheme), fs.quantize(B, scheme)
        sa, sb = qa.scales.copy(), qb.scales.copy()
        sa.reshape(6, -1)[1, 0] = nan
        sb.reshape(270, -1)[261, -1] = nan
        y = _check(replace(qa, scales=sa), replace(qb, scales=sb))
        nans = np.isnan(y)
        assert nans[1].all() and nans[:, 261].all() and nans.sum() == 270 + 6 - 1


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_blocks_are_added_in_k_order(scheme):
    """A first block 2^8 (NVFP4: its E4M3 scales span 2^17) or 2^20 (MX) times the others: adding the K blocks in
    another order rounds differently (checked here on the same operands), so only the tensor core's order
    matches."""
    rng = np.random.default_rng(9)
    A = rng.standard_normal((8, 512)).astype(np.float32)
    A[:, :32] *= np.float32(2.0 ** (8 if scheme == "nvfp4" else 20))
    B = rng.standard_normal((300, 512)).astype(np.float32)
    qa, qb = fs.quantize(A, scheme), fs.quantize(B, scheme)
    y = _check(qa, qb)
    bk = 16 if scheme == "nvfp4" else 32
    flip = lambda q: replace(q, codes=q.codes.reshape(q.lead[0], -1, bk // 2)[:, ::-1].reshape(q.codes.shape).copy(),  # noqa: E731
                             scales=q.scales.reshape(q.lead[0], -1)[:, ::-1].reshape(q.scales.shape).copy())
    assert not np.array_equal(fs.gemm(flip(qa), flip(qb)).view(np.uint32), y.view(np.uint32))


# ------------------------------------------------------------------ FP8 block dots: exact, then rounded once
def _f32_rne(fr):
    """The float32 nearest to the rational ``fr`` (ties to even), by integer arithmetic; normal range only."""
    from fractions import Fraction
    if fr == 0:
        return np.float32(0.0)
    s, a = (-1 if fr < 0 else 1), abs(fr)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1                                                 # now 2^e <= a < 2^(e+1)
    assert -126 <= e <= 127, "the oracle covers float32's normal range only"
    m = a / Fraction(2) ** (e - 23)                            # in [2^23, 2^24)
    n, rem = divmod(m.numerator, m.denominator)
    half = Fraction(rem, m.denominator)
    if half > Fraction(1, 2) or (half == Fraction(1, 2) and n % 2):
        n += 1
    return np.float32(s * float(Fraction(n) * Fraction(2) ** (e - 23)))


def _fp8_operand(rows, K, seed):
    """E4M3-representable values over many binades, so a block's dot has more than 24 significant bits."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, K)) * np.exp2(rng.integers(-8, 8, (rows, K)))).astype(np.float32)


@pytest.mark.parametrize("scheme,bk", [("mxfp8_e4m3", 32), ("fp8_blockwise", 128)])
def test_fp8_gemm_rounds_each_exact_block_dot_once(scheme, bk):
    """MXFP8 (32-element blocks, UE8M0 scales) and FP8 blockwise (128, float32 scales): each block's dot of the E4M3
    values, summed exactly (Python fractions) and rounded once to float32, times fl(s_a * s_b), added in block
    order in float32. The operands are chosen so that float32 summation of the products (what BLAS does)
    differs from the exact rounding in some block."""
    from fractions import Fraction
    a, b = _fp8_operand(5, 3 * bk, 1), _fp8_operand(4, 3 * bk, 2)
    qa, qb = fs.quantize(a, scheme), fs.quantize(b, scheme)
    va = qa.codes.reshape(5, -1).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    vb = qb.codes.reshape(4, -1).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if scheme == "mxfp8_e4m3":
        sa = qa.linear_scales().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
        sb = qb.linear_scales().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    else:
        sa, sb = (np.asarray(q.scales, np.float32).reshape(q.lead[0], -1) for q in (qa, qb))
    want = np.zeros((5, 4), np.float32)
    inexact = 0
    for i in range(5):
        for j in range(4):
            y = np.float32(0.0)
            for k in range(3):
                blk = slice(k * bk, (k + 1) * bk)
                exact = sum((Fraction(float(u)) * Fraction(float(v)) for u, v in zip(va[i, blk], vb[j, blk])),
                            Fraction(0))
                dot = _f32_rne(exact)
                f32_sum = np.float32(0.0)
                for u, v in zip(va[i, blk].astype(np.float32), vb[j, blk].astype(np.float32)):
                    f32_sum = np.float32(f32_sum + np.float32(u * v))
                inexact += f32_sum != dot
                y = np.float32(y + np.float32(np.float32(sa[i, k] * sb[j, k]) * dot))
            want[i, j] = y
    assert inexact > 0, "no block dot where float32 summation and the exact rounding part ways"
    _same(fs.gemm(qa, qb), want)
