"""The three GEMMs of a linear layer under a :class:`~fp4sim.training.Recipe`, on NumPy or CuPy arrays.

Each operand is quantized from the high-precision tensor along its GEMM's dot-product axis (after the
GEMM's RHT, if any, with the tensor amax taken after the transform), and the GEMM is :func:`fp4sim.gemm`.
Stochastic rounding draws Philox bits keyed by ``layer_seed(recipe.seed, layer)`` with the stream
``8 * call + operand``: the same seed and the same sequence of calls give the same bits on any backend.
"""
from __future__ import annotations

import numpy as np

from ._xp import xp_of
from .gemm import gemm
from .quantize import dequantize, quantize, rht
from .training import OPERANDS, Operand, Recipe

__all__ = ["fprop", "dgrad", "wgrad", "layer_seed", "quantize_operand"]

_OP_INDEX = {op: i for i, op in enumerate(OPERANDS)}
_GOLD = 0x9E3779B97F4A7C15


def layer_seed(seed: int, layer: int) -> int:
    """The Philox key of one layer: the recipe seed mixed with the layer's index (64 bits)."""
    return (int(seed) + (int(layer) + 1) * _GOLD) % (1 << 64)


def _signs(op: Operand, recipe: Recipe, layer: int, call: int, gemm_id: int):
    if op.rht_signs == "te":
        return "te"
    if op.rht_signs == "none":
        return None
    if op.rht_signs == "fixed":
        return int(recipe.seed)
    return layer_seed(recipe.seed, layer) ^ ((call * 4 + gemm_id) & 0xFFFFFFFF)  # per_transform


def _pad_axis(a, axis, mult):
    n = a.shape[axis]
    p = -(-n // mult) * mult
    if p == n:
        return a
    xp = xp_of(a)
    shape = list(a.shape)
    shape[axis] = p
    out = xp.zeros(shape, np.float32)
    sl = [slice(None)] * a.ndim
    sl[axis] = slice(0, n)
    out[tuple(sl)] = a
    return out


def quantize_operand(a, op: Operand, axis: int, recipe: Recipe, layer: int, call: int, name: str, signs=None,
                     stats=None):
    """One operand: (padded and rotated along ``axis`` when the operand has an RHT) quantized along ``axis``.
    Returns a QuantizedTensor, or the float32 array itself for an unquantized operand."""
    if op.rht:
        a = _pad_axis(a, axis, op.rht)
        a = rht(a, op.rht, signs, axis=axis, out=recipe.rht_dtype, memory="axis_last")   # quantized along axis
    if not op.quantized:
        return a
    kw = {}
    if op.block is not None:
        kw["block"] = op.block
    if op.four_over_six is not None:
        kw["four_over_six"] = op.four_over_six
    if op.rounding == "sr":
        kw.update(rounding="sr", seed=layer_seed(recipe.seed, layer),
                  stream=(call * 8 + _OP_INDEX[name]) & 0xFFFFFFFF)
    q = quantize(a, op.scheme, axis=axis, **kw)
    if stats is not None:
        stats.append(_operand_stats(a, q, name))
    return q


def _operand_stats(a, q, name):
    """What TE's LogNvfp4TensorStats logs, and the clamp: relative MSE, underflow (nonzero -> 0), the share of FP4
    codes at the largest magnitude +-6 (``max_code``: every block's amax element takes it by design, about 1 in 16
    codes on Gaussian data) and the share of elements clipped by it (``clipped``: |x| above the dequantized
    +-6 of its block, what the clamp lost)."""
    xp = xp_of(a)
    y = dequantize(q)
    a64, y64 = a.astype(np.float64), y.astype(np.float64)
    ms = float((a64 * a64).mean())
    err = float(((y64 - a64) ** 2).mean())
    nz = a64 != 0
    n_nz = int(nz.sum())
    max_code = clipped = 0.0
    if q.scales is not None and q.scheme.name.startswith(("nvfp4", "mxfp4")):
        from .layout import unpack_fp4
        codes = unpack_fp4(q.codes.reshape(q.lead[0], -1))[:, : q.K]
        top = (codes & 7) == 7
        top = top if q.axis == 1 else top.T
        max_code = float(top.mean())
        with np.errstate(invalid="ignore"):
            clipped = float((top & (xp.abs(a64) > xp.abs(y64))).mean())
    return dict(operand=name, rel_mse=err / ms if ms > 0 else float("nan"),
                underflow=float((nz & (y64 == 0)).sum()) / n_nz if n_nz else 0.0, max_code=max_code,
                clipped=clipped, amax=float(xp.abs(a).max()) if a.size else 0.0)


def _family(q):
    return (type(q.scheme), getattr(q.scheme, "elem", None)) if hasattr(q, "codes") else None


def _matmul(qa, qb, recipe, a_axis, b_axis):
    """A·Bᵀ of two operands along their dot axes: the block-scaled GEMM when both are quantized in one format
    family; otherwise (e.g. NVFP4 weights with BF16 activations, the paper's weights-only ablation) a mixed GEMM
    that upcasts each quantized operand to its float32 values and multiplies in float32."""
    fa, fb = _family(qa), _family(qb)
    if fa is not None and fa == fb:
        return gemm(qa, qb, accumulate=recipe.accumulate)
    return _upcast_matmul(qa, qb, a_axis, b_axis)


def _upcast_matmul(qa, qb, a_axis, b_axis):
    """A·Bᵀ in float32 of the operands' float32 values (quantized ones dequantized)."""
    a = dequantize(qa) if hasattr(qa, "codes") else qa
    b = dequantize(qb) if hasattr(qb, "codes") else qb
    A = a if a_axis == 1 else a.T
    B = b if b_axis == 1 else b.T
    return xp_of(a).matmul(A, B.T).astype(np.float32)


def fprop(x2, w, recipe: Recipe, layer: int = 0, call: int = 0, stats=None, return_qx=False):
    """y = x · Wᵀ: x (M, K), w (N, K) -> (M, N) float32. Returns (y, the quantized weight for reuse), and the
    quantized activation third with ``return_qx`` (for ``wgrad_x_reuse_fprop``)."""
    s = _signs(recipe.fprop_x, recipe, layer, call, 0) if recipe.fprop_x.rht else None
    qx = quantize_operand(x2, recipe.fprop_x, 1, recipe, layer, call, "fprop_x", s, stats)
    qw = quantize_operand(w, recipe.fprop_w, 1, recipe, layer, call, "fprop_w", s, stats)
    y = _matmul(qx, qw, recipe, 1, 1)
    return (y, qw, qx) if return_qx else (y, qw)


def dgrad(dy2, w, recipe: Recipe, layer: int = 0, call: int = 0, qw_fprop=None, stats=None):
    """dx = dy · W: dy (M, N), w (N, K) -> (M, K) float32."""
    s = _signs(recipe.dgrad_dy, recipe, layer, call, 1) if recipe.dgrad_dy.rht else None
    qdy = quantize_operand(dy2, recipe.dgrad_dy, 1, recipe, layer, call, "dgrad_dy", s, stats)
    if recipe.dgrad_w_reuse_fprop and qw_fprop is not None and recipe.dgrad_w.quantized:
        # simulation only: the Fprop weight (quantized along K) used as it is along N
        return _upcast_matmul(qdy, qw_fprop, 1, 0)
    qw = quantize_operand(w, recipe.dgrad_w, 0, recipe, layer, call, "dgrad_w", s, stats)
    return _matmul(qdy, qw, recipe, 1, 0)


def wgrad(dy2, x2, recipe: Recipe, layer: int = 0, call: int = 0, stats=None, qx_fprop=None):
    """dW = dyᵀ · x: dy (M, N), x (M, K) -> (N, K) float32. With ``recipe.wgrad_x_reuse_fprop``, ``qx_fprop``
    (Fprop's quantized x, along K) is used as it is, upcast to float32, instead of x re-quantized along M."""
    s = _signs(recipe.wgrad_dy, recipe, layer, call, 2) if recipe.wgrad_dy.rht else None
    qdy = quantize_operand(dy2, recipe.wgrad_dy, 0, recipe, layer, call, "wgrad_dy", s, stats)
    if recipe.wgrad_x_reuse_fprop and qx_fprop is not None and recipe.wgrad_x.quantized:
        return _upcast_matmul(qdy, qx_fprop, 0, 0)
    qx = quantize_operand(x2, recipe.wgrad_x, 0, recipe, layer, call, "wgrad_x", s, stats)
    return _matmul(qdy, qx, recipe, 0, 0)
