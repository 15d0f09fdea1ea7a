"""Public block-scaled entry points: ``quantize``, ``dequantize``, ``fake_quantize`` (SPEC §2-3)."""
from __future__ import annotations

import warnings

import numpy as np

from . import _inputs
from .cpu import blocks as _b
from .cpu.elements import MODES
from .elements import ROUNDINGS, encode, decode, kernel_params
from .formats import E2M1, E4M3
from .layout import swizzle_scales, unpack_fp4
from .qtensor import QuantizedTensor
from .rng import philox_bytes
from ._xp import is_cupy, table, xp_of
from .schemes import MX, NVFP4, BF16Cast, FP8Blockwise, FP8Tensor, get_scheme

__all__ = ["quantize", "dequantize", "fake_quantize"]

f32 = np.float32
_C2688 = f32(2688.0)
_INV2688 = f32(1.0) / _C2688
_POW2_ENC = np.array([2.0 ** (127 - e) for e in range(255)] + [np.nan], dtype=np.float32)
_POW2_DEC = np.array([2.0 ** (e - 127) for e in range(255)] + [np.nan], dtype=np.float32)


class _Prepared:
    """The input as a 2-D (rows, K) float32 array with the block axis last, plus its SR bits."""

    def __init__(self, x, axis, rounding, rbits, seed, sr_bits, stream, rbits_mapping):
        xs = _inputs.as_float32(x)
        self.axis = _inputs.check_axis(axis, xs.ndim, "a block-scaled scheme")
        self.shape = xs.shape
        self.K = xs.shape[self.axis]
        if self.K == 0:
            raise ValueError(f"axis {axis} of x has length 0: there is nothing to quantize along it")
        if xs.size == 0:
            raise ValueError(f"x has shape {xs.shape} with no elements; nothing to quantize")
        self.rounding = _inputs.check_choice(rounding, "rounding", ROUNDINGS)
        self.mode = MODES[self.rounding]
        self.nsr = _inputs.check_int(sr_bits, "sr_bits", 1, 8)
        stream = _inputs.check_int(stream, "stream", 0, 0xFFFFFFFF)
        kind, per = _inputs.sr_bytes(xs.size, xs.shape, self.rounding, rbits, seed, self.nsr, rbits_mapping)
        if kind == 2:
            per = philox_bytes(seed, xs.size, stream)
            if self.nsr < 8:
                per &= np.uint8((1 << self.nsr) - 1)
        self.x2 = self._to2d(xs)
        self.use_rb = per is not None
        self.rb = self._to2d(per.reshape(xs.shape)) if per is not None else np.zeros((1, 1), np.uint8)
        self.R = self.x2.shape[0]
        self.lead = self.x2.shape[:0] + tuple(s for i, s in enumerate(xs.shape) if i != self.axis)

    def _to2d(self, a):
        return np.ascontiguousarray(np.moveaxis(a, self.axis, -1)).reshape(-1, self.K)

    def back(self, y2):
        """A (rows, K) result in the input's original layout."""
        return np.moveaxis(y2.reshape(self.lead + (self.K,)), -1, self.axis)


def _nvfp4_constants(flavor, amax_g):
    """Per-tensor float32 constants (c0, c1, c2) of a flavour and its dequantize constants."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if flavor in ("te", "paper"):
            s_enc = f32(1.0) if amax_g == 0 else min(_C2688 / amax_g, np.finfo(np.float32).max)
            s_enc = f32(1.0) if s_enc == 0 else f32(s_enc)
            s_dec = f32(1.0) / s_enc
            c0 = s_enc * _b.R6 if flavor == "te" else s_enc
            return (f32(c0), s_dec, f32(0)), np.array([amax_g, _INV2688], np.float32)
        pts = amax_g / _C2688
        if flavor == "torchao":
            return (pts, f32(1.0) / pts, f32(0)), np.array([pts, 0], np.float32)
        return (f32(6.0) * pts, pts, f32(0)), np.array([pts, 0], np.float32)  # modelopt: wsf2 = pts


def _check_global_amax(global_amax):
    if global_amax is None:
        return None
    try:
        g = f32(global_amax)
    except (TypeError, ValueError):
        raise TypeError(f"global_amax must be a number, not {type(global_amax).__name__}") from None
    if np.isnan(g) or g < 0:
        raise ValueError(f"global_amax={global_amax!r} must be a non-negative number (the tensor's |x| max)")
    return g


def _warn_specials(sch, amax_g, has_nan, has_inf):
    if isinstance(sch, NVFP4):
        if not np.isfinite(amax_g):
            warnings.warn("the tensor (or global_amax) is not finite: NVFP4 encodes with S_enc = 1 but "
                          "dequantizes to Inf/NaN, as TransformerEngine's kernels do", RuntimeWarning, 3)
        if sch.flavor in ("torchao", "modelopt") and amax_g == 0:
            warnings.warn(f"all-zero tensor under the {sch.flavor} flavour: its per-tensor scale is 0, so the "
                          "scales are NaN (0xFF) as the library itself produces", RuntimeWarning, 3)
        if sch.flavor == "torchao" and (has_nan or has_inf):
            warnings.warn("torchao's output for NaN/Inf elements depends on NaN payloads; fp4sim follows the "
                          "te flavour's semantics for them", RuntimeWarning, 3)
    elif isinstance(sch, MX) and has_inf:
        warnings.warn("an Inf inside an MX block: its scale comes from Inf's exponent field (floor/ceil/even) "
                      "or saturates (rceil); the block's finite elements flush toward 0", RuntimeWarning, 3)


def _run(x, scheme, axis, rounding, flavor, block, scale_mode, global_amax, rbits, seed, stream, sr_bits,
         rbits_mapping, scale_layout, fake, return_intermediates=False):
    sch = get_scheme(scheme, flavor=flavor, block=block, scale_mode=scale_mode)
    scale_layout = _inputs.check_choice(scale_layout, "scale_layout", ("linear", "swizzled"))
    if scale_layout == "swizzled" and not isinstance(sch, (NVFP4, MX)):
        raise ValueError(f"scale_layout='swizzled' applies to NVFP4 and MX schemes, not {sch.name!r}")
    p = _Prepared(x, axis, rounding, rbits, seed, sr_bits, stream, rbits_mapping)
    g = _check_global_amax(global_amax)
    if g is not None and not isinstance(sch, (NVFP4, FP8Tensor)):
        raise ValueError(f"global_amax applies to NVFP4 and FP8 per-tensor schemes only, not {sch.name!r}")
    x2, R, K = p.x2, p.R, p.K
    fake_out = np.empty((R, K) if fake else (1, 1), np.float32)
    extras = {}

    if isinstance(sch, BF16Cast):
        kw = {"rbits": p.rb} if p.use_rb else {}
        codes = encode(x2, sch.elem, rounding=p.rounding, saturate=p.rounding == "sr", sr_bits=p.nsr, **kw)
        if fake:
            return p.back(decode(codes, sch.elem))
        return QuantizedTensor(codes.reshape(p.lead + (K,)), None, None, sch, p.axis, p.shape)

    amax_t, has_nan = _b.absmax_nan(x2)
    has_inf = bool(np.isinf(amax_t))
    if isinstance(sch, NVFP4):
        amax_g = amax_t if g is None else g
        _warn_specials(sch, amax_g, has_nan, has_inf)
        (c0, c1, c2), dq = _nvfp4_constants(sch.flavor, amax_g)
        tile = sch.block[0]
        nbk = -(-K // 16)
        codes = np.empty((R, nbk * 8), np.uint8)
        scales = np.empty((-(-R // tile), nbk), np.uint8)
        _b.nvfp4_kernel(x2, p.rb, p.use_rb, p.mode, p.nsr, _b.FLAVOR_IDS[sch.flavor], tile, c0, c1, c2, dq,
                        E4M3.values, codes, scales, fake_out, fake)
        gamax = f32(amax_g)
        if return_intermediates:
            extras = {"s_enc_constants": (c0, c1), "dequant_constants": dq, "tensor_amax": f32(amax_t)}
    elif isinstance(sch, MX):
        _warn_specials(sch, amax_t, has_nan, has_inf)
        fmt = sch.elem
        nbk = -(-K // 32)
        is_fp4 = fmt is E2M1
        codes = np.empty((R, nbk * (16 if is_fp4 else 32)), np.uint8)
        scales = np.empty((R, nbk), np.uint8)
        smode = {"rceil": 0, "floor": 1, "ceil": 2, "even": 3}[sch.scale_mode]
        rcp = f32(1.0) / f32(fmt.max)
        _b.mx_kernel(x2, p.rb, p.use_rb, p.mode, p.nsr, smode, fmt.emax, rcp, _POW2_ENC, _POW2_DEC,
                     *kernel_params(fmt), is_fp4, fmt.values, codes, scales, fake_out, fake)
        gamax = None
    else:  # FP8 per-tensor or blockwise
        fmt = sch.elem
        codes = np.empty((R, K), np.uint8)
        if isinstance(sch, FP8Tensor):
            scale = fp8_tensor_scale(fmt, amax_t if g is None else g)
            scales = np.array([f32(1.0) / scale], np.float32)
            _b.fp8_kernel(x2, p.rb, p.use_rb, p.mode, p.nsr, 1, K, scale, False, *kernel_params(fmt), fmt.values,
                          codes, np.empty((1, 1), np.float32), fake_out, fake)
        else:
            tile = sch.block[0]
            scales = np.empty((-(-R // tile), -(-K // 128)), np.float32)
            _b.fp8_kernel(x2, p.rb, p.use_rb, p.mode, p.nsr, tile, 128, f32(1.0), True, *kernel_params(fmt),
                          fmt.values, codes, scales, fake_out, fake)
        gamax = None
    if fake:
        return p.back(fake_out)
    return finish(sch, codes, scales, gamax, p.lead, p.axis, p.shape, scale_layout, extras)


def fp8_tensor_scale(fmt, amax):
    """FP8 current scaling: fl(max / amax), 1 when amax is 0 or not finite, at most FLT_MAX."""
    with np.errstate(divide="ignore", over="ignore"):
        scale = f32(fmt.max) / amax if (amax > 0 and np.isfinite(amax)) else f32(1.0)
    return f32(min(scale, np.finfo(np.float32).max))


def finish(sch, codes, scales, gamax, lead, axis, shape, scale_layout, extras=None) -> QuantizedTensor:
    """Wrap kernel outputs (2-D codes and scales) into a QuantizedTensor in the documented shapes/layout
    (NumPy or CuPy arrays alike)."""
    xp = xp_of(codes)
    R = codes.shape[0]
    codes = codes.reshape(tuple(lead) + (codes.shape[-1],))
    if isinstance(sch, (NVFP4, MX)):
        if scale_layout == "swizzled":
            s2 = scales if sch.block[0] == 1 else xp.repeat(scales, sch.block[0], axis=0)[:R]
            scales = swizzle_scales(s2)
        elif sch.block[0] == 1:
            scales = scales.reshape(tuple(lead) + (scales.shape[-1],))
    elif isinstance(sch, FP8Blockwise) and sch.block[0] == 1:
        scales = scales.reshape(tuple(lead) + (scales.shape[-1],))
    return QuantizedTensor(codes, scales, gamax, sch, axis, shape, scale_layout, extras or {})


def quantize(x, scheme="nvfp4", axis: int = -1, rounding: str = "rne", flavor: str | None = None,
             block=None, scale_mode: str | None = None, global_amax=None, rbits=None, seed=None,
             stream: int = 0, sr_bits: int = 8, rbits_mapping: str = "te", scale_layout: str = "linear",
             return_intermediates: bool = False) -> QuantizedTensor:
    """Quantize ``x`` with a block-scaled scheme; returns a :class:`QuantizedTensor`.

    Parameters
    ----------
    x : float32/float16/bfloat16/float64 array, any shape with at least one axis.
    scheme : ``"nvfp4"``, ``"nvfp4_2d"``, ``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"fp8_e4m3"``,
        ``"fp8_e5m2"``, ``"fp8_blockwise"``, ``"bf16"`` or a scheme object from :mod:`fp4sim.schemes`.
    axis : the block axis (the GEMM reduction dimension K); lengths not a multiple of the block are
        zero-padded for the computation. 16x16 / 128x128 tiles span ``axis`` and the rows formed by all other
        axes flattened in order.
    rounding : element rounding, ``"rne"`` (default) or ``"sr"`` (or ``rz``/``ru``/``rd``); SR bits come from
        ``rbits`` (per element of ``x``, or uint32 words) or ``seed`` (Philox; element index = flat C-order
        index in ``x``'s own shape), ``stream``, ``sr_bits``, ``rbits_mapping`` as :func:`fp4sim.encode`.
    flavor : NVFP4 flavour ``"te"`` (default), ``"paper"``, ``"torchao"``, ``"modelopt"`` (SPEC §3.3).
    block : ``(1, 16)`` or ``(16, 16)`` for NVFP4; ``(1, 128)`` or ``(128, 128)`` for FP8 blockwise.
    scale_mode : MX scale rounding ``"rceil"`` (default), ``"floor"``, ``"ceil"``, ``"even"`` (SPEC §2.2).
    global_amax : the tensor amax override of NVFP4 and FP8 per-tensor scaling (delayed scaling, post-RHT amax,
        or the amax of a whole tensor quantized in row chunks).
    scale_layout : ``"linear"`` (default) or ``"swizzled"`` (cuBLAS 128x4).
    return_intermediates : keep per-tensor constants in ``q.extras`` for analyses.
    """
    if is_cupy(x):
        from .gpu import ops
        return ops.quantize(ops.backend(), x, scheme, axis, rounding, flavor, block, scale_mode, global_amax, rbits,
                            seed, stream, sr_bits, rbits_mapping, scale_layout)
    return _run(x, scheme, axis, rounding, flavor, block, scale_mode, global_amax, rbits, seed, stream, sr_bits,
                rbits_mapping, scale_layout, False, return_intermediates)


def fake_quantize(x, scheme="nvfp4", axis: int = -1, rounding: str = "rne", flavor: str | None = None,
                  block=None, scale_mode: str | None = None, global_amax=None, rbits=None, seed=None,
                  stream: int = 0, sr_bits: int = 8, rbits_mapping: str = "te") -> np.ndarray:
    """``dequantize(quantize(x, ...))`` in one fused pass: float32 in ``x``'s shape, bit-identical to the
    two-step result."""
    if is_cupy(x):
        from .gpu import ops
        return ops.quantize(ops.backend(), x, scheme, axis, rounding, flavor, block, scale_mode, global_amax, rbits,
                            seed, stream, sr_bits, rbits_mapping, fake=True)
    return _run(x, scheme, axis, rounding, flavor, block, scale_mode, global_amax, rbits, seed, stream, sr_bits,
                rbits_mapping, "linear", True)


def dequantize(q: QuantizedTensor) -> np.ndarray:
    """float32 values of a :class:`QuantizedTensor` in its original shape (SPEC §2 dequantize rules).

    NumPy in, NumPy out; a QuantizedTensor holding CuPy arrays dequantizes on its GPU.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor (from fp4sim.quantize), not {type(q).__name__}")
    if is_cupy(q.codes):
        from .gpu import ops
        return ops.dequantize(ops.backend(), q)
    xp = xp_of(q.codes)
    sch = q.scheme
    K = q.K
    lead = q.lead
    R = int(np.prod(lead, dtype=np.int64))
    codes = q.codes.reshape(R, -1)
    if isinstance(sch, BF16Cast):
        y2 = decode(codes, sch.elem)
    elif isinstance(sch, (NVFP4, MX)):
        if isinstance(sch, NVFP4):
            s = table(xp, E4M3.values)[q.scales_per_row()]
            _, dq = _nvfp4_constants(sch.flavor, f32(q.global_amax))
            with np.errstate(invalid="ignore", over="ignore"):
                fac = (s * dq[0]) * dq[1] if sch.flavor in ("te", "paper") else s * dq[0]
        else:
            fac = table(xp, _POW2_DEC)[q.linear_scales()]
        bk = sch.block[1]
        if xp is np and sch.elem is E2M1:  # one fused pass on the CPU
            y2 = np.empty((R, K), np.float32)
            _b.fp4_dequant_kernel(np.ascontiguousarray(codes), np.ascontiguousarray(fac, np.float32), bk, y2)
        else:
            c = unpack_fp4(codes) if sch.elem is E2M1 else codes
            with np.errstate(invalid="ignore", over="ignore"):
                y2 = (table(xp, sch.elem.values)[c].reshape(R, -1, bk) * fac[:, :, None]).reshape(R, -1)
    elif isinstance(sch, FP8Tensor):
        y2 = table(xp, sch.elem.values)[codes] * q.scales.reshape(-1)[0:1]
    else:
        s = q.scales.reshape(-(-R // sch.block[0]), -1)
        s = xp.repeat(xp.repeat(s, sch.block[0], axis=0)[:R], 128, axis=1)[:, :K]
        y2 = table(xp, sch.elem.values)[codes] * s
    y2 = xp.ascontiguousarray(y2[:, :K], dtype=np.float32)
    return xp.moveaxis(y2.reshape(tuple(lead) + (K,)), -1, q.axis)
