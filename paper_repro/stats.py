"""Numbers the figures report: relative differences over seeds, the token multiplier of Fig. 6b, and the test of
the sqrt(3) gradient-SNR claim."""
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


def snr_claim(rows_q, rows_ref, seeds):
    """Chmiel et al.'s sqrt(3) claim on one quantized variant against BF16 (the teacher figures, gpt_snr). Per seed, the first evaluation at which
    the median weight-gradient SNR of the quantized layers is below sqrt(3); the growth of log(MSE_q / MSE_bf16)
    per evaluation interval after it minus before it, paired over the seeds that cross inside the run (after the
    first evaluation and before the last). 'reproduces' when the excess loss grows faster after the crossing by
    more than 2 s.e.; 'contradicts' when slower by more than 2 s.e. Also, over the evaluation intervals that start
    and end below sqrt(3), the share in which the quantized run's own held-out MSE still fell (``fell_below``) and
    the factor it fell by there (geometric mean over seeds): training that keeps helping below the threshold."""
    from fp4sim.torch.stats import SNR_THRESHOLD
    diffs, crossings, kinds = [], {}, {"from the first evaluation": 0, "never": 0, "only at the last evaluation": 0}
    fell, n_below, factors = 0, 0, []
    for s in seeds:
        q, r = rows_q[s], rows_ref[s]
        snr = [row.get("snr_median", math.inf) for row in q]
        ex = np.log([a["val_mse"] / b["val_mse"] for a, b in zip(q, r)])
        below = [k for k in range(1, len(q)) if snr[k - 1] < SNR_THRESHOLD and snr[k] < SNR_THRESHOLD]
        n_below += len(below)
        fell += sum(q[k]["val_mse"] < q[k - 1]["val_mse"] for k in below)
        if below:
            factors.append(sum(math.log(q[k - 1]["val_mse"] / q[k]["val_mse"]) for k in below))
        i = next((k for k, v in enumerate(snr) if v < SNR_THRESHOLD), None)
        if i is None:
            kinds["never"] += 1
        elif i == 0:
            kinds["from the first evaluation"] += 1
        elif i > len(ex) - 2:
            kinds["only at the last evaluation"] += 1
        else:
            crossings[s] = q[i]["step"]
            diffs.append(float(np.mean(np.diff(ex[i:])) - np.mean(np.diff(ex[:i + 1]))))
    low = min(min(row.get("snr_median", math.inf) for row in rows_q[s]) for s in seeds)
    extra = {"crossing_step": crossings, "lowest_snr_median": low, "seeds_below": kinds,
             "intervals_below": n_below, "fell_below": fell / n_below if n_below else None,
             "mse_fall_factor_below": math.exp(float(np.mean(factors))) if factors else None}
    if len(diffs) < 2:
        why = ", ".join(f"{k} in {v}" for k, v in kinds.items() if v)
        return {"verdict": f"not tested: the median gradient SNR crossed sqrt(3) inside the run in {len(diffs)} "
                           f"seed(s) (below it {why})", "n": len(diffs), **extra}
    word, info = verdict("worse", diffs, [False] * len(diffs))
    return {"verdict": word, **info, **extra}


def verdict(expect: str, diffs, diverged_flags) -> tuple[str, dict]:
    """The verdict of a variant from its paired final-loss differences to the reference (the ablations' rule, see
    paper_repro/ablations.py): ``expect`` "worse" / "better": "reproduces" when the mean difference has that sign
    beyond two standard errors, "contradicts" beyond two the other way, else not distinguishable from seed noise;
    "same": "reproduces (no difference)" within two standard errors; "diverges": any diverged run reproduces."""
    d = np.asarray(diffs, np.float64)
    dv = any(diverged_flags)
    if dv:
        return ("reproduces (diverged)" if expect == "diverges" else "contradicts: diverged"), {"diverged": True}
    n = len(d)
    m = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    se = sd / math.sqrt(n) if n > 1 else math.nan
    info = {"effect": m, "spread": sd, "stderr": se, "n": n}
    if not math.isfinite(se):
        return "one seed: no verdict", info
    noise = f"not distinguishable from seed noise at this scale (spread {sd:.4f}, effect {m:+.4f})"
    if expect in ("worse", "better"):
        sign = 1 if expect == "worse" else -1
        if sign * m > 2 * se:
            return "reproduces", info
        if sign * m < -2 * se:
            return f"contradicts (effect {m:+.4f} ± {se:.4f})", info
        return noise, info
    if expect == "same":
        return ("reproduces (no difference)" if abs(m) <= 2 * se else
                f"contradicts: a difference of {m:+.4f} ± {se:.4f}"), info
    return "reference", info
