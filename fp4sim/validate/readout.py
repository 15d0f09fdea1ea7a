"""What :func:`fp4sim.validate.compare` and :func:`fp4sim.validate.diagnose` both do with a kernel's output:
read its code and scale bytes as per-row matrices, and round the input from given scale bytes (the values each
element is rounded from, then its E2M1 / FP8 code under a tie rule and the flavour's special cases)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..elements import decode, encode
from ..formats import E2M1, E2M3, E3M2, E4M3
from ..layout import swizzled_size, unpack_fp4, unpack_fp6, unswizzle_scales
from ..planning import POW2_ENC, is_fp4, nvfp4_constants_rows
from ..schemes import MX, NVFP4, BF16Cast

__all__ = ["as_bytes", "codes_unpacked", "scales_per_row", "x2_padded", "scaled", "codes_from_scaled"]

f32 = np.float32
FLT_MAX = f32(np.finfo(np.float32).max)
E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
E2M1_MAGS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


# ------------------------------------------------------------------------------------------ normalising
_BYTE_DTYPES = tuple(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu,
                                            ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fnuz,
                                            ml_dtypes.float8_e5m2fnuz, ml_dtypes.float6_e2m3fn,
                                            ml_dtypes.float6_e3m2fn))


def as_bytes(a, name):
    a = np.asarray(a)
    if a.dtype in _BYTE_DTYPES:                    # ml_dtypes' one-byte floats: their codes
        a = a.view(np.uint8)
    if a.dtype != np.uint8:
        raise TypeError(f"{name} must hold raw bytes (uint8, or an ml_dtypes float8 array), not {a.dtype}")
    return a


def fp6_packed(codes, q) -> bool:
    """Whether ``codes`` holds an FP6 scheme's codes packed four to three bytes (by its size)."""
    return (getattr(q.scheme, "elem", None) in (E2M3, E3M2) and np.asarray(codes).size * 4 == q.codes.size * 3
            and q.codes.size > 0)


def codes_unpacked(codes, q, nibble_order="low_first"):
    """The kernel's codes as (rows, Kp) unpacked (FP4; FP6 packed four to three bytes, ``nibble_order``
    "low_first" reading compressed-tensors' little-endian order and "high_first" the big-endian one) or (rows, n)
    (one code per byte)."""
    sch = q.scheme
    want = q.codes
    if isinstance(sch, BF16Cast):
        c = np.asarray(codes)
        if c.dtype != np.uint16 and c.dtype != np.dtype(ml_dtypes.bfloat16):
            raise TypeError(f"codes for bf16 must be uint16 (or bfloat16), not {c.dtype}")
        c = c.view(np.uint16)
    else:
        c = as_bytes(codes, "codes")
    if fp6_packed(c, q):
        return unpack_fp6(c.reshape(want.shape[0], -1), "little" if nibble_order == "low_first" else "big")
    if c.size != want.size:
        what = "packed FP4 codes, two per byte" if is_fp4(sch) else "codes, one per byte"
        if getattr(sch, "elem", None) in (E2M3, E3M2):
            what += f" (or {want.size * 3 // 4} bytes of FP6 packed four codes to three)"
        raise ValueError(f"codes has {c.size} entries; {sch.name} of an input of shape {q.shape} (axis {q.axis}) "
                         f"needs {want.size} {what}, shaped {want.shape}")
    c = c.reshape(-1, want.shape[-1])
    return unpack_fp4(c, nibble_order) if is_fp4(sch) else c


def scales_per_row(scales, q, layout):
    """The kernel's scale bytes as the per-row (rows, blocks) matrix, read in ``layout``."""
    sch = q.scheme
    s = as_bytes(scales, "scales").reshape(-1)
    rows = int(np.prod(q.lead, dtype=np.int64))
    C = q.scale_rows_cols[1]
    if layout == "swizzled":
        need = swizzled_size(rows, C)
        if s.size != need:
            raise ValueError(f"swizzled scales have {s.size} bytes; {rows} rows x {C} blocks padded to multiples "
                             f"of 128 x 4 need {need}")
        return unswizzle_scales(s, rows, C)
    tiles = q.scale_rows_cols[0]
    if s.size == rows * C:
        return s.reshape(rows, C)
    if sch.block[0] > 1 and s.size == tiles * C:
        return np.repeat(s.reshape(tiles, C), sch.block[0], axis=0)[:rows]
    raise ValueError(f"scales have {s.size} bytes; expected {rows * C} ({rows} rows x {C} blocks)"
                     + (f" or {tiles * C} (one per 16x16 tile)" if sch.block[0] > 1 else "")
                     + " in the linear layout (or pass scale_layout='swizzled' / --scale-layout swizzled)")


# ------------------------------------------------------------------------------------------ emulation
def x2_padded(q, x2):
    bk = q.scheme.block[1]
    Kp = -(-q.K // bk) * bk
    xp = np.zeros((x2.shape[0], Kp), np.float32)
    xp[:, : q.K] = x2
    return xp


def scaled(xp, sch, s_rows, global_amax):
    """(y, factor-is-NaN mask): the values each element is rounded from, given per-row scale bytes."""
    bk = sch.block[1]
    with np.errstate(all="ignore"):
        if isinstance(sch, MX):
            fac = np.repeat(POW2_ENC[s_rows], bk, axis=1)
            return xp * fac, np.zeros(xp.shape, bool)
        c0, c1, _ = nvfp4_constants_rows(sch.flavor, 1.0 if global_amax is None else global_amax,
                                          sch.per_tensor_scale, sch.e4m3_max)
        c0, c1 = c0.reshape(-1, 1), c1.reshape(-1, 1)          # one per row (row-scaled) or one
        sval = np.repeat(E4M3.values[s_rows], bk, axis=1)
        if sch.flavor in ("te", "paper"):
            fac = np.minimum(f32(1.0) / (sval * c1), FLT_MAX)
        elif sch.flavor == "torchao":
            fac = c1 / sval
        else:
            return xp / (sval * c1), np.zeros(xp.shape, bool)
        return xp * fac, np.isnan(fac)


def codes_from_scaled(y, xp, nanfac, sch, tie="even"):
    """Element codes from scaled values, with a tie rule (even / away / zero) and the flavour's specials."""
    elem = sch.elem
    c = encode(y, elem)
    if tie != "even" and elem is E2M1:
        ay = np.abs(y)
        at_tie = np.isin(ay, E2M1_TIES)
        up = np.searchsorted(E2M1_MAGS, ay).astype(np.uint8)  # first magnitude >= |y|
        mag = up if tie == "away" else up - 1
        c = np.where(at_tie, mag | (np.signbit(y).astype(np.uint8) << 3), c).astype(np.uint8)
    elif tie != "even":                             # any other element: exact midpoints of two neighbours
        with np.errstate(invalid="ignore"):
            ay = np.abs(y).astype(np.float32)
            lo = decode(encode(ay, elem, "rz"), elem).astype(np.float64)
            hi = decode(encode(ay, elem, "ru"), elem).astype(np.float64)
            at_tie = (hi != lo) & (ay.astype(np.float64) == (lo + hi) / 2)
        if at_tie.any():
            alt = encode(y, elem, "rz") if tie == "zero" else np.where(np.signbit(y), encode(y, elem, "rd"),
                                                                        encode(y, elem, "ru"))
            c = np.where(at_tie, alt, c)
    if isinstance(sch, NVFP4):
        c = np.where(np.isnan(xp), 7, c)
        if sch.flavor == "torchao":
            c = np.where(nanfac & ~np.isnan(xp), 0xC, c)
        if sch.flavor == "modelopt":
            c = np.where(y == 0, 0, c)
    return c.astype(np.uint8)
