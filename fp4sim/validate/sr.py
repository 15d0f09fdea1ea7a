"""Statistical check of stochastic rounding when the kernel's random bits are unknown."""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import binomtest, norm

from ..formats import Format


RULES = {"te": "TE's truncating rule: up iff floor(delta 2^n) + r >= 2^n",
         "midpoint": "the midpoint rule: up iff delta + (2r + 1) / 2^(n+1) >= 1"}


def up_probability(delta, n: int, rule: str = "te"):
    """The probability that SR rounds up, over the 2^n random integers, at the position ``delta`` in [0, 1)
    between neighbours: floor(delta 2^n) / 2^n (``"te"``) or floor((floor(delta 2^(n+1)) + 1) / 2) / 2^n
    (``"midpoint"``: the rule rounds up for r >= 2^n - (t + 1) // 2 with t = floor(delta 2^(n+1)))."""
    if rule == "te":
        return np.floor(delta * 2.0**n) / 2.0**n
    return np.floor((np.floor(delta * 2.0 ** (n + 1)) + 1) / 2) / 2.0**n


def sr_statistics(y: np.ndarray, codes: np.ndarray, fmt: Format, n: int = 8, alpha: float = 1e-3,
                  bins: int = 8, rule: str = "te") -> dict:
    """Check SR outputs ``codes`` of scaled inputs ``y`` (same shape). The whole check's false-alarm rate on a
    correct SR kernel is at most ``alpha``.

    Hard check: each code is ``lo`` or ``hi``, the neighbouring magnitudes of |y| (the exact value when y is
    representable), with y's sign. Frequency check: over inexact elements, the number rounded up is compared
    with its expectation (sum(floor(delta*2^n)/2^n) for ``rule="te"``, :func:`up_probability` for
    ``"midpoint"``) by a normal approximation of the Poisson-binomial (z-test,
    two-sided p-value), and in each of ``bins`` delta bins the round-up count is compared with its expectation
    (exact binomial test), Bonferroni-corrected over the bins + 1 tests: RNE and RZ fail it at any useful size
    (their rates are 0 or 1 per bin). Returns counts, rates, per-delta-bin rates and p-values, the smallest
    overall rate shift the test can see (``detectable_rate_shift``), the relative bias
    ``sum((up - p) * (hi - lo)) / sum(|y|)`` and findings that name the likely fault — among them the other
    rule, when the overall rate fails under ``rule`` and passes under it.
    """
    grid = fmt.finite_values.astype(np.float64)
    ay = np.abs(y.astype(np.float64)).ravel()
    c = codes.ravel().astype(np.int64)
    fin = np.isfinite(ay)
    mag_code = c & (fmt.sign_mask - 1)
    sign = (c & fmt.sign_mask) != 0
    top = len(grid) - 1
    lo = np.clip(np.searchsorted(grid, ay, side="right") - 1, 0, top)
    exact = (grid[lo] == ay) | (ay >= grid[-1])
    lo = np.where(ay >= grid[-1], top, lo)
    hi = np.minimum(lo + 1, top)
    ok_mag = np.where(exact, mag_code == lo, (mag_code == lo) | (mag_code == hi))
    ok_sign = (mag_code == 0) | (sign == np.signbit(y.ravel()))
    valid = fin & ~np.isnan(ay)
    bad = valid & ~(ok_mag & ok_sign)
    inex = valid & ~exact & ok_mag
    with np.errstate(invalid="ignore", divide="ignore"):
        delta = (ay - grid[lo]) / (grid[hi] - grid[lo])
    p = up_probability(delta, n, rule)
    up = (mag_code == hi) & inex
    P, U = p[inex], up[inex].astype(np.float64)
    var = float(np.sum(P * (1 - P)))
    z = float((U.sum() - P.sum()) / math.sqrt(var)) if var > 0 else 0.0
    pval = math.erfc(abs(z) / math.sqrt(2))
    step = (grid[hi] - grid[lo])[inex]
    rel_bias = float(np.sum((U - P) * step) / max(np.sum(ay[valid]), 1e-300))
    edges = np.linspace(0, 1, bins + 1)
    b = np.clip(np.digitize(delta[inex], edges) - 1, 0, bins - 1)
    # Per-delta-bin tests: in each bin the round-up count is compared with its expectation by an exact
    # binomial test at the bin's mean probability (the Poisson-binomial count has at most that variance, so
    # the test is conservative); Bonferroni over the bins and the overall z-test keeps the false-alarm rate
    # of the whole check at most alpha.
    ntests = bins + 1
    per_bin = []
    bin_fail = False
    for i in range(bins):
        m = b == i
        k, nn = int(U[m].sum()), int(m.sum())
        pe = float(P[m].mean()) if nn else None
        pv = None
        if nn:
            if pe <= 0.0 or pe >= 1.0:
                pv = 1.0 if k == round(pe * nn) else 0.0
            else:
                pv = float(binomtest(k, nn, pe).pvalue)
            bin_fail |= pv < alpha / ntests
        per_bin.append(dict(delta_lo=float(edges[i]), delta_hi=float(edges[i + 1]), n=nn,
                            up_rate=k / nn if nn else None, expected=pe, p_value=pv))
    overall_fail = bool(inex.sum()) and pval < alpha / ntests
    # the smallest shift of the overall round-up rate the overall test would see (two-sided, at its level)
    zc = float(norm.isf(alpha / ntests / 2))
    detectable = zc * math.sqrt(var) / max(P.size, 1) if var > 0 else float("nan")
    findings = []
    nb = int(bad.sum())
    if nb:
        far = valid & ~ok_mag & ~exact
        two = far & ((mag_code == lo + 2) | (mag_code == lo - 1))
        if two.any():
            findings.append(f"{int(two.sum())} outputs are a whole grid step beyond the neighbours of the scaled "
                            "input: the rounding step looks doubled (SR adds 2 ulp, or uses hi - lo twice)")
        if (valid & ~ok_sign).any():
            findings.append(f"{int((valid & ~ok_sign).sum())} outputs have the wrong sign")
        if nb > int(two.sum()) + int((valid & ~ok_sign).sum()):
            findings.append("some outputs are neither neighbour of the scaled input: wrong scale or not SR")
    filled = [d for d in per_bin if d["n"] >= 20]
    near = lambda r, v: abs(r - v) <= 0.005  # noqa: E731
    deterministic = len(filled) >= 2 and all(near(d["up_rate"], 0) or near(d["up_rate"], 1) for d in filled)
    if deterministic and (bin_fail or overall_fail):
        if all(near(d["up_rate"], 0) for d in filled):
            what = "it never rounds up: round toward zero (RZ)"
        elif all(near(d["up_rate"], 1 if d["delta_lo"] >= 0.5 else 0) for d in filled if d["delta_hi"] <= 0.5
                 or d["delta_lo"] >= 0.5):
            what = "it rounds up exactly when delta > 1/2: round to nearest (RNE)"
        else:
            what = "whether it rounds up depends on delta alone, with no randomness"
        findings.append(f"deterministic rounding (RNE/RZ), not SR: the round-up rate is 0 or 1 in every delta bin; "
                        f"{what}")
    elif bin_fail and not overall_fail:
        bad_bins = [f"[{d['delta_lo']:.3f}, {d['delta_hi']:.3f}): {d['up_rate']:.3f} vs {d['expected']:.3f}"
                    for d in per_bin if d["p_value"] is not None and d["p_value"] < alpha / ntests]
        findings.append("the overall round-up rate is right but it does not follow delta: " + "; ".join(bad_bins))
    if overall_fail and not deterministic and nb == 0:
        other = "midpoint" if rule == "te" else "te"
        Po = up_probability(delta, n, other)[inex]
        vo = float(np.sum(Po * (1 - Po)))
        zo = float((U.sum() - Po.sum()) / math.sqrt(vo)) if vo > 0 else 0.0
        if math.erfc(abs(zo) / math.sqrt(2)) >= alpha / ntests:
            findings.append(f"the round-up rate is that of {RULES[other]} (z = {zo:.2f}), not {RULES[rule]} "
                            f"(z = {z:.2f}): validate with rbits_mapping={other!r}")
    if overall_fail and not deterministic:
        rate, exp = float(U.mean()), float(P.mean())
        if rate == 0:
            findings.append("never rounds up on inexact inputs: this is rounding toward zero, not SR")
        elif rate < exp:
            findings.append(f"rounds up too rarely ({rate:.4f} vs {exp:.4f}): biased toward zero (random bits "
                            "compared off by one, too few bits, or a truncating path)")
        else:
            findings.append(f"rounds up too often ({rate:.4f} vs {exp:.4f}): biased away from zero (random bits "
                            "misaligned with delta, or added before truncation twice)")
    return dict(n=int(valid.sum()), n_inexact=int(inex.sum()), not_neighbour=nb, up_rate=float(U.mean()) if U.size
                else 0.0, expected_up_rate=float(P.mean()) if P.size else 0.0, z=z, p_value=pval, alpha=alpha,
                relative_bias=rel_bias, per_bin=per_bin, findings=findings, n_tests=ntests,
                detectable_rate_shift=detectable, rule=rule,
                passed=bool(nb == 0 and not overall_fail and not bin_fail))
