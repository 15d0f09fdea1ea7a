"""Per-token NVFP4 (TE's NVFP4PerTokenBlockScaling): one FP32 outer scale per row of a row-wise operand, per
column of a column-wise (Wgrad) one. The outer amaxes against a direct computation; the recipe's GEMMs against
fs.quantize(row_scaled=True) + fs.gemm with those amaxes, on the general and the fast path."""
from __future__ import annotations

import numpy as np
import pytest

import fp4sim as fs
from fp4sim import emulate
from fp4sim.training import Operand, Recipe


def operands():
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((64, 48)) * np.exp(rng.uniform(-4, 4, (64, 1)))).astype(np.float32)   # token scales
    w = (rng.standard_normal((32, 48)) * 0.1).astype(np.float32)
    dy = (rng.standard_normal((64, 32)) * np.exp(rng.uniform(-4, 4, (64, 1)))).astype(np.float32)
    return x, w, dy


def test_the_outer_amax_is_per_token_row_wise_and_per_feature_column_wise():
    x, w, dy = operands()
    rec = Recipe.preset("nvfp4_paper", per_token=True)
    assert rec.fprop_x.per_token and rec.wgrad_x.per_token and rec.dgrad_dy.per_token
    assert not rec.fprop_w.per_token                          # 16x16 weights keep one scale per tensor
    qx = emulate.quantize_operand(x, rec.fprop_x, 1, rec, 0, 0, "fprop_x")
    assert np.array_equal(np.asarray(qx.global_amax), np.abs(x).max(1))          # one per token
    qxt = emulate.quantize_operand(x, rec.wgrad_x, 0, rec, 0, 0, "wgrad_x", "te")
    rotated = fs.rht(x, 16, "te", axis=0, out="bf16")
    assert np.array_equal(np.asarray(qxt.global_amax), np.abs(rotated).max(0))   # one per feature, after RHT
    assert "per-token" in rec.fprop_x.label()


@pytest.mark.parametrize("accumulate", ["exact", "fast"])
def test_the_three_gemms_use_per_row_outer_scales(accumulate):
    x, w, dy = operands()
    rec = Recipe.preset("nvfp4_paper", per_token=True, disable_stochastic_rounding=True, accumulate=accumulate)
    y, qw = emulate.fprop(x, w, rec)
    dx = emulate.dgrad(dy, w, rec)
    dw = emulate.wgrad(dy, x, rec)
    ex = fs.quantize(x, "nvfp4", row_scaled=True)
    ew = fs.quantize(w, "nvfp4", block=(16, 16))
    edy = fs.quantize(dy, "nvfp4", row_scaled=True)
    ewn = fs.quantize(w, "nvfp4", axis=0, block=(16, 16))
    a = fs.rht(dy, 16, "te", axis=0, out="bf16")
    b = fs.rht(x, 16, "te", axis=0, out="bf16")
    ea = fs.quantize(a, "nvfp4", axis=0, row_scaled=True)
    eb = fs.quantize(b, "nvfp4", axis=0, row_scaled=True)
    want = [fs.gemm(ex, ew), fs.gemm(edy, ewn), fs.gemm(ea, eb)]
    for got, w_ in zip((y, dx, dw), want):
        if accumulate == "exact":
            assert got.tobytes() == w_.tobytes()
        else:
            np.testing.assert_allclose(got, w_, rtol=1e-4, atol=1e-4 * np.abs(w_).max())


def test_per_token_scales_keep_small_tokens_that_a_tensor_scale_flushes():
    """Tokens spread over 2^23 in magnitude, wider than E4M3's block-scale range under one tensor scale (448 down
    to 2^-9): the smallest rows' blocks flush to zero per tensor and keep their own scale per token."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 48)) * np.exp2(rng.uniform(-23, 0, (64, 1)))).astype(np.float32)
    w = (rng.standard_normal((32, 48)) * 0.1).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T

    def row_err(rec):
        y = emulate.fprop(x, w, rec)[0].astype(np.float64)
        return np.sqrt(((y - ref) ** 2).sum(1) / (ref ** 2).sum(1))

    tok = row_err(Recipe.preset("nvfp4_paper", per_token=True, disable_stochastic_rounding=True))
    ten = row_err(Recipe.preset("nvfp4_paper", disable_stochastic_rounding=True))
    small = np.abs(x).max(1) < np.abs(x).max() * 2.0**-19      # below the smallest scale under one amax
    assert small.sum() >= 5
    assert tok.max() < 0.3 and ten[small].min() == 1.0     # per tensor they vanish: the GEMM row is 0


def test_per_token_is_checked():
    with pytest.raises(ValueError, match="NVFP4 1x16 option"):
        Operand("nvfp4", block=(16, 16), per_token=True)
    with pytest.raises(ValueError, match="NVFP4 1x16 option"):
        Operand("mxfp4", per_token=True)
    with pytest.raises(ValueError, match="NVFP4 1x16 option"):
        Operand("nvfp4", per_token=True, amax="delayed", amax_every=4)
    with pytest.raises(ValueError, match="no NVFP4 1x16 operand"):
        Recipe.preset("mxfp4_paper", per_token=True)
    # with UE5M3 block scales the reason is the combination, not a missing NVFP4 operand (nvfp4_paper has six)
    with pytest.raises(ValueError, match="per_token=True with scale_format='ue5m3'") as e:
        Recipe.preset("nvfp4_paper", scale_format="ue5m3", per_token=True)
    assert "no NVFP4 1x16 operand" not in str(e.value)
