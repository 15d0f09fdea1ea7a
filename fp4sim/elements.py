"""Public element conversions: ``encode`` (float -> codes) and ``decode`` (codes -> float32).

Semantics follow SPEC §1: CUDA/PTX ``.satfinite`` behaviour by default, every rounding mode, stochastic
rounding with given or Philox-generated bits.
"""
from __future__ import annotations

import numpy as np

from . import planning
from .formats import get_format
from ._xp import is_cupy, table, xp_of
from .planning import ROUNDINGS, kernel_params  # noqa: F401  (kernel_params: re-exported for callers)

__all__ = ["encode", "decode", "ROUNDINGS"]


def encode(x, fmt, rounding: str = "rne", saturate: bool = True, rbits=None, seed=None, sr_bits: int = 8,
           stream: int = 0, rbits_mapping: str = "te", _generic: bool = False) -> np.ndarray:
    """Encode values into ``fmt`` codes, one unpacked code per element.

    Parameters
    ----------
    x : array of float32, float16, bfloat16 (ml_dtypes) or float64 (rounded to float32 first, RNE).
    fmt : Format or name (``E2M1``, ``E4M3``, ``E5M2``, ``UE8M0``, ``BF16``, ``E2M3``, ``E3M2``, ``INT8``, ``E4M3FNUZ``,
        ``binary8p3``, ...: ``fp4sim.FORMATS``).
    rounding : ``"rne"`` (nearest, ties to even code), ``"rz"``, ``"ru"``/``"rp"``, ``"rd"``, ``"sr"``.
    saturate : overflow gives +-max (True, CUDA ``.satfinite``) or the format's Inf/NaN code (False).
        Formats with neither Inf nor NaN (E2M1, FP6, INT8) always saturate; stochastic rounding always saturates
        (the hardware instruction does).
    rbits, seed, sr_bits, stream, rbits_mapping : stochastic rounding bits (SPEC §1.3): ``rbits`` uint8 per
        element or uint32 words (4 elements per word, byte k of word j for element 4j+k with the ``"te"``
        mapping, byte 3-k with ``"msb_first"``), or ``seed`` for Philox4x32-10 bits; ``sr_bits`` = n.
    _generic : internal, for tests: use the generic integer path for E2M1 instead of its comparison-mask path.

    Returns
    -------
    uint8 codes (uint16 for BF16; FP6 in the low six bits; INT8 as two's complement bytes) with the shape of ``x``.
    """
    if is_cupy(x):
        from .gpu import ops
        return ops.encode(ops.backend(), x, fmt, rounding, saturate, rbits, seed, sr_bits, stream, rbits_mapping)
    from .cpu.backend import CPU
    if not _generic:
        return planning.run_encode(CPU, x, fmt, rounding, saturate, rbits, seed, sr_bits, stream, rbits_mapping)
    xs = CPU.as_float32(x)
    p = planning.plan_encode(xs.shape, xs.size, fmt, rounding, saturate, rbits, seed, sr_bits, stream, rbits_mapping)
    return CPU.encode(xs, p.fmt, p.mode, p.sat, p.sr.kernel_nsr, p.sr, generic=True)


def decode(codes, fmt) -> np.ndarray:
    """float32 values of ``fmt`` codes (uint8, or uint16 for BF16), any shape."""
    fmt = get_format(fmt)
    if is_cupy(codes):
        xp = xp_of(codes)
        if fmt.name == "bf16":
            return (codes.astype(np.uint32) << 16).view(np.float32)
        return table(xp, fmt.values)[codes]
    if not isinstance(codes, np.ndarray):
        raise TypeError(f"codes must be a NumPy array of {fmt.code_dtype} codes, not {type(codes).__name__}")
    if codes.dtype.kind not in "ui":
        raise TypeError(f"codes has dtype {codes.dtype}; codes are unsigned integers ({fmt.code_dtype})")
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= fmt.n_codes):
        raise ValueError(f"codes hold values outside 0..{fmt.n_codes - 1}, which is not a {fmt.name} code "
                         "(packed FP4? unpack with fp4sim.layout.unpack_fp4 first)")
    if fmt.name == "bf16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    out = np.empty(c.shape, np.float32)
    if c.size:
        from .cpu import elements as _k
        _k.decode_kernel(c.reshape(-1), fmt.values, out.reshape(-1))
    return out
