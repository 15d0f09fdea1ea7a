"""The block-FMA tensor-core models with exact rationals, one output at a time (the oracle of
``fp4sim.tensorcore``): sign-magnitude integers and powers of two, no floating-point arithmetic at all."""
from __future__ import annotations

from fractions import Fraction

__all__ = ["ilog2", "rne32", "step", "dot", "gemm_entry", "tcgen05_fp4"]

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


def step(a, b, c, nfma, frac, frac_out, min_exp, late, emin_a, emin_b, c_emin=None):
    """One block-FMA step of the products a_k · b_k (rationals, at most nfma of them) and the addend c (its
    exponent clamped below at ``c_emin`` where given)."""
    if isinstance(c, float):                          # an infinite accumulator stays so
        return c
    prods = [(Fraction(x) * Fraction(y), max(ilog2(x), emin_a) + max(ilog2(y), emin_b))
             for x, y in zip(a, b) if x != 0 and y != 0]
    ec = ilog2(c) if c != 0 else None
    if ec is not None and c_emin is not None:
        ec = max(ec, c_emin)
    E = max([min_exp] + [e for _, e in prods] + ([ec] if (ec is not None and not late) else []))
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
                 emin_a, emin_b, s.c_emin)
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


def tcgen05_fp4(a, sa, b, sb, block: int, scale_emin: int):
    """Blackwell's ``kind::mxf4nvf4`` instruction chain (MMA-Sim's model) for one output: a, b the E2M1 element
    values (rationals, K a multiple of 64), sa, sb the decoded block scales (one per ``block`` elements;
    ``scale_emin``: their format's smallest normal exponent, -6 for UE4M3, -127 for UE8M0). Per 64 elements:
    each 16-product group's exact sum times its two scales is a term at exponent e(sa) + e(sb) (-139 when its
    products are all zero or its scale product is zero); with the accumulator (exponent clamped at -126; -139
    when zero) the terms are truncated to 35 fraction bits below the largest exponent, summed exactly, and the
    sum truncated to a float32."""
    c = Fraction(0)
    for k0 in range(0, len(a), 64):
        if isinstance(c, float):
            return c
        terms = []
        for g in range(k0, k0 + 64, 16):
            prods = [Fraction(x) * Fraction(y) for x, y in zip(a[g:g + 16], b[g:g + 16])]
            s = Fraction(sa[g // block]) * Fraction(sb[g // block])
            e = (max(ilog2(sa[g // block]), scale_emin) + max(ilog2(sb[g // block]), scale_emin)
                 if any(p != 0 for p in prods) and s != 0 else -139)
            terms.append((sum(prods, Fraction(0)) * s, e))
        terms.append((c, max(ilog2(c), -126) if c != 0 else -139))
        unit = _p2(max(e for _, e in terms) - 35)
        d = sum((_trunc(v, unit) for v, _ in terms), Fraction(0))
        if d != 0:
            d = _trunc(d, _p2(max(ilog2(d), -126) - 23))
        if abs(d) >= _p2(128):
            return INF if d > 0 else -INF
        c = d
    return c
