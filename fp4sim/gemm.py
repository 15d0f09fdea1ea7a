"""Emulated block-scaled GEMM: ``gemm(qa, qb) = A · Bᵀ`` as a block-scaled tensor core computes it.

``qa`` and ``qb`` are :class:`QuantizedTensor` s of 2-D matrices quantized along their dot-product axis (the
``axis`` they were quantized along; the other axis is the matrix's row). The result is float32 of shape
(rows of A, rows of B).

Rules (``accumulate="exact"``, the default):

- NVFP4 × NVFP4 (1×16 or 16×16 tiles on either side): for each 16-element K block, the inner product of the
  E2M1 values (exact in float32: every partial sum is a multiple of 1/4 below 2^10), times ``fl(s_a · s_b)``
  of the two decoded E4M3 block scales, accumulated in float32 in block order; then multiplied by
  ``alpha = fl(fl(amax_a · amax_b) / (6·6·448·448))`` — per output row (column) when A (B) is row-scaled.
  This is TransformerEngine 2.20.2's reference ``qgemm`` (``custom_recipes/reference_nvfp4.py``) operation by
  operation, and matches it bit for bit. torchao / modelopt operands use ``alpha = fl(pts_a · pts_b)``, their
  per-tensor decode scales (1 without a tensor scale).
- MXFP4 × MXFP4: the same with 32-element blocks and power-of-two UE8M0 scales ``2^(e-127)``, no alpha (TE's
  ``pow_2_scales`` path).
- MXFP8, FP8 blockwise (1×128 / 128×128) and FP8 per-tensor: an FP8 block inner product is not exact in float32,
  so each block's (32 for MX, 128 for blockwise and per-tensor) inner product is computed in float64 (exact for
  E4M3 × E4M3: at most 50 significant bits) and rounded once to float32 — the per-block promotion to float32 of
  DeepSeek-V3's FP8 GEMMs — then multiplied by ``fl(s_a · s_b)`` and accumulated in float32 in block order; FP8
  per-tensor applies ``fl(s_a · s_b)`` once at the end instead.
- BF16 × BF16: the whole inner product in float64, rounded once to float32.

K not a multiple of the block: the zero padding contributes nothing.

Accumulation models (``accumulate=``). The rules above are ``"te_reference"`` (``"exact"`` is its alias): what
TransformerEngine's reference computes, not necessarily what a tensor core returns. For NVFP4 × NVFP4 three
more models are defined, all on the products of the decoded operands (E2M1 value × decoded E4M3 block scale on
each side, without the FP32 tensor scales; every such product, and every sum of them, is exact on the lattice
of 2^-20), with alpha applied last as above, ``y = fl(alpha · c)``:

- ``"exact_sum"``: the exact dot product, rounded once to float32.
- ``"k64_rtz"``: the dot product split along K, in physical order, into groups of 64 products; each group's
  exact sum rounded once to nearest-even; the partials added in order with float32 additions rounded toward
  zero (``c = RTZ(c + p_j)`` from ``c = 0``). ``grid=1024`` then rounds ``c`` to the nearest multiple of 1/1024
  (ties to even; IEEE's roundToIntegral of ``1024 c``, so a negative ``c`` that rounds to 0 gives -0) before
  alpha. This is the model that Hu, Luschi and Balanca (Graphcore, 2026: "UE5M3 FP4 Block
  Scaling for Stable Language Model Pretraining", Sec. 4 and App. B) fitted to the native Blackwell NVFP4 GEMM
  through TransformerEngine: an empirical model of one hardware and software stack, not a specification.
- ``"k64_rne"``: the same groups, added with nearest-even additions.
- probes for other group widths: ``"k16_rtz"``, ``"k32_rtz"``, ``"k128_rtz"`` and the ``_rne`` forms.

These models are NVFP4-only (the report measured NVFP4). A block scale that is NaN makes every output it
touches NaN, as in the reference.

Tensor-core models (:mod:`fp4sim.tensorcore`: published, hardware-validated models of the instructions):

- ``"tcgen05"``: Blackwell's block-scaled ``tcgen05.mma`` as MMA-Sim models it, for NVFP4 (alpha applied last,
  as above), MXFP4, MXFP8 and MXFP6 (E4M3, E5M2, E2M3 and E3M2 may be mixed): the instructions in physical K order through the
  float32 accumulator. A second published model of the chip that makes NVFP4's ``k64_rtz``; the two disagree on
  operands whose block scales spread over many binades.
- ``"hopper"`` (cuBLAS's slow accumulation: the chain restarts every 128 K elements, the restarts added in
  float32), ``"hopper_fast_accum"`` (one chain over K), ``"ada"``, ``"ada_fast_accum"``, ``"b200"`` (tcgen05,
  MMA-Sim's model; one chain), ``"b200_mma"`` (one chain) and ``"ampere"`` (BF16 only), for FP8 per-tensor operands (E4M3 and E5M2 may be mixed; then
  ``RN32(acc · fl(s_a · s_b))``), FP8 blockwise operands (each 128-element block's chain from +0, promoted to
  float32 and scaled as the exact rule does: DeepSeek-V3's promotion) and BF16 operands (one chain over K; the
  ``_fast_accum`` names are FP8 settings and are refused). A model given operands of a format it does not
  cover raises ValueError; in emulated training (``Recipe(accumulate=...)``) those GEMMs take their exact rule.
- ``"cdna3"``: AMD MI300's MFMA model (:mod:`fp4sim.tensorcore.cdna`) for the FNUZ per-tensor schemes
  ``fp8_e4m3fnuz`` / ``fp8_e5m2fnuz`` (either mix; then ``RN32(acc · fl(s_a · s_b))``) and BF16: one chain of
  instructions over K from +0.

``accumulate="fast"`` dequantizes both
operands and does one float32 BLAS matmul: faster, but it rounds differently (the scales are folded into the
values first and the sum order is BLAS's), so it is not bit-exact with the tensor core; the difference is of
the order of float32 rounding of the sum.
"""
from __future__ import annotations

import numpy as np

from ._f32 import add, div, mul
from ._xp import matmul, xp_of
from .formats import E2M1, E4M3
from .layout import unpack_fp4
from .planning import POW2_DEC
from .qtensor import QuantizedTensor
from .schemes import MX, NVFP4, NVFP4UE5M3, BF16Cast, FP8Blockwise, FP8Tensor

__all__ = ["gemm", "MODELS", "model_names", "covers"]

f32 = np.float32
NVFP4_ALPHA_DIV = f32(6.0 * 6.0 * 448.0 * 448.0)
_E2M1_F32 = np.ascontiguousarray(E2M1.values, dtype=np.float32)


def _check(q, name):
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"{name} must be a QuantizedTensor (fp4sim.quantize of a 2-D matrix), not {type(q).__name__}")
    if len(q.shape) != 2:
        raise ValueError(f"{name} holds a tensor of shape {q.shape}; gemm takes 2-D matrices (reshape to (rows, K))")
    return q


def _kind(sch):
    if isinstance(sch, NVFP4):
        return "nvfp4"
    if isinstance(sch, MX):
        return "mxfp4" if sch.elem is E2M1 else f"mx_{sch.elem.name}"
    if isinstance(sch, FP8Blockwise):
        return "fp8_blockwise"
    if isinstance(sch, FP8Tensor):
        return f"fp8_{sch.elem.name}"
    if isinstance(sch, BF16Cast):
        return "bf16"
    if isinstance(sch, NVFP4UE5M3):
        raise ValueError("UE5M3 block-scaled operands have no hardware GEMM to model: multiply their dequantized "
                         "values (fs.dequantize, then a float32 matmul), as fp4sim's emulated training does")
    raise TypeError(f"unsupported scheme {sch!r}")


def fast_operand(q, axis: int | None = None):
    """An operand of ``accumulate="fast"`` (rows, K): the dequantized values as the BLAS takes them, which can
    decide its summation order. Quantized along axis 1: as they lie (C order). Along axis 0: transposed as they
    lie (no copy), where BF16 values (elementwise: no blocks that fix a layout) lie as the tensor was given, in
    the C order of its shape, so that a caller holding the tensor itself hands the BLAS the same layout without a
    transposing copy (the training fast path); the other formats as their codes lie (K last). ``axis``: the
    dot axis of the dequantized matrix where it is not the one ``q`` was quantized along (a reused operand)."""
    from .quantize import dequantize
    v = dequantize(q)
    if (q.axis if axis is None else axis) == 1:
        return v
    if isinstance(q.scheme, BF16Cast):
        v = xp_of(v).ascontiguousarray(v)
    return v.T


def _values(q, xp):
    """Element values (rows, Kp) float32 (codes decoded, no scales)."""
    rows = q.lead[0]
    codes = q.codes.reshape(rows, -1)
    sch = q.scheme
    if isinstance(sch, BF16Cast):
        return (codes.astype(np.uint32) << 16).view(np.float32)
    c = unpack_fp4(codes) if sch.elem is E2M1 else codes
    tab = sch.elem.values if xp is np else xp.asarray(sch.elem.values)
    return tab[c]


def _block_scales(q, xp):
    """Decoded float32 scale per (row, K block)."""
    sch = q.scheme
    if isinstance(sch, NVFP4):
        tab = E4M3.values if xp is np else xp.asarray(E4M3.values)
        return tab[q.scales_per_row()]
    if isinstance(sch, MX):
        tab = POW2_DEC if xp is np else xp.asarray(POW2_DEC)
        return tab[q.linear_scales()]
    rows = q.lead[0]
    s = q.scales.reshape(-(-rows // sch.block[0]), -1)
    return xp.repeat(s, sch.block[0], axis=0)[:rows].astype(np.float32)


GROUPS = (16, 32, 64, 128)
NVFP4_MODELS = ("exact_sum", "k64_rtz", "k64_rne") + tuple(
    f"k{g}_{r}" for g in GROUPS if g != 64 for r in ("rtz", "rne"))
# the tensor-core models of fp4sim.tensorcore: FP8 (per-tensor and blockwise) and BF16 operands
TENSOR_CORE = ("hopper", "hopper_fast_accum", "ada", "ada_fast_accum", "b200", "b200_mma", "ampere")
# AMD's CDNA3 (MI300) matrix cores: per-tensor FP8 FNUZ operands (either mix) and BF16
CDNA3_KINDS = ("fp8_e4m3fnuz", "fp8_e5m2fnuz", "bf16")
MODELS = ("te_reference",) + NVFP4_MODELS + ("tcgen05",) + TENSOR_CORE + ("cdna3",)
_TC_KINDS = ("fp8_e4m3", "fp8_e5m2", "fp8_blockwise", "bf16")
_TCGEN05_KINDS = ("nvfp4", "mxfp4", "mx_e4m3", "mx_e5m2", "mx_e2m3", "mx_e3m2")
_MXF8F6F4 = {"mx_e4m3", "mx_e5m2", "mx_e2m3", "mx_e3m2"}      # kind::mxf8f6f4 takes any pair of these


def covers(accumulate: str, scheme) -> bool:
    """Whether the accumulation model ``accumulate`` applies to operands of ``scheme`` (else a GEMM of that format
    takes its exact rule, as emulated training does)."""
    model = ALIASES.get(accumulate, accumulate)
    if model in ("te_reference", "fast"):
        return True
    try:
        kind = _kind(scheme)
    except (TypeError, ValueError):
        return False
    if model in NVFP4_MODELS:
        return kind == "nvfp4"
    if model == "tcgen05":
        return kind in _TCGEN05_KINDS
    if model == "cdna3":
        return kind in CDNA3_KINDS
    if model in TENSOR_CORE:
        from .tensorcore import get_model
        fam = "bf16" if kind == "bf16" else "fp8"
        return kind in _TC_KINDS and fam in get_model(model.replace("_fast_accum", "")).steps
    return False
ALIASES = {"exact": "te_reference"}
_E2M1_HALF = np.round(np.asarray(E2M1.values, np.float64) * 2).astype(np.int8)      # twice the E2M1 values
_E4M3_512 = np.asarray(E4M3.values, np.float64) * 512                               # 512 x the E4M3 values
_E4M3_NAN = np.isnan(_E4M3_512)
_E4M3_INT = np.where(_E4M3_NAN, 0, _E4M3_512).astype(np.int64)


def model_names() -> tuple:
    """Every name ``accumulate`` takes: the models, their aliases and ``"fast"``."""
    return MODELS + tuple(ALIASES) + ("fast",)


def parse_accumulate(accumulate, grid=None, name="accumulate"):
    """(model, grid) for an ``accumulate`` name (aliases resolved) and ``grid``; ValueError naming the choices."""
    if not isinstance(accumulate, str) or (accumulate not in MODELS and accumulate not in ALIASES
                                            and accumulate != "fast"):
        raise ValueError(f"{name}={accumulate!r}: use one of {', '.join(repr(m) for m in model_names())} "
                         "('exact' is 'te_reference', TE's reference rule; 'fast' one BLAS matmul; 'k64_rtz' the "
                         "native Blackwell NVFP4 model)")
    model = ALIASES.get(accumulate, accumulate)
    if grid is not None:
        if not model.endswith(("_rtz", "_rne")):
            raise ValueError(f"grid={grid!r} applies to the kG_rtz / kG_rne models, not {name}={accumulate!r}")
        if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 1 or grid & (grid - 1):
            raise ValueError(f"grid={grid!r}: a power of two (the accumulator is rounded to multiples of 1/grid; "
                             "the Blackwell model uses 1024), or None")
        grid = int(grid)
    return model, grid


def gemm(qa: QuantizedTensor, qb: QuantizedTensor, accumulate: str = "exact", grid: int | None = None, *,
         backend=None):
    """``A · Bᵀ`` (float32, shape (rows of A, rows of B)) from two quantized matrices; see the module docstring
    for the exact rule of each scheme and the accumulation models (``accumulate``: ``"te_reference"`` /
    ``"exact"``, ``"exact_sum"``, ``"k64_rtz"``, ``"k64_rne"``, the group-width probes, ``"fast"``; ``grid``:
    None or 1024 for the kG models). NumPy or CuPy operands (both on the same side). ``backend``: a CUDA backend
    (:mod:`fp4sim.gpu.backend`) whose kernels run the NVFP4 models — by default CuPy's for CuPy operands and
    Numba's for NumPy ones; the tests pass the host build of the CUDA source."""
    kernels = None
    if backend is not None:
        from .gpu import ops
        kernels = ops.kernels(backend)
    qa, qb = _check(qa, "qa"), _check(qb, "qb")
    model, grid = parse_accumulate(accumulate, grid)
    ka, kb = _kind(qa.scheme), _kind(qb.scheme)
    if ((model in TENSOR_CORE and {ka, kb} <= {"fp8_e4m3", "fp8_e5m2"})
            or (model == "tcgen05" and {ka, kb} <= _MXF8F6F4)   # tensor cores mix E4M3, E5M2 (and FP6 on B200)
            or (model == "cdna3" and {ka, kb} <= {"fp8_e4m3fnuz", "fp8_e5m2fnuz"})):
        kb = ka
    if ka != kb:
        raise ValueError(f"qa is {qa.scheme.name} and qb is {qb.scheme.name}: a block-scaled GEMM takes two operands "
                         "of the same format (quantize both with one scheme family)")
    if qa.K != qb.K:
        raise ValueError(f"the dot-product lengths differ: qa has K={qa.K} (axis {qa.axis} of {qa.shape}), qb has "
                         f"K={qb.K} (axis {qb.axis} of {qb.shape})")
    xp = xp_of(qa.codes, qb.codes)
    if model == "tcgen05" or model in TENSOR_CORE or model == "cdna3":
        return _tensor_core(qa, qb, model, ka, xp, backend)
    if model not in ("te_reference", "fast"):
        if ka != "nvfp4":
            raise ValueError(f"accumulate={accumulate!r} is an NVFP4 accumulation model; {qa.scheme.name} operands "
                             "take 'te_reference' (or 'exact') and 'fast'")
        return _nvfp4_model(qa, qb, model, grid, xp, kernels)
    if accumulate == "fast":
        return matmul(fast_operand(qa), fast_operand(qb).T).astype(np.float32, copy=False)
    if xp is np and ka in ("nvfp4", "mxfp4"):
        y = _e2m1_exact_cpu(qa, qb, 16 if ka == "nvfp4" else 32)
        return _nvfp4_alpha(qa, qb, xp) * y if ka == "nvfp4" else y
    return _blockwise(qa, qb, ka, xp)


def _tensor_core(qa, qb, model, kind, xp, backend=None):
    """The hardware models of fp4sim.tensorcore (its docstring): ``tcgen05`` for NVFP4 / MXFP4 / MXFP8 / MXFP6, the chip
    models for FP8 (per-tensor: cuBLAS's K walk then RN32(acc · fl(s_a · s_b)); blockwise: each 128-element
    block's chain from +0 promoted to float32 as the exact rule does) and BF16 (one chain over K)."""
    from . import tensorcore as tc
    if xp is not np:
        raise ValueError(f"accumulate={model!r} takes NumPy operands (cupy.asnumpy / .get()); backend= runs its "
                         "kernels on a CUDA backend")
    if model == "tcgen05":
        if kind not in _TCGEN05_KINDS:
            raise ValueError(f"accumulate='tcgen05' models Blackwell's block-scaled instructions: NVFP4, MXFP4, "
                             f"MXFP8 and MXFP6 operands, not {qa.scheme.name}")
        va, vb = _values(qa, np), _values(qb, np)
        sa, sb = _block_scales(qa, np), _block_scales(qb, np)
        if kind == "nvfp4":
            c = tc.tcgen05_fp4(va, sa, vb, sb, 16, "ue4m3", backend)
            with np.errstate(over="ignore", invalid="ignore"):
                return _nvfp4_alpha(qa, qb, np) * c
        if kind == "mxfp4":
            return tc.tcgen05_fp4(va, sa, vb, sb, 32, "ue8m0", backend)
        return tc.tcgen05_fp8(va, qa.scheme.elem.name, sa, vb, qb.scheme.elem.name, sb, backend)
    if model == "cdna3":
        if kind not in CDNA3_KINDS:
            raise ValueError(f"accumulate='cdna3' models AMD's CDNA3 (MI300) matrix cores for FP8 FNUZ "
                             f"(fp8_e4m3fnuz / fp8_e5m2fnuz) and BF16 operands, not {qa.scheme.name}")
        va, vb = _values(qa, np), _values(qb, np)
        if kind == "bf16":
            return tc.mfma(va, vb, "bf16", "bf16")
        acc = tc.mfma(va, vb, qa.scheme.elem.name, qb.scheme.elem.name)
        return _per_tensor_epilogue(acc, qa, qb)
    name = model.replace("_fast_accum", "")
    if kind not in _TC_KINDS or not covers(model, qa.scheme):
        have = "FP8 and BF16" if "fp8" in tc.get_model(name).steps else "BF16"
        raise ValueError(f"accumulate={model!r} models {tc.get_model(name).chip}'s tensor cores for {have} "
                         f"operands, not {qa.scheme.name} (NVFP4 takes 'te_reference', 'k64_rtz' or 'tcgen05')")
    va, vb = _values(qa, np), _values(qb, np)
    if kind == "bf16":
        if model.endswith("_fast_accum"):
            raise ValueError(f"accumulate={model!r}: fast accumulation is an FP8 setting; BF16 GEMMs chain "
                             f"through the whole K: use {name!r}")
        return tc.accumulate(va, vb, "bf16", "bf16", name, "bf16", fast=True, backend=backend)
    fa, fb = qa.scheme.elem.name, qb.scheme.elem.name
    if kind == "fp8_blockwise":
        step = tc.get_model(name).step("fp8")
        Kp = -(-qa.K // 128) * 128
        va, vb = _pad(va, Kp, np), _pad(vb, Kp, np)
        sa, sb = _block_scales(qa, np), _block_scales(qb, np)
        y = np.zeros((va.shape[0], vb.shape[0]), np.float32)
        parts = tc.chain_runs(va, vb, fa, fb, step, [np.arange(j, j + 128) for j in range(0, Kp, 128)], backend)
        with np.errstate(over="ignore", invalid="ignore"):
            for j in range(Kp // 128):
                y += (sa[:, j, None] * sb[None, :, j]) * parts[j]
        return y
    fast = model.endswith("_fast_accum") or tc.get_model(name).slow_chunk is None     # b200_mma: one chain
    acc = tc.accumulate(va, vb, fa, fb, name, "fp8", fast=fast, backend=backend)
    return _per_tensor_epilogue(acc, qa, qb)


def _per_tensor_epilogue(acc, qa, qb):
    """RN32(acc · fl(s_a · s_b)) of two per-tensor scaled operands (an exact zero is +0)."""
    sab = f32(f32(float(qa.scales.reshape(-1)[0])) * f32(float(qb.scales.reshape(-1)[0])))
    with np.errstate(over="ignore", invalid="ignore"):
        return (acc.astype(np.float64) * np.float64(sab) + 0.0).astype(np.float32)


def _lattice(q, xp):
    """An NVFP4 operand on the integer lattice: (twice the E2M1 values (rows, Kp) int8, 512 x the block scales
    (rows, Kp/16) int64, rows whose scales hold a NaN (bool))."""
    rows = q.lead[0]
    sb = q.scales_per_row()
    nblk = sb.shape[1]
    tab = _E2M1_HALF if xp is np else xp.asarray(_E2M1_HALF)
    v = tab[unpack_fp4(q.codes.reshape(rows, -1))]
    if v.shape[1] != nblk * 16:                      # codes narrower than the blocks: zero elements
        w = xp.zeros((v.shape[0], nblk * 16), np.int8)
        n = min(v.shape[1], nblk * 16)
        w[:, :n] = v[:, :n]
        v = w
    ti, tn = (_E4M3_INT, _E4M3_NAN) if xp is np else (xp.asarray(_E4M3_INT), xp.asarray(_E4M3_NAN))
    return xp.ascontiguousarray(v), xp.ascontiguousarray(ti[sb]), tn[sb].any(axis=1)


def _nvfp4_model(qa, qb, model, grid, xp, kernels=None):
    """exact_sum / kG_rne / kG_rtz (module docstring): the accumulator from the integer-lattice kernels (Numba on
    the CPU, CUDA for CuPy operands or the given kernels), then NaN rows / columns, then alpha."""
    from . import ids
    A, SA, na = _lattice(qa, xp)
    B, SB, nb_ = _lattice(qb, xp)
    if A.shape[1] != B.shape[1]:
        raise ValueError(f"qa and qb have {A.shape[1]} and {B.shape[1]} padded K elements")
    if A.shape[1] >= 1 << 20 and model == "exact_sum":
        raise ValueError(f"K={qa.K}: exact_sum holds the dot product in an int64 on the 2^-20 lattice, which "
                         "needs K < 2^20")
    if model == "exact_sum":
        mode, group = ids.ACC_EXACT, 16
    else:
        g, r = model[1:].split("_")
        mode, group = (ids.ACC_RTZ if r == "rtz" else ids.ACC_RNE), int(g)
    if kernels is None and xp is np:
        from .cpu.gemm_models import nvfp4_models
        c = nvfp4_models(A, B, SA, SB, group, mode, grid or 0)
    else:
        if kernels is None:
            from .gpu import ops
            kernels = ops.kernels(ops.backend())
        c = kernels.nvfp4_gemm_models(A, B, SA, SB, group, mode, grid or 0)
    if bool(na.any()) or bool(nb_.any()):
        c[na, :] = np.nan
        c[:, nb_] = np.nan
    return mul(_nvfp4_alpha(qa, qb, xp), c)


def _blockwise(qa, qb, ka, xp):
    """The exact rule as one matmul per K block on the whole operands (CuPy, the FP8 schemes, BF16; on the CPU the
    tests compare the NVFP4 / MXFP4 kernels with it)."""
    va, vb = _values(qa, xp), _values(qb, xp)
    M, N = va.shape[0], vb.shape[0]
    if ka == "bf16":
        return (va.astype(np.float64) @ vb.astype(np.float64).T).astype(np.float32)
    if ka == "nvfp4" or ka == "mxfp4":
        bk = 16 if ka == "nvfp4" else 32
        exact_dot = True
    elif ka.startswith("mx_"):
        bk, exact_dot = 32, False
    else:
        bk, exact_dot = 128, False
    Kp = -(-qa.K // bk) * bk
    va, vb = _pad(va, Kp, xp), _pad(vb, Kp, xp)
    per_tensor = ka in ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")
    sa = sb = None
    if not per_tensor:
        sa, sb = _block_scales(qa, xp), _block_scales(qb, xp)
    y = xp.zeros((M, N), np.float32)
    nb = Kp // bk
    # E4M3 x E4M3: a block's float64 sum is exact in any order (products of 8 significant bits between 2^-18
    # and 2^17.6, at most 128 of them: 43 bits), so the blocks' dots can come from batched matmuls, a group of
    # blocks at a time (at most about 32 MiB of float64 dots)
    batched = (not exact_dot and xp is np and qa.scheme.elem is E4M3 and qb.scheme.elem is E4M3 and M and N)
    group = max(1, min(nb, (32 << 20) // (8 * M * N))) if batched else 1
    with np.errstate(over="ignore", invalid="ignore"):    # inf / NaN from scale products: the rule's result
        for j in range(nb):
            if batched:
                if j % group == 0:
                    g1 = min(nb, j + group)
                    A3 = va[:, j * bk:g1 * bk].reshape(M, g1 - j, bk).transpose(1, 0, 2).astype(np.float64)
                    B3 = vb[:, j * bk:g1 * bk].reshape(N, g1 - j, bk).transpose(1, 2, 0).astype(np.float64)
                    dots = matmul(A3, B3).astype(np.float32)
                dot = dots[j % group]
            else:
                a, b = va[:, j * bk:(j + 1) * bk], vb[:, j * bk:(j + 1) * bk]
                if exact_dot:
                    dot = matmul(a, b.T)                      # exact: dyadic partial sums below 2^11
                else:
                    dot = matmul(a.astype(np.float64), b.astype(np.float64).T).astype(np.float32)
            if per_tensor:
                y += dot
            else:
                y = add(y, mul(mul(sa[:, j, None], sb[None, :, j]), dot))  # fl(fl(s_a * s_b) * dot), fl(y + .)
    if per_tensor:
        sab = f32(f32(float(qa.scales.reshape(-1)[0])) * f32(float(qb.scales.reshape(-1)[0])))
        y = mul(y, sab)
    elif ka == "nvfp4":
        y = mul(_nvfp4_alpha(qa, qb, xp), y)
    return y


def _e2m1_exact_cpu(qa, qb, bk):
    """The NVFP4 / MXFP4 rule above (before alpha) by the Numba kernels of ``fp4sim.cpu.gemm``: the same float32
    operations in the same order as :func:`_blockwise`, without a BLAS call and an (M, N)
    temporary per K block."""
    from .cpu.gemm import e2m1_gemm_exact
    ca, cb = qa.codes.reshape(qa.lead[0], -1), qb.codes.reshape(qb.lead[0], -1)
    return e2m1_gemm_exact(ca, _block_scales(qa, np), cb, _block_scales(qb, np), bk, _E2M1_F32)


def _second_level(q, xp, side):
    """The operand's second-level factor as a float32 column (side 0) or row (side 1) vector, or a scalar."""
    sch = q.scheme
    g = q.global_amax
    if g is None:                                 # torchao without a tensor scale
        v = np.ones(1, np.float32)
    else:
        v = np.asarray(g.get() if hasattr(g, "get") else g, np.float32).reshape(-1)
    if sch.flavor not in ("te", "paper") and g is not None:
        v = (v / f32(2688.0)).astype(np.float32)      # torchao / modelopt decode with pts = amax / 2688
    v = xp.asarray(v) if xp is not np else v
    if v.shape[0] == 1:
        return v.reshape(1, 1)
    return v.reshape(-1, 1) if side == 0 else v.reshape(1, -1)


def _nvfp4_alpha(qa, qb, xp):
    """te/paper: fl(fl(amax_a * amax_b) / (6*6*448*448)) (per output row / column for row-scaled operands, as TE's
    qgemm); torchao/modelopt: fl(pts_a * pts_b), the product of their per-tensor decode scales."""
    a, b = _second_level(qa, xp, 0), _second_level(qb, xp, 1)
    with np.errstate(over="ignore"):
        if qa.scheme.flavor in ("te", "paper") and qb.scheme.flavor in ("te", "paper"):
            div_ = NVFP4_ALPHA_DIV if qa.scheme.e4m3_max == qb.scheme.e4m3_max == 448 else \
                f32(36.0 * qa.scheme.e4m3_max * qb.scheme.e4m3_max)      # 4over6 with an E4M3 max of 256
            return div(mul(a, b), div_)
        return mul(a, b)


def _pad(v, Kp, xp):
    if v.shape[1] == Kp:
        return xp.ascontiguousarray(v)
    out = xp.zeros((v.shape[0], Kp), np.float32)
    out[:, : v.shape[1]] = v[:, :Kp]
    return out
