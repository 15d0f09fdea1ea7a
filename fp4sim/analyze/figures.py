"""Figures of an analysis Dataset (matplotlib, PNG), readable for any number of tensors.

Per-tensor panels show at most ``top`` tensors (the worst by the panel's own measure, named in full on a
horizontal axis of their own); every tensor's numbers are in ``tensors.csv`` beside the figures. Legends sit
outside the data.
"""
from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import numpy as np
import xarray as xr

TOP = 40


def short_name(name: str) -> str:
    """The full name (kept for compatibility: figures name tensors in full, so twins stay distinguishable)."""
    return name


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _height(n):
    return 1.6 + 0.24 * n


def _pick(values, top, largest=True):
    """Indices of the ``top`` tensors with the largest (or smallest) finite values, in that order."""
    v = np.asarray(values, float)
    key = np.where(np.isfinite(v), v if largest else -v, -np.inf)
    order = np.argsort(-key, kind="stable")
    return [int(i) for i in order[:top] if np.isfinite(v[i])]


def _worst_per_role(ds, j, top):
    """(indices, groups): per role (weights, activations, gradients, in that order), the tensors with the lowest
    SQNR under scheme ``j``, ``top`` in all, shared out evenly over the roles present (a role with fewer tensors
    leaves its share to the others)."""
    roles = [r for r in ("weight", "activation", "gradient") if r in set(map(str, ds.role.values))]
    roles += sorted(set(map(str, ds.role.values)) - set(roles))
    members = {r: [i for i, x in enumerate(ds.role.values) if str(x) == r] for r in roles}
    sq = ds.sqnr_db.values[:, j].astype(float)
    ranked = {}
    for r in roles:
        m = members[r]
        key = np.where(np.isfinite(sq[m]), sq[m], np.inf)       # lost (-inf) first, exact / n/a (nan) last
        key = np.where(np.isneginf(sq[m]), -np.inf, key)
        ranked[r] = [m[k] for k in np.argsort(key, kind="stable")]
    share, left = {r: 0 for r in roles}, min(top, sum(len(v) for v in ranked.values()))
    while left:
        for r in roles:
            if left and share[r] < len(ranked[r]):
                share[r] += 1
                left -= 1
    groups = [ranked[r][:share[r]] for r in roles if share[r]]
    return [i for g in groups for i in g], groups


def _title(ax, text, n_shown, n_all, what):
    more = f" ({n_shown} of {n_all} tensors: the {what}; all in tensors.csv)" if n_shown < n_all else ""
    ax.set_title(text + more, fontsize=10, loc="left")


def write_csv(ds: xr.Dataset, path: Path) -> Path:
    """One row per tensor: role, numel, per-tensor studies and SQNR / rel-MSE / status per scheme."""
    schemes = [str(s) for s in ds.scheme.values]
    per = [v for v in ds.data_vars if ds[v].dims == ("tensor",)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tensor", "role", "numel"] + per + [f"{m}_{s}" for s in schemes for m in
                                                        ("sqnr_db", "rel_mse", "status")])
        for i, t in enumerate(ds.tensor.values):
            row = [str(t), str(ds.role.values[i]), int(ds.numel.values[i])] + [float(ds[v].values[i]) for v in per]
            for j in range(len(schemes)):
                row += [float(ds.sqnr_db.values[i, j]), float(ds.rel_mse.values[i, j]),
                        str(ds.status.values[i, j]) if "status" in ds else ""]
            w.writerow(row)
    return path


def write_figures(ds: xr.Dataset, outdir, top: int = TOP) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    files = [write_csv(ds, out / "tensors.csv")]
    names = [str(t) for t in ds.tensor.values]
    n = len(names)
    schemes = [str(s) for s in ds.scheme.values]
    if n == 0:
        return files

    # 1. SQNR heat map: tensors (the worst by NVFP4 SQNR within each role, so the weights and activations of a
    # dump show beside its stochastically rounded gradients) x schemes
    j4 = schemes.index("nvfp4") if "nvfp4" in schemes else 0
    idx, groups = _worst_per_role(ds, j4, top)
    vals = ds.sqnr_db.values[idx].astype(float)
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(schemes) + 4), _height(len(idx))))
    shown = np.where(np.isfinite(vals), vals, np.nan)
    im = ax.imshow(shown, aspect="auto", cmap="viridis", interpolation="nearest")
    for a in range(len(idx)):
        for b in range(len(schemes)):
            st = str(ds.status.values[idx[a], b]) if "status" in ds else "ok"
            txt = {"not applied": "n/a", "exact": "exact", "degenerate": "degen.", "lost": "lost"}.get(
                st, f"{vals[a, b]:.1f}")
            ax.text(b, a, txt, ha="center", va="center", fontsize=7,
                    color="white" if np.isfinite(shown[a, b]) and shown[a, b] < np.nanmean(shown) else "black")
    ax.set_xticks(range(len(schemes)), schemes, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(idx)), [f"{names[i]} [{ds.role.values[i]}]" for i in idx], fontsize=7)
    for g0 in np.cumsum([len(g) for g in groups])[:-1]:
        ax.axhline(g0 - 0.5, color="white", lw=2)
    fig.colorbar(im, ax=ax, label="SQNR (dB), higher is better", fraction=0.04, pad=0.02)
    _title(ax, "Quantization error by scheme", len(idx), n, "lowest NVFP4 SQNR of each role")
    files.append(_save(fig, out / "error_by_scheme.png"))

    # 2. scale histograms: median and 10-90% band over tensors, the widest-spread tensors drawn alone
    from ..formats import E4M3
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    panels = ((axes[0], "nvfp4", "NVFP4: E4M3 block scales", np.log2(np.where(E4M3.values[:256] > 0,
                                                                              E4M3.values[:256], np.nan))),
              (axes[1], "mxfp4_rceil", "MXFP4 (rceil): UE8M0 block scales", np.arange(256.0) - 127))
    for ax, s, title, xval in panels:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("log2(decoded scale)")
        ax.set_ylabel("fraction of blocks")
        if s not in schemes:
            continue
        h = ds.scale_hist.values[:, schemes.index(s)].astype(float)
        use = h.sum(1) > 0
        if not use.any():
            continue
        ok = np.isfinite(xval) & (h[use].sum(0) > 0)
        order = np.argsort(xval[ok])
        xs = xval[ok][order]
        frac = (h[use] / h[use].sum(1, keepdims=True))[:, ok][:, order]
        ax.fill_between(xs, np.percentile(frac, 10, 0), np.percentile(frac, 90, 0), color="0.8",
                        label=f"10-90% of {int(use.sum())} tensors")
        ax.plot(xs, np.median(frac, 0), "k-", lw=1.5, label="median tensor")
        spread = list(np.flatnonzero(use))
        sv = ds.scale_std.values[spread, schemes.index(s)]
        for i in [spread[k] for k in np.argsort(-np.nan_to_num(sv))[:3]]:
            hi = h[i][ok][order] / h[i].sum()
            ax.plot(xs, hi, lw=1, marker=".", ms=3, label=f"{names[i]} (widest spread)")
        if s == "nvfp4":
            ax.axvspan(-10, -6, color="0.93", zorder=0, label="E4M3 subnormal scales")
        ax.set_xlim(xs.min() - 1, xs.max() + 1)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1, frameon=False)
    files.append(_save(fig, out / "scale_histograms.png"))

    # 3. outlier maps of the four most heavy-tailed tensors
    top4 = _pick(ds.kurtosis.values, 4)
    if top4:
        fig, axes = plt.subplots(1, len(top4), figsize=(4.4 * len(top4), 4.6), squeeze=False,
                                 layout="constrained")
        for ax, i in zip(axes[0], top4):
            m = ds.absmax_map.values[i]
            with np.errstate(divide="ignore"):
                im = ax.imshow(np.log10(m), aspect="auto", cmap="magma", interpolation="nearest")
            ax.set_title("\n".join(textwrap.wrap(names[i], 30)) + f"\nkurtosis {ds.kurtosis.values[i]:.0f}",
                         fontsize=7)
            ax.set_xlabel("feature (last axis), pooled", fontsize=8)
            ax.set_ylabel("row, pooled", fontsize=8)
            cb = fig.colorbar(im, ax=ax, shrink=0.9)
            cb.set_label("log10 max|x|", fontsize=8)
            cb.ax.tick_params(labelsize=7)
        fig.suptitle("Outlier maps: the most heavy-tailed tensors (64 x 64 max-pooled |x|)", fontsize=10)
        files.append(_save(fig, out / "outlier_maps.png"))

    # 4. outliers and the error they carry
    idx = _pick(ds.kurtosis.values, top)
    if idx:
        fig, axes = plt.subplots(1, 2, figsize=(13, _height(len(idx))), sharey=True)
        y = np.arange(len(idx))
        axes[0].barh(y, ds.kurtosis.values[idx], color="C0")
        axes[0].set_xscale("log")
        axes[0].set_xlabel("kurtosis (Gaussian: 3)")
        axes[0].axvline(3, color="gray", lw=0.8)
        axes[1].barh(y, 100 * ds.outlier_block_err_share.values[idx], color="C1")
        axes[1].set_xlabel("% of NVFP4 squared error in blocks holding |x| > 6 sigma")
        axes[0].set_yticks(y, [names[i] for i in idx], fontsize=7)
        axes[0].invert_yaxis()
        _title(axes[0], "Outliers and the error they carry", len(idx), n, "most heavy-tailed")
        files.append(_save(fig, out / "outliers.png"))

    # 5. Hadamard effect (mean over tensors)
    if "rht_rel_mse" in ds:
        fig, ax = plt.subplots(figsize=(7.5, 4))
        dims = ds.rht_d.values
        for s, ls in (("nvfp4", "-"), ("mxfp4", "--")):
            r = ds.rht_rel_mse.sel(rht_scheme=s, rht_signs="random").values  # (tensor, d)
            with np.errstate(invalid="ignore", divide="ignore"):
                rel = np.nanmean(r / r[:, 0:1], axis=0)
            ok = np.isfinite(rel)
            ax.plot(np.where(dims == 0, 1, dims)[ok], rel[ok], ls, marker="o", label=f"{s} (random signs)")
        ax.set_xscale("log", base=2)
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("Hadamard size d (1 = no transform)")
        ax.set_ylabel(f"rel-MSE after / before (mean of {n} tensors)")
        ax.set_title("Random Hadamard transform effect", fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        files.append(_save(fig, out / "rht_effect.png"))

    # 6. gradient bias and the weight-gradient GEMM
    g = [i for i, r in enumerate(ds.role.values) if r == "gradient"]
    if g:
        gi = [g[k] for k in _pick(np.abs(ds.grad_shrink_rne.values[g]), top)] or g[:top]
        pairs = "pair" in ds.coords
        npair = min(ds.sizes.get("pair", 0), top) if pairs else 0
        hs = [max(2.0, _height(len(gi)))] + ([max(2.0, _height(npair))] if pairs else [])
        fig, axes = plt.subplots(len(hs), 1, figsize=(10, sum(hs) + 0.6 * len(hs)), squeeze=False,
                                 gridspec_kw={"height_ratios": hs}, layout="constrained")
        ax = axes[0][0]
        y = np.arange(len(gi))
        for k, (v, lab) in enumerate((("grad_shrink_rne", "RNE"), ("grad_shrink_sr", "SR, one seed"),
                                      ("grad_shrink_sr_expected", "SR, exact expectation (256 draws)"))):
            ax.barh(y + (k - 1) * 0.27, ds[v].values[gi], 0.27, label=lab)
        ax.axvline(0, color="gray", lw=0.8)
        ax.set_yticks(y, [names[i] for i in gi], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("mean error along sign(g) / mean |g| (negative = toward zero)")
        _title(ax, "Gradient rounding bias in NVFP4", len(gi), len(g), "most biased under RNE")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        if pairs:
            ax = axes[1][0]
            p = [str(v) for v in ds.pair.values]
            pi = _pick(ds.wgrad_rel_err_rne.values, top)
            yp = np.arange(len(pi))
            for k, (v, lab) in enumerate((("wgrad_rel_err_rne", "RNE"),
                                          ("wgrad_rel_err_sr_one_seed", "SR, one seed (what a step sees)"),
                                          ("wgrad_rel_err_sr_mean", "SR, output averaged over 8 seeds"))):
                ax.barh(yp + (k - 1) * 0.27, ds[v].values[pi], 0.27, label=lab)
            ax.set_yticks(yp, [p[i] for i in pi], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("||dW_q - dW|| / ||dW||, dW = G^T X the weight gradient")
            ax.set_title("Weight-gradient GEMM G^T X in NVFP4 (16-pt RHT): relative error", fontsize=10,
                         loc="left")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        files.append(_save(fig, out / "sr_bias.png"))
    return files
