"""Statistical check of stochastic rounding when the kernel's random bits are unknown."""
from __future__ import annotations

import math

import numpy as np

from ..formats import Format


def sr_statistics(y: np.ndarray, codes: np.ndarray, fmt: Format, n: int = 8, alpha: float = 1e-3,
                  bins: int = 8) -> dict:
    """Check SR outputs ``codes`` of scaled inputs ``y`` (same shape).

    Hard check: each code is ``lo`` or ``hi``, the neighbouring magnitudes of |y| (the exact value when y is
    representable), with y's sign. Frequency check: over inexact elements, the number rounded up is compared
    with its expectation sum(floor(delta*2^n)/2^n) by a normal approximation of the Poisson-binomial (z-test,
    two-sided p-value). Returns counts, rates, per-delta-bin rates, the relative bias
    ``sum((up - p) * (hi - lo)) / sum(|y|)`` and findings that name the likely fault.
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
    p = np.floor(delta * 2.0**n) / 2.0**n
    up = (mag_code == hi) & inex
    P, U = p[inex], up[inex].astype(np.float64)
    var = float(np.sum(P * (1 - P)))
    z = float((U.sum() - P.sum()) / math.sqrt(var)) if var > 0 else 0.0
    pval = math.erfc(abs(z) / math.sqrt(2))
    step = (grid[hi] - grid[lo])[inex]
    rel_bias = float(np.sum((U - P) * step) / max(np.sum(ay[valid]), 1e-300))
    edges = np.linspace(0, 1, bins + 1)
    b = np.clip(np.digitize(delta[inex], edges) - 1, 0, bins - 1)
    per_bin = [dict(delta_lo=float(edges[i]), delta_hi=float(edges[i + 1]), n=int((b == i).sum()),
                    up_rate=float(U[b == i].mean()) if (b == i).any() else None,
                    expected=float(P[b == i].mean()) if (b == i).any() else None) for i in range(bins)]
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
    if inex.sum() and pval < alpha:
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
                relative_bias=rel_bias, per_bin=per_bin, findings=findings,
                passed=bool(nb == 0 and pval >= alpha))
