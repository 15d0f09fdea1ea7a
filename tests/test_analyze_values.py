"""Every analysis metric asserted against an independent NumPy computation from the quantized values, and
the analysis's memory bound."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from fp4sim.analyze.metrics import SCHEMES_BY_LABEL, scheme_metrics
from fp4sim.analyze.studies import gradient_bias, hadamard_effect, outliers, wgrad_gemm
from fp4sim.layout import unpack_fp4

X = heavy((64, 96), 11)
X[3, 5] = 0.0
X[7, :16] = 1e-6 * X[7, :16]         # a block that underflows


def _oracle(x, y, codes=None, B=16):
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    e = y64 - x64
    ms, mse = np.mean(x64 ** 2), np.mean(e ** 2)
    nz = x64 != 0
    blocks = x64.reshape(x.shape[0], -1, B)
    yb = y64.reshape(x.shape[0], -1, B)
    am = np.abs(blocks).argmax(-1)
    xm = np.take_along_axis(np.abs(blocks), am[..., None], -1)[..., 0]
    ym = np.take_along_axis(np.abs(yb), am[..., None], -1)[..., 0]
    ok = xm > 0
    eb = (e ** 2).reshape(x.shape[0], -1, B).sum(-1).ravel()
    top = np.sort(eb)[::-1][: max(1, eb.size // 100)]
    out = dict(mse=mse, rel_mse=mse / ms, sqnr_db=10 * np.log10(ms / mse), max_abs_err=np.abs(e).max(),
               underflow_frac=(nz & (y64 == 0)).sum() / nz.sum(),
               blockmax_rel_err=np.mean(np.abs(ym[ok] - xm[ok]) / xm[ok]),
               block_err_p50=np.percentile(eb, 50), block_err_p99=np.percentile(eb, 99),
               worst1pct_block_err_share=top.sum() / eb.sum())
    if codes is not None:
        mag = codes & 7
        out["zero_code_frac"] = (mag == 0).mean()
        out["saturation_frac"] = ((mag == 7) & (np.abs(x64) > np.abs(y64) * (1 + 1e-7))).mean()
        mb = mag.reshape(x.shape[0], -1, B)
        out["frac_blocks_amax_max"] = ((mb.max(-1) == 7) & ok).sum() / ok.sum()
        binade = np.where(mb >= 2, mb >> 1, np.where(mb == 1, 0, -1))
        out["binades_per_block"] = sum((binade == b).any(-1) for b in range(4))[ok].sum() / ok.sum()
    return out


@pytest.mark.parametrize("label,role", [("nvfp4", "activation"), ("mxfp4_floor", "weight"), ("nvfp4", "gradient"),
                                        ("fp8_e4m3", "activation")])
def test_scalar_metrics_equal_an_independent_computation(label, role):
    spec = SCHEMES_BY_LABEL[label]
    m, hist, shist = scheme_metrics(X, spec, role, seed=5)
    kw = dict(spec.kwargs)
    if spec.scheme.startswith("nvfp4") or spec.scheme.startswith("fp8_e"):
        kw["global_amax"] = float(np.abs(X).max())
    if role == "gradient" and spec.fp4:
        kw.update(rounding="sr", seed=5, stream=0)      # gradients are rounded stochastically
    q = fs.quantize(X, spec.scheme, **kw)
    y = fs.dequantize(q)
    codes = unpack_fp4(q.codes)[:, : X.shape[1]] if spec.fp4 else None
    want = _oracle(X, y, codes, spec.block if spec.block > 1 else X.shape[1])
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-15), (label, role, k)
    if spec.fp4:
        assert np.array_equal(hist, np.bincount(codes.ravel(), minlength=16))
        assert np.array_equal(shist, np.bincount(np.asarray(q.scales).ravel(), minlength=256))
    if role == "gradient":
        rne = fs.dequantize(fs.quantize(X, spec.scheme, global_amax=kw["global_amax"]))
        assert m["mse"] != pytest.approx(np.mean((rne.astype(np.float64) - X) ** 2), rel=1e-6)


def test_outlier_study_values():
    x = heavy((48, 64), 2)
    x[:, 9] *= 200                                    # one outlier column
    o = outliers(x, chunk_elems=16 * 64)
    v = x.astype(np.float64).ravel()
    d = v - v.mean()
    assert o["kurtosis"] == pytest.approx(np.mean(d ** 4) / np.mean(d ** 2) ** 2, rel=1e-9)
    assert o["max_over_rms"] == pytest.approx(np.abs(v).max() / np.sqrt(np.mean(v ** 2)), rel=1e-9)
    big = np.abs(x) > 6 * v.std()
    assert o["n_outlier_cols"] == int(big.any(0).sum()) and o["n_outlier_rows"] == int(big.any(1).sum())
    y = fs.fake_quantize(x, "nvfp4").astype(np.float64)
    e2 = (y - x) ** 2
    keep = ~big.any(0)
    assert o["nvfp4_rel_mse"] == pytest.approx(e2.sum() / (x.astype(np.float64) ** 2).sum(), rel=1e-9)
    assert o["nvfp4_rel_mse_without_outlier_cols"] == pytest.approx(
        e2[:, keep].sum() / (x[:, keep].astype(np.float64) ** 2).sum(), rel=1e-9)
    eb, bb = e2.reshape(48, -1, 16).sum(-1), big.reshape(48, -1, 16).any(-1)
    assert o["outlier_block_err_share"] == pytest.approx(eb[bb].sum() / eb.sum(), rel=1e-9)
    assert o["outlier_block_frac"] == pytest.approx(bb.mean())


def test_hadamard_study_values_and_random_signs():
    x = heavy((32, 64), 3)
    dims, err, kur = hadamard_effect(x, seed=4, chunk_elems=8 * 64)
    i16, irnd = dims.index(16), 1
    for si, signs in ((0, "te"), (irnd, 5), (2, None)):
        xr = fs.rht(x, 16, signs, out="fp32").astype(np.float64)
        y = fs.fake_quantize(xr.astype(np.float32), "nvfp4").astype(np.float64)
        assert err[i16, si, 0] == pytest.approx(np.sum((y - xr) ** 2) / np.sum(xr ** 2), rel=1e-9), signs
        d = xr.ravel() - xr.mean()
        assert kur[i16, si] == pytest.approx(np.mean(d ** 4) / np.mean(d ** 2) ** 2, rel=1e-9)
    assert err[i16, irnd, 0] != err[i16, 2, 0]       # "random" signs are not all +1


def test_gradient_bias_values():
    g = heavy((16, 64), 5)
    b = gradient_bias(g, seed=3)
    amax = np.abs(g).max()
    y = fs.fake_quantize(g, "nvfp4", global_amax=amax).astype(np.float64)
    ysr = fs.fake_quantize(g, "nvfp4", rounding="sr", seed=3, global_amax=amax).astype(np.float64)
    ma = np.mean(np.abs(g.astype(np.float64)))
    assert b["grad_bias_rne"] == pytest.approx(np.mean(y - g) / ma, rel=1e-9)
    assert b["grad_bias_sr"] == pytest.approx(np.mean(ysr - g) / ma, rel=1e-9)
    exp = sum(fs.fake_quantize(g, "nvfp4", rounding="sr", rbits=np.full(g.shape, r, np.uint8),
                               global_amax=amax).astype(np.float64) for r in range(256)) / 256
    assert b["grad_shrink_sr_expected"] == pytest.approx(np.mean((exp - g) * np.sign(g)) / ma, rel=1e-9)


def test_wgrad_study_uses_a_new_seed_per_sample():
    rng = np.random.default_rng(0)
    X, G = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((64, 16)).astype(np.float32)
    r = wgrad_gemm(X, G, seeds=4)
    W = G.astype(np.float64).T @ X
    Xq = fs.fake_quantize(fs.rht(X, 16, "te", axis=0), "nvfp4", axis=0).astype(np.float64)
    GrT = fs.rht(G.T.copy(), 16, "te")               # G along tokens; SR bits by the flat index of G^T
    ws = np.stack([fs.fake_quantize(GrT, "nvfp4", rounding="sr", seed=s).astype(np.float64) @ Xq
                   for s in range(4)])
    assert r["wgrad_rel_var_sr"] == pytest.approx(np.mean(ws.var(0)) / np.mean(W ** 2), rel=1e-9)
    assert r["wgrad_rel_err_sr_mean"] == pytest.approx(np.linalg.norm(ws.mean(0) - W) / np.linalg.norm(W), rel=1e-9)


def test_analysis_memory_stays_within_three_tensors(tmp_path):
    from fp4sim.analyze.core import analyze_tensor
    from fp4sim.analyze.inputs import Source
    x = heavy((1024, 1024), 6)
    np.save(tmp_path / "t.npy", x)
    src = Source("t", str(tmp_path / "t.npy"), None, "gradient")
    analyze_tensor(Source("w", str(tmp_path / "t.npy"), None, "gradient"), hadamard=False)  # compile first
    tracemalloc.start()
    analyze_tensor(src)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    extra = peak - x.nbytes                          # beyond the loaded tensor itself
    assert extra <= 3.0 * x.nbytes, f"peak extra memory {extra / x.nbytes:.2f}x the tensor"


def test_wgrad_study_tiles_give_the_same_numbers_in_bounded_memory():
    rng = np.random.default_rng(1)
    X, G = heavy((256, 1024), 2), rng.standard_normal((256, 384)).astype(np.float32)
    whole = wgrad_gemm(X, G, seeds=3, budget_bytes=1 << 30)     # float64 W (384 x 1024) is 3x X's size
    wgrad_gemm(X, G, seeds=3)                        # compile every kernel signature first (not data memory)
    tracemalloc.start()
    tiled = wgrad_gemm(X, G, seeds=3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    for k, v in whole.items():
        assert tiled[k] == pytest.approx(v, rel=1e-9), k
    assert peak <= 3.5 * X.nbytes, peak / X.nbytes


def test_scale_counts_keep_zero_and_subnormal_scale_bytes_apart():
    """nvfp4 with the tensor amax 2688 (S_enc = 1, so a block's scale is E4M3(amax_b / 6)): 5 all-zero blocks and
    3 blocks of amax 1e-4 (amax / 6 below half of E4M3's smallest subnormal 2^-9) give scale byte 0; 6 blocks of amax
    0.05 give subnormal bytes (0.05 / 6 < 2^-6); the rest are normal. Counted here by construction."""
    rng = np.random.default_rng(1)
    x = (rng.uniform(0.2, 1.0, (16, 64)) * np.where(rng.random((16, 64)) < 0.5, -1, 1)).astype(np.float32)
    blocks = x.reshape(64, 16)                          # the 64 blocks, rows of x in order (4 per row)
    blocks[:, 0] = 1.0
    blocks[0, 0] = 2688.0
    blocks[1:6] = 0.0
    blocks[6:9] *= np.float32(1e-4)
    blocks[9:15] *= np.float32(0.05)
    spec = SCHEMES_BY_LABEL["nvfp4"]
    m, _, shist = scheme_metrics(x, spec, "activation")
    s = fs.quantize(x, "nvfp4").scales.ravel()
    assert list(np.flatnonzero(s == 0)) == list(range(1, 9))
    assert list(np.flatnonzero((s > 0) & (s < 8))) == list(range(9, 15))
    assert m["n_scale_zero"] == 8 and m["n_scale_subnormal"] == 6
