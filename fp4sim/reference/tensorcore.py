"""The block-FMA tensor-core models with exact rationals, one output at a time (the oracle of
``fp4sim.tensorcore``): sign-magnitude integers and powers of two, no floating-point arithmetic at all."""
from __future__ import annotations

from fractions import Fraction

__all__ = ["ilog2", "rne32", "step", "dot", "gemm_entry"]

INF = float("inf")


def ilog2(x: Fraction) -> int:
    """floor(log2 |x|) of a nonzero rational, exactly."""
    x = abs(Fraction(x))
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e if Fraction(2) ** e <= x else e - 1


def _p2(e: int) -> Fraction:
    return Fraction(2) ** e


def _trunc(x: Fraction, unit: Fraction) -> Fraction:
    """x truncated toward zero to a multiple of unit."""
    n = abs(x) // unit
    return (n if x >= 0 else -n) * unit


def rne32(x) -> Fraction | float:
    """x rounded to nearest-even binary32 (with subnormals); ±inf past the largest finite value."""
    if isinstance(x, float):
        return x
    if x == 0:
        return Fraction(0)
    q = _p2(max(ilog2(x), -126) - 23)
    n, r = divmod(abs(x), q)
    if r > q / 2 or (r == q / 2 and n % 2):
        n += 1
    v = n * q
    if v >= _p2(128):
        return INF if x > 0 else -INF
    return v if x > 0 else -v


def step(a, b, c, nfma, frac, frac_out, min_exp, late, emin_a, emin_b):
    """One block-FMA step of the products a_k · b_k (rationals, at most nfma of them) and the addend c."""
    if isinstance(c, float):                          # an infinite accumulator stays so
        return c
    prods = [(Fraction(x) * Fraction(y), max(ilog2(x), emin_a) + max(ilog2(y), emin_b))
             for x, y in zip(a, b) if x != 0 and y != 0]
    E = max([min_exp] + [e for _, e in prods] + ([ilog2(c)] if (c != 0 and not late) else []))
    unit = _p2(E - frac)
    d = sum((_trunc(p, unit) for p, _ in prods), Fraction(0))
    if not late:
        d += _trunc(Fraction(c), unit)
    if d != 0:
        d = _trunc(d, _p2(max(ilog2(d), -126) - frac_out))
    if late:
        return rne32(d + Fraction(c))
    if abs(d) >= _p2(128):
        return INF if d > 0 else -INF
    return d


def dot(a, b, model_step, emin_a, emin_b, c=Fraction(0)):
    """The chain over K of one output: steps of nfma consecutive products from addend c."""
    s = model_step
    for k0 in range(0, len(a), s.nfma):
        c = step(a[k0:k0 + s.nfma], b[k0:k0 + s.nfma], c, s.nfma, s.frac, s.frac_out, s.min_exp, s.late,
                 emin_a, emin_b)
    return c


def gemm_entry(a, b, model_step, emin_a, emin_b, chunk=None):
    """One accumulator entry of a GEMM: one chain over K (``chunk`` None: fast accumulation) or a chain per
    ``chunk`` consecutive elements, their results added in order with nearest-even binary32 additions from 0."""
    if chunk is None:
        return dot(a, b, model_step, emin_a, emin_b)
    acc = Fraction(0)
    for k0 in range(0, len(a), chunk):
        part = dot(a[k0:k0 + chunk], b[k0:k0 + chunk], model_step, emin_a, emin_b)
        acc = part if isinstance(part, float) else (acc if isinstance(acc, float) else rne32(acc + part))
    return acc
