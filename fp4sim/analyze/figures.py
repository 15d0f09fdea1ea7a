"""Figures of an analysis Dataset (matplotlib, PNG)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr


def write_figures(ds: xr.Dataset, outdir) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    names = [str(t) for t in ds.tensor.values]
    short = [n.split(".", 1)[-1][-28:] for n in names]

    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(names)), 5))
    schemes = [str(s) for s in ds.scheme.values]
    w = 0.8 / len(schemes)
    for j, s in enumerate(schemes):
        ax.bar(np.arange(len(names)) + j * w, ds.sqnr_db.values[:, j], w, label=s)
    ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, short, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("SQNR (dB)")
    ax.set_title("Quantization error by scheme and tensor (higher is better)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    files.append(out / "error_by_scheme.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, s, title, xlab in ((axes[0], "nvfp4", "NVFP4 E4M3 block scales", "E4M3 scale byte"),
                               (axes[1], "mxfp4_rceil", "MXFP4 (rceil) UE8M0 block scales", "UE8M0 scale byte")):
        if s in schemes:
            for i, n in enumerate(short):
                h = ds.scale_hist.values[i, schemes.index(s)]
                if h.sum():
                    ax.step(np.arange(256), h / h.sum(), where="mid", label=n)
        ax.set_title(title)
        ax.set_xlabel(xlab)
        ax.set_ylabel("fraction of blocks")
        ax.legend(fontsize=6)
    fig.tight_layout()
    files.append(out / "scale_histograms.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, ds.kurtosis.values, 0.4, label="kurtosis")
    ax.bar(x + 0.2, 100 * ds.outlier_block_err_share.values, 0.4, label="% of NVFP4 error in outlier blocks")
    ax.set_yscale("log")
    ax.set_xticks(x, short, rotation=30, ha="right", fontsize=8)
    ax.set_title("Outliers: kurtosis and the error share of blocks holding |x| > 6 sigma")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "outliers.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

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
        fig.tight_layout()
        files.append(out / "rht_effect.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    g = [i for i, r in enumerate(ds.role.values) if r == "gradient"]
    if g:
        fig, ax = plt.subplots(figsize=(8, 4))
        x = np.arange(len(g))
        for k, (v, lab) in enumerate((("grad_bias_rne", "RNE"), ("grad_bias_sr", "SR (one seed)"),
                                      ("grad_bias_sr_expected", "SR, exact expectation"))):
            ax.bar(x + (k - 1) * 0.27, ds[v].values[g], 0.27, label=lab)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xticks(x, [short[i] for i in g], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("mean signed error / mean |g|")
        ax.set_title("Gradient rounding bias in NVFP4")
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out / "sr_bias.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files
