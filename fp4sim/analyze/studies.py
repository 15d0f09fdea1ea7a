"""Studies beyond plain error: outliers, the Hadamard transform, and gradient-rounding bias."""
from __future__ import annotations

import numpy as np

from .. import dequantize, fake_quantize, quantize, rht
from .metrics import as_rows

RHT_DIMS = (2, 4, 16, 32, 128)
RHT_SIGNS = ("te", "random", "none")
RHT_SCHEMES = ("nvfp4", "mxfp4")


def kurtosis(x: np.ndarray) -> float:
    """Pearson kurtosis E[(x-mu)^4]/sigma^4 (3 for a Gaussian), over finite values."""
    v = x[np.isfinite(x)].astype(np.float64)
    if v.size < 2:
        return float("nan")
    d = v - v.mean()
    s2 = np.mean(d ** 2)
    return float(np.mean(d ** 4) / s2 ** 2) if s2 > 0 else float("nan")


def _rel_mse(x, y):
    x = x.astype(np.float64)
    fin = np.isfinite(x)
    ms = np.mean(x[fin] ** 2)
    return float(np.mean((y.astype(np.float64)[fin] - x[fin]) ** 2) / ms) if ms > 0 else float("nan")


def outliers(x: np.ndarray, k: float = 6.0) -> dict:
    """Kurtosis, max/RMS, outlier rows/columns (any |x| > k*sigma), NVFP4 error with and without the outlier
    columns, and the share of NVFP4 error carried by 1x16 blocks that hold an outlier."""
    x2 = as_rows(x).astype(np.float32)
    v = x2[np.isfinite(x2)].astype(np.float64)
    sd = float(v.std()) if v.size else 0.0
    rms = float(np.sqrt(np.mean(v ** 2))) if v.size else 0.0
    big = np.abs(x2) > k * sd if sd > 0 else np.zeros_like(x2, bool)
    cols, rows = big.any(0), big.any(1)
    y = fake_quantize(x2, "nvfp4")
    err = np.where(np.isfinite(x2), (y.astype(np.float64) - x2) ** 2, 0)
    K = x2.shape[1]
    Kp = -(-K // 16) * 16
    eb = np.pad(err, ((0, 0), (0, Kp - K))).reshape(x2.shape[0], -1, 16).sum(-1)
    bb = np.pad(big, ((0, 0), (0, Kp - K))).reshape(x2.shape[0], -1, 16).any(-1)
    keep = ~cols
    return dict(kurtosis=kurtosis(x2), max_over_rms=float(np.max(np.abs(v)) / rms) if rms > 0 else np.nan,
                n_outlier_rows=int(rows.sum()), n_outlier_cols=int(cols.sum()),
                nvfp4_rel_mse=_rel_mse(x2, y),
                nvfp4_rel_mse_without_outlier_cols=_rel_mse(x2[:, keep], y[:, keep]) if keep.any() else np.nan,
                outlier_block_err_share=float(eb[bb].sum() / eb.sum()) if eb.sum() > 0 else 0.0,
                outlier_block_frac=float(bb.mean()))


def absmax_map(x: np.ndarray, size: int = 64) -> np.ndarray:
    """max |x| pooled onto a size x size grid of the (rows, K) view (NaN-free; for outlier maps)."""
    x2 = np.abs(np.nan_to_num(as_rows(x), nan=0.0, posinf=0.0, neginf=0.0))
    R, K = x2.shape
    pr, pc = -(-R // size), -(-K // size)
    pad = np.zeros((pr * size, pc * size), np.float32)
    pad[:R, :K] = x2
    m = pad.reshape(size, pr, size, pc).max(axis=(1, 3))
    rows, cols = -(-R // pr), -(-K // pc)
    out = np.full((size, size), np.nan, np.float32)
    out[:rows, :cols] = m[:rows, :cols]
    return out


def hadamard_effect(x: np.ndarray, seed: int = 0, kurt0: float | None = None):
    """rel-MSE of NVFP4 and MXFP4 on rht(x) and its kurtosis, for each d and sign mode (NaN where the last axis
    is not a multiple of d, or 'te' with d != 16). Index [0] of the d axis is no transform (``kurt0``: the
    kurtosis of x when the caller has it already)."""
    x2 = as_rows(x)
    K = x2.shape[1]
    dims = (0,) + RHT_DIMS
    err = np.full((len(dims), len(RHT_SIGNS), len(RHT_SCHEMES)), np.nan)
    kur = np.full((len(dims), len(RHT_SIGNS)), np.nan)
    err[0, :] = [_rel_mse(x2, fake_quantize(x2, s)) for s in RHT_SCHEMES]  # d = 0: no transform, any signs
    kur[0, :] = kurtosis(x2) if kurt0 is None else kurt0
    for di, d in enumerate(dims[1:], 1):
        if K % d:
            continue
        for si, sg in enumerate(RHT_SIGNS):
            if sg == "te" and d != 16:
                continue
            signs = {"te": "te", "random": seed + 1, "none": None}[sg]
            xr = rht(x2, d, signs, out="fp32")
            kur[di, si] = kurtosis(xr)
            for ci, s in enumerate(RHT_SCHEMES):
                err[di, si, ci] = _rel_mse(xr, fake_quantize(xr, s))
    return dims, err, kur


def gradient_bias(g: np.ndarray, seed: int = 0, sample: int = 1 << 16) -> dict:
    """NVFP4 rounding bias of a gradient. On the whole tensor: the mean signed error relative to mean |g|
    under RNE and SR. On a sample (the first rows, up to ``sample`` elements; the tensor amax still sets the
    scale): the error along sign(g) (negative = toward zero) under RNE, SR with one seed, and SR's exact
    expectation (all 256 random bytes enumerated, the same byte for every element of a pass)."""
    g2 = as_rows(g)
    amax = np.float32(np.nanmax(np.abs(g2)))

    def rel(y, x, along_sign=False):
        fin = np.isfinite(x)
        e = y[fin].astype(np.float64) - x[fin]
        if along_sign:
            e = e * np.sign(x[fin])
        return float(np.mean(e) / (np.mean(np.abs(x[fin])) or 1.0))

    rows = max(1, min(g2.shape[0], sample // max(g2.shape[1], 1)))
    s = g2[:rows]
    acc = np.zeros(s.shape)
    for r in range(256):
        acc += fake_quantize(s, "nvfp4", rounding="sr", rbits=np.full(s.shape, r, np.uint8), global_amax=amax)
    return dict(grad_bias_rne=rel(fake_quantize(g2, "nvfp4", global_amax=amax), g2),
                grad_bias_sr=rel(fake_quantize(g2, "nvfp4", rounding="sr", seed=seed, global_amax=amax), g2),
                grad_bias_sr_expected=rel(acc / 256, s), sample_elements=int(s.size),
                grad_shrink_rne=rel(fake_quantize(s, "nvfp4", global_amax=amax), s, True),
                grad_shrink_sr=rel(fake_quantize(s, "nvfp4", rounding="sr", seed=seed, global_amax=amax), s, True),
                grad_shrink_sr_expected=rel(acc / 256, s, True))


def wgrad_gemm(x: np.ndarray, g: np.ndarray, seeds: int = 8) -> dict:
    """The weight-gradient GEMM W = G^T X of a linear layer with both operands in NVFP4 as the paper's recipe:
    16-point RHT ('te' signs) along the token dimension, blocks along tokens, SR for the gradient (RNE for
    the activation), against the exact float64 product; also with RNE for both. Bias = mean(W_q - W)/mean|W|
    (SR averaged over seeds), relative error = ||W_q - W|| / ||W||, relative variance of SR across seeds."""
    X, G = as_rows(x), as_rows(g)
    if X.shape[0] != G.shape[0]:
        raise ValueError(f"activation has {X.shape[0]} tokens and gradient {G.shape[0]}")
    T = X.shape[0]
    W = G.astype(np.float64).T @ X.astype(np.float64)
    mW, nW = float(np.mean(np.abs(W))), float(np.linalg.norm(W))
    use_rht = T % 16 == 0
    Xr = rht(X, 16, "te", axis=0) if use_rht else X
    Gr = rht(G, 16, "te", axis=0) if use_rht else G
    Xq = dequantize(quantize(Xr, "nvfp4", axis=0)).astype(np.float64)
    Gq = dequantize(quantize(Gr, "nvfp4", axis=0)).astype(np.float64)
    W_rne = Gq.T @ Xq
    ws = np.stack([dequantize(quantize(Gr, "nvfp4", axis=0, rounding="sr", seed=s)).astype(np.float64).T @ Xq
                   for s in range(seeds)])
    W_sr = ws.mean(0)
    return dict(tokens=T, rht=use_rht, wgrad_bias_rne=float(np.mean(W_rne - W) / mW),
                wgrad_bias_sr=float(np.mean(W_sr - W) / mW),
                wgrad_rel_err_rne=float(np.linalg.norm(W_rne - W) / nW),
                wgrad_rel_err_sr_one_seed=float(np.linalg.norm(ws[0] - W) / nW),
                wgrad_rel_err_sr_mean=float(np.linalg.norm(W_sr - W) / nW),
                wgrad_rel_var_sr=float(np.mean(ws.var(0)) / np.mean(W ** 2)))
