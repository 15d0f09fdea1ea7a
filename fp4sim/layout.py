"""Storage layouts: FP4 nibble packing and the cuBLAS/CUTLASS "128x4" swizzled scale layout (SPEC §2.1)."""
from __future__ import annotations

import numpy as np

from ._xp import xp_of

__all__ = ["pack_fp4", "unpack_fp4", "pack_fp6", "unpack_fp6", "FP6_ORDERS", "swizzle_scales", "unswizzle_scales",
           "swizzled_size"]


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes two per byte along the last axis: element 2i in the low nibble, 2i+1 in the high.

    The last axis must have even length (pad with code 0 first).
    """
    xp = xp_of(codes)
    codes = xp.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must be uint8, not {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"the last axis has odd length {codes.shape[-1]}; pad it with a zero code to even length")
    if codes.size and codes.max() > 15:
        raise ValueError("codes hold values above 15, which are not 4-bit codes")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # works on NumPy and CuPy arrays


def unpack_fp4(packed: np.ndarray, nibble_order: str = "low_first") -> np.ndarray:
    """Inverse of :func:`pack_fp4`; ``nibble_order="high_first"`` reads the swapped convention."""
    xp = xp_of(packed)
    packed = xp.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed codes must be uint8, not {packed.dtype}")
    lo, hi = packed & 0xF, packed >> 4
    if nibble_order == "high_first":
        lo, hi = hi, lo
    elif nibble_order != "low_first":
        raise ValueError("nibble_order must be 'low_first' or 'high_first'")
    out = xp.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = lo, hi
    return out


FP6_ORDERS = ("little", "big")


def _fp6_order(order):
    if order not in FP6_ORDERS:
        raise ValueError(f"order={order!r}: use 'little' (compressed-tensors, a little-endian bit stream) or 'big' "
                         "(torchao's former pack_uint6: the first code in the high bits)")
    return order


def _fp6_groups(a, n: int, name: str, fix: str):
    """(array module, ``a``'s last axis as groups of ``n`` uint32, the leading shape) after the checks every FP6
    packing call makes."""
    xp = xp_of(a)
    a = xp.asarray(a)
    if a.dtype != np.uint8:
        raise TypeError(f"{name} must be uint8, not {a.dtype}")
    if a.shape[-1] % n:
        raise ValueError(f"the last axis has length {a.shape[-1]}, not a multiple of {n}: {fix}")
    return xp, a.reshape(a.shape[:-1] + (-1, n)).astype(np.uint32), a.shape[:-1]


def pack_fp6(codes: np.ndarray, order: str = "little") -> np.ndarray:
    """Pack 6-bit codes (FP6 E2M3 / E3M2, one per uint8) four to three bytes along the last axis.

    ``order="little"``: codes c0..c3 form the 24-bit word c0 | c1 << 6 | c2 << 12 | c3 << 18, stored low byte
    first (compressed-tensors' ``mxfp6-pack-quantized``; the bits read as one little-endian stream);
    ``order="big"``: c0 << 18 | c1 << 12 | c2 << 6 | c3 stored high byte first (torchao's former ``pack_uint6``).
    The last axis must be a multiple of 4 long (pad with code 0 first).
    """
    _fp6_order(order)
    xp, c, lead = _fp6_groups(codes, 4, "codes", "pad it with zero codes (FP6 packs four codes into three bytes)")
    if c.size and int(c.max()) > 63:
        raise ValueError("codes hold values above 63, which are not 6-bit codes")
    if order == "little":
        w = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
        parts = (w, w >> 8, w >> 16)
    else:
        w = (c[..., 0] << 18) | (c[..., 1] << 12) | (c[..., 2] << 6) | c[..., 3]
        parts = (w >> 16, w >> 8, w)
    return xp.stack([p & 0xFF for p in parts], axis=-1).astype(np.uint8).reshape(lead + (-1,))


def unpack_fp6(packed: np.ndarray, order: str = "little") -> np.ndarray:
    """Inverse of :func:`pack_fp6`: one 6-bit code per uint8; the last axis must be a multiple of 3 bytes."""
    _fp6_order(order)
    xp, b, lead = _fp6_groups(packed, 3, "packed codes", "packed FP6 holds four codes in every three bytes "
                              "(a truncated buffer, or not FP6)")
    if order == "little":
        w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        shifts = (0, 6, 12, 18)
    else:
        w = (b[..., 0] << 16) | (b[..., 1] << 8) | b[..., 2]
        shifts = (18, 12, 6, 0)
    return xp.stack([(w >> s) & 0x3F for s in shifts], axis=-1).astype(np.uint8).reshape(lead + (-1,))


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the swizzled layout of an R x C scale matrix (padded to multiples of 128 x 4)."""
    return (-(-rows // 128) * 128) * (-(-cols // 4) * 4)


def _swizzle_index(rows: int, cols: int):
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    r = np.arange(rp)[:, None]
    c = np.arange(cp)[None, :]
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4, rp, cp


def swizzle_scales(scales: np.ndarray) -> np.ndarray:
    """Store a logical R x C scale matrix in the 128x4 swizzled layout (1-D, zero-padded).

    S[r, c] goes to byte ``((r//128)*(CP//4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.
    """
    xp = xp_of(scales)
    s = xp.asarray(scales)
    if s.ndim != 2:
        raise ValueError(f"scales must be a 2-D (rows, blocks) matrix, got shape {s.shape}")
    idx, rp, cp = _swizzle_index(*s.shape)
    padded = xp.zeros((rp, cp), s.dtype)
    padded[: s.shape[0], : s.shape[1]] = s
    out = xp.empty(rp * cp, s.dtype)
    out[xp.asarray(idx.ravel())] = padded.ravel()
    return out


def unswizzle_scales(swizzled: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of :func:`swizzle_scales`: the logical ``rows x cols`` matrix."""
    xp = xp_of(swizzled)
    s = xp.asarray(swizzled).reshape(-1)
    need = swizzled_size(rows, cols)
    if s.size != need:
        raise ValueError(f"swizzled scales have {s.size} bytes; a {rows}x{cols} scale matrix needs {need} "
                         f"(rows padded to a multiple of 128, columns to a multiple of 4)")
    idx, _, _ = _swizzle_index(rows, cols)
    return s[xp.asarray(idx)][:rows, :cols].copy()
