"""The planning layer: every public entry point checks its arguments and plans its call here, once, for any
array module; then it calls the small set of kernel entry points that both backends implement.

A backend ("kernels" object) provides::

    xp                                   the array module (numpy or cupy)
    as_float32(x, order="C")             x as a C-contiguous (order="K": any layout) float32 array of that
                                         module (or a clear error)
    sr_bytes(sr, shape)                  the per-element random bytes of an SRPlan, in ``shape``
    philox_in_kernel                     True where nvfp4 / mx take a :class:`PhiloxRows` for ``rb``: Philox
                                         bits generated inside the kernel, no tensor-sized byte array
    moved_rows(a, axis)                  optional: ``a``'s (R, K) rows along ``axis``, as an array or an
                                         object the kernels below read them from in place (the CPU gathers a
                                         chunk of rows at a time, the GPU reads strided; x2 of absmax,
                                         row_absmax, nvfp4, mx, and on the CPU rb)
    encode(xs, fmt, mode, sat, nsr, sr)  element codes of a float32 array
    absmax(x2)                           (max |x| with NaN ignored as float32, whether a NaN was seen)
    absmax_blocks(x2)                    optional (CPU): absmax's pair, an NVFP4 code array holding each
                                         16-element block's amax for nvfp4's ``codes=`` and row_absmax's
                                         vector (both None where it cannot): one pass fewer
    row_absmax(x2)                       max |x| of each row, NaN ignored, as a host float32 vector
    nvfp4_4over6(x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4) -> codes, scales, map-to-4 per block
    nvfp4(x2, rb, use_rb, mode, nsr, flavor, tile, c0, c1, dq, fake[, codes]) -> codes, scales, fake_values
        (c0, c1: float32 vectors, dq: (n, 2); n = 1, or one per row for row-scaled NVFP4)
    mx(x2, rb, use_rb, mode, nsr, scale_mode, fmt, fake)        -> codes, scales, fake_values, amax
        (amax: absmax's pair where the backend reduced it in the same pass, else None: absmax then runs)
    fp8(x2, rb, use_rb, mode, nsr, fmt, tile, scale, fake)              -> codes, scales, fake_values
        (scale None: blockwise, tile x 128 blocks, float32 scales; else per-tensor with that scale)
    dequantize(q, dq: DequantPlan)       float32 (rows, K) values
    rht(x2, d, sh, scale, to_bf16)       the transform of every d-long chunk of each row

A backend with ``amax_on_device`` (the GPU's) quantizes NVFP4 (one second-level amax), MX and FP8 through
:func:`_quantize_on_device` instead, which reads nothing back: ``absmax_device(x2[, rht])`` (the amax bits and a
NaN flag, left on the device), ``nvfp4_tensor_constants(acc, flavor)``, ``nvfp4(..., cst=, rht=, flags=)`` (with a
given second-level amax, the input's NaN / Inf flags set by the kernel itself, no amax pass), ``mx`` returning
its NaN / Inf flags where the others return an amax, ``fp8(..., amax_dev=)``, ``defer_warnings`` (the warnings read
once the values reach the host), ``as_block_input`` (16-bit inputs kept as they are) and ``rht_operand`` (an RHT
fused into NVFP4's kernels, :func:`run_quantize`'s ``pre_rht``).

``fp4sim.cpu.backend.CpuKernels`` implements it with Numba, ``fp4sim.gpu.ops.GpuKernels`` with the CUDA
kernels (on a GPU through CuPy, or compiled for the host in the tests). The ids the kernels take (rounding
modes, flavours, scale modes) are those of :mod:`fp4sim.ids`.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from . import _inputs, ids
from ._xp import xp_of
from .formats import E2M1, Format, get_format
from .hadamard import check_d, hadamard_matrix, rht_signs
from .qtensor import QuantizedTensor
from .schemes import MX, NVFP4, BF16Cast, FP8Blockwise, FP8Tensor, get_scheme

f32 = np.float32
FLT_MAX = f32(np.finfo(np.float32).max)
ROUNDINGS = ("rne", "rz", "ru", "rp", "rd", "sr")
C2688 = f32(2688.0)
INV2688 = f32(1.0) / C2688
R6 = f32(1.0) / f32(6.0)
as_float32 = _inputs.as_float32  # NumPy inputs: any float dtype fp4sim takes -> C-contiguous float32
POW2_ENC = np.array([2.0 ** (127 - e) for e in range(255)] + [np.nan], dtype=np.float32)  # 1 / 2^(e - 127)
POW2_DEC = np.array([2.0 ** (e - 127) for e in range(255)] + [np.nan], dtype=np.float32)


# ------------------------------------------------------------------------------------------------ elements
def kernel_params(fmt: Format) -> tuple:
    """The integer description of a format that the encode kernels take."""
    if fmt.has_inf:
        nosat = fmt.inf_code
    elif fmt.nan_code is not None:
        nosat = fmt.nan_code
    else:
        nosat = fmt.max_code
    nan = fmt.nan_code if fmt.nan_code is not None else fmt.max_code
    sign = -fmt.sign_mask if fmt.twos_complement else fmt.sign_mask   # (how encode_one writes a sign)
    return (fmt.mbits, fmt.emin, fmt.bias, fmt.max_code, nosat, nan, sign)


@dataclass(frozen=True)
class SRPlan:
    """Where stochastic-rounding bits come from: ``kind`` is ids.SR_NONE, SR_GIVEN (``per``: one byte per
    element, flat C order of the input) or SR_PHILOX (``seed``, ``stream``); ``nsr`` random bits."""
    kind: int
    nsr: int = 8
    per: object = None
    seed: int | None = None
    stream: int = 0
    midpoint: bool = False

    @property
    def kernel_nsr(self) -> int:
        """The bit count the kernels take: ``nsr``, plus ids.SR_MIDPOINT for the midpoint rule."""
        return self.nsr + (ids.SR_MIDPOINT if self.midpoint else 0)


@dataclass(frozen=True)
class PhiloxRows:
    """Seeded stochastic-rounding bits that a kernel generates itself for its (R, K) rows (SPEC §1.3's mapping of
    the original flat index): ``layout`` 1 when row r, element k is flat index r*K + k (the block axis is last,
    or only size-1 axes follow it); 2 when the block axis has stride ``stride`` (a multiple of 16) in the
    original C order, so 16 consecutive rows share each Philox call. ``mask`` keeps the low ``nsr`` bits."""
    layout: int
    k0: int
    k1: int
    stream: int
    mask: int
    stride: int


def philox_rows(sr: SRPlan, shape, axis: int):
    """The :class:`PhiloxRows` of a seeded plan for an input of ``shape`` blocked along ``axis``, or None when
    the block axis's stride is not 1 or a multiple of 16 (then the byte array is generated and moved)."""
    if sr.kind != ids.SR_PHILOX:
        return None
    layout, stride = philox_layout(shape, axis)
    if layout is None:
        return None
    from .rng import seed_key
    k0, k1 = seed_key(sr.seed)
    return PhiloxRows(layout, k0, k1, sr.stream, (1 << sr.nsr) - 1, stride)


def philox_layout(shape, axis: int):
    """(layout, stride) of the in-kernel Philox bits of an input of ``shape`` blocked along ``axis``: layout 1
    (the block axis's stride is 1), 2 (a multiple of 16) or None (not generated in the kernel)."""
    stride = math.prod(shape[axis + 1:])
    return (1 if stride == 1 else (2 if stride % 16 == 0 else None)), stride


def plan_sr(n: int, shape, rounding: str, rbits, seed, sr_bits, stream, rbits_mapping) -> SRPlan:
    nsr = _inputs.check_int(sr_bits, "sr_bits", 1, 8)
    stream = _inputs.check_int(stream, "stream", 0, 0xFFFFFFFF)
    kind, per = _inputs.sr_bytes(n, shape, rounding, rbits, seed, nsr, rbits_mapping)
    if kind == ids.SR_PHILOX:
        from .rng import seed_key
        seed_key(seed)  # checks the seed
    return SRPlan(kind, nsr, per, seed, stream, kind != ids.SR_NONE and rbits_mapping == "midpoint")


@dataclass(frozen=True)
class ElementPlan:
    fmt: Format
    mode: int
    sat: bool
    sr: SRPlan


def plan_encode(shape, size, fmt, rounding, saturate, rbits, seed, sr_bits, stream, rbits_mapping) -> ElementPlan:
    fmt = get_format(fmt)
    rounding = _inputs.check_choice(rounding, "rounding", ROUNDINGS)
    if not isinstance(saturate, (bool, np.bool_)):
        raise TypeError(f"saturate must be True or False, not {type(saturate).__name__}")
    mode = ids.MODES[rounding]
    if fmt.name == "ue8m0":
        if mode == ids.SR:
            raise ValueError("rounding='sr' is not defined for UE8M0 scales; use 'rz', 'rp'/'ru' or 'rne'")
        if mode == ids.RD:
            mode = ids.RZ  # UE8M0 ignores the sign, so rounding down is rounding toward zero
    if mode == ids.SR and not saturate and not fmt.always_saturates:
        raise ValueError("saturate=False is not defined with rounding='sr': stochastic rounding is satfinite "
                         "(as the hardware cvt.rs instruction); use saturate=True")
    sr = plan_sr(size, shape, rounding, rbits, seed, sr_bits, stream, rbits_mapping)
    return ElementPlan(fmt, mode, bool(saturate), sr)


def run_encode(kern, x, fmt, rounding="rne", saturate=True, rbits=None, seed=None, sr_bits=8, stream=0,
               rbits_mapping="te"):
    """:func:`fp4sim.encode` on the backend ``kern``."""
    fmt = get_format(fmt)
    xs = kern.as_float32(x)
    p = plan_encode(xs.shape, xs.size, fmt, rounding, saturate, rbits, seed, sr_bits, stream, rbits_mapping)
    return kern.encode(xs, p.fmt, p.mode, p.sat, p.sr.kernel_nsr, p.sr)


# ------------------------------------------------------------------------------------------------ block schemes
def check_global_amax(global_amax):
    if global_amax is None:
        return None
    if isinstance(global_amax, (str, bytes)) or isinstance(global_amax, bool):
        raise TypeError(f"global_amax must be a number, not {type(global_amax).__name__}")
    try:
        arr = np.asarray(global_amax, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"global_amax must be a number, not {type(global_amax).__name__}") from None
    if arr.size != 1:
        raise ValueError(f"global_amax must be one number (the tensor's |x| max), not an array of {arr.size}")
    g = f32(arr.reshape(-1)[0])
    if np.isnan(g) or g < 0:
        raise ValueError(f"global_amax={float(g)!r} must be a non-negative number (the tensor's |x| max)")
    return g


def nvfp4_constants_rows(flavor: str, amax, per_tensor_scale: bool = True, e4m3_max: int = 448):
    """The constants of :func:`nvfp4_constants` for a vector of second-level amaxes (one per row of a
    row-scaled tensor, or one): arrays ``c0``, ``c1`` (float32, shape (n,)) and ``dq`` (float32, (n, 2)).
    ``per_tensor_scale=False`` (torchao without a tensor scale): the per-tensor scale is exactly 1.
    ``e4m3_max=256`` (4over6's option): the dequantize constant is fl(1/(6·256)) instead of fl(1/2688)."""
    a = np.asarray(amax, np.float32).reshape(-1)
    inv = INV2688 if e4m3_max == 448 else f32(1.0) / f32(f32(6.0) * f32(e4m3_max))
    if a.size == 1 and flavor in ("te", "paper"):
        return _te_constants_one(a, flavor, inv, e4m3_max)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if flavor in ("te", "paper"):
            num = C2688 if e4m3_max == 448 else f32(f32(6.0) * f32(e4m3_max))
            s_enc = np.where(a == 0, f32(1.0), np.minimum(num / a, FLT_MAX)).astype(np.float32)
            s_enc = np.where(s_enc == 0, f32(1.0), s_enc).astype(np.float32)
            s_dec = (f32(1.0) / s_enc).astype(np.float32)
            c0 = (s_enc * R6).astype(np.float32) if flavor == "te" else s_enc
            dq = np.stack([a, np.full(a.shape, inv, np.float32)], axis=1)
            return c0, s_dec, dq.astype(np.float32)
        pts = (a / C2688).astype(np.float32) if per_tensor_scale else np.ones(a.shape, np.float32)
        if flavor == "torchao":
            c0, c1 = pts, (f32(1.0) / pts).astype(np.float32)
        else:
            c0, c1 = (f32(6.0) * pts).astype(np.float32), pts  # modelopt: wsf2 = pts
        return c0, c1, np.stack([pts, np.zeros(a.shape, np.float32)], axis=1).astype(np.float32)


def _te_constants_one(a, flavor, inv, e4m3_max):
    """:func:`nvfp4_constants_rows` for one te / paper amax with Python float arithmetic (a quantize call's
    planning cost, not its result): a float32 quotient or product computed in float64 and rounded once to
    float32 is the float32 operation's result (53 >= 2 * 24 + 2 bits; the products are exact in float64)."""
    v = float(a[0])
    num = 2688.0 if e4m3_max == 448 else float(f32(f32(6.0) * f32(e4m3_max)))
    if v != v:
        s = f32(v)                                     # the NaN itself, quieted, as num / a propagates it
    elif v == 0.0 or v == float("inf"):                # num / inf = 0: both give the encode scale 1
        s = f32(1.0)
    else:
        q = num / v                                    # no float64 overflow: v >= 2^-149
        s = FLT_MAX if q > float(FLT_MAX) else f32(q)  # and never 0: q >= num / FLT_MAX
    s_dec = f32(1.0 / float(s))
    c0 = f32(float(s) * float(R6)) if flavor == "te" else s
    return (np.array([c0], np.float32), np.array([s_dec], np.float32),
            np.array([[a[0], inv]], np.float32))


def nvfp4_constants(flavor: str, amax_g, per_tensor_scale: bool = True):
    """Per-tensor float32 constants ``(c0, c1)`` a flavour's kernel takes, and its dequantize constants ``dq``."""
    c0, c1, dq = nvfp4_constants_rows(flavor, [amax_g], per_tensor_scale)
    return (c0[0], c1[0]), dq[0]


# Above this tensor amax the te/paper decode factor fl(s * amax_g) overflows float32 for the largest scale byte.
NVFP4_DEQUANT_AMAX_LIMIT = float(FLT_MAX) / 448.0


def fp8_tensor_scale(fmt, amax):
    """FP8 current scaling: fl(max / amax), 1 when amax is 0 or not finite, at most FLT_MAX."""
    with np.errstate(divide="ignore", over="ignore"):
        scale = f32(fmt.max) / amax if (amax > 0 and np.isfinite(amax)) else f32(1.0)
    return f32(min(scale, FLT_MAX))


def nan_into_no_nan(fmt: Format) -> str:
    """The warning for a NaN quantized into elements that have none (E2M1, FP6, INT8)."""
    return (f"NaN in the input: {fmt.name.upper()} has no NaN, so it encodes as +{fmt.max:g} (CUDA's satfinite "
            f"rule, code {fmt.max_code:#x}) and leaves the tensor as a finite value; find where it came from "
            "(fp4sim.validate and the torch bridge's on_nonfinite='raise' stop at it)")


NAN_E2M1 = nan_into_no_nan(E2M1)
NAN_NO_NAN_RE = r"NaN in the input: \w+ has no NaN, so it encodes"     # (matches every such warning)


def warn_specials(sch, amax_g, has_nan, has_inf, stacklevel=4):
    if has_nan and isinstance(sch, (NVFP4, MX)) and sch.elem.always_saturates:
        warnings.warn(nan_into_no_nan(sch.elem), RuntimeWarning, stacklevel)
    if isinstance(sch, NVFP4):
        if not np.isfinite(amax_g):
            warnings.warn("the tensor (or global_amax) is not finite: NVFP4 encodes with S_enc = 1 but "
                          "dequantizes to Inf/NaN, as TransformerEngine's kernels do", RuntimeWarning, stacklevel)
        elif sch.flavor in ("te", "paper") and amax_g > NVFP4_DEQUANT_AMAX_LIMIT:
            warnings.warn(f"tensor amax {float(amax_g):.4g} exceeds FLT_MAX/448 = {NVFP4_DEQUANT_AMAX_LIMIT:.4g}: "
                          "the codes and scale bytes are exact, but dequantizing blocks with large scale bytes "
                          "overflows float32 (fl(s * amax) = Inf) and gives Inf/NaN, as TE's kernels would",
                          RuntimeWarning, stacklevel)
        if sch.flavor in ("torchao", "modelopt") and amax_g == 0:
            warnings.warn(f"all-zero tensor under the {sch.flavor} flavour: its per-tensor scale is 0, so the "
                          "scales are NaN (0xFF) as the library itself produces", RuntimeWarning, stacklevel)
        if sch.flavor == "torchao" and (has_nan or has_inf):
            warnings.warn("torchao's output for NaN/Inf elements depends on NaN payloads; fp4sim follows the "
                          "te flavour's semantics for them", RuntimeWarning, stacklevel)
    elif isinstance(sch, MX) and has_inf:
        warnings.warn("an Inf inside an MX block: its scale comes from Inf's exponent field (floor/ceil/even) "
                      "or saturates (rceil); the block's finite elements flush toward 0", RuntimeWarning, stacklevel)


@dataclass(frozen=True)
class QuantPlan:
    """A checked block-scaled call: the scheme, the input viewed as (R, K) rows with the block axis last."""
    scheme: object
    axis: int
    shape: tuple
    K: int
    R: int
    lead: tuple
    rounding: str
    mode: int
    sr: SRPlan
    global_amax: object
    scale_layout: str
    fake: bool

    def to2d(self, kern, a):
        """``a`` as (R, K) rows, C-contiguous with the block axis last (the backend's ``axis_last`` copy)."""
        return kern.axis_last(a, self.axis).reshape(-1, self.K)

    def back(self, xp, y2):
        """A (R, K) result in the input's original layout."""
        return xp.moveaxis(y2.reshape(self.lead + (self.K,)), -1, self.axis)


def plan_quantize(shape, scheme, axis=-1, rounding="rne", flavor=None, block=None, scale_mode=None,
                  global_amax=None, rbits=None, seed=None, stream=0, sr_bits=8, rbits_mapping="te",
                  scale_layout="linear", fake=False, row_scaled=None, per_tensor_scale=None) -> QuantPlan:
    sch = get_scheme(scheme, flavor=flavor, block=block, scale_mode=scale_mode, row_scaled=row_scaled,
                     per_tensor_scale=per_tensor_scale)
    scale_layout = _inputs.check_choice(scale_layout, "scale_layout", ("linear", "swizzled"))
    if scale_layout == "swizzled" and not isinstance(sch, (NVFP4, MX)):
        raise ValueError(f"scale_layout='swizzled' applies to NVFP4 and MX schemes, not {sch.name!r}")
    shape = tuple(int(s) for s in shape)
    ax = _inputs.check_axis(axis, len(shape), "a block-scaled scheme")
    K = shape[ax]
    if K == 0:
        raise ValueError(f"axis {axis} of x has length 0: there is nothing to quantize along it")
    size = math.prod(shape)
    if size == 0:
        raise ValueError(f"x has shape {shape} with no elements; nothing to quantize")
    rounding = _inputs.check_choice(rounding, "rounding", ROUNDINGS)
    sr = plan_sr(size, shape, rounding, rbits, seed, sr_bits, stream, rbits_mapping)
    R = size // K
    if isinstance(sch, NVFP4) and sch.row_scaled:
        g = None if global_amax is None else _row_amaxes(global_amax, R)
    else:
        g = check_global_amax(global_amax)
    if g is not None and not isinstance(sch, (NVFP4, FP8Tensor)):
        raise ValueError(f"global_amax applies to NVFP4 and FP8 per-tensor schemes only, not {sch.name!r}")
    if g is not None and isinstance(sch, NVFP4) and not sch.per_tensor_scale:
        raise ValueError("global_amax sets the FP32 tensor scale, which per_tensor_scale=False does not have")
    lead = tuple(s for i, s in enumerate(shape) if i != ax)
    return QuantPlan(sch, ax, shape, K, R, lead, rounding, ids.MODES[rounding], sr, g, scale_layout, bool(fake))


def _row_amaxes(global_amax, R):
    """A row-scaled tensor's second-level amaxes: one non-negative number per row (rows = all axes but the
    block axis, flattened in order)."""
    try:
        a = np.asarray(global_amax.get() if hasattr(global_amax, "get") else global_amax, dtype=np.float32)
    except (TypeError, ValueError):
        raise TypeError(f"global_amax must be an array of numbers, not {type(global_amax).__name__}") from None
    a = a.reshape(-1)
    if a.size != R:
        raise ValueError(f"row_scaled NVFP4 takes one global amax per row: {R} values, not {a.size}")
    if np.isnan(a).any() or (a < 0).any():
        raise ValueError("global_amax for a row-scaled tensor must hold non-negative numbers (each row's |x| max)")
    return a


def finish(sch, codes, scales, gamax, lead, axis, shape, scale_layout, extras=None) -> QuantizedTensor:
    """Wrap kernel outputs (2-D codes and scales) into a QuantizedTensor in the documented shapes/layout
    (NumPy or CuPy arrays alike)."""
    R = codes.shape[0]
    codes = codes.reshape(tuple(lead) + (codes.shape[-1],))
    if isinstance(sch, (NVFP4, MX)):
        if scale_layout == "swizzled":
            from .layout import swizzle_scales
            s2 = scales if sch.block[0] == 1 else xp_of(scales).repeat(scales, sch.block[0], axis=0)[:R]
            scales = swizzle_scales(s2)
        elif sch.block[0] == 1:
            scales = scales.reshape(tuple(lead) + (scales.shape[-1],))
    elif isinstance(sch, FP8Blockwise) and sch.block[0] == 1:
        scales = scales.reshape(tuple(lead) + (scales.shape[-1],))
    return QuantizedTensor(codes, scales, gamax, sch, axis, shape, scale_layout, extras or {})


def run_quantize(kern, x, scheme="nvfp4", axis=-1, rounding="rne", flavor=None, block=None, scale_mode=None,
                 global_amax=None, rbits=None, seed=None, stream=0, sr_bits=8, rbits_mapping="te",
                 scale_layout="linear", fake=False, return_intermediates=False, row_scaled=None,
                 per_tensor_scale=None, pre_rht=None):
    """:func:`fp4sim.quantize` (or ``fake_quantize`` with ``fake=True``) on the backend ``kern``. ``pre_rht``: (d,
    signs, out) of an RHT along ``axis`` first (:func:`fp4sim.quantize.rht_quantize`), run inside the NVFP4
    kernels where the backend can (the GPU, d = 16), else as :func:`run_rht` before the quantize."""
    # to2d copies once, with the block axis last; the GPU's block kernels read 16-bit inputs as they are
    xs = kern.as_block_input(x) if hasattr(kern, "as_block_input") else kern.as_float32(x, order="K")
    p = plan_quantize(xs.shape, scheme, axis, rounding, flavor, block, scale_mode, global_amax, rbits, seed,
                      stream, sr_bits, rbits_mapping, scale_layout, fake, row_scaled, per_tensor_scale)
    fused_rht = None
    if pre_rht is not None:
        d, signs, rht_out = pre_rht
        _, _, sh, to_bf16 = rht_args(xs, d, signs, p.axis, rht_out)
        sch = p.scheme
        if (getattr(kern, "amax_on_device", False) and d == 16 and isinstance(sch, NVFP4) and not sch.row_scaled
                and not sch.four_over_six and not return_intermediates):
            fused_rht = kern.rht_operand(sh, math.sqrt(1.0 / d), to_bf16)
        else:
            xs = kern.as_float32(run_rht(kern, xs, d, signs, p.axis, rht_out, memory="axis_last"), order="K")
    xp, sch = kern.xp, p.scheme
    # The CPU kernels read an input blocked along another axis than the last a chunk of rows at a time
    # (kern.moved_rows): no tensor-sized moved copy. 4over6 and the FP8 / BF16 schemes take the copy.
    rows = (kern.moved_rows if hasattr(kern, "moved_rows") and isinstance(sch, (NVFP4, MX))
            and not getattr(sch, "four_over_six", None) else lambda a, ax: p.to2d(kern, a))
    x2 = rows(xs, p.axis)
    use_rb = p.sr.kind != ids.SR_NONE
    rb = (philox_rows(p.sr, xs.shape, p.axis) if use_rb and getattr(kern, "philox_in_kernel", False)
          and isinstance(sch, (NVFP4, MX)) else None)
    if rb is None:
        rb = rows(kern.sr_bytes(p.sr, xs.shape), p.axis) if use_rb else xp.zeros((1, 1), np.uint8)
    if isinstance(sch, BF16Cast):
        srp = SRPlan(ids.SR_GIVEN, p.sr.nsr, rb.reshape(-1), midpoint=p.sr.midpoint) if use_rb else p.sr
        codes = kern.encode(x2, sch.elem, p.mode, p.rounding == "sr", p.sr.kernel_nsr, srp)
        if fake:
            return p.back(xp, (codes.astype(np.uint32) << 16).view(np.float32))
        return QuantizedTensor(codes.reshape(p.lead + (p.K,)), None, None, sch, p.axis, p.shape)
    if getattr(kern, "amax_on_device", False) and not (return_intermediates and isinstance(sch, NVFP4)):
        q = _quantize_on_device(kern, p, x2, rb, use_rb, fused_rht)
        if q is not None:
            return q
    if isinstance(sch, MX):                 # no tensor amax needed: the backend may reduce it as it quantizes
        codes, scales, fv, amax = kern.mx(x2, rb, use_rb, p.mode, p.sr.kernel_nsr, ids.SCALE_MODE_IDS[sch.scale_mode],
                                          sch.elem, fake)
        amax_t, has_nan = kern.absmax(x2) if amax is None else amax
        warn_specials(sch, amax_t, has_nan, bool(np.isinf(amax_t)))
        return p.back(xp, fv) if fake else finish(sch, codes, scales, None, p.lead, p.axis, p.shape, p.scale_layout)
    pre = row_amax = None   # where the backend can: the block (and row) amaxes come from the tensor-amax pass
    if hasattr(kern, "absmax_blocks") and isinstance(sch, NVFP4) and not sch.four_over_six:
        amax_t, has_nan, pre, row_amax = kern.absmax_blocks(x2)
    elif isinstance(sch, NVFP4) or (isinstance(sch, FP8Tensor) and p.global_amax is None):
        amax_t, has_nan = kern.absmax(x2)
    else:                   # FP8 blockwise, and FP8 per-tensor with a given amax: no tensor amax to take
        amax_t, has_nan = f32(0.0), False
    pre = () if pre is None else (pre,)
    has_inf = bool(np.isinf(amax_t))
    extras, gamax = {}, None
    if isinstance(sch, NVFP4):
        if sch.row_scaled:
            if p.global_amax is not None:
                amax_g = p.global_amax
            else:
                amax_g = kern.row_absmax(x2) if row_amax is None else row_amax
            warn_specials(sch, f32(np.max(amax_g)), has_nan, has_inf)
        elif not sch.per_tensor_scale:
            amax_g = f32(1.0)
            warn_specials(sch, amax_g, has_nan, has_inf)
        else:
            amax_g = amax_t if p.global_amax is None else p.global_amax
            warn_specials(sch, amax_g, has_nan, has_inf)
        if sch.four_over_six:
            if p.mode != ids.RNE:
                raise ValueError("four_over_six is defined for round-to-nearest only (TE's 4over6 path has no "
                                 "stochastic rounding); use rounding='rne'")
            g = np.asarray(amax_g, np.float32).reshape(-1) if sch.row_scaled else f32(amax_g)
            codes, scales, pick = kern.nvfp4_4over6(x2, sch.block[0], g, sch.e4m3_max, sch.four_over_six,
                                                    sch.four_over_six_fast_math, sch.four_over_six_ties == "map_to_4")
            q = finish(sch, codes, scales, g, p.lead, p.axis, p.shape, p.scale_layout,
                       {"map_to_4_frac": float(np.mean(pick)), "map_to_4": pick})
            # fake: the (R, K) rows themselves (run_dequantize's result is in the input's shape, which for a
            # blocked axis other than the last is not those rows reshaped)
            return p.back(xp, kern.dequantize(q, plan_dequantize(q)).reshape(p.R, p.K)) if fake else q
        c0, c1, dq = nvfp4_constants_rows(sch.flavor, amax_g, sch.per_tensor_scale)
        codes, scales, fv = kern.nvfp4(x2, rb, use_rb, p.mode, p.sr.kernel_nsr, ids.FLAVOR_IDS[sch.flavor], sch.block[0],
                                       c0, c1, dq, fake, *pre)
        gamax = (np.asarray(amax_g, np.float32).reshape(-1) if sch.row_scaled else
                 None if not sch.per_tensor_scale else f32(amax_g))
        if return_intermediates:
            extras = {"s_enc_constants": (c0, c1), "dequant_constants": dq, "tensor_amax": f32(amax_t)}
    elif isinstance(sch, FP8Tensor):
        scale = fp8_tensor_scale(sch.elem, amax_t if p.global_amax is None else p.global_amax)
        codes, scales, fv = kern.fp8(x2, rb, use_rb, p.mode, p.sr.kernel_nsr, sch.elem, 1, scale, fake)
    else:
        codes, scales, fv = kern.fp8(x2, rb, use_rb, p.mode, p.sr.kernel_nsr, sch.elem, sch.block[0], None, fake)
    if fake:
        return p.back(xp, fv)
    return finish(sch, codes, scales, gamax, p.lead, p.axis, p.shape, p.scale_layout, extras)


def _quantize_on_device(kern, p: QuantPlan, x2, rb, use_rb, rht=None):
    """run_quantize on a backend that keeps the tensor amax on the device (the GPU): NVFP4 with one second-level
    amax, MX and FP8 without a host round trip. The tensor amax, the constants made from it and the NaN / Inf flags
    stay on the device; the warnings about the input are queued (``kern.defer_warnings``) and emitted once their
    values have reached the host. None for what needs host values (4over6, row-scaled NVFP4). ``rht``: NVFP4's
    rows are first rotated by the 16-point RHT inside its kernels (kern.rht_operand's)."""
    sch, nsr, xp = p.scheme, p.sr.kernel_nsr, kern.xp
    gamax = None
    if isinstance(sch, MX):
        codes, scales, fv, flags = kern.mx(x2, rb, use_rb, p.mode, nsr, ids.SCALE_MODE_IDS[sch.scale_mode],
                                           sch.elem, p.fake)
        kern.defer_warnings(sch, flags=flags)
    elif isinstance(sch, NVFP4):
        if sch.row_scaled or sch.four_over_six:
            return None
        fl = ids.FLAVOR_IDS[sch.flavor]
        if sch.per_tensor_scale and p.global_amax is None:
            acc = kern.absmax_device(x2, rht=rht)
            kern.defer_warnings(sch, acc=acc)
            cst = kern.nvfp4_tensor_constants(acc, sch.flavor)
            codes, scales, fv = kern.nvfp4(x2, rb, use_rb, p.mode, nsr, fl, sch.block[0], None, None, None, p.fake,
                                           cst=cst, rht=rht)
            gamax = kern.device_amax(acc)
        else:                                 # the second-level amax is the host's: global_amax, or 1
            g = p.global_amax if sch.per_tensor_scale else f32(1.0)
            c0, c1, dq = nvfp4_constants_rows(sch.flavor, g, sch.per_tensor_scale)
            flags = xp.zeros(1, np.uint32)      # the input's NaN / Inf, seen by the quantize kernel itself
            codes, scales, fv = kern.nvfp4(x2, rb, use_rb, p.mode, nsr, fl, sch.block[0], c0, c1, dq, p.fake,
                                           rht=rht, flags=flags)
            kern.defer_warnings(sch, flags=flags, amax_g=g)
            gamax = f32(g) if sch.per_tensor_scale else None
    elif isinstance(sch, FP8Tensor):
        if p.global_amax is None:
            codes, scales, fv = kern.fp8(x2, rb, use_rb, p.mode, nsr, sch.elem, 1, None, p.fake,
                                         amax_dev=kern.absmax_device(x2))
        else:
            codes, scales, fv = kern.fp8(x2, rb, use_rb, p.mode, nsr, sch.elem, 1,
                                         fp8_tensor_scale(sch.elem, p.global_amax), p.fake)
    else:
        codes, scales, fv = kern.fp8(x2, rb, use_rb, p.mode, nsr, sch.elem, sch.block[0], None, p.fake)
    if p.fake:
        return p.back(xp, fv)
    return finish(sch, codes, scales, gamax, p.lead, p.axis, p.shape, p.scale_layout)


# ------------------------------------------------------------------------------------------------ dequantize
@dataclass(frozen=True)
class DequantPlan:
    """How a QuantizedTensor's codes become values: kind (ids.DQ_*), block length, the NVFP4 flavour id and its
    dequantize constants (``dq``: (1, 2), or (R, 2) for a row-scaled tensor; None when the tensor amax is on the
    device), the FP8 blockwise tile rows, rows R and length K."""
    kind: int
    R: int
    K: int
    bk: int
    flavor: int = 0
    dq: object = None
    tile: int = 1


def plan_dequantize(q) -> DequantPlan:
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor (from fp4sim.quantize), not {type(q).__name__}")
    sch = q.scheme
    R = int(np.prod(q.lead, dtype=np.int64))
    if isinstance(sch, BF16Cast):
        return DequantPlan(-1, R, q.K, q.K)
    if isinstance(sch, NVFP4):
        if hasattr(q.global_amax, "get"):
            # a tensor amax on the device (the GPU's quantize): the kernel makes the constants there (dq None);
            # a too-large amax was already warned about by that quantize
            return DequantPlan(ids.DQ_NVFP4, R, q.K, 16, ids.FLAVOR_IDS[sch.flavor], None)
        g = np.asarray(1.0 if q.global_amax is None else q.global_amax, np.float32).reshape(-1)
        big = g[np.isfinite(g)]
        if sch.flavor in ("te", "paper") and big.size and big.max() > NVFP4_DEQUANT_AMAX_LIMIT:
            warnings.warn(f"global amax {float(big.max()):.4g} > FLT_MAX/448: blocks with large scale bytes "
                          "dequantize to Inf/NaN (fl(s * amax) overflows float32)", RuntimeWarning, 4)
        _, _, dq = nvfp4_constants_rows(sch.flavor, g, sch.per_tensor_scale, sch.e4m3_max)
        return DequantPlan(ids.DQ_NVFP4, R, q.K, 16, ids.FLAVOR_IDS[sch.flavor], dq)
    if isinstance(sch, MX):
        return DequantPlan(ids.DQ_MX, R, q.K, 32)
    if isinstance(sch, FP8Tensor):
        return DequantPlan(ids.DQ_FP8_TENSOR, R, q.K, q.K)
    return DequantPlan(ids.DQ_FP8_BLOCKWISE, R, q.K, 128, tile=sch.block[0])


def run_dequantize(kern, q):
    """:func:`fp4sim.dequantize` on the backend ``kern``."""
    p = plan_dequantize(q)
    xp = kern.xp
    y2 = kern.dequantize(q, p)
    return xp.moveaxis(y2.reshape(tuple(q.lead) + (q.K,)), -1, q.axis)


def is_fp4(sch) -> bool:
    return isinstance(sch, NVFP4) or (isinstance(sch, MX) and sch.elem is E2M1)


# ------------------------------------------------------------------------------------------------ RHT
def rht_args(xs, d, signs, axis, out):
    """Checked arguments of :func:`fp4sim.rht`: (axis 0..ndim-1, its length, diag(s) @ H_d as float64,
    bf16 output?)."""
    check_d(d)
    out = _inputs.check_choice(out, "out", ("bf16", "fp32"))
    axis = _inputs.check_axis(axis, xs.ndim, "rht")
    K = xs.shape[axis]
    if K % d:
        raise ValueError(f"axis {axis} has length {K}, not a multiple of d={d}; pad it or choose another d")
    if isinstance(signs, (str, int, np.integer)) and not isinstance(signs, bool):
        sh = _signed_hadamard(int(d), signs if isinstance(signs, str) else int(signs))
    else:
        sh = np.ascontiguousarray(rht_signs(d, signs)[:, None] * hadamard_matrix(d))
    return axis, K, sh, out == "bf16"


@functools.lru_cache(maxsize=256)
def _signed_hadamard(d, signs):
    """diag(s) @ H_d (float64) for a named or seeded sign vector, built once per (d, signs): training calls the
    RHT with the same few of them every step (the kernels only read it)."""
    return np.ascontiguousarray(rht_signs(d, signs)[:, None] * hadamard_matrix(d))


def run_rht(kern, x, d=16, signs="te", axis=-1, out="bf16", memory="C"):
    """:func:`fp4sim.rht` on the backend ``kern``."""
    xp = kern.xp
    if memory not in ("C", "axis_last"):
        raise ValueError(f"memory={memory!r}: use 'C' (a C-contiguous input's own layout) or 'axis_last' (the "
                         "transformed axis last in memory, what quantize along it reads without a copy)")
    xs = kern.as_float32(x, order="K")
    axis, K, sh, to_bf16 = rht_args(xs, d, signs, axis, out)
    if axis != xs.ndim - 1 and hasattr(kern, "rht_axis") and xs.flags.c_contiguous:
        outer = math.prod(xs.shape[:axis])               # CPU: along a strided axis without transposing
        last = memory == "axis_last"
        y = kern.rht_axis(xs.reshape(outer, K, -1), d, sh, math.sqrt(1.0 / d), to_bf16, last)
        if last:                                          # (outer, inner, K) in memory, seen in x's shape
            return np.moveaxis(y.reshape(xs.shape[:axis] + xs.shape[axis + 1:] + (K,)), -1, axis)
        return y.reshape(xs.shape)
    xm = kern.axis_last(xs, axis)
    x2 = xm.reshape(-1, K)
    y = kern.rht(x2, d, sh, math.sqrt(1.0 / d), to_bf16)
    return xp.moveaxis(y.reshape(xm.shape), -1, axis)
