"""Blackwell's block-scaled tensor-core instructions (``tcgen05.mma`` with block scales) as MMA-Sim models them
(Microsoft's MMA-Sim 2.1.1, PyPI ``mmasim``; facts, not code):

- ``kind::mxf4nvf4`` (NVFP4: 16-element blocks with UE4M3 scales; MXFP4: 32-element blocks with UE8M0 scales),
  K = 64 per instruction: the exact sum of each group of 16 products, times its two block scales, is a term
  whose alignment exponent is the sum of the two scales' exponents (a group whose products are all zero, or
  whose scale product is zero, takes exponent -139; a group whose nonzero products cancel keeps its scales'
  exponent); the terms and the incoming float32 accumulator (its exponent clamped below at -126) are aligned
  to the largest exponent, each truncated toward zero to 35 fraction bits below it, summed exactly, and the sum
  truncated to a float32 (23 fraction bits below its exponent, at least -126) that the next instruction adds to.
  A UE4M3 scale is the E4M3 code without its sign bit; a subnormal one keeps exponent -6.
- ``kind::mxf8f6f4`` with UE8M0 block scales (MXFP8 and MXFP6, 32-element blocks, any pair of E4M3, E5M2,
  E2M3 and E3M2 operands), K = 32 per instruction: a block-FMA
  step (``BlockFMA(32, 25, 23, -133)``, the addend's exponent clamped below at -126) on the products
  a·b·s_a·s_b, whose exponents are the elements' (clamped at their format's smallest normal exponent) plus the
  scales'.

The chain walks K in physical order from +0; fp4sim applies NVFP4's tensor scales (alpha) afterwards, as for its
other NVFP4 models.
"""
from __future__ import annotations

import numpy as np

from ..cpu import tensorcore as _cpu
from .accumulate import chain_exp, exponents
from .models import BlockFMA

__all__ = ["tcgen05_fp4", "tcgen05_fp8", "MXF8_STEP"]

MXF8_STEP = BlockFMA(32, 25, 23, -133, c_emin=-126)
_SCALE_EMIN = {"ue4m3": -6, "ue8m0": -127}


def _scale_parts(s, fmt):
    """(float64 scale values, int64 exponents clamped at the scale format's smallest normal exponent)."""
    s = np.abs(np.asarray(s, np.float64)) if fmt == "ue4m3" else np.asarray(s, np.float64)
    with np.errstate(invalid="ignore"):
        m, e = np.frexp(np.where(np.isfinite(s), s, 1.0))
    e = np.maximum(e.astype(np.int64) - 1, _SCALE_EMIN[fmt])
    return s, e


def _pad(v, axis_len):
    """v (rows, n) zero-padded to (rows, axis_len)."""
    if v.shape[1] == axis_len:
        return np.ascontiguousarray(v)
    out = np.zeros((v.shape[0], axis_len), v.dtype)
    out[:, :v.shape[1]] = v
    return out


def tcgen05_fp4(va, sa, vb, sb, block: int, scale_fmt: str, backend=None) -> np.ndarray:
    """float32 (M, N) accumulator of ``kind::mxf4nvf4``: va (M, K), vb (N, K) E2M1 values; sa (M, K/block),
    sb (N, K/block) decoded block scales (``scale_fmt`` "ue4m3" for NVFP4 with block 16, "ue8m0" for MXFP4 with
    block 32)."""
    K = va.shape[1]
    Kp = -(-K // 64) * 64
    nb = Kp // block
    va, vb = _pad(np.asarray(va, np.float32), Kp), _pad(np.asarray(vb, np.float32), Kp)
    sa, ea = _scale_parts(_pad(np.asarray(sa, np.float64), nb), scale_fmt)
    sb, eb = _scale_parts(_pad(np.asarray(sb, np.float64), nb), scale_fmt)
    if backend is not None:                      # the CUDA kernel (the same bits)
        from ..gpu import ops
        xp = backend.xp
        y = ops.kernels(backend).tc_group_chain(*(xp.asarray(v) for v in (va, vb, sa, sb, ea, eb)), 64, 16, block,
                                                 35, -139)
        return y.get() if hasattr(y, "get") else y
    return _cpu.group_chain(va, vb, sa, sb, ea, eb, 64, 16, block, 35, -139)


def tcgen05_fp8(va, fmt_a: str, sa, vb, fmt_b: str, sb, backend=None) -> np.ndarray:
    """float32 (M, N) accumulator of ``kind::mxf8f6f4`` with UE8M0 scales: va (M, K), vb (N, K) FP8 or FP6 values
    of formats fmt_a / fmt_b ("e4m3", "e5m2", "e2m3", "e3m2"); sa (M, K/32), sb (N, K/32) the decoded power-of-two
    scales."""
    K = va.shape[1]
    Kp = -(-K // 32) * 32
    va, vb = _pad(np.asarray(va, np.float32), Kp), _pad(np.asarray(vb, np.float32), Kp)
    sa = np.repeat(_pad(np.asarray(sa, np.float64), Kp // 32), 32, axis=1)
    sb = np.repeat(_pad(np.asarray(sb, np.float64), Kp // 32), 32, axis=1)
    _, esa = _scale_parts(sa, "ue8m0")
    _, esb = _scale_parts(sb, "ue8m0")
    ea, eb = exponents(va, fmt_a), exponents(vb, fmt_b)
    ea = np.where(va != 0, ea + esa, ea).astype(np.int32)
    eb = np.where(vb != 0, eb + esb, eb).astype(np.int32)
    with np.errstate(invalid="ignore", over="ignore"):
        A = va.astype(np.float64) * sa
        B = vb.astype(np.float64) * sb
    return chain_exp(A, ea, B, eb, MXF8_STEP, backend=backend)
