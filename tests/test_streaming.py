"""Weight gradients reduced as the backward makes them (fp4sim.torch.streaming): gradient_sinks hands each layer's
float32 weight gradient over, the same bits that .grad gets from a plain backward (a bfloat16 weight's too, against
the model widened to float32); streaming_fidelity equals gradient_fidelity, which holds every layer's gradients
at once, while no gradient outlives its layer; wgrad_errors in pieces equals it whole to the last bits."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from peers import torch_or_skip

torch = torch_or_skip()


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                            torch.nn.Linear(96, 64), torch.nn.GELU(), torch.nn.Linear(64, 32, bias=False))
    for lin in (m[0], m[3], m[5]):
        lin.weight.data = lin.weight.data.to(dtype)
    return m


def _x(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 16, 64, generator=g), torch.randn(3, 16, 32, generator=g)


def _loss(m, x, t):
    return ((m(x) - t) ** 2).mean()


@pytest.mark.parametrize("recipe", ["nvfp4_paper", "none"])
def test_the_sink_gets_the_bits_that_grad_gets(recipe):
    from fp4sim.torch import convert, gradient_sinks
    x, t = _x()
    plain = convert(_model(), recipe, quantize_head=True)
    plain.zero_grad()
    _loss(plain, x, t).backward()
    want = {n: m.weight.grad.clone() for n, m in plain.named_modules() if hasattr(m, "_calls")}
    # the same weights stored in bfloat16 against a float32 model holding their widened values
    for dtype in (torch.float32, torch.bfloat16):
        m = convert(_model(dtype), recipe, quantize_head=True)
        if dtype == torch.bfloat16:
            ref = convert(_model(dtype), recipe, quantize_head=True)
            for lin in ref.modules():
                if hasattr(lin, "_calls"):
                    lin.weight.data = lin.weight.data.float()
            ref.zero_grad()
            _loss(ref, x, t).backward()
            want = {n: q.weight.grad.clone() for n, q in ref.named_modules() if hasattr(q, "_calls")}
        got = {}
        with gradient_sinks(m, lambda n, g: got.__setitem__(n, g.clone())):
            _loss(m, x, t).backward()
        assert set(got) == set(want)
        for n in want:
            assert got[n].dtype == torch.float32
            assert torch.equal(got[n], want[n]), (recipe, dtype, n)
        assert all(q.weight.grad is None for q in m.modules() if hasattr(q, "_calls"))   # nothing accumulated
        assert m[0].bias.grad is not None                      # the other parameters' gradients as ever


def test_streaming_fidelity_is_gradient_fidelity_with_no_gradient_held():
    from fp4sim.torch import convert, gradient_fidelity, streaming_fidelity
    from fp4sim.torch import streaming
    x, t = _x()
    m = convert(_model(), "nvfp4_paper", quantize_head=True)
    before = torch.full_like(m[0].bias, 7.0)
    m[0].bias.grad = before.clone()                          # a .grad from before stays as it was

    def fn():
        m.zero_grad(set_to_none=True)
        _loss(m, x, t).backward()

    m[0].bias.grad = before.clone()
    grads = [p.grad for p in m.parameters()]
    want = gradient_fidelity(m, fn)
    for p, g in zip(m.parameters(), grads):
        p.grad = g
    alive = []
    put = streaming._Spill.put

    def spying(self, key, g):                                # every gradient handed over dies after its call
        assert all(r() is None for r in alive), "a layer's gradient outlived its layer"
        alive.append(weakref.ref(g))
        return put(self, key, g)

    streaming._Spill.put = spying
    try:
        got, loss, loss_ref = streaming_fidelity(m, lambda quantized: _loss(m, x, t))
    finally:
        streaming._Spill.put = put
    gc.collect()
    assert len(alive) == 3
    np.testing.assert_array_equal(got.snr.values, want.snr.values)
    np.testing.assert_array_equal(got.cosine.values, want.cosine.values)
    np.testing.assert_array_equal(got.rel_error.values, want.rel_error.values)
    assert list(got.layer.values) == list(want.layer.values)
    assert torch.equal(m[0].bias.grad, before) and m[3].weight.grad is None
    with torch.no_grad():
        assert loss_ref == float(_loss(convert(_model(), "none"), x, t))
    for n in want.layer.values:                  # (both take the SNR and cosine from gradient_sums, below)
        assert 0 < float(got.snr.sel(layer=n)) < 1e6 and -1 <= float(got.cosine.sel(layer=n)) <= 1


def test_gradient_sums_are_the_float64_sums():
    """gradient_sums (the CPU's fused pass, and torch's float64 operations in pieces of rows as a device runs
    them) against math.fsum of the exact float64 products: equal to the last bits, on gradients with a large
    dynamic range, an odd length and zeros."""
    import math
    from fp4sim.torch.stats import _torch_sums, gradient_sums
    g = torch.Generator().manual_seed(5)
    for shape in ((3, 5), (97, 301), (1024, 33)):
        r = torch.randn(*shape, generator=g) * torch.exp(3 * torch.randn(*shape, generator=g))
        q = r + 0.1 * torch.randn(*shape, generator=g) * r.abs()
        q[0, :2] = 0
        a, b = q.double().reshape(-1).tolist(), r.double().reshape(-1).tolist()
        want = (math.fsum(y * y for y in b), math.fsum((x - y) ** 2 for x, y in zip(a, b)),
                math.fsum(x * x for x in a), math.fsum(x * y for x, y in zip(a, b)))
        for got in (gradient_sums(q, r), _torch_sums(q, r, 100), _torch_sums(q, r)):
            for u, v in zip(got, want):
                assert u == pytest.approx(v, rel=1e-13), shape


def test_a_layer_missing_from_one_pass_is_named(tmp_path):
    from fp4sim.torch import convert, streaming_fidelity
    x, t = _x()
    m = convert(_model(), "nvfp4_paper", quantize_head=True)
    with pytest.raises(ValueError, match=r"'5'.*float32 reference run"):
        streaming_fidelity(m, lambda quantized: ((m[:5](x)) ** 2).mean())
    with pytest.raises(ValueError, match="spill_dir=.*not a folder"):
        streaming_fidelity(m, lambda quantized: _loss(m, x, t), spill_dir=tmp_path / "none")


def test_wgrad_errors_in_pieces_are_the_whole_sums_to_the_last_bits(monkeypatch):
    from fp4sim.torch import convert, stats, wgrad_errors
    x, t = _x()

    def run():
        m = convert(_model(), "nvfp4_paper", quantize_head=True)
        with wgrad_errors(m) as calls:
            _loss(m, x, t).backward()
        return calls

    whole = run()
    monkeypatch.setattr(stats, "CHUNK", 200)            # every layer in pieces of 200 outputs' rows
    pieces = run()
    for n in whole:
        (e0, r0), = whole[n]
        (e1, r1), = pieces[n]
        assert e1 == pytest.approx(e0, rel=1e-12) and r1 == pytest.approx(r0, rel=1e-12)


@pytest.mark.parametrize("scheme,block", [("nvfp4", None), ("nvfp4", (16, 16)), ("mxfp4", None),
                                          ("mxfp8_e4m3", None), ("fp8_e4m3", None)])
def test_the_fused_operand_statistics_are_numpys(scheme, block):
    """collect_stats' per-operand statistics in one fused pass on the CPU against the NumPy expressions they
    replace: the counts (underflow, codes at +-6, clipped) and the amax equal, the relative MSE to the last bits
    (float64 sums in another order); C- and Fortran-ordered operands quantized along either axis, with zeros,
    a subnormal, a NaN-free and an all-zero row, and an odd length."""
    from fp4sim import emulate
    from fp4sim.quantize import dequantize, quantize
    rng = np.random.default_rng(3)
    for shape in ((64, 48), (48, 64), (32, 33)):
        x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 3)).astype(np.float32)
        x[0, :5] = 0
        x[1, 3] = 1e-30
        x[2] = 0
        for a in (x, np.asfortranarray(x)):
            for axis in (0, 1):
                kw = {"block": block} if block else {}
                if shape[axis ^ 1] % 2 and block:
                    continue
                q = quantize(a, scheme, axis=axis, **kw)
                y = dequantize(q)
                got = emulate._operand_stats_cpu(a, y, q, "x")
                want = emulate._operand_stats_arrays(a, y, q, "x")
                for k in ("underflow", "max_code", "clipped", "amax"):
                    assert got[k] == want[k], (scheme, shape, a.flags.f_contiguous, axis, k)
                assert got["rel_mse"] == pytest.approx(want["rel_mse"], rel=1e-13)
                if scheme.endswith("fp4"):
                    assert got["max_code"] > 0.001                 # the code check ran
