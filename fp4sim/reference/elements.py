"""Reference element encoders: one value at a time with exact fractions, plus an exact vectorised twin.

The rules are SPEC §1 stated literally: find the representable neighbours ``lo <= |x| < hi`` of the
magnitude on the format's value grid extended by one value above the maximum (where the next binade would
start), apply the rounding mode, and call it overflow when the result lands above the maximum.
"""
from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

from ..formats import Format

__all__ = ["grid", "encode_scalar", "encode_array", "ue8m0_scalar", "float32_value"]


def float32_value(u: int) -> float:
    """The float32 with bit pattern ``u``, as a Python float (exact)."""
    return float(np.array([u], dtype=np.uint32).view(np.float32)[0])


def grid(fmt: Format) -> list[Fraction]:
    """Finite non-negative magnitudes of ``fmt`` in code order, plus the first value beyond the maximum."""
    mags = [Fraction(fmt.value_of(c)) for c in range(fmt.max_code + 1)]
    assert all(a < b for a, b in zip(mags, mags[1:])), "magnitude codes must be monotone"
    top_ulp = Fraction(2) ** (fmt.emax - fmt.mbits)
    return mags + [mags[-1] + top_ulp]


_GRIDS: dict[str, list[Fraction]] = {}


def _grid(fmt: Format) -> list[Fraction]:
    if fmt.name not in _GRIDS:
        _GRIDS[fmt.name] = grid(fmt)
    return _GRIDS[fmt.name]


def _round_on_grid(mag: Fraction, g: list[Fraction], mode: str, negative: bool, r: int, n: int) -> int:
    """Index in ``g`` of |x| rounded; ``len(g) - 1`` (the value past the max) means overflow."""
    if mag >= g[-1]:
        return len(g) - 1
    lo = bisect.bisect_right(g, mag) - 1  # largest grid value <= mag
    if g[lo] == mag:
        return lo
    hi = lo + 1
    if mode == "rne":
        mid = (g[lo] + g[hi]) / 2
        return hi if mag > mid or (mag == mid and hi % 2 == 0) else lo
    if mode == "rz":
        return lo
    if mode in ("ru", "rp"):
        return lo if negative else hi
    if mode == "rd":
        return hi if negative else lo
    if mode == "sr":
        delta = (mag - g[lo]) / (g[hi] - g[lo])
        return hi if math.floor(delta * 2**n) + r >= 2**n else lo
    if mode == "sr_midpoint":                        # rbits_mapping="midpoint"
        delta = (mag - g[lo]) / (g[hi] - g[lo])
        return hi if delta + Fraction(2 * r + 1, 2 ** (n + 1)) >= 1 else lo
    raise ValueError(mode)


def encode_scalar(x: float, fmt: Format, rounding: str = "rne", saturate: bool = True, r: int = 0,
                  n: int = 8) -> int:
    """Code of one float32 value ``x`` (a Python float holding a float32) in a signed format."""
    if fmt.name == "ue8m0":
        return ue8m0_scalar(x, rounding, saturate)
    g = _grid(fmt)
    maxc = len(g) - 2
    if math.isnan(x):
        return fmt.nan_code if fmt.nan_code is not None else maxc      # E2M1: NaN -> +6 (cuda_fp4.h)
    negative = math.copysign(1.0, x) < 0
    if math.isinf(x):
        idx = len(g) - 1
    else:
        idx = _round_on_grid(Fraction(abs(x)), g, rounding, negative, r, n)
    if idx > maxc:  # overflow
        if saturate or rounding.startswith("sr") or fmt.always_saturates:
            return fmt.signed_code(maxc, negative)
        return fmt.signed_code(fmt.inf_code if fmt.has_inf else fmt.nan_code, negative)
    return fmt.signed_code(idx, negative)


def ue8m0_scalar(x: float, rounding: str = "rz", saturate: bool = True) -> int:
    """UE8M0 byte of a float32 value (sign ignored), SPEC §1.4; rne ties go to the even code."""
    if math.isnan(x):
        return 0xFF
    mag = abs(x)
    if mag == 0:
        return 0
    if math.isinf(mag):
        e = 255
    else:
        f = Fraction(mag)
        # largest e with 2^(e-127) <= |x| (frexp is exact: |x| = m * 2^k, 0.5 <= m < 1); -1 below 2^-127
        e = max(math.frexp(mag)[1] - 1 + 127, -1)
        if rounding in ("ru", "rp"):
            if e < 0 or Fraction(2) ** (e - 127) != f:
                e += 1
        elif rounding == "rne":
            lo = Fraction(2) ** (e - 127) if e >= 0 else Fraction(0)
            hi = Fraction(2) ** (e + 1 - 127)
            mid = (lo + hi) / 2
            if f > mid or (f == mid and (e + 1) % 2 == 0):
                e += 1
        e = max(e, 0)
    if e > 254:
        return 0xFE if saturate else 0xFF
    return e


def encode_array(x: np.ndarray, fmt: Format, rounding: str = "rne", saturate: bool = True,
                 r: np.ndarray | None = None, n: int = 8) -> np.ndarray:
    """Vectorised twin of :func:`encode_scalar` for signed formats (exact: float64 holds every float32, every
    grid value and every midpoint of neighbouring grid values)."""
    with np.errstate(invalid="ignore"):  # signalling-NaN patterns widen to quiet NaNs
        x = np.asarray(x).astype(np.float32).astype(np.float64)
    g = np.array([float(v) for v in _grid(fmt)])
    maxc = len(g) - 2
    mag = np.abs(x)
    neg = np.signbit(x)
    lo = np.clip(np.searchsorted(g, mag, side="right") - 1, 0, len(g) - 1)
    hi = np.minimum(lo + 1, len(g) - 1)
    exact = g[lo] == mag
    if rounding == "rne":
        mid = (g[lo] + g[hi]) / 2
        up = (mag > mid) | ((mag == mid) & (hi % 2 == 0))
    elif rounding == "rz":
        up = np.zeros_like(neg)
    elif rounding in ("ru", "rp"):
        up = ~neg
    elif rounding == "rd":
        up = neg
    elif rounding in ("sr", "sr_midpoint"):
        with np.errstate(invalid="ignore", divide="ignore"):  # only where mag >= the grid's end
            delta = (mag - g[lo]) / (g[hi] - g[lo])
        if rounding == "sr":
            up = np.floor(delta * 2.0**n) + r.astype(np.float64) >= 2.0**n
        else:                                    # floor(delta 2^(n+1)) + 2r + 1 >= 2^(n+1), exactly
            up = np.floor(delta * 2.0 ** (n + 1)) + 2 * r.astype(np.float64) + 1 >= 2.0 ** (n + 1)
    else:
        raise ValueError(rounding)
    idx = np.where(exact, lo, lo + up)
    idx = np.where(mag >= g[-1], len(g) - 1, idx)  # includes Inf
    over = idx > maxc
    if saturate or rounding.startswith("sr") or fmt.always_saturates:
        over_code = maxc
    else:
        over_code = fmt.inf_code if fmt.has_inf else fmt.nan_code
    mc = np.where(over, over_code, idx).astype(np.int64)
    if fmt.twos_complement:
        code = np.where(neg, (-mc) % fmt.n_codes, mc)
    else:
        code = np.where(neg & ((mc != 0) | fmt.has_neg_zero), mc | fmt.sign_mask, mc)
    nan_code = fmt.nan_code if fmt.nan_code is not None else maxc
    code = np.where(np.isnan(x), nan_code, code)
    return code.astype(fmt.code_dtype)
