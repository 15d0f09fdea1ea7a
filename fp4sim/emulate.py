"""The three GEMMs of a linear layer under a :class:`~fp4sim.training.Recipe`, on NumPy or CuPy arrays.

Each operand is quantized from the high-precision tensor along its GEMM's dot-product axis (after the
GEMM's RHT, if any, with the tensor amax taken after the transform), and the GEMM is :func:`fp4sim.gemm`.
Stochastic rounding draws Philox bits keyed by ``sr_key(recipe.seed, layer, rank)`` with the stream
``8 * call + operand``: the same seed and the same sequence of calls give the same bits on any backend. ``rank``
is the data-parallel rank set by :func:`data_parallel_rank` (0 outside it, where the key is ``layer_seed(seed,
layer)``), so ranks fed the same data draw different bits; the RHT signs do not depend on it.

With ``recipe.accumulate == "fast"``, NumPy operands and no stats, the three functions take the fast path of
:mod:`fp4sim.fastpath`: the same bits, without codes and scale bytes. There :func:`fprop` returns the operands'
float32 values (:class:`Values`) where it returns quantized tensors otherwise; passed on to :func:`dgrad` and
:func:`wgrad` as ``qw_fprop`` / ``qx_fprop``, they serve the reuse switches and, where an operand's values do
not depend on the dot axis and the backward recipe quantizes it the same way, they are used again instead of
quantizing the tensor a second time. :func:`dgrad` leaves the output gradient's values in ``cache`` (a dict)
for :func:`wgrad` in the same way.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import numpy as np

from . import fastpath
from ._f32 import absmax
from ._xp import matmul, xp_of
from .gemm import TENSOR_CORE, covers, fast_operand, gemm
from .quantize import dequantize, fake_quantize, quantize, rht, rht_quantize
from .schemes import NVFP4UE5M3, BF16Cast, FP8Tensor, get_scheme
from .training import OPERANDS, Operand, Recipe

__all__ = ["fprop", "dgrad", "wgrad", "layer_seed", "sr_key", "data_parallel_rank", "amax_reduction",
           "per_layer_signs", "held_amax",
           "quantize_operand", "Values", "serves"]

_OP_INDEX = {op: i for i, op in enumerate(OPERANDS)}
_GOLD = 0x9E3779B97F4A7C15


def layer_seed(seed: int, layer: int) -> int:
    """The Philox key of one layer: the recipe seed mixed with the layer's index (64 bits)."""
    return (int(seed) + (int(layer) + 1) * _GOLD) % (1 << 64)


_RANK_MIX = 0xD1B54A32D192ED03
_RANK = contextvars.ContextVar("fp4sim_data_parallel_rank", default=0)


def sr_key(seed: int, layer: int, rank: int = 0) -> int:
    """The Philox key of stochastic rounding in one layer on one data-parallel rank: ``(layer_seed(seed, layer) +
    rank · 0xD1B54A32D192ED03) mod 2^64`` — :func:`layer_seed` itself on rank 0 (and in a single process)."""
    return (layer_seed(seed, layer) + int(rank) * _RANK_MIX) % (1 << 64)


@contextlib.contextmanager
def data_parallel_rank(rank: int):
    """Within the block, stochastic rounding draws the bits of data-parallel rank ``rank`` (:func:`sr_key`); the
    RHT signs, the amaxes and everything else stay as they are."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
        raise ValueError(f"rank={rank!r}: a data-parallel rank is an integer >= 0")
    tok = _RANK.set(int(rank))
    try:
        yield
    finally:
        _RANK.reset(tok)


_AMAX_REDUCE = contextvars.ContextVar("fp4sim_amax_reduce", default=None)


@contextlib.contextmanager
def amax_reduction(reduce):
    """Within the block, the tensor amax that an operand with ``amax="delayed"`` / ``"history"`` records is
    ``reduce(local amax)``: the torch bridge passes the maximum over the data-parallel ranks (one all_reduce per
    such operand and call, as TransformerEngine's delayed scaling reduces its amaxes), so every rank holds the
    same history and quantizes with the same scale."""
    tok = _AMAX_REDUCE.set(reduce)
    try:
        yield
    finally:
        _AMAX_REDUCE.reset(tok)


def per_layer_signs(seed: int, layer: int, d: int) -> np.ndarray:
    """The RHT sign vector (+-1.0, length d) of ``rht_signs="per_layer"``: Philox bits keyed by
    :func:`layer_seed` ``(seed, layer)``, the same on every call."""
    from .hadamard import rht_signs
    return rht_signs(d, layer_seed(seed, layer))


def _signs(op: Operand, recipe: Recipe, layer: int, call: int, gemm_id: int):
    if op.rht_signs == "te":
        return "te"
    if op.rht_signs == "none":
        return None
    if op.rht_signs == "fixed":
        return int(recipe.seed)
    if op.rht_signs == "per_layer":
        return layer_seed(recipe.seed, layer)
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


def held_amax(a, op: Operand, call: int, name: str, amax_state):
    """The tensor amax an operand with ``amax="delayed"`` / ``"history"`` quantizes with at call ``call``
    (``a``: the tensor after its RHT), updating ``amax_state`` (a dict: ``{name: {"held": v}}`` or ``{name:
    {"history": [...]}}``, the values float32)."""
    if amax_state is None:
        raise ValueError(f"{name}: Operand amax={op.amax!r} keeps state between calls; pass amax_state (a dict the "
                         "caller keeps, as QuantLinear does)")
    cur = float(absmax(a)) if a.size else 0.0       # NaN ignored, as quantize's own amax does
    reduce = _AMAX_REDUCE.get()
    if reduce is not None:                          # data-parallel ranks hold one amax (TE's reduce_amax)
        cur = float(reduce(cur))
    if op.amax == "delayed":
        st = amax_state.get(name)
        if st is None or call % op.amax_every == 0:
            st = amax_state[name] = {"held": cur}
        return np.float32(st["held"])
    h = amax_state.setdefault(name, {"history": []})["history"]
    use = max(h) if h else cur
    h.append(cur)
    del h[:-op.amax_window]
    return np.float32(use)


def quantize_operand(a, op: Operand, axis: int, recipe: Recipe, layer: int, call: int, name: str, signs=None,
                     stats=None, amax_state=None):
    """One operand: (padded and rotated along ``axis`` when the operand has an RHT) quantized along ``axis``.
    Returns a QuantizedTensor, or the float32 array itself for an unquantized operand. ``amax_state``: the
    state of operands whose tensor amax is delayed (:func:`held_amax`)."""
    if op.rht:
        a = _pad_axis(a, axis, op.rht)
        if op.quantized and op.amax == "current" and stats is None:    # one call: on the GPU the RHT is fused
            return rht_quantize(a, op.rht, signs, recipe.rht_dtype, op.scheme, axis,    # into the quantize
                                **_quant_kwargs(op, recipe, layer, call, name))
        a = rht(a, op.rht, signs, axis=axis, out=recipe.rht_dtype, memory="axis_last")   # quantized along axis
    if not op.quantized:
        return a
    kw = _quant_kwargs(op, recipe, layer, call, name)
    if op.amax != "current":
        kw["global_amax"] = held_amax(a, op, call, name, amax_state)
    q = quantize(a, op.scheme, axis=axis, **kw)
    if stats is not None:
        stats.append(_operand_stats(a, q, name))
    return q


def _quant_kwargs(op: Operand, recipe: Recipe, layer: int, call: int, name: str) -> dict:
    kw = {}
    if op.block is not None:
        kw["block"] = op.block
    if op.four_over_six is not None:
        kw["four_over_six"] = op.four_over_six
    if op.per_token:
        kw["row_scaled"] = True                # one outer amax per row of the operand along its dot axis
    if op.scheme == "nvfp4_ue5m3":
        kw.update(scale_target=op.scale_target, per_tensor_scale=op.per_tensor_scale)
    if op.rounding == "sr":
        kw.update(rounding="sr", seed=sr_key(recipe.seed, layer, _RANK.get()), stream=_stream(call, name),
                  rbits_mapping=op.rbits_mapping)
    return kw


def _stream(call, name):
    return (call * 8 + _OP_INDEX[name]) & 0xFFFFFFFF


@dataclass(eq=False)
class Values:
    """One operand of the fast path as its GEMM reads it: ``a`` (rows along the dot axis, C-contiguous for a
    quantized operand), the :class:`~fp4sim.training.Operand` that made it, and ``reuse`` (whether the recipe
    that made it asked for it to be reused: ``dgrad_w_reuse_fprop`` / ``wgrad_x_reuse_fprop``)."""
    a: object
    op: Operand
    reuse: bool = False


def _fast(recipe: Recipe, stats, *arrays) -> bool:
    return (recipe.accumulate == "fast" and stats is None and fastpath.enabled()
            and all(isinstance(a, np.ndarray) for a in arrays)
            and all(getattr(recipe, op).amax == "current" for op in OPERANDS))    # a held amax: the general path


def _operand_values(a, op: Operand, axis: int, recipe: Recipe, layer: int, call: int, name: str, signs=None):
    """The fast path's :func:`quantize_operand`: the operand's float32 values with the dot axis last (what the
    general path's ``dequantize`` moved to the dot axis gives, in the same layout)."""
    if op.rht:
        a = _pad_axis(a, axis, op.rht)
        a = rht(a, op.rht, signs, axis=axis, out=recipe.rht_dtype, memory="axis_last")
    if not op.quantized:
        return a if axis == 1 else a.T
    plan = fastpath.operand_plan(op, a.shape, axis)
    if plan.kind == "bf16":                 # elementwise, laid out as the tensor (gemm.fast_operand's layout)
        v = fastpath.bf16_values(np.ascontiguousarray(a, np.float32))
        return v if axis == 1 else v.T
    if plan.kind in ("nvfp4", "fp8_blockwise", "mx"):
        A = fastpath.a_form(a, axis)
        if plan.kind == "fp8_blockwise":
            v = fastpath.fp8_blockwise_values(A, plan)
        else:
            kernel = fastpath.nvfp4_values if plan.kind == "nvfp4" else fastpath.mx_values
            v = kernel(A, plan, sr_key(recipe.seed, layer, _RANK.get()), _stream(call, name))
        if v is not None:
            return v
        v = dequantize(quantize(a, op.scheme, axis=axis, **_quant_kwargs(op, recipe, layer, call, name)))
    else:
        v = fake_quantize(a, op.scheme, axis=axis, **_quant_kwargs(op, recipe, layer, call, name))
    return v if axis == 1 else v.T


def _as_values(q):
    """A quantized tensor (or float32 array) from the general path as the fast path's :class:`Values`."""
    if q is None or isinstance(q, Values):
        return q
    return Values(dequantize(q) if hasattr(q, "codes") else q, None, True)


def _from_values(q):
    """The general path's view of a :class:`Values`: its array where it was made for reuse, else nothing."""
    if isinstance(q, Values):
        return q.a if q.reuse else None
    return q


def serves(v, op: Operand) -> bool:
    """Whether ``v`` (what :func:`fprop` returned for one operand) gives the other GEMM's operand ``op`` its
    values: a :class:`Values` made by the same operand, whose values do not depend on the dot axis. A caller
    keeping fprop's outputs for the backward pass keeps those that serve (or that a reuse switch needs)."""
    return isinstance(v, Values) and v.op == op and fastpath.shared_values(op)


def _shared(prev, op: Operand):
    """``prev`` (a :class:`Values` of the other GEMM's operand from the same tensor) transposed, where its
    values are this operand's: the same operand, whose values do not depend on the dot axis; else None."""
    if serves(prev, op):                                   # the layout the general path gives the BLAS, whose
        if isinstance(get_scheme(op.scheme, block=op.block), BF16Cast):   # bits can depend on it (gemm.
            return prev.a.T                                # fast_operand): BF16 values transposed as they lie,
        return fastpath.a_form(prev.a, 0)                  # the others transposed, C-contiguous (a tiled copy)
    return None


def _fast_matmul(A, B):
    """A·Bᵀ of two operands with their dot axes last: the call and layouts of ``gemm(accumulate="fast")``."""
    return matmul(A, B.T).astype(np.float32, copy=False)


def _operand_stats(a, q, name):
    """What TE's LogNvfp4TensorStats logs, and the clamp: relative MSE, underflow (nonzero -> 0), the share of FP4
    codes at the largest magnitude +-6 (``max_code``: every block's amax element takes it by design, about 1 in 16
    codes on Gaussian data) and the share of elements clipped by it (``clipped``: |x| above the dequantized
    +-6 of its block, what the clamp lost)."""
    y = dequantize(q)
    if xp_of(a) is np and a.ndim == 2 and a.size and a.dtype == np.float32:
        return _operand_stats_cpu(a, y, q, name)
    return _operand_stats_arrays(a, y, q, name)


def _operand_stats_arrays(a, y, q, name):
    """:func:`_operand_stats` as NumPy / CuPy expressions (on a GPU; the oracle of the CPU's fused pass)."""
    xp = xp_of(a)
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


def _operand_stats_cpu(a, y, q, name):
    """:func:`_operand_stats` on the CPU in one fused pass (fp4sim.cpu.analysis.operand_stats): the counts are
    NumPy's, the two float64 sums added in another order (rows, then the rows in turn), so ``rel_mse`` equals
    the NumPy expression to the last bits."""
    from .cpu.analysis import operand_stats
    fp4 = q.scales is not None and q.scheme.name.startswith(("nvfp4", "mxfp4"))
    codes = q.codes.reshape(q.lead[0], -1) if fp4 else np.zeros((1, 1), np.uint8)
    # the arrays in the layout they lie in (a transposed operand read along its memory), the codes indexed to match
    A, Y, along = (a, y, q.axis == 1) if a.flags.c_contiguous or not a.flags.f_contiguous else (a.T, y.T, q.axis == 0)
    (sa, se, amax), (nz, un, top, cl) = operand_stats(A, Y, codes, fp4, not along)
    n = a.size
    ms, err = sa / n, se / n
    return dict(operand=name, rel_mse=err / ms if ms > 0 else float("nan"),
                underflow=float(un) / nz if nz else 0.0, max_code=float(top) / n if fp4 else 0.0,
                clipped=float(cl) / n if fp4 else 0.0, amax=float(amax))


def _family(q):
    """The format family of a quantized operand whose GEMM fs.gemm models; None for float32 arrays and for UE5M3
    block scales (no hardware GEMM: their dequantized values are multiplied in float32)."""
    if not hasattr(q, "codes") or isinstance(q.scheme, NVFP4UE5M3):
        return None
    return (type(q.scheme), getattr(q.scheme, "elem", None))


def _matmul(qa, qb, recipe, a_axis, b_axis):
    """A·Bᵀ of two operands along their dot axes: the block-scaled GEMM when both are quantized in one format
    family; otherwise (e.g. NVFP4 weights with BF16 activations, the paper's weights-only ablation) a mixed GEMM
    that upcasts each quantized operand to its float32 values and multiplies in float32."""
    fa, fb = _family(qa), _family(qb)
    acc, grid = recipe.accumulate, recipe.accumulate_grid
    if (fa is not None and fb is not None and fa[0] is fb[0] is FP8Tensor and (acc in TENSOR_CORE or acc == "cdna3")
            and covers(acc, qa.scheme) and covers(acc, qb.scheme)):
        return gemm(qa, qb, accumulate=acc)    # a tensor core multiplies E4M3 by E5M2 (the hybrid FP8 GEMMs)
    if fa is not None and fa == fb:
        if not covers(acc, qa.scheme):
            acc, grid = "exact", None         # a model of other formats: this format takes its exact rule
        return gemm(qa, qb, accumulate=acc, grid=grid)
    return _upcast_matmul(qa, qb, a_axis, b_axis)


def _upcast_matmul(qa, qb, a_axis, b_axis):
    """A·Bᵀ in float32 of the operands' float32 values (quantized ones dequantized, laid out as
    ``gemm(accumulate="fast")`` lays them out)."""
    A = fast_operand(qa, a_axis) if hasattr(qa, "codes") else (qa if a_axis == 1 else qa.T)
    B = fast_operand(qb, b_axis) if hasattr(qb, "codes") else (qb if b_axis == 1 else qb.T)
    return matmul(A, B.T).astype(np.float32)


def fprop(x2, w, recipe: Recipe, layer: int = 0, call: int = 0, stats=None, return_qx=False, amax_state=None):
    """y = x · Wᵀ: x (M, K), w (N, K) -> (M, N) float32. Returns (y, the quantized weight for reuse), and the
    quantized activation third with ``return_qx`` (for ``wgrad_x_reuse_fprop``). ``amax_state``: a dict the
    caller keeps for operands with a delayed tensor amax (:func:`held_amax`), the same for every call."""
    s = _signs(recipe.fprop_x, recipe, layer, call, 0) if recipe.fprop_x.rht else None
    if _fast(recipe, stats, x2, w):
        xv = Values(_operand_values(x2, recipe.fprop_x, 1, recipe, layer, call, "fprop_x", s), recipe.fprop_x,
                    recipe.wgrad_x_reuse_fprop)
        wv = Values(_operand_values(w, recipe.fprop_w, 1, recipe, layer, call, "fprop_w", s), recipe.fprop_w,
                    recipe.dgrad_w_reuse_fprop)
        y = _fast_matmul(xv.a, wv.a)
        return (y, wv, xv) if return_qx else (y, wv)
    qx = quantize_operand(x2, recipe.fprop_x, 1, recipe, layer, call, "fprop_x", s, stats, amax_state)
    qw = quantize_operand(w, recipe.fprop_w, 1, recipe, layer, call, "fprop_w", s, stats, amax_state)
    y = _matmul(qx, qw, recipe, 1, 1)
    return (y, qw, qx) if return_qx else (y, qw)


def _override(recipe: Recipe, a, q_fprop, what: str):
    """The operand and recipe of a backward GEMM under ``recipe.backward_override``: the high-precision recipe on
    the original tensor ``a``, or on Fprop's quantized copy dequantized (``q_fprop``: what :func:`fprop` returned
    for it)."""
    if recipe.backward_override == "dequantized":
        if q_fprop is None:
            raise ValueError(f"backward_override='dequantized': give {what} (fprop's quantized operand, "
                             "fprop(..., return_qx=True) returns both)")
        if isinstance(q_fprop, Values):
            a = q_fprop.a
        elif hasattr(q_fprop, "codes"):
            a = dequantize(q_fprop)
        else:
            a = q_fprop                                       # an unquantized Fprop operand: the tensor itself
    return a, recipe.backward_recipe()


def dgrad(dy2, w, recipe: Recipe, layer: int = 0, call: int = 0, qw_fprop=None, stats=None, cache=None,
          amax_state=None):
    """dx = dy · W: dy (M, N), w (N, K) -> (M, K) float32. On the fast path, ``cache`` (a dict) receives the
    output gradient's values for :func:`wgrad`. With ``recipe.backward_override``, the high-precision recipe on
    ``w`` or (``"dequantized"``) on ``qw_fprop`` dequantized."""
    if recipe.backward_override is not None:
        w, bw = _override(recipe, w, qw_fprop, "qw_fprop")
        return dgrad(dy2, w, bw, layer, call, None, stats, cache)
    s = _signs(recipe.dgrad_dy, recipe, layer, call, 1) if recipe.dgrad_dy.rht else None
    if _fast(recipe, stats, dy2, w):
        qw_fprop = _as_values(qw_fprop)
        dyv = Values(_operand_values(dy2, recipe.dgrad_dy, 1, recipe, layer, call, "dgrad_dy", s), recipe.dgrad_dy)
        if cache is not None:
            cache["dy"] = dyv
        if recipe.dgrad_w_reuse_fprop and isinstance(qw_fprop, Values) and qw_fprop.reuse and recipe.dgrad_w.quantized:
            return matmul(dyv.a, qw_fprop.a).astype(np.float32)     # the Fprop weight as it is, along N
        B = _shared(qw_fprop, recipe.dgrad_w)
        if B is None:
            B = _operand_values(w, recipe.dgrad_w, 0, recipe, layer, call, "dgrad_w", s)
        return _fast_matmul(dyv.a, B)
    qw_fprop = _from_values(qw_fprop)
    qdy = quantize_operand(dy2, recipe.dgrad_dy, 1, recipe, layer, call, "dgrad_dy", s, stats, amax_state)
    if recipe.dgrad_w_reuse_fprop and qw_fprop is not None and recipe.dgrad_w.quantized:
        # simulation only: the Fprop weight (quantized along K) used as it is along N
        return _upcast_matmul(qdy, qw_fprop, 1, 0)
    qw = quantize_operand(w, recipe.dgrad_w, 0, recipe, layer, call, "dgrad_w", s, stats, amax_state)
    return _matmul(qdy, qw, recipe, 1, 0)


def wgrad(dy2, x2, recipe: Recipe, layer: int = 0, call: int = 0, stats=None, qx_fprop=None, cache=None,
          amax_state=None):
    """dW = dyᵀ · x: dy (M, N), x (M, K) -> (N, K) float32. With ``recipe.wgrad_x_reuse_fprop``, ``qx_fprop``
    (Fprop's quantized x, along K) is used as it is, upcast to float32, instead of x re-quantized along M. On
    the fast path, ``cache`` is :func:`dgrad`'s (the output gradient's values, used again where they can be).
    With ``recipe.backward_override``, the high-precision recipe on ``x2`` or (``"dequantized"``) on ``qx_fprop``
    dequantized."""
    if recipe.backward_override is not None:
        x2, bw = _override(recipe, x2, qx_fprop, "qx_fprop")
        return wgrad(dy2, x2, bw, layer, call, stats, None, cache)
    s = _signs(recipe.wgrad_dy, recipe, layer, call, 2) if recipe.wgrad_dy.rht else None
    if _fast(recipe, stats, dy2, x2):
        qx_fprop = _as_values(qx_fprop)
        A = _shared(cache.get("dy") if cache else None, recipe.wgrad_dy)
        if A is None:
            A = _operand_values(dy2, recipe.wgrad_dy, 0, recipe, layer, call, "wgrad_dy", s)
        if recipe.wgrad_x_reuse_fprop and isinstance(qx_fprop, Values) and qx_fprop.reuse and recipe.wgrad_x.quantized:
            return matmul(A, qx_fprop.a).astype(np.float32)          # Fprop's x as it is, along K
        B = _shared(qx_fprop, recipe.wgrad_x)
        if B is None:
            B = _operand_values(x2, recipe.wgrad_x, 0, recipe, layer, call, "wgrad_x", s)
        return _fast_matmul(A, B)
    qx_fprop = _from_values(qx_fprop)
    qdy = quantize_operand(dy2, recipe.wgrad_dy, 0, recipe, layer, call, "wgrad_dy", s, stats, amax_state)
    if recipe.wgrad_x_reuse_fprop and qx_fprop is not None and recipe.wgrad_x.quantized:
        return _upcast_matmul(qdy, qx_fprop, 0, 0)
    qx = quantize_operand(x2, recipe.wgrad_x, 0, recipe, layer, call, "wgrad_x", s, stats, amax_state)
    return _matmul(qdy, qx, recipe, 0, 0)
