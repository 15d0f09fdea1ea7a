"""Figures of an analysis Dataset (matplotlib, PNG)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr


def short_name(name: str) -> str:
    """A compact label: model prefix kept, 'encoder.layer.N' -> 'L N', 'blkN' -> 'L N'."""
    import re
    n = re.sub(r"encoder\.layer\.(\d+)\.", r"L\1 ", name)
    n = re.sub(r"blk\.?(\d+)\.", r"L\1 ", n)
    n = n.replace("attention.self.", "attn.").replace("intermediate.dense", "ffn_up").replace("ffn_down.", "ffn_down ")
    n = n.replace(".", " ", 1) if n.count(" ") == 0 else n.replace(".", " ", 1)
    return n[-40:]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(ds: xr.Dataset, outdir) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    names = [str(t) for t in ds.tensor.values]
    short = [short_name(n) for n in names]

    fig, ax = plt.subplots(figsize=(max(9, 1.3 * len(names)), 5))
    schemes = [str(s) for s in ds.scheme.values]
    w = 0.8 / len(schemes)
    for j, s in enumerate(schemes):
        ax.bar(np.arange(len(names)) + j * w, ds.sqnr_db.values[:, j], w, label=s)
    ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, short, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("SQNR (dB)")
    ax.set_title("Quantization error by scheme and tensor (higher is better)")
    ax.legend(fontsize=7, ncol=4)
    files.append(_save(fig, out / "error_by_scheme.png"))

    from ..formats import E4M3
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    panels = ((axes[0], "nvfp4", "NVFP4: E4M3 block scales", np.log2(np.where(E4M3.values[:256] > 0,
                                                                              E4M3.values[:256], np.nan))),
              (axes[1], "mxfp4_rceil", "MXFP4 (rceil): UE8M0 block scales", np.arange(256.0) - 127))
    for ax, s, title, xval in panels:
        if s in schemes:
            lo, hi = np.inf, -np.inf
            for i, n in enumerate(short):
                h = ds.scale_hist.values[i, schemes.index(s)].astype(float)
                ok = np.isfinite(xval) & (h > 0)
                if ok.any():
                    order = np.argsort(xval[ok])
                    ax.plot(xval[ok][order], (h[ok] / h.sum())[order], marker=".", ms=3, lw=1, label=n)
                    lo, hi = min(lo, xval[ok].min()), max(hi, xval[ok].max())
            if s == "nvfp4":
                ax.axvspan(-10, -6, color="0.9", zorder=0, label="E4M3 subnormal scales")
            if np.isfinite(lo):
                ax.set_xlim(lo - 1, hi + 1)
        ax.set_title(title)
        ax.set_xlabel("log2(decoded scale)")
        ax.set_ylabel("fraction of blocks")
        ax.legend(fontsize=6)
    files.append(_save(fig, out / "scale_histograms.png"))

    top = list(np.argsort(-np.nan_to_num(ds.kurtosis.values))[:4])
    fig, axes = plt.subplots(1, len(top), figsize=(3.4 * len(top), 3.6), squeeze=False)
    for ax, i in zip(axes[0], top):
        m = ds.absmax_map.values[i]
        with np.errstate(divide="ignore"):
            im = ax.imshow(np.log10(m), aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_title(f"{short[i]}\nkurtosis {ds.kurtosis.values[i]:.0f}", fontsize=8)
        ax.set_xlabel("feature (last axis), pooled")
        ax.set_ylabel("row, pooled")
        fig.colorbar(im, ax=ax, label="log10 max|x|")
    fig.suptitle("Outlier maps: the most heavy-tailed tensors (64 x 64 max-pooled |x|)", fontsize=10)
    files.append(_save(fig, out / "outlier_maps.png"))

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, ds.kurtosis.values, 0.4, label="kurtosis (Gaussian: 3)")
    ax.bar(x + 0.2, 100 * ds.outlier_block_err_share.values, 0.4,
           label="% of NVFP4 squared error in blocks holding |x| > 6 sigma")
    ax.set_yscale("log")
    ax.set_xticks(x, short, rotation=30, ha="right", fontsize=8)
    ax.set_title("Outliers and the error they carry")
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "outliers.png"))

    if "rht_rel_mse" in ds:
        fig, ax = plt.subplots(figsize=(7, 4))
        dims = ds.rht_d.values
        for s, ls in (("nvfp4", "-"), ("mxfp4", "--")):
            r = ds.rht_rel_mse.sel(rht_scheme=s, rht_signs="random").values  # (tensor, d)
            base = r[:, 0:1]
            rel = np.nanmean(r / base, axis=0)
            ok = np.isfinite(rel)
            ax.plot(np.where(dims == 0, 1, dims)[ok], rel[ok], ls, marker="o", label=f"{s} (random signs)")
        ax.set_xscale("log", base=2)
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("Hadamard size d (1 = no transform)")
        ax.set_ylabel("rel-MSE after / before (mean over tensors)")
        ax.set_title("Random Hadamard transform effect")
        ax.legend(fontsize=8)
        files.append(_save(fig, out / "rht_effect.png"))

    g = [i for i, r in enumerate(ds.role.values) if r == "gradient"]
    if g:
        pairs = "pair" in ds.coords
        fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(12 if pairs else 7, 4.2), squeeze=False)
        ax = axes[0][0]
        x = np.arange(len(g))
        for k, (v, lab) in enumerate((("grad_shrink_rne", "RNE"), ("grad_shrink_sr", "SR, one seed"),
                                      ("grad_shrink_sr_expected", "SR, exact expectation (256 draws)"))):
            ax.bar(x + (k - 1) * 0.27, ds[v].values[g], 0.27, label=lab)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xticks(x, [short[i] for i in g], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("mean error along sign(g) / mean |g|")
        ax.set_title("Gradient rounding bias in NVFP4 (negative = toward zero)", fontsize=10)
        ax.legend(fontsize=7)
        if pairs:
            ax = axes[0][1]
            p = [str(v) for v in ds.pair.values]
            xp = np.arange(len(p))
            ax.bar(xp - 0.2, ds.wgrad_rel_err_rne.values, 0.4, label="RNE")
            ax.bar(xp + 0.2, ds.wgrad_rel_err_sr_mean.values, 0.4, label="SR, mean of seeds")
            ax.set_xticks(xp, [short_name(n) for n in p], fontsize=8)
            ax.set_ylabel("||W_q - W|| / ||W||")
            ax.set_title("Weight-gradient GEMM G^T X in NVFP4 (16-pt RHT)", fontsize=10)
            ax.legend(fontsize=7)
        files.append(_save(fig, out / "sr_bias.png"))
    return files
