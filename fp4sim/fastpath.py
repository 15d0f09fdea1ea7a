"""The training fast path of :mod:`fp4sim.emulate` (``Recipe(accumulate="fast")``, NumPy operands, no stats).

``accumulate="fast"`` multiplies the operands' float32 values with one BLAS call. This module produces those
values directly, in the layout the BLAS call reads (the "A form": rows along the dot axis, C-contiguous, what
``dequantize(q)`` moved to the dot axis gives), without materialising codes and scale bytes:

- NVFP4 (te / paper flavour, 1x16 or 16x16, RNE or SR with in-kernel Philox bits): one tensor-amax pass and one
  fused pass (:func:`fp4sim.cpu.fast.nvfp4_values_kernel`);
- BF16 with RNE: a vectorised float32 -> bfloat16 rounding (:func:`fp4sim.cpu.fast.bf16_round_kernel`);
- FP8 blockwise (E4M3, 1x128 or 128x128, RNE): block amax, scale and element rounding on registers in one
  kernel (:func:`fp4sim.cpu.fast.fp8_blockwise_values_kernel`);
- MX (MXFP4, MXFP8; RNE or SR with in-kernel Philox bits): the backend's MX kernel called directly, its
  float32 output taken (no planning layer, no separate dequantize);
- every other operand: ``fake_quantize`` with the arguments :func:`fp4sim.emulate.quantize_operand` gives
  ``quantize`` (its values are those of ``dequantize(quantize(...))``).

The values are bit for bit those of the general path, and so is the GEMM: the same matmul
(:func:`fp4sim._xp.matmul`: NumPy's, or torch's inside the torch bridge) of the same values in the same memory
layout — a float32 BLAS may sum in another order for another layout (OpenBLAS 0.3.31 does, for a transposed
view against its contiguous copy) — and the tests compare the bits of every preset and switch, through the
bridge too. Operands the fused kernel does not take (NaN in the operand, a non-finite
tensor amax, an amax above FLT_MAX/448, SR bits that Philox cannot generate row by row) go through the general
path. An operand's static plan (scheme, kernel ids, Philox row layout) is built once per (operand, shape, axis)
and kept in a bounded cache; the per-call parts (the tensor amax, the Philox key and stream, the RHT signs)
are computed at every call.

Quantize once, use twice: an operand whose values do not depend on the dot axis — NVFP4 16x16 or FP8 128x128
tiles, BF16 and per-tensor FP8 elementwise, all with round-to-nearest and no RHT — gives the same values to both
GEMMs that read it (Fprop's and Dgrad's weight, Fprop's and Wgrad's activation, Dgrad's and Wgrad's output
gradient): :func:`shared_values` says when, and the second GEMM reads the first's values transposed (a copy in
the layout the general path gives it).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from . import ids
from .planning import NVFP4_DEQUANT_AMAX_LIMIT, nvfp4_constants_rows, philox_layout
from .rng import seed_key
from .formats import E4M3
from .schemes import MX, NVFP4, BF16Cast, FP8Blockwise, FP8Tensor, get_scheme

__all__ = ["OperandPlan", "operand_plan", "shared_values", "enabled", "a_form", "nvfp4_values", "bf16_values",
           "fp8_blockwise_values", "mx_values"]

_ENABLED = os.environ.get("FP4SIM_FASTPATH", "1") != "0"


def enabled() -> bool:
    """Whether :mod:`fp4sim.emulate` takes the fast path where it applies (``FP4SIM_FASTPATH=0`` turns it off
    for a process; the tests compare both paths)."""
    return _ENABLED


def _set_enabled(on: bool) -> bool:
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(on)
    return old


@dataclass(frozen=True)
class OperandPlan:
    """What stays the same for one operand while its shape and the recipe do: ``kind`` ``"nvfp4"`` (the fused
    kernel), ``"bf16"`` (RNE rounding), ``"fp8_blockwise"`` (its kernel, ``tile`` 1 or 128), ``"mx"`` (the MX
    kernel called directly: ``flavor`` holds the scale mode's id, ``elem`` the element format) or ``"general"``
    (fake_quantize); the fused kernel's ids, and the layout
    of its Philox bits (``ph`` 1: the dot axis is last in the original tensor, 2: its stride ``pstride`` is a
    multiple of 16, None: not generated in the kernel)."""
    kind: str
    flavor: int = 0
    tile: int = 1
    mode: int = ids.RNE
    ph: int | None = None
    pstride: int = 1
    elem: object = None
    nsr: int = 8                 # the SR bits the kernels take (plus ids.SR_MIDPOINT for the midpoint rule)


@functools.lru_cache(maxsize=1024)
def operand_plan(op, shape: tuple, axis: int) -> OperandPlan:
    """The :class:`OperandPlan` of the operand ``op`` (a :class:`~fp4sim.training.Operand`) for an input of
    ``shape`` (after RHT padding) quantized along ``axis``."""
    sch = get_scheme(op.scheme, block=op.block, four_over_six=op.four_over_six, row_scaled=op.per_token or None)
    sr = op.rounding == "sr"
    nsr = 8 + (ids.SR_MIDPOINT if sr and op.rbits_mapping == "midpoint" else 0)
    if isinstance(sch, BF16Cast) and not sr:
        return OperandPlan("bf16")
    if (isinstance(sch, NVFP4) and sch.flavor in ("te", "paper") and not sch.four_over_six and not sch.row_scaled
            and sch.per_tensor_scale):
        ph, stride = philox_layout(shape, axis)
        if sr and ph is None:
            return OperandPlan("general")
        return OperandPlan("nvfp4", ids.FLAVOR_IDS[sch.flavor], sch.block[0], ids.SR if sr else ids.RNE, ph,
                           stride, nsr=nsr)
    if isinstance(sch, MX):
        ph, stride = philox_layout(shape, axis)
        if sr and ph is None:
            return OperandPlan("general")
        return OperandPlan("mx", ids.SCALE_MODE_IDS[sch.scale_mode], 1, ids.SR if sr else ids.RNE, ph, stride,
                           sch.elem, nsr)
    if isinstance(sch, FP8Blockwise) and sch.elem is E4M3 and not sr:
        return OperandPlan("fp8_blockwise", tile=sch.block[0])
    return OperandPlan("general")


def shared_values(op) -> bool:
    """Whether ``op``'s values are the same quantized along either axis of a matrix (so one quantization serves
    two GEMMs): square tiles or elementwise scaling, round-to-nearest, no RHT."""
    if not op.quantized or op.rht or op.rounding != "rne" or op.four_over_six:
        return False
    sch = get_scheme(op.scheme, block=op.block)
    if isinstance(sch, (BF16Cast, FP8Tensor)):
        return True
    if isinstance(sch, NVFP4):
        return sch.block == (16, 16)
    if isinstance(sch, FP8Blockwise):
        return sch.block == (128, 128)
    return False


# the fused kernel's random-byte arguments when it rounds to nearest (no bytes read)
_RNE_ARGS = (np.zeros((1, 1), np.uint8), 0, np.uint64(0), np.uint64(0), np.uint64(0), np.uint8(0xFF), 1)


def a_form(a, axis):
    """``a`` (2-D) with the dot axis last, C-contiguous (a view where it already is)."""
    from .cpu.transpose import axis_last
    m = a if axis == 1 else a.T
    if m.flags.c_contiguous and m.dtype == np.float32:
        return m
    if axis == 0 and a.flags.c_contiguous and a.dtype == np.float32:
        return axis_last(a, 0)                            # a tiled transposing copy
    return np.ascontiguousarray(m, np.float32)


def nvfp4_values(A, plan: OperandPlan, seed=None, stream=0):
    """The dequantized NVFP4 values of ``A`` (R, K) C-contiguous float32, quantized along its rows, or None
    where the fused kernel does not apply (then the caller takes the general path)."""
    import numba

    from .cpu import blocks as _b
    from .cpu.fast import nvfp4_values_kernel
    amax, has_nan = _b.absmax_nan(A)
    amax = np.float32(amax)
    if has_nan or not np.isfinite(amax) or amax > NVFP4_DEQUANT_AMAX_LIMIT:
        return None
    c0, c1, dq = nvfp4_constants_rows("te" if plan.flavor == ids.TE else "paper", [amax])
    if plan.mode == ids.SR:
        k0, k1 = seed_key(seed)
        sra = (np.zeros((1, 1), np.uint8), plan.ph, np.uint64(k0), np.uint64(k1), np.uint64(stream),
               np.uint8(0xFF), plan.pstride)
    else:
        sra = _RNE_ARGS
    out = np.empty(A.shape, np.float32)
    if A.size:
        R = A.shape[0]
        ntasks = max(1, min(-(-R // 16), 4 * numba.get_num_threads()))
        nvfp4_values_kernel(A, *sra, plan.mode, plan.nsr, plan.flavor, plan.tile, c0[0], c1[0], dq[0], E4M3.values, out,
                            ntasks)
    return out


def mx_values(A, plan: OperandPlan, seed=None, stream=0):
    """The MX values of ``A`` (R, K) C-contiguous float32 along its rows by the backend's MX kernel (its fake
    output, as ``fake_quantize``), without the planning layer; None where ``A`` holds NaN or Inf (then the
    caller takes the general path, with its warnings)."""
    from .cpu.backend import CpuKernels
    from .planning import PhiloxRows
    if plan.mode == ids.SR:
        k0, k1 = seed_key(seed)
        rb = PhiloxRows(plan.ph, k0, k1, int(stream), 0xFF, plan.pstride)
    else:
        rb = np.zeros((1, 1), np.uint8)
    if not A.size:
        return np.empty(A.shape, np.float32)
    _, _, fv, (amax, has_nan) = CpuKernels.mx(A, rb, plan.mode == ids.SR, plan.mode, plan.nsr, plan.flavor, plan.elem,
                                              True)
    if has_nan or not np.isfinite(amax):
        return None
    return fv


def fp8_blockwise_values(A, plan: OperandPlan):
    """The FP8 E4M3 blockwise values (RNE) of ``A`` (R, K) C-contiguous float32 along its rows, or None where
    the operand holds NaN or Inf (then the caller takes the general path)."""
    from .cpu import blocks as _b
    from .cpu.fast import fp8_blockwise_values_kernel
    amax, has_nan = _b.absmax_nan(A)
    if has_nan or not np.isfinite(amax):
        return None
    out = np.empty(A.shape, np.float32)
    if A.size:
        fp8_blockwise_values_kernel(A, plan.tile, out)
    return out


def bf16_values(A):
    """``A`` (C-contiguous float32) rounded to bfloat16 (RNE), as float32 values."""
    from .cpu.fast import bf16_round_kernel
    out = np.empty(A.shape, np.float32)
    if A.size:
        bf16_round_kernel(A.reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint32))
    return out
