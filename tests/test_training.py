"""Emulated training: fp4sim.gemm against TransformerEngine's reference qgemm, QuantLinear against nn.Linear and
against TE's reference quantizers + qgemm per GEMM, the recipe switches, stochastic rounding, training runs,
transformers models and DDP."""
from __future__ import annotations

import dataclasses
from dataclasses import replace
import types

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from fp4sim import emulate
from fp4sim.training import OPERANDS, Recipe
from peers import load_te_reference, torch_or_skip

torch = torch_or_skip()
from fp4sim.torch import (QuantLinear, collect_stats, convert, drop_extra_state,  # noqa: E402
                          set_data_parallel_rank, set_recipe, suggest_high_precision)


@pytest.fixture(scope="module")
def te_ref(tmp_path_factory):
    return load_te_reference(tmp_path_factory.mktemp("te"))


def _te_gemm(te_ref, qa, qb, pow2=False):
    """TE 2.20.2's reference qgemm on fp4sim's quantized operands (codes, decoded scales, global amaxes)."""
    ref = object.__new__(te_ref.NVFP4QuantizerRef)
    ref.pow_2_scales, ref.nvfp4_use_4over6, ref.nvfp4_e4m3_max = pow2, False, 448
    if pow2:
        sx, sw = torch.from_numpy(qa.linear_scales().copy()), torch.from_numpy(qb.linear_scales().copy())
        rx = rw = None
    else:
        sx = torch.from_numpy(fs.E4M3.values[qa.scales_per_row()].astype(np.float32))
        sw = torch.from_numpy(fs.E4M3.values[qb.scales_per_row()].astype(np.float32))
        amax = lambda q: torch.tensor([float(q.global_amax)], dtype=torch.float32)  # noqa: E731
        rx = types.SimpleNamespace(global_amax_row=amax(qa), global_amax_col=amax(qa))
        rw = types.SimpleNamespace(global_amax_row=amax(qb), global_amax_col=amax(qb))
    ca, cb = qa.codes.reshape(qa.lead[0], -1), qb.codes.reshape(qb.lead[0], -1)
    y = ref.qgemm(torch.from_numpy(ca.copy()), torch.from_numpy(cb.copy()), None, torch.float32, sx, sw,
                  qresult_x=rx, qresult_w=rw)
    return y.numpy()


def _operands():
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal((32, 256)) * np.exp(4 * rng.standard_normal((32, 1)))
              * np.exp(3 * rng.standard_normal((1, 256)))).astype(np.float32)   # block scales over many binades
    b = (rng.standard_normal((48, 256)) * np.exp(3 * rng.standard_normal((1, 256)))).astype(np.float32)
    zeros = b.copy()
    zeros[:, 32:64] = 0
    zeros[5] = 0
    outl = heavy((40, 128), 3)
    outl[3, 7] = 3e4
    odd = (heavy((37, 320), 7) * np.exp(2 * rng.standard_normal((1, 320)))).astype(np.float32)
    return {"spread": (spread, b), "zero_blocks": (spread, zeros), "outliers": (outl, heavy((24, 128), 4)),
            "odd_shapes": (odd, heavy((264, 320), 8))}    # rows not a multiple of 4, columns past 256


OPS = _operands()


def _same(a, b):
    assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
        f"{np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))} of {a.size} differ"


@pytest.mark.peer
@pytest.mark.parametrize("case", list(OPS))
@pytest.mark.parametrize("ta,tb", [(1, 1), (1, 16), (16, 16)])
def test_nvfp4_gemm_equals_te_reference_qgemm(te_ref, case, ta, tb):
    A, B = OPS[case]
    qa, qb = fs.quantize(A, "nvfp4", block=(ta, 16)), fs.quantize(B, "nvfp4", block=(tb, 16))
    want = _te_gemm(te_ref, qa, qb)
    _same(fs.gemm(qa, qb), want)
    _same(fs.gemm(qa, qb, accumulate="te_reference"), want)    # the model's name; "exact" is its alias


@pytest.mark.peer
@pytest.mark.parametrize("case", list(OPS))
def test_mxfp4_gemm_equals_te_reference_pow2_qgemm(te_ref, case):
    A, B = OPS[case]
    qa, qb = fs.quantize(A, "mxfp4"), fs.quantize(B, "mxfp4")
    _same(fs.gemm(qa, qb), _te_gemm(te_ref, qa, qb, pow2=True))


@pytest.mark.peer
@pytest.mark.parametrize("case", list(OPS))
@pytest.mark.parametrize("flavor", ["modelopt", "torchao"])
def test_per_tensor_scale_flavour_gemm_alpha_equals_te_reference_qgemm(te_ref, case, flavor):
    """ModelOpt's and torchao's operands decode with pts = amax / 2688, so their GEMM's alpha is fl(pts_a * pts_b).
    With tensor amaxes 2688 * 2^k (pts a power of two) that equals TE's fl(fl(amax_a * amax_b) / (6*6*448*448))
    exactly, so TE's reference qgemm on the same code and scale bytes, with those amaxes, gives the same bits."""
    A, B = OPS[case]
    out = []
    for M, k in ((A, -3), (B, 2)):
        top = np.float32(2688.0 * 2.0 ** k)
        M = (M / np.abs(M).max() * np.float32(0.7) * top).astype(np.float32)
        M[0, 0] = top
        out.append(M)
    qa, qb = (fs.quantize(M, "nvfp4", flavor=flavor) for M in out)
    assert float(qa.global_amax) == 2688.0 / 8 and float(qb.global_amax) == 2688.0 * 4
    _same(fs.gemm(qa, qb), _te_gemm(te_ref, qa, qb))


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4_2d", "mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "fp8_blockwise",
                                    "fp8_e4m3", "bf16", "mxfp6_e2m3", "mxfp6_e3m2", "mxint8", "fp8_e4m3fnuz"])
def test_gemm_agrees_with_float64_product_and_padding_contributes_nothing(scheme):
    A, B = heavy((40, 200), 1), heavy((24, 200), 2)      # K = 200: not a multiple of any block
    qa, qb = fs.quantize(A, scheme), fs.quantize(B, scheme)
    y = fs.gemm(qa, qb)
    ref = fs.dequantize(qa).astype(np.float64) @ fs.dequantize(qb).astype(np.float64).T
    tol = {"bf16": 1e-6}.get(scheme, 1e-5)
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max()
    Kp = 256
    pa, pb = np.zeros((40, Kp), np.float32), np.zeros((24, Kp), np.float32)
    pa[:, :200], pb[:, :200] = A, B
    _same(fs.gemm(fs.quantize(pa, scheme), fs.quantize(pb, scheme)), y)
    fast = fs.gemm(qa, qb, accumulate="fast")
    assert np.abs(fast - ref).max() <= 1e-5 * np.abs(ref).max()


def test_gemm_takes_operands_quantized_along_axis_zero_and_checks_arguments():
    A, B = heavy((64, 32), 5), heavy((64, 48), 6)         # Wgrad shape: dot over the 64 rows
    y = fs.gemm(fs.quantize(A, "nvfp4", axis=0), fs.quantize(B, "nvfp4", axis=0))
    _same(y, fs.gemm(fs.quantize(A.T.copy(), "nvfp4"), fs.quantize(B.T.copy(), "nvfp4")))
    with pytest.raises(ValueError, match="same format"):
        fs.gemm(fs.quantize(A, "nvfp4"), fs.quantize(A, "mxfp4"))
    with pytest.raises(ValueError, match="dot-product lengths differ"):
        fs.gemm(fs.quantize(A, "nvfp4"), fs.quantize(B, "nvfp4"))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        fs.gemm(A, B)


# ------------------------------------------------------------------------------------------------ QuantLinear
def _pair(recipe, inf=64, outf=48, bias=True, seed=0):
    torch.manual_seed(seed)
    q = QuantLinear(inf, outf, bias=bias, recipe=recipe)
    ref = torch.nn.Linear(inf, outf, bias=bias)
    ref.load_state_dict(drop_extra_state(q.state_dict()))
    return q, ref


def _run(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def test_none_recipe_is_exactly_nn_linear():
    q, ref = _pair("none")
    assert set(q.state_dict()) == set(ref.state_dict()) | {"_extra_state"}      # the call count
    x, dy = torch.randn(3, 16, 64), torch.randn(3, 16, 48)
    for a, b in zip(_run(q, x, dy), _run(ref, x, dy)):
        assert torch.equal(a, b)
    q2 = QuantLinear(8, 4, recipe="none", dtype=torch.float64)
    assert q2.weight.dtype == torch.float64


def _te_quant(te_ref, a, tile=1):
    """TE reference quantization of a (rows, K) operand along K (current scaling)."""
    g = np.float32(np.abs(a).max())
    codes, scales = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
        torch.from_numpy(a), torch.tensor(g), 16, tile, pow_2_scales=False, eps=0.0)
    q = fs.quantize(a, "nvfp4", block=(tile, 16))
    assert np.array_equal(q.codes, codes.numpy())     # TE's own quantizer gives these codes
    return q


@pytest.mark.peer
def test_nvfp4_paper_without_sr_equals_te_reference_per_gemm(te_ref):
    rec = Recipe.preset("nvfp4_paper", disable_stochastic_rounding=True)
    q, _ = _pair(rec, 96, 64, bias=False)          # TE's qgemm needs every dot length a multiple of 32
    x, dy = torch.randn(32, 96), torch.randn(32, 64)
    y, dx, dw, _ = _run(q, x, dy)
    X, W, DY = x.numpy(), q.weight.detach().numpy(), dy.numpy()
    _same(y.numpy(), _te_gemm(te_ref, _te_quant(te_ref, X), _te_quant(te_ref, W, 16)))
    _same(dx.numpy(), _te_gemm(te_ref, _te_quant(te_ref, DY), _te_quant(te_ref, W.T.copy(), 16)))
    rot = lambda a: fs.rht(a, 16, "te", axis=0).T.copy()  # noqa: E731  fp4sim's rotation fed to TE
    _same(dw.numpy(), _te_gemm(te_ref, _te_quant(te_ref, rot(DY)), _te_quant(te_ref, rot(X))))


def _changed(base, new):
    return {op for op in OPERANDS if getattr(base, op) != getattr(new, op)}


@pytest.mark.parametrize("switch,ops", [
    ("disable_rht", {"wgrad_x", "wgrad_dy"}), ("disable_stochastic_rounding", {"dgrad_dy", "wgrad_dy"}),
    ("disable_2d_quantization", {"fprop_w", "dgrad_w"}), ("sr_activations", {"fprop_x", "wgrad_x"}),
    ("sr_weights", {"fprop_w", "dgrad_w"}), ("sr_backward", {"dgrad_w", "wgrad_x"}),
    ("rht_fprop", {"fprop_x", "fprop_w"}), ("rht_dgrad", {"dgrad_dy", "dgrad_w"})])
def test_each_switch_changes_exactly_the_operands_it_names(switch, ops):
    base = Recipe.preset("nvfp4_paper")
    new = Recipe.preset("nvfp4_paper", **{switch: True})
    assert _changed(base, new) == ops
    # and numerically: a GEMM whose operands did not change gives the same bits
    torch.manual_seed(1)
    w, x, dy = torch.randn(48, 64), torch.randn(32, 64), torch.randn(32, 48)
    for g, fn in (("fprop", lambda r: emulate.fprop(x.numpy(), w.numpy(), r)[0]),
                  ("dgrad", lambda r: emulate.dgrad(dy.numpy(), w.numpy(), r)),
                  ("wgrad", lambda r: emulate.wgrad(dy.numpy(), x.numpy(), r))):
        same = np.array_equal(fn(base), fn(new))
        assert same == (not any(op.startswith(g) for op in ops)), (switch, g)


def test_rht_size_and_sign_strategies():
    r = Recipe.preset("nvfp4_paper", rht_size=128, rht_signs="per_transform")
    assert r.wgrad_x.rht == r.wgrad_dy.rht == 128 and r.wgrad_x.rht_signs == "per_transform"
    x, dy = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32), \
        np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    a, b = emulate.wgrad(dy, x, r, call=0), emulate.wgrad(dy, x, r, call=1)
    fixed = Recipe.preset("nvfp4_paper", rht_size=128, rht_signs="fixed", disable_stochastic_rounding=True)
    none = Recipe.preset("nvfp4_paper", rht_signs="none", disable_stochastic_rounding=True)
    assert not np.array_equal(a, b)                                       # a new vector per call
    assert np.array_equal(emulate.wgrad(dy, x, fixed, call=0), emulate.wgrad(dy, x, fixed, call=1))
    assert none.wgrad_x.rht_signs == "none"
    with pytest.raises(ValueError, match="unknown switches"):
        Recipe.preset("nvfp4_paper", rht_sise=3)


def test_preset_takes_operands_by_name_after_its_switches():
    from fp4sim.training import Operand
    w = Operand("nvfp4", (1, 16))
    r = Recipe.preset("bf16", fprop_w=w, dgrad_w=w)
    assert r.fprop_w == w and r.dgrad_w == w and r.fprop_x == Operand("bf16") and r.name == "bf16"
    r = Recipe.preset("nvfp4_paper", disable_rht=True, wgrad_x=Operand("bf16"))
    assert r.wgrad_x == Operand("bf16") and r.wgrad_dy.rht is None      # the switch still applies elsewhere


def test_weights_only_recipe_runs_a_mixed_gemm_on_the_quantized_values():
    """NVFP4 weights with BF16 activations (the paper's Fig. 14 weights-only case): no block-scaled GEMM takes the
    pair, so the quantized operands are upcast to their values and multiplied in float32."""
    from fp4sim.training import Operand
    w16 = Operand("nvfp4", (16, 16))
    r = Recipe.preset("bf16", fprop_w=w16, dgrad_w=w16)
    rng = np.random.default_rng(3)
    x, W, dy = (rng.standard_normal(s).astype(np.float32) for s in ((32, 64), (48, 64), (32, 48)))
    y, _ = emulate.fprop(x, W, r)
    want = np.matmul(fs.fake_quantize(x, "bf16"), fs.fake_quantize(W, "nvfp4_2d").T)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
    dx = emulate.dgrad(dy, W, r)
    want = np.matmul(fs.fake_quantize(dy, "bf16"), fs.fake_quantize(W, "nvfp4_2d", axis=0))
    assert np.array_equal(dx.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_2d_weights_give_dgrad_the_fprop_values_and_1d_weights_do_not():
    w = heavy((48, 64), 2)
    for rec, same in ((Recipe.preset("nvfp4_paper"), True), (Recipe.preset("nvfp4_paper", disable_2d_quantization=True),
                                                             False)):
        f = fs.dequantize(emulate.quantize_operand(w, rec.fprop_w, 1, rec, 0, 0, "fprop_w"))
        d = fs.dequantize(emulate.quantize_operand(w, rec.dgrad_w, 0, rec, 0, 0, "dgrad_w"))
        assert np.array_equal(f, d) == same
    reuse = Recipe.preset("nvfp4_paper", weights_1d_reuse=True, disable_stochastic_rounding=True)
    y, qw = emulate.fprop(heavy((8, 64), 3), w, reuse)
    dy = heavy((8, 48), 4)
    got = emulate.dgrad(dy, w, reuse, qw_fprop=qw)
    want = fs.dequantize(emulate.quantize_operand(dy, reuse.dgrad_dy, 1, reuse, 0, 0, "dgrad_dy")) @ fs.dequantize(qw)
    assert np.array_equal(got, want.astype(np.float32))


def test_wgrad_can_reuse_the_fprop_copy_of_the_activations():
    from fp4sim.training import Operand
    a1 = Operand("nvfp4", (1, 16))
    reuse = Recipe.preset("bf16", fprop_x=a1, wgrad_x=a1, wgrad_x_reuse_fprop=True)
    x, w, dy = heavy((32, 64), 5), heavy((48, 64), 6), heavy((32, 48), 7)
    y, _, qx = emulate.fprop(x, w, reuse, return_qx=True)
    got = emulate.wgrad(dy, x, reuse, qx_fprop=qx)
    xk = fs.dequantize(fs.quantize(x, "nvfp4", axis=1))                  # x along K, as Fprop quantized it
    dyb = dy.astype(ml_dtypes.bfloat16).astype(np.float32)                # the BF16 gradient operand
    assert np.array_equal(got, (dyb.T @ xk).astype(np.float32))
    again = emulate.wgrad(dy, x, replace(reuse, wgrad_x_reuse_fprop=False))   # re-quantized along the tokens
    xm = fs.dequantize(fs.quantize(x, "nvfp4", axis=0))
    assert np.array_equal(again, (dyb.T @ xm).astype(np.float32)) and not np.array_equal(got, again)
    # through QuantLinear: the same dW as the emulated GEMM on the Fprop copy, multiplied by torch (the bridge's
    # float32 GEMMs run on torch's threads)
    lin = QuantLinear(64, 48, bias=False, recipe=reuse)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    xt = torch.from_numpy(x).requires_grad_(True)
    lin(xt).backward(torch.from_numpy(dy))
    assert np.array_equal(lin.weight.grad.numpy(), (torch.from_numpy(dyb).T @ torch.from_numpy(xk)).numpy())
    with pytest.raises(ValueError, match="wgrad_x_reuse_fprop.*RHT"):
        Recipe.preset("nvfp4_paper", wgrad_x_reuse_fprop=True)
    with pytest.raises(TypeError, match="wgrad_x_reuse_fprop='yes'"):
        Recipe.preset("bf16", wgrad_x_reuse_fprop="yes")


def test_sr_is_reproducible_seeded_and_unbiased():
    x, dy = torch.randn(64, 64), torch.randn(64, 48)

    def grads(seed):
        q, _ = _pair(Recipe.preset("nvfp4_paper", seed=seed))
        return _run(q, x, dy)

    a, b, c = grads(7), grads(7), grads(8)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    q, _ = _pair(Recipe.preset("nvfp4_paper", seed=7))          # fresh bits on every call, reproducibly
    first = _run(q, x, dy)
    q.weight.grad = q.bias.grad = None
    second = _run(q, x, dy)
    assert torch.equal(first[1], a[1]) and not torch.equal(second[1], first[1])
    assert torch.equal(first[3], dy.sum(0)) and torch.equal(second[3], dy.sum(0))   # bias grad: sum over tokens
    assert torch.equal(a[0], c[0])                         # the forward never depends on the SR seed
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[2], c[2])
    # Dgrad and Wgrad: the mean over seeds converges at the 1/sqrt(n) rate to the product with the gradient's
    # exact SR expectation (all 256 random bytes enumerated). That expectation equals the unrounded gradient up
    # to the 8-bit truncation floor(delta*256)/256 except where the E4M3 block scale rounds below amax/6: there
    # the block's largest elements scale above 6 and saturate (SR is satfinite) - NVFP4's one real SR bias.
    rec = Recipe.preset("nvfp4_paper")
    rng = np.random.default_rng(9)
    W, X = rng.standard_normal((48, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    D = dy.numpy()
    qw = fs.dequantize(emulate.quantize_operand(W, rec.dgrad_w, 0, rec, 0, 0, "dgrad_w")).astype(np.float64)
    qx = fs.dequantize(emulate.quantize_operand(X, rec.wgrad_x, 0, rec, 0, 0, "wgrad_x", "te")).astype(np.float64)
    Dr = fs.rht(D, 16, "te", axis=0, out="bf16")                      # Wgrad sees the rotated gradient

    def expectation(a, axis):
        return sum(fs.fake_quantize(a, "nvfp4", axis=axis, rounding="sr", rbits=np.full(a.shape, r, np.uint8))
                   .astype(np.float64) for r in range(256)) / 256

    E1, E0 = expectation(D, 1), expectation(Dr, 0)
    for name, fn, ref in (("dgrad", lambda r: emulate.dgrad(D, W, r), E1 @ qw),
                          ("wgrad", lambda r: emulate.wgrad(D, X, r), E0.T @ qx)):
        samples = [fn(dataclasses.replace(rec, seed=s)) for s in range(256)]
        err = [np.linalg.norm(np.mean(samples[:n], 0) - ref) for n in (4, 16, 64, 256)]
        assert all(1.5 < err[i] / err[i + 1] < 2.7 for i in range(3)), (name, err)
    q = fs.quantize(D, "nvfp4")
    fac = np.repeat(fs.E4M3.values[q.scales].astype(np.float64), 16, axis=1) * float(q.global_amax) / 2688
    over = np.abs(D) / fac > 6                                             # scaled above 6: saturates
    assert over.any() and np.all(np.abs(E1 - D)[~over] <= 2 * fac[~over] / 256)   # 8-bit truncation only
    assert np.abs(E1 - D)[over].max() > 10 * (2 * fac / 256).max()


class TinyGPT(torch.nn.Module):
    """Two pre-norm blocks (attention with q, k, v, o projections; an MLP), untied head."""

    def __init__(self, vocab=32, d=64, heads=4, blocks=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(blocks):
            blk = torch.nn.Module()
            blk.n1, blk.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            blk.q, blk.k, blk.v, blk.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
            blk.up, blk.down = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)
            self.layers.append(blk)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.heads = heads

    def forward(self, idx):
        B, T = idx.shape
        h = self.emb(idx)
        for blk in self.layers:
            a = blk.n1(h)
            q, k, v = (f(a).view(B, T, self.heads, -1).transpose(1, 2) for f in (blk.q, blk.k, blk.v))
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + blk.o(att.transpose(1, 2).reshape(B, T, -1))
            h = h + blk.down(torch.relu(blk.up(blk.n2(h))) ** 2)
        return self.head(h)


def _data(n=8, T=32, vocab=32):
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + torch.arange(T + 1)) % vocab            # counting sequences: learnable in a few steps


@pytest.mark.parametrize("preset", ["none", "bf16", "nvfp4_paper", "mxfp4_paper", "mxfp8", "mxfp6", "fp8_blockwise"])
def test_tiny_transformer_trains_under_every_preset(preset):
    torch.manual_seed(0)
    model = convert(TinyGPT(), Recipe.preset(preset, keep=("head",)) if preset != "none" else "none")
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 13
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = _data()
    losses = []
    for _ in range(12):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


def test_convert_keeps_blocks_and_set_recipe_switches_late():
    model = convert(TinyGPT(blocks=3), Recipe.preset("nvfp4_paper", keep_last=1, keep=("head",)))
    kept = {n for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.recipe.name == "bf16"}
    assert kept == {f"layers.2.{p}" for p in ("q", "k", "v", "o", "up", "down")} | {"head"}
    set_recipe(model, "bf16", which="backward")
    m = model.layers[0].q
    assert m.recipe.name == "nvfp4_paper"
    assert m.recipe_backward.name == "bf16"
    model(_data(2, 16)[:, :-1]).sum().backward()
    with pytest.raises(ValueError, match="which"):
        set_recipe(model, "bf16", which="sideways")


def test_per_layer_stats_and_high_precision_suggestion():
    torch.manual_seed(0)
    model = convert(TinyGPT(), "nvfp4_paper")
    data = _data(4, 32)
    step = lambda: torch.nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, 32),  # noqa: E731
                                                     data[:, 1:].reshape(-1)).backward()
    with collect_stats(model) as log:
        step()
    ds = log.dataset()
    assert set(ds.operand.values) == set(OPERANDS) and ds.sizes["layer"] == 13
    assert float(ds.rel_mse.min()) > 0 and float(ds.rel_mse.max()) < 0.2 and int(ds.calls.min()) == 1
    r = [x for x in log.records() if x["layer"] == "layers.0.q" and x["operand"] == "fprop_x"][0]
    a = model.layers[0].n1(model.emb(data[:, :-1])).detach().reshape(-1, 64).numpy()
    y = fs.fake_quantize(a, "nvfp4").astype(np.float64)
    assert r["rel_mse"] == pytest.approx(np.mean((y - a) ** 2) / np.mean(a.astype(np.float64) ** 2), rel=1e-9)
    for p in model.parameters():
        p.grad = None
    keep, err = suggest_high_precision(model, step, fraction=0.15)
    assert len(keep) == 2 and set(err) == {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert all(err[k] >= max(v for n, v in err.items() if n not in keep) for k in keep)
    assert all(p.grad is None for p in model.parameters())


def test_convert_a_transformers_llama_and_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    convert(model, Recipe.preset("nvfp4_paper", keep=("lm_head",)))
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 2 * 7 + 1
    ids = torch.randint(0, 64, (2, 32))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.model.layers[0].mlp.down_proj.weight.grad is not None
    g2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4,
                                                              n_positions=64))
    convert(g2, "nvfp4_paper")       # GPT-2 uses Conv1D, not nn.Linear: only its head is a Linear
    assert sum(isinstance(m, QuantLinear) for m in g2.modules()) == 1


def _ddp_worker(rank, world, path):
    torch.manual_seed(0)
    model = convert(TinyGPT(), Recipe.preset("nvfp4_paper", seed=3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = _data(4, 32)[rank * 2:(rank + 1) * 2]
    loss = torch.nn.functional.cross_entropy(ddp(data[:, :-1]).reshape(-1, 32), data[:, 1:].reshape(-1))
    loss.backward()
    torch.save({n: p.grad for n, p in model.named_parameters()}, f"{path}/ddp{rank}.pt")


def test_ddp_gradients_are_the_mean_of_each_process_alone(tmp_path, monkeypatch):
    from gloo import spawn
    spawn(_ddp_worker, (str(tmp_path),), monkeypatch)
    synced = torch.load(tmp_path / "ddp0.pt")
    alone = []
    for rank in range(2):
        torch.manual_seed(0)
        model = convert(TinyGPT(), Recipe.preset("nvfp4_paper", seed=3))
        set_data_parallel_rank(model, rank)            # each rank draws its own stochastic-rounding bits
        data = _data(4, 32)[rank * 2:(rank + 1) * 2]
        torch.nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, 32), data[:, 1:].reshape(-1)).backward()
        alone.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in synced.items():
        assert torch.allclose(g, (alone[0][n] + alone[1][n]) / 2, rtol=1e-5, atol=1e-7), n


@pytest.mark.gpu
def test_quant_linear_on_cuda_gives_the_cpu_bits():
    if not (torch.cuda.is_available() and fs.gpu.available()):
        pytest.skip("no CUDA device with CuPy: the GPU run needs pip install '.[gpu]' and a CUDA torch")
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    cpu = _run(_pair(Recipe.preset("nvfp4_paper", seed=5))[0], x, dy)
    # a second layer with the same weights: its first call draws the same stochastic-rounding bytes and RHT signs
    # (the call count is part of their streams)
    gpu = _run(_pair(Recipe.preset("nvfp4_paper", seed=5))[0].cuda(), x.cuda(), dy.cuda())
    for a, b in zip(cpu[:3], gpu[:3]):               # y, dx, dW: the emulated GEMMs
        assert torch.equal(a, b.cpu())
    # the bias gradient is torch's own float32 sum of dy, as nn.Linear's: its order is each device's
    assert torch.equal(cpu[3], dy.sum(0)) and torch.equal(gpu[3], dy.cuda().sum(0))


# ------------------------------------------------------------------------ streams, signs and switches of a call
def _bits_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_sr_streams_of_the_six_operands_of_a_call_are_independent_and_reproducible():
    """Every operand of one call draws its own Philox stream, 8 * call + its index in OPERANDS, under the layer's
    key (emulate's rule): the same tensor quantized as each of the six operands (same settings and axis) gives six
    different SR results, equal to fs.quantize with that stream; the same call again gives the same bits, and
    another call or layer other bits."""
    from fp4sim.training import Operand
    sr = Operand("nvfp4", (1, 16), rounding="sr")
    rec = Recipe(**{op: sr for op in OPERANDS}, seed=11)
    a = heavy((32, 64), 13)

    def codes(name, call=3, layer=2):
        q = emulate.quantize_operand(a, sr, 1, rec, layer, call, name)
        return q.codes.copy()

    got = {name: codes(name) for name in OPERANDS}
    for i, name in enumerate(OPERANDS):
        want = fs.quantize(a, "nvfp4", rounding="sr", seed=emulate.layer_seed(11, 2), stream=8 * 3 + i)
        assert np.array_equal(got[name], want.codes), name
        assert np.array_equal(codes(name), got[name]), name                 # reproducible
        assert not np.array_equal(codes(name, call=4), got[name]), name     # a new stream per call
        assert not np.array_equal(codes(name, layer=3), got[name]), name    # a new key per layer
    for i, u in enumerate(OPERANDS):
        for v in OPERANDS[i + 1:]:
            assert not np.array_equal(got[u], got[v]), (u, v)
    # a data-parallel rank r keys its draws (layer_seed + r x 0xD1B54A32D192ED03) mod 2^64 (docs/training.md)
    for r in (1, 5):
        with emulate.data_parallel_rank(r):
            q = emulate.quantize_operand(a, sr, 1, rec, 2, 3, "wgrad_dy")
        key = (emulate.layer_seed(11, 2) + r * 0xD1B54A32D192ED03) % 2 ** 64
        want = fs.quantize(a, "nvfp4", rounding="sr", seed=key, stream=8 * 3 + OPERANDS.index("wgrad_dy"))
        assert np.array_equal(q.codes, want.codes) and not np.array_equal(q.codes, got["wgrad_dy"])



def test_per_transform_rht_signs_are_distinct_for_each_gemm_of_a_call(monkeypatch):
    """rht_signs='per_transform' draws a new sign vector for every GEMM: with the RHT on all three GEMMs, the two
    operands of a GEMM share one vector, the three GEMMs of one call have three different vectors, another call
    has others, and the same call again the same ones (the vectors recorded from the transforms applied)."""
    from fp4sim.hadamard import rht_signs
    rec = Recipe.preset("nvfp4_paper", rht_fprop=True, rht_dgrad=True, rht_signs="per_transform", seed=3)
    assert all(getattr(rec, op).rht == 16 and getattr(rec, op).rht_signs == "per_transform" for op in OPERANDS)
    seen = []
    real, real_q = emulate.rht, emulate.rht_quantize

    def spy(a, d, signs, **kw):
        seen.append(tuple(rht_signs(d, signs)))
        return real(a, d, signs, **kw)

    def spy_q(a, d, signs, *args, **kw):             # an RHT with the quantize that follows it (one call)
        seen.append(tuple(rht_signs(d, signs)))
        return real_q(a, d, signs, *args, **kw)

    monkeypatch.setattr(emulate, "rht", spy)
    monkeypatch.setattr(emulate, "rht_quantize", spy_q)
    x, w, dy = heavy((32, 64), 1), heavy((48, 64), 2), heavy((32, 48), 3)

    def vectors(call):
        seen.clear()
        emulate.fprop(x, w, rec, layer=1, call=call)
        emulate.dgrad(dy, w, rec, layer=1, call=call)
        emulate.wgrad(dy, x, rec, layer=1, call=call)
        assert len(seen) == 6
        assert seen[0] == seen[1] and seen[2] == seen[3] and seen[4] == seen[5]     # one vector per GEMM
        return seen[0], seen[2], seen[4]

    c0 = vectors(0)
    assert len(set(c0)) == 3, "two GEMMs of one call share a sign vector"
    assert vectors(0) == c0
    c1 = vectors(1)
    assert len(set(c1)) == 3 and not set(c1) & set(c0)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_set_recipe_which_changes_exactly_its_gemms(which):
    """set_recipe(model, 'bf16', which=...) on an nvfp4_paper layer: 'forward' changes Fprop alone, 'backward'
    Dgrad and Wgrad alone. The layer's output and gradients against the emulated GEMMs run directly under the
    recipe each GEMM should have (the same layer index and call, so the same SR bits)."""
    nv, bf = Recipe.preset("nvfp4_paper", seed=4), Recipe.preset("bf16", seed=4)
    lin = QuantLinear(64, 48, bias=False, recipe=nv)
    lin.layer_index = 2
    model = torch.nn.Sequential(lin)
    set_recipe(model, bf, which=which)
    x, dy = heavy((32, 64), 8), heavy((32, 48), 9)
    xt = torch.from_numpy(x).requires_grad_(True)
    y = model(xt)
    y.backward(torch.from_numpy(dy))
    w = lin.weight.detach().numpy()
    fwd, bwd = (bf, nv) if which == "forward" else (nv, bf)
    want_y, _ = emulate.fprop(x, w, fwd, 2, 0)
    assert _bits_equal(y.detach().numpy(), want_y)
    assert _bits_equal(xt.grad.numpy(), emulate.dgrad(dy, w, bwd, 2, 0))
    assert _bits_equal(lin.weight.grad.numpy(), emulate.wgrad(dy, x, bwd, 2, 0))
    other_y, _ = emulate.fprop(x, w, bwd, 2, 0)                  # the switch really changes something
    assert not _bits_equal(want_y, other_y)
    assert not _bits_equal(emulate.dgrad(dy, w, fwd, 2, 0), emulate.dgrad(dy, w, bwd, 2, 0))


def test_dgrad_reuses_the_fprop_weight_copy_only_when_asked():
    """dgrad_w_reuse_fprop=True: Dgrad multiplies by Fprop's copy of W (quantized along K, 1x16) upcast to float32;
    False: W is quantized again along N for Dgrad, whatever copy is at hand. In emulate and through QuantLinear,
    against the product of the fp4sim-quantized values computed here (through QuantLinear, whose float32 GEMMs
    are torch's, by torch.matmul)."""
    base = Recipe.preset("nvfp4_paper", disable_2d_quantization=True, disable_stochastic_rounding=True)
    on = replace(base, dgrad_w_reuse_fprop=True)
    x, w, dy = heavy((32, 64), 21), heavy((48, 64), 22), heavy((32, 48), 23)
    dyq = fs.dequantize(fs.quantize(dy, "nvfp4", axis=1))                        # dgrad_dy: dy along N
    along_k = fs.dequantize(fs.quantize(w, "nvfp4", axis=1))                     # Fprop's copy of W
    along_n = fs.quantize(w, "nvfp4", axis=0)                                    # Dgrad's own copy of W
    want_on = np.matmul(dyq, along_k).astype(np.float32)
    want_off = fs.gemm(fs.quantize(dy, "nvfp4", axis=1), along_n)
    torch_on = (torch.from_numpy(dyq) @ torch.from_numpy(along_k)).numpy()
    assert not _bits_equal(want_on, want_off)
    for rec, want, bridge in ((on, want_on, torch_on), (base, want_off, want_off)):
        _, qw = emulate.fprop(x, w, rec)
        assert _bits_equal(emulate.dgrad(dy, w, rec, qw_fprop=qw), want), rec.dgrad_w_reuse_fprop
        lin = QuantLinear(64, 48, bias=False, recipe=rec)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w))
        xt = torch.from_numpy(x).requires_grad_(True)
        lin(xt).backward(torch.from_numpy(dy))
        assert _bits_equal(xt.grad.numpy(), bridge), rec.dgrad_w_reuse_fprop


def test_operand_stats_count_max_codes_and_clipping_of_negative_blocks():
    """collect_stats' max_code is the share of codes with magnitude 6: each block here has one element at its
    amax and the rest at a tenth of it, so exactly 1 in 16 codes is +-6 whatever the signs: all-negative,
    all-positive and mixed inputs give 1/16 (the rest code to 0.5). clipped counts the amax elements above their
    block's largest value."""
    lin = QuantLinear(64, 32, bias=False, recipe="nvfp4_paper")
    model = torch.nn.Sequential(lin)
    rng = np.random.default_rng(0)
    base = np.full((32, 64), 0.1, np.float32) * np.exp(rng.standard_normal((32, 1))).astype(np.float32)
    base[:, ::16] *= 10                                          # one amax element per 16-element block
    for sign in (-1.0, 1.0, np.where(np.arange(32) % 2, -1.0, 1.0)[:, None]):
        x = (base * sign).astype(np.float32)
        with collect_stats(model) as log:
            model(torch.from_numpy(x))
        r = [e for e in log.records() if e["operand"] == "fprop_x"][0]
        assert r["max_code"] == 1 / 16, (sign, r)
        codes = fs.layout.unpack_fp4(fs.quantize(x, "nvfp4").codes)
        assert np.all((codes & 7) == np.where(np.arange(64) % 16 == 0, 7, 1)), "the crafted codes"
        # clipped: the amax elements whose block scale rounded below amax / 6, so |x| > its dequantized +-6
        lost = np.abs(x[:, ::16]) > np.abs(fs.fake_quantize(x, "nvfp4")[:, ::16])
        assert 0 < lost.sum() < lost.size and r["clipped"] == lost.sum() / x.size, (sign, r)
