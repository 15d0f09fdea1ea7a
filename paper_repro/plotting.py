"""What the figures share: the long-format CSV / JSON writers, the training figures' rows, and the drawing
helpers (seed means with standard-error bars, bands, wrapped titles), for figures, ablations and teacher alike."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from . import stats
from .train import COLUMNS

__all__ = ["TRAIN_COLUMNS", "write_csv", "write_json", "pyplot", "curves", "training_rows", "band", "lines",
           "ylim_all", "title", "mark_quick", "QUICK_NOTE"]

TRAIN_COLUMNS = ("figure", "run", "seed", "step", "tokens", "lr", "train_loss", "val_loss", "rel_diff_pct",
                 "token_multiplier")


def write_csv(path: Path, columns, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else (repr(float(r[k])) if isinstance(r[k], (float, np.floating))
                                                          else r[k])) for k in columns})


def write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=float) + "\n")


QUICK_NOTE = "--quick: a smoke test of the pipeline (a tiny model, a few steps), not a measurement"


def mark_quick(png: Path, js: Path):
    """Mark a --quick figure as the smoke test it is: a red line above the picture and ``"quick"`` in its JSON."""
    d = json.loads(js.read_text())
    if isinstance(d, dict):
        d["quick"] = QUICK_NOTE
        write_json(js, d)
    plt = pyplot()
    img = plt.imread(str(png))
    h, w = img.shape[:2]
    band = 30
    f = plt.figure(figsize=(w / 100, (h + band) / 100), dpi=100)
    ax = f.add_axes((0, 0, 1, h / (h + band)))
    ax.imshow(img, interpolation="none")
    ax.set_axis_off()
    f.text(0.5, 1 - band / 2 / (h + band), QUICK_NOTE, color="#c00000", ha="center", va="center", fontsize=11,
           weight="bold")
    f.savefig(str(png), dpi=100)
    plt.close(f)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def curves(runs, logs, label):
    """(tokens, val (seeds, points)) of one run label over seeds, in seed order."""
    sel = sorted((c.seed, logs[c.key()]) for lab, _, c in runs if lab == label)
    tokens = np.array([r["tokens"] for r in sel[0][1]])
    return tokens, np.array([[r["val_loss"] for r in rows] for _, rows in sel])


def training_rows(fig, runs, logs, baseline="bf16"):
    """The long-format rows, with the relative difference from the same seed's baseline at the same step."""
    base_by_seed = {c.seed: {r["step"]: r["val_loss"] for r in logs[c.key()]}
                    for lab, _, c in runs if lab == baseline}
    rows = []
    for lab, mult, c in runs:
        for r in logs[c.key()]:
            b = base_by_seed.get(c.seed, {}).get(r["step"]) if lab != baseline else None
            row = {"figure": fig, "run": lab, "seed": c.seed, **{k: r[k] for k in COLUMNS},
                   "rel_diff_pct": None if b is None else float(stats.rel_diff_pct(b, r["val_loss"])),
                   "token_multiplier": mult if fig == "fig6b" else None}
            if r.get("wgrad_error"):
                row["wgrad_rel_error_mean"] = float(np.mean(list(r["wgrad_error"].values())))
            rows.append(row)
    return rows


def band(ax, x, Y, color, label):
    """One curve with its +-std band over seeds: for a panel that shows one curve only."""
    m, s = stats.mean_std(Y)
    ax.plot(x, m, color=color, label=label, lw=1.6)
    if Y.shape[0] > 1:
        ax.fill_between(x, m - s, m + s, color=color, alpha=0.2, lw=0)


def lines(ax, x, Y, color, label, k=0, n=1, err=True):
    """The seed mean of Y (seeds, points) as a thin line, with +-1 standard error bars at the evaluations when
    ``err`` and there are several seeds; curve ``k`` of ``n`` is shifted by a fraction of the first evaluation
    interval so that the bars of curves on one panel stay apart."""
    x = np.asarray(x, np.float64)
    m, s = stats.mean_std(Y)
    dx = (x[1] - x[0]) if x.size > 1 else 1.0
    xs = x + (k - (n - 1) / 2) * 0.12 * dx
    ax.plot(x, m, color=color, label=label, lw=1.2)
    if err and Y.shape[0] > 1:
        ax.errorbar(xs, m, yerr=s / np.sqrt(Y.shape[0]), fmt="none", ecolor=color, elinewidth=1, capsize=2,
                    alpha=0.9)


def ylim_all(ax, *Ys, pad=0.04):
    """y limits that include every evaluation of every curve (NaN of a diverged run ignored)."""
    v = np.concatenate([np.asarray(Y, np.float64).ravel() for Y in Ys])
    v = v[np.isfinite(v)]
    if v.size:
        lo, hi = float(v.min()), float(v.max())
        span = (hi - lo) or abs(hi) or 1.0
        ax.set_ylim(lo - pad * span, hi + pad * span)


def title(ax, text, width=72, **kw):
    """A title wrapped to the panel's width, so that it stays inside the figure."""
    import textwrap
    ax.set_title(textwrap.fill(text, width), fontsize=9, **kw)
