"""AMD's CDNA3 matrix cores (MI300: ``v_mfma_f32_*`` instructions) as MMA-Sim 2.1 models them (Microsoft's
MMA-Sim, PyPI ``mmasim``, ``mmasim.amd.MFMA``; facts, not code).

Every operand is read as s·2^e with 1 <= ``|s|`` < 2, or as a subnormal at its format's smallest normal exponent
(E4M3FNUZ -7, E5M2FNUZ -15, FP16 -14, BF16 and the float32 accumulator -126). One instruction step takes ``L``
products and the incoming float32 accumulator c:

- **FP8 (E4M3FNUZ / E5M2FNUZ, any mix), L = 16**: the products at even and at odd positions form two groups;
  each group's terms are aligned to the group's largest product exponent and truncated toward zero to F = 24
  fraction bits, then summed exactly; the two sums are aligned to the larger of their exponents and floored to
  24 fraction bits; that dot and c are aligned to the larger of the dot's and c's exponents, the dot floored to
  32 fraction bits and c to 24 (c is dropped where it lies more than 25 binades below); their exact sum,
  normalised (subnormal below 2^-126), is floored to 31 fraction bits and rounded to float32 (nearest-even).
- **BF16 / FP16, L = 8**: one group of all L products, truncated to 24 fraction bits below its largest exponent
  and summed; then as FP8 from the alignment with c on (without the drop); a product whose exponent reaches
  2^128 is infinite.

A zero product takes no part in the alignment. NaN anywhere gives the canonical float32 NaN (0x7FFFFFFF).
:func:`mfma` chains these steps over K in order from the given accumulator, as a sequence of MFMA instructions
does (a 16x16x32 FP8 instruction is two steps, a 16x16x16 BF16 one two).
"""
from __future__ import annotations

import numpy as np

__all__ = ["mfma", "CDNA3_FORMATS", "step_length"]

F, F2 = 24, 31
_ZERO = -999                                            # the exponent of a zero product (never a maximum)
# operand formats of the CDNA3 MFMA models: their smallest normal exponent (subnormals are read there)
CDNA3_FORMATS = {"e4m3fnuz": -7, "e5m2fnuz": -15, "bf16": -126, "fp16": -14}
_FP8 = ("e4m3fnuz", "e5m2fnuz")


def step_length(fmt_a: str, fmt_b: str) -> int:
    """Products per step: 16 for FP8 (FNUZ) operands, 8 for BF16 / FP16."""
    return 16 if fmt_a in _FP8 else 8


def _parts(x: np.ndarray, e_sub: int):
    """(s, e): x = s · 2^e with 1 <= |s| < 2, or e = e_sub and |s| < 1 for values below 2^e_sub (zero: e_sub)."""
    m, e = np.frexp(x.astype(np.float64))
    s, e = m * 2.0, e.astype(np.int64) - 1
    sub = e < e_sub
    s = np.where(sub, np.ldexp(s, np.where(sub, e - e_sub, 0)), s)
    e = np.where(sub | (s == 0), e_sub, e)
    return s, e


def _fused(s, e):
    """Each term truncated toward zero to F fraction bits below the largest exponent along the last axis, summed
    exactly: (sum, that exponent)."""
    em = e.max(axis=-1)
    t = np.trunc(np.ldexp(s, e - em[..., None] + F))
    return np.ldexp(t.sum(axis=-1), -F), em


def _close(s_dot, e_dot, c, drop: bool):
    """The step's second stage: the dot (s_dot · 2^e_dot) and the accumulator c aligned, floored, summed,
    normalised, floored to F2 fraction bits and rounded to float32."""
    s_c, e_c = _parts(c, -126)
    e_max = np.maximum(e_dot, e_c)
    s_dot = np.ldexp(np.floor(np.ldexp(s_dot, e_dot - e_max + F2 + 1)), -(F2 + 1))
    s_c = np.ldexp(np.floor(np.ldexp(s_c, e_c - e_max + F)), -F)
    if drop:
        s_c = np.where(e_c < e_max - F - 1, 0.0, s_c)
    with np.errstate(over="ignore", invalid="ignore"):
        v = np.ldexp(s_dot + s_c, e_max)
    s, e = _parts(v, -126)
    s = np.ldexp(np.floor(np.ldexp(s, F2)), -F2)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.ldexp(s, e).astype(np.float32)
    r.view(np.uint32)[np.isnan(r)] = np.uint32(0x7FFFFFFF)
    return r


def _step(sa, ea, sb, eb, c, fp8: bool):
    """One instruction step on the (M, 1, L) and (1, N, L) operand parts and the (M, N) accumulator."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = sa * sb
        e = ea + eb
        if not fp8:                                      # a product of 2^128 or more is infinite
            s = np.where((np.abs(s) >= 2.0) + e >= 128, s * np.inf, s)
        e = np.where(s == 0, _ZERO, e)
        if fp8:
            s0, e0 = _fused(s[..., 0::2], e[..., 0::2])
            s1, e1 = _fused(s[..., 1::2], e[..., 1::2])
            e_dot = np.maximum(e0, e1)
            s_dot = (np.ldexp(np.floor(np.ldexp(s0, e0 - e_dot + F)), -F)
                     + np.ldexp(np.floor(np.ldexp(s1, e1 - e_dot + F)), -F))
        else:
            s_dot, e_dot = _fused(s, e)
    return _close(s_dot, e_dot, c, drop=fp8)


def mfma(A: np.ndarray, B: np.ndarray, fmt_a: str, fmt_b: str, C: np.ndarray | None = None,
         arch: str = "cdna3") -> np.ndarray:
    """float32 (M, N): the CDNA3 MFMA chain over K of A (M, K) and B (N, K) — float32 arrays holding values of
    formats ``fmt_a`` / ``fmt_b`` ("e4m3fnuz" / "e5m2fnuz" in any mix, or both "bf16" or both "fp16") — from the
    accumulator ``C`` (float32 (M, N); None: +0)."""
    if arch != "cdna3":
        raise ValueError(f"arch={arch!r}: fp4sim models AMD's CDNA3 (MI300) matrix cores ('cdna3')")
    for f, name in ((fmt_a, "fmt_a"), (fmt_b, "fmt_b")):
        if f not in CDNA3_FORMATS:
            raise ValueError(f"{name}={f!r}: CDNA3's MFMA models take {', '.join(CDNA3_FORMATS)} operands")
    fp8 = fmt_a in _FP8
    if fp8 != (fmt_b in _FP8) or (not fp8 and fmt_a != fmt_b):
        raise ValueError(f"fmt_a={fmt_a!r} and fmt_b={fmt_b!r}: an MFMA takes two FP8 (FNUZ) operands, or two of "
                         "the same 16-bit format")
    A = np.asarray(A, np.float32)
    B = np.asarray(B, np.float32)
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1]:
        raise ValueError(f"A {A.shape} and B {B.shape} must be (M, K) and (N, K)")
    M, K = A.shape
    N = B.shape[0]
    c = np.zeros((M, N), np.float32) if C is None else np.array(C, np.float32, copy=True)
    if c.shape != (M, N):
        raise ValueError(f"C has shape {c.shape}, not ({M}, {N})")
    sa, ea = _parts(A, CDNA3_FORMATS[fmt_a])
    sb, eb = _parts(B, CDNA3_FORMATS[fmt_b])
    L = step_length(fmt_a, fmt_b)
    for k in range(0, K, L):
        sl = slice(k, min(k + L, K))
        c = _step(sa[:, None, sl], ea[:, None, sl], sb[None, :, sl], eb[None, :, sl], c, fp8)
    return c
