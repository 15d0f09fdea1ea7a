"""Public entry points that run on a backend: ``quantize``, ``dequantize``, ``fake_quantize`` (SPEC §2-3) and
``rht``, the random Hadamard transform (SPEC §3.1; its matrices are in :mod:`fp4sim.hadamard`).

Each checks and plans its call in :mod:`fp4sim.planning` and runs on the backend of its input: Numba for NumPy
arrays, the CUDA kernels for CuPy arrays.
"""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from . import planning
from ._xp import is_cupy
from .planning import fp8_tensor_scale  # noqa: F401  (part of this module's documented surface)
from .qtensor import QuantizedTensor

__all__ = ["quantize", "dequantize", "fake_quantize", "rht"]


def _variant(scheme, flavor, block, scale_mode, fos, fos_fast, fos_max, fos_ties, scale_target=None,
             per_tensor_scale=None):
    from .schemes import NVFP4UE5M3, get_scheme
    sch = get_scheme(scheme, flavor=flavor, block=block, scale_mode=scale_mode, four_over_six=fos,
                     four_over_six_fast_math=fos_fast, four_over_six_e4m3_max=fos_max, four_over_six_ties=fos_ties,
                     scale_target=scale_target)
    if isinstance(sch, NVFP4UE5M3) and per_tensor_scale is not None:
        sch = get_scheme(sch, per_tensor_scale=per_tensor_scale)
    return sch


def _ue5m3(sch) -> bool:
    from .schemes import NVFP4UE5M3
    return isinstance(sch, NVFP4UE5M3)


_FORCED = contextvars.ContextVar("fp4sim_forced_kernels", default=None)


@contextlib.contextmanager
def forced_kernels(kern):
    """Within the block, every call of this module runs on the backend ``kern`` whatever its input (the tests run
    the CUDA source's host build on NumPy arrays this way, the whole training path included), and the training
    fast path (Numba's fused kernels) is off, so that the quantizations go through ``kern``."""
    from . import fastpath
    token = _FORCED.set(kern)
    old = fastpath._set_enabled(False)
    try:
        yield kern
    finally:
        fastpath._set_enabled(old)
        _FORCED.reset(token)


def _kernels(a):
    forced = _FORCED.get()
    if forced is not None:
        return forced
    if is_cupy(a):
        from .gpu import ops
        return ops.kernels(ops.backend())
    from .cpu.backend import CPU
    return CPU


def quantize(x, scheme="nvfp4", axis: int = -1, rounding: str = "rne", flavor: str | None = None,
             block=None, scale_mode: str | None = None, global_amax=None, rbits=None, seed=None,
             stream: int = 0, sr_bits: int = 8, rbits_mapping: str = "te", scale_layout: str = "linear",
             return_intermediates: bool = False, row_scaled: bool | None = None,
             per_tensor_scale: bool | None = None, four_over_six: str | None = None,
             four_over_six_fast_math: bool | None = None, four_over_six_e4m3_max: int | None = None,
             four_over_six_ties: str | None = None, scale_target: float | None = None) -> QuantizedTensor:
    """Quantize ``x`` with a block-scaled scheme; returns a :class:`QuantizedTensor`.

    Parameters
    ----------
    x : float32/float16/bfloat16/float64 array, any shape with at least one axis.
    scheme : ``"nvfp4"``, ``"nvfp4_2d"``, ``"mxfp4"``, ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``,
        ``"mxfp6_e3m2"``, ``"mxint8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"fp8_blockwise"``, ``"bf16"`` or a scheme
        object from :mod:`fp4sim.schemes`.
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
    row_scaled : NVFP4 (1x16, te/paper) with one FP32 second-level scale per row (TransformerEngine's
        ``row_scaled_nvfp4``); ``q.global_amax`` is then a float32 vector with one amax per row, and a
        ``global_amax`` override must be such a vector.
    per_tensor_scale : ``False`` for torchao's single-level NVFP4 (``flavor="torchao"``, no FP32 tensor scale;
        ``q.global_amax`` is None).
    four_over_six, four_over_six_fast_math, four_over_six_e4m3_max : TransformerEngine's 4over6 NVFP4 (``"mae"``
        or ``"mse"``; te flavour, RNE): see :class:`fp4sim.schemes.NVFP4`. ``q.extras["map_to_4"]``
        says which blocks chose the map-to-4 scale.
    scale_target : ``"nvfp4_ue5m3"`` (UE5M3 block scales, :mod:`fp4sim.ue5m3`): the target the tensor amax maps
        to, over 6 (448 by default); with ``per_tensor_scale=False`` that scheme has no FP32 tensor scale.
    """
    scheme = _variant(scheme, flavor, block, scale_mode, four_over_six, four_over_six_fast_math,
                      four_over_six_e4m3_max, four_over_six_ties, scale_target, per_tensor_scale)
    if _ue5m3(scheme):
        from . import ue5m3
        _no_extras(row_scaled, return_intermediates)
        return ue5m3.quantize(x, scheme, axis, rounding, global_amax, rbits, seed, stream, sr_bits, rbits_mapping,
                              scale_layout)
    return planning.run_quantize(_kernels(x), x, scheme, axis, rounding, None, None, None, global_amax,
                                 rbits, seed, stream, sr_bits, rbits_mapping, scale_layout, False, return_intermediates,
                                 row_scaled, per_tensor_scale)


def rht_quantize(x, d: int, signs, rht_out: str, scheme, axis: int = -1, **kw) -> QuantizedTensor:
    """``quantize(rht(x, d, signs, axis=axis, out=rht_out, memory="axis_last"), scheme, axis=axis, **kw)`` in one
    call, bit for bit (the training path's Wgrad operands). On the GPU, NVFP4 with d = 16 runs the RHT inside its
    amax and quantize kernels, so that the rotated tensor is never stored; elsewhere it is the two calls. ``kw``:
    :func:`quantize`'s keywords (a UE5M3 scheme takes the two calls)."""
    names = ("flavor", "block", "scale_mode", "four_over_six", "four_over_six_fast_math", "four_over_six_e4m3_max",
             "four_over_six_ties", "scale_target", "per_tensor_scale")
    variant = {k: kw.pop(k, None) for k in names}
    scheme = _variant(scheme, variant["flavor"], variant["block"], variant["scale_mode"], variant["four_over_six"],
                      variant["four_over_six_fast_math"], variant["four_over_six_e4m3_max"],
                      variant["four_over_six_ties"], variant["scale_target"], variant["per_tensor_scale"])
    if _ue5m3(scheme):
        return quantize(rht(x, d, signs, axis=axis, out=rht_out, memory="axis_last"), scheme, axis, **kw)
    return planning.run_quantize(_kernels(x), x, scheme, axis, pre_rht=(d, signs, rht_out),
                                 per_tensor_scale=variant["per_tensor_scale"], **kw)


def fake_quantize(x, scheme="nvfp4", axis: int = -1, rounding: str = "rne", flavor: str | None = None,
                  block=None, scale_mode: str | None = None, global_amax=None, rbits=None, seed=None,
                  stream: int = 0, sr_bits: int = 8, rbits_mapping: str = "te", row_scaled: bool | None = None,
                  per_tensor_scale: bool | None = None, four_over_six: str | None = None,
                  four_over_six_fast_math: bool | None = None, four_over_six_e4m3_max: int | None = None,
                  four_over_six_ties: str | None = None, scale_target: float | None = None):
    """``dequantize(quantize(x, ...))`` in one fused pass: float32 in ``x``'s shape, bit-identical to the
    two-step result."""
    scheme = _variant(scheme, flavor, block, scale_mode, four_over_six, four_over_six_fast_math,
                      four_over_six_e4m3_max, four_over_six_ties, scale_target, per_tensor_scale)
    if _ue5m3(scheme):
        from . import ue5m3
        _no_extras(row_scaled, False)
        return ue5m3.quantize(x, scheme, axis, rounding, global_amax, rbits, seed, stream, sr_bits, rbits_mapping,
                              "linear", fake=True)
    return planning.run_quantize(_kernels(x), x, scheme, axis, rounding, None, None, None, global_amax,
                                 rbits, seed, stream, sr_bits, rbits_mapping, "linear", True, False, row_scaled,
                                 per_tensor_scale)


def dequantize(q: QuantizedTensor) -> np.ndarray:
    """float32 values of a :class:`QuantizedTensor` in its original shape (SPEC §2 dequantize rules).

    NumPy in, NumPy out; a QuantizedTensor holding CuPy arrays dequantizes on its GPU.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor (from fp4sim.quantize), not {type(q).__name__}")
    if _ue5m3(q.scheme):
        from . import ue5m3
        return ue5m3.dequantize(q)
    return planning.run_dequantize(_kernels(q.codes), q)


def _no_extras(row_scaled, return_intermediates):
    if row_scaled:
        raise ValueError("row_scaled=True: the UE5M3 scheme has one tensor scale (or none: per_tensor_scale=False)")
    if return_intermediates:
        raise ValueError("return_intermediates: not kept for the UE5M3 scheme (fp4sim.ue5m3 states its constants)")


def rht(x, d: int = 16, signs="te", axis: int = -1, out: str = "bf16", memory: str = "C") -> np.ndarray:
    """Random Hadamard transform of every contiguous d-long chunk along ``axis``.

    The d signed terms are summed in float64 in index order, multiplied by float64(1/sqrt(d)) and rounded
    once: to bfloat16 with ``out="bf16"`` (returned as float32 values that are exactly bfloat16, as
    TransformerEngine rounds the transform's output before quantizing) or to float32 with ``out="fp32"``.
    The length of ``axis`` must be a multiple of d.

    ``memory="axis_last"``: the same values in ``x``'s shape, as a strided view of memory laid out with ``axis``
    last, which :func:`fp4sim.quantize` along ``axis`` reads without moving the axis (the Wgrad operands). The
    default keeps the layout of a C-contiguous ``x`` on the CPU; other inputs (and CuPy arrays) take the
    axis-last layout either way.
    """
    return planning.run_rht(_kernels(x), x, d, signs, axis, out, memory)
