"""Recipe(backward_override=...): TransformerEngine's switch. The backward GEMMs are checked against exact
rational dot products (Python fractions, rounded once to float32) of the operands they should use: the original
x, W and dy rounded to bfloat16 ("high_precision"), or the forward's quantized x and W — quantized here directly
with fs.quantize under the forward operands' settings — dequantized and rounded to bfloat16 ("dequantized");
bfloat16 rounding by ml_dtypes. Through the emulation and through QuantLinear, on both the general and the fast
path."""
from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim import emulate
from fp4sim.training import Recipe
from peers import torch_or_skip

M, N, K = 32, 24, 48


def operands(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    dy = (rng.standard_normal((M, N)) * 1e-3).astype(np.float32)
    return x, w, dy


def bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def exact_matmul(a, b):
    """a (m, k) · b (k, n), each dot product exact in rationals, rounded once to float32."""
    fa = [[Fraction(float(v)) for v in row] for row in a]
    fb = [[Fraction(float(v)) for v in col] for col in b.T]
    return np.array([[np.float32(float(sum(p * q for p, q in zip(r, c)))) for c in fb] for r in fa], np.float32)


def forward_operands(x, w):
    """The nvfp4_paper forward's x (1x16 along K) and W (16x16), quantized directly and dequantized."""
    qx = fs.quantize(x, "nvfp4", block=(1, 16), global_amax=np.abs(x).max())
    qw = fs.quantize(w, "nvfp4", block=(16, 16), global_amax=np.abs(w).max())
    return fs.dequantize(qx), fs.dequantize(qw)


def expected(mode, x, w, dy):
    """(dx, dw, and the bounds of a float32 summation's error on each: k · 2^-24 · |a|·|b|)."""
    if mode == "high_precision":
        xs, ws = x, w
    else:
        xs, ws = forward_operands(x, w)
    a, b, c = bf16(dy), bf16(ws), bf16(xs)
    bound = lambda p, q: p.shape[1] * 2.0 ** -24 * (np.abs(p).astype(np.float64) @ np.abs(q))  # noqa: E731
    return exact_matmul(a, b), exact_matmul(a.T, c), bound(a, b), bound(a.T, c)


def close(got, want, bound):
    assert (np.abs(got.astype(np.float64) - want) <= bound).all()


@pytest.mark.parametrize("accumulate", ["exact", "fast"])
@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_the_backward_gemms_use_the_operands_the_mode_names(mode, accumulate):
    x, w, dy = operands()
    rec = Recipe.preset("nvfp4_paper", backward_override=mode, accumulate=accumulate, seed=5)
    y, qw, qx = emulate.fprop(x, w, rec, 3, 7, return_qx=True)
    dx = emulate.dgrad(dy, w, rec, 3, 7, qw_fprop=qw)
    dw = emulate.wgrad(dy, x, rec, 3, 7, qx_fprop=qx)
    want_dx, want_dw, bx, bw = expected(mode, x, w, dy)
    if accumulate == "exact":
        assert dx.tobytes() == want_dx.tobytes() and dw.tobytes() == want_dw.tobytes()
    else:                                          # the fast path: the same operands through BLAS (float32 sums)
        close(dx, want_dx, bx)
        close(dw, want_dw, bw)
    # the forward is the recipe's, untouched by the switch
    y0, _ = emulate.fprop(x, w, Recipe.preset("nvfp4_paper", accumulate=accumulate, seed=5), 3, 7)
    assert y.tobytes() == y0.tobytes()
    # and without the switch the backward quantizes: a different result
    base = Recipe.preset("nvfp4_paper", accumulate=accumulate, seed=5)
    assert not np.array_equal(emulate.dgrad(dy, w, base, 3, 7), dx)


def test_the_dequantized_backward_needs_the_forward_operands():
    x, w, dy = operands()
    rec = Recipe.preset("nvfp4_paper", backward_override="dequantized")
    with pytest.raises(ValueError, match="give qw_fprop"):
        emulate.dgrad(dy, w, rec)
    with pytest.raises(ValueError, match="give qx_fprop"):
        emulate.wgrad(dy, x, rec)


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_quant_linear_backward_honours_the_switch(mode):
    torch = torch_or_skip()
    from fp4sim.torch import QuantLinear
    x, w, dy = operands(1)
    for accumulate in ("exact", "fast"):
        lin = QuantLinear(K, N, bias=False, recipe=Recipe.preset("nvfp4_paper", backward_override=mode,
                                                                 accumulate=accumulate))
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w))
        xt = torch.from_numpy(x).requires_grad_(True)
        lin(xt).backward(torch.from_numpy(dy))
        want_dx, want_dw, bx, bw = expected(mode, x, w, dy)
        if accumulate == "exact":
            assert xt.grad.numpy().tobytes() == want_dx.tobytes()
            assert lin.weight.grad.numpy().tobytes() == want_dw.tobytes()
        else:
            close(xt.grad.numpy(), want_dx, bx)
            close(lin.weight.grad.numpy(), want_dw, bw)


def test_the_switch_is_checked():
    with pytest.raises(ValueError, match=r"backward_override='dequantised': use one of \[None, 'high_precision', "
                                         r"'dequantized'\]"):
        Recipe.preset("nvfp4_paper", backward_override="dequantised")
    with pytest.raises(ValueError, match="weights_1d_reuse|dgrad_w_reuse_fprop"):
        Recipe.preset("nvfp4_paper", backward_override="high_precision", weights_1d_reuse=True)
    with pytest.raises(ValueError, match="drop rht_fprop"):
        Recipe.preset("nvfp4_paper", backward_override="dequantized", rht_fprop=True)
    r = Recipe.preset("nvfp4_paper", backward_override="dequantized")
    assert r.fprop_w == Recipe.preset("nvfp4_paper").fprop_w and r.backward_recipe().dgrad_w.scheme == "bf16"
    assert Recipe.preset("nvfp4_paper").backward_recipe() == Recipe.preset("nvfp4_paper")
    f32 = Recipe.preset("nvfp4_paper", backward_override="high_precision", high_precision=None)
    assert f32.backward_recipe().dgrad_w.scheme is None
