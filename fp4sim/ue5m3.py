"""NVFP4 with UE5M3 block scales (Hu, Luschi and Balanca, "UE5M3 FP4 Block Scaling for Stable Language Model
Pretraining", 2026): E2M1 elements in 16-element blocks (or 16x16 tiles) with an unsigned E5M3 scale per block
(bias 15, subnormals; 2^-17 ... 61,440), under an optional FP32 tensor scale.

The rule, every operation in float32 as their kernels order it (``T`` the scale target, 448 by default):

- tensor scale: ``s_enc = fl(fl(6 T) / amax)`` (1 for an all-zero tensor, at most FLT_MAX), ``s_dec = fl(1 /
  s_enc)``; without a tensor scale (``per_tensor_scale=False``) both are 1, the block scales alone carrying the
  range UE5M3 can hold;
- block scale: ``UE5M3_rne(fl(amax_b · fl(s_enc · fl(1/6))))``, saturating at 61,440 (their clamp to it first
  changes nothing); a scale that rounds to zero (an
  all-zero block, or one below UE5M3's range) becomes 1.0 (byte 0x78);
- elements: ``dec = fl(scale · s_dec)``, ``E2M1(fl(x · fl(1 / dec)))`` in the requested rounding (RNE, or SR
  with either rule, ``rbits_mapping="midpoint"`` being theirs); values decode as ``fl(e2m1 · dec)``.

There is no hardware GEMM for these operands: the emulated training multiplies their dequantized values in
float32 (the source's "decoded" control). The element codes come from fp4sim's encode kernels (CPU or CUDA);
the rest is float32 array arithmetic, the same on NumPy and CuPy arrays.
"""
from __future__ import annotations

import numpy as np

from ._f32 import absmax, div, mul
from ._xp import xp_of
from .formats import E2M1, UE5M3
from .qtensor import QuantizedTensor

__all__ = ["quantize", "dequantize", "tensor_constants"]

f32 = np.float32
FLT_MAX = np.finfo(np.float32).max
R6 = f32(1.0 / 6.0)
ONE = 0x78                     # UE5M3 1.0: exponent field 15, mantissa 0


def tensor_constants(sch, amax):
    """``(s_enc, s_dec)`` (float32) of a scheme and the tensor amax it quantizes with."""
    if not sch.per_tensor_scale:
        return f32(1.0), f32(1.0)
    a = f32(amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = f32(1.0) if a == 0 else f32(min(f32(f32(6.0 * sch.scale_target) / a), FLT_MAX))
        return s, f32(f32(1.0) / s)


def _rows(x, axis):
    """``x`` as (rows, K) with ``axis`` last, the other axes flattened in order."""
    xp = xp_of(x)
    return xp.ascontiguousarray(xp.moveaxis(x, axis, -1)).reshape(-1, x.shape[axis])


def _block_amax(x2, tile):
    """Per (row, block) amax of |x| (NaN ignored), tiles of ``tile`` rows sharing theirs."""
    xp = xp_of(x2)
    R, Kp = x2.shape
    b = absmax(x2.reshape(R, Kp // 16, 16), axis=-1) if R else xp.zeros((0, Kp // 16), np.float32)
    if tile == 1:
        return b, b
    Rp = -(-R // tile) * tile
    bp = xp.zeros((Rp, Kp // 16), np.float32)
    bp[:R] = b
    t = bp.reshape(Rp // tile, tile, -1).max(1)
    return t, xp.repeat(t, tile, axis=0)[:R]


def quantize(x, sch, axis, rounding="rne", global_amax=None, rbits=None, seed=None, stream=0, sr_bits=8,
             rbits_mapping="te", scale_layout="linear", fake=False):
    """:func:`fp4sim.quantize` (``fake``: :func:`fp4sim.fake_quantize`) for an :class:`~fp4sim.schemes.NVFP4UE5M3`
    scheme; arguments as there."""
    from . import _inputs, planning
    from .elements import encode
    from .layout import pack_fp4
    if scale_layout != "linear":
        raise ValueError(f"scale_layout={scale_layout!r}: UE5M3 scales are stored in the linear layout only (no "
                         "hardware reads a swizzled UE5M3 layout)")
    xp = xp_of(x)
    xs = planning.as_float32(x) if xp is np else xp.asarray(x, dtype=np.float32)
    ax = _inputs.check_axis(axis, xs.ndim, "quantize")
    K = xs.shape[ax]
    if K == 0 or xs.size == 0:
        raise ValueError(f"x has shape {tuple(xs.shape)} with no elements along axis {axis}; nothing to quantize")
    Kp = -(-K // 16) * 16
    x2 = _rows(xs, ax)
    R = x2.shape[0]
    xp2 = xp.zeros((R, Kp), np.float32)
    xp2[:, :K] = x2
    sr = planning.plan_sr(xs.size, xs.shape, rounding, rbits, seed, sr_bits, stream, rbits_mapping)
    rb = None
    if sr.kind != 0:
        if sr.per is not None:
            per = xp.asarray(sr.per).reshape(xs.shape)
        else:
            from .rng import philox_bytes
            per = xp.asarray(philox_bytes(seed, xs.size, stream)).reshape(xs.shape)
        if sr.nsr < 8:
            per = per & np.uint8((1 << sr.nsr) - 1)
        rb = xp.zeros((R, Kp), np.uint8)
        rb[:, :K] = _rows(per, ax)
    nan = bool(xp.isnan(xs).any())
    if nan:
        import warnings
        warnings.warn(planning.NAN_E2M1, RuntimeWarning, stacklevel=3)
    if global_amax is None:
        amax = absmax(xs)
    else:
        amax = planning.check_global_amax(global_amax.get() if hasattr(global_amax, "get") else global_amax)
    if sch.per_tensor_scale and not np.isfinite(amax):
        raise ValueError(f"{'global_amax' if global_amax is not None else 'x'}: the tensor amax is {float(amax)}; "
                         "UE5M3 NVFP4's tensor scale 6 T / amax needs a finite one (the source's rule refuses "
                         "non-finite tensors); pass a finite global_amax, or per_tensor_scale=False")
    s_enc, s_dec = tensor_constants(sch, amax)
    mult = f32(s_enc * R6)
    tile = sch.block[0]
    bt, brow = _block_amax(xp2, tile)
    with np.errstate(over="ignore", invalid="ignore"):
        sb = encode(mul(bt, mult).astype(np.float32), UE5M3)     # RNE, saturating at 61,440
        sb = xp.where(sb == 0, np.uint8(ONE), sb).astype(np.uint8)
        vals = xp.asarray(UE5M3.values)
        srow = sb if tile == 1 else xp.repeat(sb, tile, axis=0)[:R]
        dec = mul(vals[srow], s_dec).astype(np.float32)
        enc = div(f32(1.0), dec).astype(np.float32)
        y = mul(xp2.reshape(R, -1, 16), enc[:, :, None]).astype(np.float32).reshape(R, Kp)
    kw = {}
    if rb is not None:
        kw = dict(rbits=rb, sr_bits=sr.nsr, rbits_mapping="midpoint" if sr.midpoint else "te")
    codes = encode(y, E2M1, rounding=rounding, **kw)
    lead = tuple(s for i, s in enumerate(xs.shape) if i != ax)
    q = QuantizedTensor(pack_fp4(codes).reshape(*lead, Kp // 2), sb if tile > 1 else sb.reshape(*lead, -1),
                        amax if sch.per_tensor_scale else None, sch, ax, tuple(xs.shape))
    return dequantize(q) if fake else q


def dequantize(q: QuantizedTensor):
    """float32 values of a UE5M3 NVFP4 tensor in its original shape: ``fl(e2m1 · fl(scale · s_dec))``."""
    from .layout import unpack_fp4
    xp = xp_of(q.codes)
    sch = q.scheme
    K = q.K
    Kp = -(-K // 16) * 16
    c = unpack_fp4(q.codes.reshape(-1, Kp // 2))
    R = c.shape[0]
    s_dec = tensor_constants(sch, q.global_amax if q.global_amax is not None else 0)[1]
    sb = q.scales.reshape(-1, Kp // 16)
    if sch.block[0] > 1:
        sb = xp.repeat(sb, sch.block[0], axis=0)[:R]
    dec = mul(xp.asarray(UE5M3.values)[sb], s_dec).astype(np.float32)
    v = mul(xp.asarray(E2M1.values)[c].reshape(R, -1, 16), dec[:, :, None]).astype(np.float32).reshape(R, Kp)[:, :K]
    lead = tuple(s for i, s in enumerate(q.shape) if i != q.axis)
    return xp.ascontiguousarray(xp.moveaxis(v.reshape(*lead, K), -1, q.axis))
