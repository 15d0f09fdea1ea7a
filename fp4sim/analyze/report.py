"""Console table and JSON summary of an analysis Dataset."""
from __future__ import annotations

import json

import numpy as np
import xarray as xr


def _f(v, fmt="{:.1f}"):
    """A per-tensor statistic; 'undef.' where it is not defined (a constant or all-zero tensor)."""
    return "undef." if v is None or not np.isfinite(v) else fmt.format(v)


_MARK = {"not applied": "n/a", "exact": "exact", "degenerate": "degen.", "lost": "lost"}


def _cell(ds, i, j, v, fmt="{:.1f}", scale=1.0):
    """A tensor x scheme value, or what its status says instead."""
    st = str(ds.status.values[i, j]) if "status" in ds else "ok"
    if st in ("not applied", "degenerate", "lost"):
        return _MARK[st]
    if st == "exact" and v is not None and not np.isfinite(v):
        return "exact"
    return _f(v * scale if v is not None else v, fmt)


WORST = 5      # tensors named per role in the summary


def by_role(ds: xr.Dataset, worst: int = WORST) -> list[str]:
    """The summary a many-tensor report opens with: per role, the median SQNR of each scheme over its tensors
    and the role's ``worst`` tensors by NVFP4 SQNR (lost first; exact and not-applied cells left out)."""
    schemes = [str(s) for s in ds.scheme.values]
    roles = [r for r in ("weight", "activation", "gradient") if r in set(map(str, ds.role.values))]
    lines = ["Summary by role: median SQNR (dB) over the role's tensors (n/a: not applied to the role)",
             f"{'role':10} {'tensors':>7} " + " ".join(f"{s:>13}" for s in schemes)]
    j4 = schemes.index("nvfp4") if "nvfp4" in schemes else 0
    worst_lines = []
    for r in roles:
        idx = [i for i, x in enumerate(ds.role.values) if str(x) == r]
        cells = []
        for j in range(len(schemes)):
            st = [str(ds.status.values[i, j]) for i in idx]
            v = np.array([ds.sqnr_db.values[i, j] for i, s_ in zip(idx, st) if s_ in ("ok", "exact")], float)
            lost = st.count("lost")
            med = np.median(v) if v.size else np.nan            # exact cells count as +inf
            c = ("exact" if np.isposinf(med) else f"{med:.1f}" if v.size else "lost" if lost else "n/a")
            cells.append(c + (f", {lost} lost" if lost and c != "lost" else ""))
        lines.append(f"{r:10} {len(idx):>7} " + " ".join(f"{c:>13}" for c in cells))
        sq = np.array([ds.sqnr_db.values[i, j4] for i in idx], float)
        order = [idx[k] for k in np.argsort(np.where(np.isnan(sq), np.inf, sq), kind="stable")
                 if np.isfinite(sq[k]) or np.isneginf(sq[k])][:worst]
        if order:
            worst_lines.append(f"  {r}: " + ", ".join(
                f"{ds.tensor.values[i]} ({_cell(ds, i, j4, ds.sqnr_db.values[i, j4])})" for i in order))
    if worst_lines:
        lines += [f"Worst by {schemes[j4]} SQNR, per role (up to {worst}):"] + worst_lines
    return lines


def table(ds: xr.Dataset) -> str:
    """Readable summary: per role, the median SQNR and the worst tensors; then SQNR (dB) per tensor x scheme
    (dump order), outliers, RHT, bias and Wgrad results."""
    schemes = [str(s) for s in ds.scheme.values]
    w = max([len(str(t)) for t in ds.tensor.values] + [6])
    lines = by_role(ds) + [""] if len(ds.tensor) > 1 else []
    lines += ["SQNR (dB) by tensor and scheme (higher is better; exact = no error at all; n/a = scheme not applied "
             "to this role; degen. = no finite nonzero value, so no relative error; lost = finite values come back "
             "Inf or NaN)",
             f"{'tensor':{w}} {'role':10} " + " ".join(f"{s:>13}" for s in schemes)]
    for i, t in enumerate(ds.tensor.values):
        vals = " ".join(f"{_cell(ds, i, j, ds.sqnr_db.values[i, j]):>13}" for j in range(len(schemes)))
        lines.append(f"{str(t):{w}} {str(ds.role.values[i]):10} {vals}")
    bad = [i for i in range(len(ds.tensor)) if "n_nan" in ds and (ds.n_nan.values[i] or ds.n_inf.values[i])]
    if bad:
        lines += ["", "Non-finite inputs (left out of the error sums; E2M1 has no Inf or NaN: CUDA's satfinite rule "
                      "encodes NaN as +6 and Inf as +-6):"]
        for i in bad:
            lost = [f"{s} {100 * ds.lost_frac.values[i, j]:.1f}%" for j, s in enumerate(schemes)
                    if str(ds.status.values[i, j]) == "lost"]
            lines.append(f"{str(ds.tensor.values[i]):{w}} {int(ds.n_inf.values[i])} Inf, {int(ds.n_nan.values[i])} "
                         f"NaN of {int(ds.numel.values[i])}" + (f"; finite values lost (come back Inf/NaN) under "
                                                                f"{', '.join(lost)}" if lost else ""))
    lines += ["", "Underflow (nonzero -> 0, %) and blocks whose amax codes to +-6 (%), NVFP4 | MXFP4 rceil:"]
    j4 = schemes.index("nvfp4") if "nvfp4" in schemes else None
    jm = schemes.index("mxfp4_rceil") if "mxfp4_rceil" in schemes else None
    for i, t in enumerate(ds.tensor.values):
        parts = []
        for j in (j4, jm):
            if j is not None:
                parts.append(f"{_cell(ds, i, j, ds.underflow_frac.values[i, j], '{:.2f}%', 100)} / "
                             f"{_cell(ds, i, j, ds.frac_blocks_amax_max.values[i, j], '{:.1f}%', 100)}")
        lines.append(f"{str(t):{w}} " + " | ".join(parts))
    lines += ["", f"{'tensor':{w}} {'kurtosis':>9} {'max/rms':>8} {'outl.cols':>9} {'err share of outlier blocks':>28}"]
    for i, t in enumerate(ds.tensor.values):
        lines.append(f"{str(t):{w}} {_f(ds.kurtosis.values[i]):>9} {_f(ds.max_over_rms.values[i]):>8} "
                     f"{int(ds.n_outlier_cols.values[i]):>9} {_f(100 * ds.outlier_block_err_share.values[i]):>27}%")
    if "rht_rel_mse" in ds:
        lines += ["", "Random Hadamard transform (16-point, 'te' signs): rel-MSE before -> after, NVFP4 | MXFP4"]
        for i, t in enumerate(ds.tensor.values):
            r = ds.rht_rel_mse.sel(tensor=t)
            b = [float(r.sel(rht_d=0, rht_signs="te", rht_scheme=s)) for s in ("nvfp4", "mxfp4")]
            a = [float(r.sel(rht_d=16, rht_signs="te", rht_scheme=s)) for s in ("nvfp4", "mxfp4")]
            lines.append(f"{str(t):{w}} {_f(b[0], '{:.4g}')} -> {_f(a[0], '{:.4g}')} | "
                         f"{_f(b[1], '{:.4g}')} -> {_f(a[1], '{:.4g}')}")
    g = [i for i, r in enumerate(ds.role.values) if r == "gradient"]
    if g:
        lines += ["", "Gradient rounding bias, NVFP4, relative to mean |g|: signed error RNE | SR | SR exact "
                      "expectation (sample);", "  error along sign(g), negative = toward zero, on the sample: "
                      "RNE | SR exact expectation"]
        for i in g:
            lines.append(f"{str(ds.tensor.values[i]):{w}} {_f(ds.grad_bias_rne.values[i], '{:+.2e}')} | "
                         f"{_f(ds.grad_bias_sr.values[i], '{:+.2e}')} | "
                         f"{_f(ds.grad_bias_sr_expected.values[i], '{:+.2e}')};  "
                         f"{_f(ds.grad_shrink_rne.values[i], '{:+.2e}')} | "
                         f"{_f(ds.grad_shrink_sr_expected.values[i], '{:+.2e}')}")
    if "pair" in ds.coords:
        lines += ["", "Weight-gradient GEMM dW = G^T X in NVFP4 (16-point RHT along tokens where their count is a "
                      "multiple of 16), vs exact: bias RNE | bias SR (mean of 8 seeds) | rel. error RNE | rel. error "
                      "SR, one seed (what a step sees) | rel. error SR, output averaged over 8 seeds | RHT"]
        for k, p in enumerate(ds.pair.values):
            on = bool(ds.wgrad_rht.values[k]) if "wgrad_rht" in ds else True
            rh = "on" if on else f"off ({int(ds.wgrad_tokens.values[k])} tokens, not a multiple of 16)"
            lines.append(f"{str(p):{w}} {ds.wgrad_bias_rne.values[k]:+.3e} | {ds.wgrad_bias_sr.values[k]:+.3e} | "
                         f"{ds.wgrad_rel_err_rne.values[k]:.4f} | {ds.wgrad_rel_err_sr_one_seed.values[k]:.4f} | "
                         f"{ds.wgrad_rel_err_sr_mean.values[k]:.4f} | {rh}")
    sk = json.loads(ds.attrs.get("skipped", "[]"))
    bad = [s for s in sk if not s.get("ignored")]
    if bad:
        lines += ["", f"skipped {len(bad)}:"] + [f"  {s['tensor']}: {s['reason']}" for s in bad]
    ign = [s for s in sk if s.get("ignored")]
    if ign:
        lines += ["", f"not analysed, no quantization target ({len(ign)}):"] + [f"  {s['tensor']}: {s['reason']}"
                                                                               for s in ign]
    return "\n".join(lines)


def summary(ds: xr.Dataset) -> dict:
    """JSON-ready summary: per tensor, the scalar metrics per scheme and the per-tensor studies."""
    out = {"tensors": {}, "pairs": {}, "skipped": json.loads(ds.attrs.get("skipped", "[]")),
           "sources": json.loads(ds.attrs.get("sources", "{}"))}
    clean = lambda v: None if not np.isfinite(v) else float(v)  # noqa: E731
    for i, t in enumerate(ds.tensor.values):
        d = {"role": str(ds.role.values[i]), "numel": int(ds.numel.values[i]), "schemes": {}}
        for j, s in enumerate(ds.scheme.values):
            st = str(ds.status.values[i, j]) if "status" in ds else "ok"
            if st != "not applied":
                d["schemes"][str(s)] = {v: clean(ds[v].values[i, j]) for v in ds.data_vars
                                        if ds[v].dims == ("tensor", "scheme") and v != "status"}
                d["schemes"][str(s)]["status"] = st
        for v in ds.data_vars:
            if ds[v].dims == ("tensor",):
                d[v] = clean(ds[v].values[i])
        d["schemes_not_applied"] = [str(s) for j, s in enumerate(ds.scheme.values)
                                    if "status" in ds and str(ds.status.values[i, j]) == "not applied"]
        out["tensors"][str(t)] = d
    if "pair" in ds.coords:
        for k, p in enumerate(ds.pair.values):
            out["pairs"][str(p)] = {v: (bool(ds[v].values[k]) if ds[v].dtype == bool else clean(ds[v].values[k]))
                                    for v in ds.data_vars if ds[v].dims == ("pair",)}
    return out
