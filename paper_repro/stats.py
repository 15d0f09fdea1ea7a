"""Numbers the figures report: relative differences over seeds and the token multiplier of Fig. 6b."""
from __future__ import annotations

import math

import numpy as np


def rel_diff_pct(baseline, run):
    """The paper's relative difference, in percent: (baseline - run) / baseline * 100 — negative where the run's
    loss is higher (worse) than the baseline's."""
    b = np.asarray(baseline, np.float64)
    return (b - np.asarray(run, np.float64)) / b * 100.0


def mean_std(a, axis=0):
    """Mean and sample standard deviation (ddof 1; 0 for a single value) along ``axis``."""
    a = np.asarray(a, np.float64)
    n = a.shape[axis]
    return a.mean(axis), (a.std(axis, ddof=1) if n > 1 else np.zeros_like(a.mean(axis)))


def token_multiplier(mults, losses, target) -> dict:
    """The token multiplier at which a loss-vs-multiplier curve reaches ``target``.

    mults: increasing multipliers (e.g. 1.0, 1.25, 1.36, 1.5); losses: the final loss at each (lower is better,
    expected to fall with more tokens). Linear interpolation between the first pair of neighbouring points that
    brackets the target. Returns {'value', 'status', 'extrapolated'}: status 'interpolated'; 'at_or_below_min'
    (the curve is already at or below the target at the smallest multiplier: value = that multiplier, an upper
    bound); 'above_max' (never reached: value NaN; 'extrapolated' is the straight line through the last two
    points, only an indication).
    """
    m = np.asarray(mults, np.float64)
    y = np.asarray(losses, np.float64)
    if m.ndim != 1 or m.shape != y.shape or len(m) < 2 or np.any(np.diff(m) <= 0):
        raise ValueError("mults must be increasing and match losses (at least two points)")
    t = float(target)
    ext = math.nan
    if y[0] <= t:
        return {"value": float(m[0]), "status": "at_or_below_min", "extrapolated": math.nan}
    for i in range(len(m) - 1):
        if y[i] > t >= y[i + 1]:
            f = (y[i] - t) / (y[i] - y[i + 1])
            return {"value": float(m[i] + f * (m[i + 1] - m[i])), "status": "interpolated", "extrapolated": math.nan}
    slope = (y[-1] - y[-2]) / (m[-1] - m[-2])
    if slope < 0:
        ext = float(m[-1] + (t - y[-1]) / slope)
    return {"value": math.nan, "status": "above_max", "extrapolated": ext}


def token_multiplier_over_seeds(mults, losses_by_seed, targets_by_seed) -> dict:
    """Fig. 6b's answer with its uncertainty: the multiplier from the seed-mean curve and seed-mean target, and the
    per-seed (paired: seed i's MXFP4 runs against seed i's NVFP4 run) multipliers with their standard error."""
    L = np.asarray(losses_by_seed, np.float64)          # (seeds, mults)
    T = np.asarray(targets_by_seed, np.float64)         # (seeds,)
    main = token_multiplier(mults, L.mean(0), T.mean())
    per = [token_multiplier(mults, L[s], T[s]) for s in range(L.shape[0])]
    vals = np.array([p["value"] for p in per])
    ok = np.isfinite(vals) & np.array([p["status"] == "interpolated" for p in per])
    se = float(vals[ok].std(ddof=1) / math.sqrt(ok.sum())) if ok.sum() > 1 else math.nan
    return {**main, "per_seed": [float(v) for v in vals], "per_seed_status": [p["status"] for p in per],
            "stderr": se}


def effective_data(ref_tokens, ref_losses, loss, tokens):
    """The share of ``tokens`` with which the reference (BF16) reaches ``loss``: the reference's loss against its
    budgets (``ref_tokens`` increasing, ``ref_losses`` their final losses) interpolated linearly in log tokens at
    the first pair of neighbouring budgets that brackets ``loss``, divided by ``tokens``. None where the reference
    never reaches the loss (above its best: more data than the sweep has) or is already below it at its smallest
    budget (less than the sweep measures), or the loss is not finite."""
    t = np.asarray(ref_tokens, np.float64)
    y = np.asarray(ref_losses, np.float64)
    if t.ndim != 1 or t.shape != y.shape or len(t) < 2 or np.any(np.diff(t) <= 0):
        raise ValueError("ref_tokens must be increasing and match ref_losses (at least two budgets)")
    L = float(loss)
    if not math.isfinite(L) or not np.isfinite(y).all():
        return None
    for i in range(len(t) - 1):
        if y[i] >= L >= y[i + 1] and y[i] > y[i + 1]:
            f = (y[i] - L) / (y[i] - y[i + 1])
            return float(math.exp(math.log(t[i]) + f * (math.log(t[i + 1]) - math.log(t[i]))) / float(tokens))
    return None
