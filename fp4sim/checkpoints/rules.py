"""The exporter rules: each a named, documented function from a high-precision weight to the bytes an exporter
writes (packed E2M1 codes, block-scale bytes, the tensor scale it stores), with its provenance (the library and
version it was checked against, and how), in one registry, :data:`RULES`, that ``validate checkpoint`` and
``analyze --requantize`` both use.

A rule takes a float32 2-D weight ``x`` (rows, K) and returns :class:`RuleBytes`: codes in fp4sim's packing
(element 2i in the low nibble of byte i, uint8 (rows, K / 2)), scale bytes (uint8 (rows, K / block)) and the
tensor scale as the exporter stores it (None where it stores none). :class:`Requantized` holds one weight's
bytes under every rule asked for, each computed once, so that naming the rule that reproduces a tensor and
costing every rule on it quantize the tensor once per rule. ``rules_table()`` renders the registry as the
Markdown table of the docs (a test holds the two equal); :mod:`fp4sim.checkpoints.faults` is the table of
layout faults beside it.

ggml's MXFP4 quantizer (gguf-py's ``MXFP4.quantize_blocks``), as a rule: the shared exponent ``e = floor(log2
amax) - 2 + 127`` (0 for an all-zero block), the log2 evaluated in float32 — so an amax within a few float32 ulps
below a power of two from 8 on takes the exponent of that power (log2(7.9999995) rounds to 3.0) — the OCP rule
whose values above 6 · 2^(e - 127) clip to 6 — and each
element the E2M1 code whose value times the scale is nearest in float32 (``|2^(e-128) · 2k - x|``), the first in
code order on a tie: ties go to the smaller magnitude (not to even), and a negative value that rounds to zero is
+0 (code 0, not fp4sim's -0, code 8). fp4sim's ``mxfp4`` with ``scale_mode="floor"`` gives the same scale bytes
(:func:`ggml_mxfp4_quantize` says where the codes differ).

llama.cpp's NVFP4 quantizer (``quantize_row_nvfp4_ref`` in ggml's C source), as a rule: per 16-element
sub-block, the scale byte ``ggml_ue4m3(fl(amax / 6))`` (:func:`ggml_ue4m3`: its own UE4M3 rounding, not
round-to-nearest-even: the fourth mantissa bit rounds half up, a scale at or above 2^8 — after that rounding,
so from 248 on — becomes 448 (byte 0x7E), and below 2^-6 the subnormal ``trunc(s · 512 + 0.5)``, at most 7), no
tensor scale, and each element by the MXFP4 rule's nearest-candidate search over ``E2M1 x E4M3(byte)`` (ties
to the smaller magnitude, +0 for negatives that round to zero).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["RULES", "ExporterRule", "RuleBytes", "Requantized", "rule", "rules_for", "candidates", "title_of",
           "exact_dtypes", "reproducing", "rule_costs", "rules_table",
           "COST_RULES", "BITS_PER_VALUE", "MX_RULES", "mx_rule_key", "compressed_tensors_quantize",
           "ggml_mxfp4_quantize", "ggml_nvfp4_quantize", "ggml_ue4m3", "te_nvfp4_blocks",
           "compressed_tensors_mx_quantize", "mlx_quantize", "MLX_MODES"]

F32 = np.float32
C2688 = F32(2688.0)


def _rule_input(x, multiple: int, kind: str) -> np.ndarray:
    """``x`` as a float32 (rows, K) array, K a multiple of ``multiple``; ValueError naming ``x`` otherwise, or for
    NaN / Inf (ggml's rules have no code for them)."""
    a = np.asarray(x, np.float32)
    if a.ndim != 2 or a.shape[1] % multiple:
        raise ValueError(f"x: a 2-D array (rows, K) with K a multiple of {multiple} is needed, not shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"x holds NaN or Inf: ggml's {kind} rule has no code for them")
    return a


def ggml_mxfp4_quantize(x) -> tuple:
    """ggml's MXFP4 quantizer (the module docstring's rule, gguf-py's ``MXFP4.quantize_blocks`` byte for byte):
    ``(codes, scales)`` of a 2-D float32 ``x`` (rows, K), K a multiple of 32 — codes in fp4sim's packing
    (uint8 (rows, K / 2)), scales the E8M0 bytes (uint8 (rows, K / 32)). :func:`fp4sim.checkpoints.gguf.to_ggml_order` gives
    the bytes ggml writes. ValueError for NaN / Inf (the rule has no answer for them) or a block amax below 2^-125 (its
    exponent byte would leave E8M0's range)."""
    from ..formats import E2M1
    from ..layout import pack_fp4
    a = _rule_input(x, 32, "MXFP4")
    R, K = a.shape
    blk = a.reshape(R, K // 32, 32)
    amax = np.abs(blk).max(-1)
    if ((amax > 0) & (amax < np.float32(2.0 ** -125))).any():
        raise ValueError("x: a block amax below 2^-125 has no E8M0 exponent under ggml's rule "
                         "(floor(log2 amax) - 2 + 127 < 0)")
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax.astype(np.float32))) - 2 + 127, 0).astype(np.uint8)
    # the candidates' values in code order 0..15 (E2M1 x 2^(e-127), exact in float32) and |candidate - x|
    # rounded to float32, as the rule computes it; argmin takes the first of equal errors
    half = np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)
    doubled = np.round(E2M1.values.astype(np.float64) * 2).astype(np.float32)           # 0, 1, ..., 12, -0, ...
    cand = (half[:, :, None] * doubled[None, None, :]).astype(np.float32)
    err = np.abs(cand[:, :, None, :] - blk[:, :, :, None]).astype(np.float32)
    codes = np.argmin(err, axis=-1).astype(np.uint8).reshape(R, K)
    return pack_fp4(codes), e.astype(np.uint8)


def ggml_ue4m3(v) -> np.ndarray:
    """ggml's float32 -> UE4M3 scale byte (``ggml_fp32_to_ue4m3``) of non-negative float32 values: clamped to
    [0, 448]; a normal value keeps three mantissa bits and adds the fourth (half up, in magnitude), the carry
    moving into the exponent; an exponent field of 15 or more, before or after that carry, gives 448 (0x7E) — so
    scales in [248, 256) round up to 448, not to 256; below 2^-6 the subnormal byte is ``trunc(fl(v · 512) + 0.5)``
    clamped to 7 (so [7.5, 8) x 2^-9 stays at 7 x 2^-9 instead of becoming 2^-6); zero and negatives give 0."""
    a = np.clip(np.asarray(v, np.float32), np.float32(0), np.float32(448)).astype(np.float32)
    bits = a.view(np.uint32).astype(np.int64)
    e = ((bits >> 23) & 0xFF) - 127 + 7
    m = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carry = m > 7
    m = np.where(carry, 0, m)
    e2 = np.where(carry, e + 1, e)
    normal = np.where(e2 >= 15, 0x7E, (e2 << 3) | m)
    sub = np.clip((a * np.float32(512) + np.float32(0.5)).astype(np.float32).astype(np.int64), 0, 7)
    out = np.where(a <= 0, 0, np.where(e <= 0, sub, np.where(e >= 15, 0x7E, normal)))
    return out.astype(np.uint8)


def _nearest_codes(blk, d):
    """The MXFP4 rule's element search: per element of ``blk`` (..., n) the first code whose E2M1 value times
    ``d`` (..., broadcast) is nearest in float32."""
    from ..formats import E2M1
    cand = (d[..., None, None] * E2M1.values.astype(np.float32)[None, :]).astype(np.float32)
    err = np.abs(cand - blk[..., None]).astype(np.float32)
    return np.argmin(err, axis=-1).astype(np.uint8)


def ggml_nvfp4_quantize(x) -> tuple:
    """llama.cpp's NVFP4 quantizer (the module docstring's rule): ``(codes, scales)`` of a 2-D float32 ``x``
    (rows, K), K a multiple of 16 (GGUF tensors: of 64) — codes in fp4sim's packing (uint8 (rows, K / 2)),
    scales the UE4M3 bytes (uint8 (rows, K / 16)); there is no tensor scale. :func:`fp4sim.checkpoints.gguf.to_gguf_blocks`
    gives the 36-byte blocks ggml writes. ValueError for NaN or Inf."""
    from ..formats import E4M3
    from ..layout import pack_fp4
    a = _rule_input(x, 16, "NVFP4")
    R, K = a.shape
    blk = a.reshape(R, K // 16, 16)
    sb = ggml_ue4m3((np.abs(blk).max(-1) / np.float32(6)).astype(np.float32))
    d = np.where(sb == 0x7F, np.float32(0), E4M3.values[sb]).astype(np.float32)
    codes = _nearest_codes(blk, d).reshape(R, K)
    return pack_fp4(codes), sb




def te_nvfp4_blocks(x, n: int = 16, amax=None) -> tuple:
    """TransformerEngine's NVFP4 rule with one E4M3 scale per ``n`` elements of a row: ``(codes, scales)``, codes
    unpacked (uint8 (rows, K), one per element), scales the E4M3 bytes (rows, K / n). The FP32 tensor scale
    ``S_enc = 2688 / amax`` (1 for an all-zero tensor), each block's byte ``E4M3(amax_b · fl(S_enc / 6))``, the
    elements ``E2M1(x · fl(1 / fl(E4M3(s) · fl(1 / S_enc))))``, round-to-nearest-even throughout. ``n = 16`` is
    fp4sim's ``nvfp4`` (the codes and bytes of ``fs.quantize(x, "nvfp4")``); ``n = 32`` spends MXFP4's 4.25 bits
    per value on NVFP4's scale format. A value decodes as ``E2M1 · E4M3(s) · fl(1 / S_enc)``. ``amax``: the
    tensor's amax where ``x`` is a piece of it (default: the amax of ``x``)."""
    from ..elements import encode
    from ..formats import E4M3
    f32 = np.float32
    a = np.asarray(x, f32)
    if a.ndim != 2 or a.shape[1] % n or not np.isfinite(a).all():
        raise ValueError(f"x: a finite 2-D array (rows, K) with K a multiple of {n} is needed")
    R, K = a.shape
    amax = (f32(np.abs(a).max()) if a.size else f32(0)) if amax is None else f32(amax)
    s_enc = f32(1) if amax == 0 else f32(min(f32(2688.0) / amax, np.finfo(f32).max))
    s_dec = f32(f32(1) / s_enc)
    blk = a.reshape(R, K // n, n)
    sb = encode((np.abs(blk).max(-1) * f32(s_enc * (f32(1) / f32(6)))).astype(f32), "E4M3")
    with np.errstate(divide="ignore"):
        enc = np.minimum(f32(1) / (E4M3.values[sb].astype(f32) * s_dec).astype(f32), np.finfo(f32).max)
    codes = encode((blk * enc.astype(f32)[..., None]).astype(f32), "E2M1")
    return codes.reshape(R, K), sb, s_dec


_DTYPES = ("float32", "bfloat16", "float16")


def _rounder(dt):
    """An operation's float32 result rounded to the dtype ``dt`` (as torch and MLX compute a bfloat16 / float16
    operation: in float32, then rounded), returned as float32."""
    def r(v):
        return np.asarray(v, np.float32).astype(dt).astype(np.float32)
    return r


def _weight_dtype(a, dtype) -> tuple:
    """(name, NumPy type) of the dtype a rule computes in: ``dtype`` (one of :data:`_DTYPES`) or the dtype of the
    array ``a``; ValueError naming ``dtype`` for another."""
    import ml_dtypes
    name = dtype if dtype is not None else {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                                            np.dtype(ml_dtypes.bfloat16): "bfloat16"}.get(a.dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype: {dtype if dtype is not None else a.dtype} is not one of {', '.join(_DTYPES)}")
    return name, {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[name]


def compressed_tensors_quantize(x, dtype: str | None = None, amax=None):
    """compressed-tensors' NVFP4 weight quantizer, byte for byte: ``(codes, scales, weight_global_scale)`` —
    packed E2M1 codes (uint8, (out, in/2)), E4M3 block-scale bytes (uint8, (out, in/16)) and the float32 global
    scale its export stores, for a 2-D weight ``x`` (in a multiple of 16).

    The operations, each in the weight's own dtype ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``;
    default: the dtype of ``x``; torch computes a bfloat16 / float16 operation in float32 and rounds the result)
    unless float32 is named:

    - global scale ``gs = fl(fl(1 / amax) · 2688)`` (torch evaluates ``2688 / t`` as ``reciprocal(t) · 2688``),
      rounded to float32; not finite (an all-zero or tiny weight) -> 1;
    - block scale ``E4M3(gs · fl(amax_b / 6))`` (the product in float32), saturating at 448; a zero scale
      becomes 0.125 (E4M3's "eps", byte 0x20), so an all-zero block stores 0x20, not 0x00;
    - element ``E2M1_rne(fl(x / fl(scale / gs)))`` in float32, clamped to ±6; a negative input that rounds to
      zero keeps its sign (code 0x8), while an input of -0 gives code 0x0 (torch's ``sign(-0) = 0``).

    ``amax``: the amax the global scale is computed from (default: the weight's own, ``max |x|`` in its dtype);
    llm-compressor gives the weights of one fused GEMM (q / k / v, gate / up) the smallest of their global scales,
    which is the global scale of their largest amax: pass that amax to reproduce such a weight.

    ModelOpt's rule differs in the order of the operations (``amax_b / fl(6 · amax / 2688)`` and ``x / fl(scale ·
    amax / 2688)``), so the two exporters' bytes differ where a block scale or an element falls on a rounding
    boundary; both agree on the layout (element 2i in the low nibble, scales row by row)."""
    from ..formats import E4M3
    from ..elements import encode
    from ..layout import pack_fp4
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"x: a 2-D weight (out, in) is needed, not shape {a.shape}")
    if a.shape[1] % 16:
        raise ValueError(f"x: in_features {a.shape[1]} is not a multiple of 16 (compressed-tensors' NVFP4 groups)")
    name, dt = _weight_dtype(a, dtype)
    f32 = np.float32

    r = _rounder(dt)
    xd = r(a.astype(np.float32))
    R, K = xd.shape
    ab = np.abs(xd).reshape(R, K // 16, 16)
    with np.errstate(all="ignore"):
        # compressed-tensors clamps amax to the dtype's smallest normal, which changes no result: at and below it
        # 2688 / amax overflows to Inf either way, and Inf gives 1
        if amax is None:
            amax = f32(ab.max()) if ab.size else f32(0)
        else:
            amax = f32(amax)
            if not (np.isfinite(amax) and amax >= 0):
                raise ValueError(f"amax: {float(amax)!r}; give a finite, non-negative amax (or None: the weight's own)")
        gs = r(r(f32(1.0) / amax) * f32(2688.0))
        gs = f32(gs) if np.isfinite(gs) else f32(1.0)
        sb = encode((gs * r(ab.max(-1) / f32(6.0))).astype(np.float32), E4M3)
        sb = np.where(sb == 0, np.uint8(0x20), sb).astype(np.uint8)
        dq = (E4M3.values[sb].astype(np.float32) / gs).astype(np.float32)
        y = (xd.reshape(R, K // 16, 16) / dq[:, :, None]).astype(np.float32).reshape(R, K)
        codes = np.where(y == 0, np.uint8(0), encode(y, "E2M1")).astype(np.uint8)     # -0 -> +0 (torch.sign)
    return pack_fp4(codes), sb, gs



_MX_OFFSET = {4: 2, 6: 2, 8: 8}    # floor(log2 of the element's largest value): E2M1 6, E2M3 7.5 -> 2, E4M3 448 -> 8
_MX_ELEM_MANTISSA = {4: 1, 6: 3, 8: 1}   # the element mantissa width round_to_power_2 takes (E4M3's: E2M1's)


def _power_of_two_at_or_above_three_quarters(a, dt, elem_mantissa: int = 1):
    """compressed-tensors' ``round_to_power_2`` with an element mantissa width (E2M1's 1 by default), on the bits
    of ``a`` in dtype ``dt``: 1 << (mantissa - elem_mantissa - 1) added to the bit pattern, the mantissa masked off
    — the power of two of ``a``'s binade, or the next one where ``a``'s significand is 1.75 or more (E2M3's 3 bits:
    1.9375 or more; for a subnormal: 0, or the smallest normal)."""
    import ml_dtypes
    bits = {np.float32: (np.uint32, 23, 8), ml_dtypes.bfloat16: (np.uint16, 7, 8), np.float16: (np.uint16, 10, 5)}
    ut, mant, expo = bits[dt]
    x = np.asarray(a, dt).view(ut).astype(np.int64)
    mask = ((1 << (expo + 1)) - 1) << mant
    return ((x + (1 << (mant - elem_mantissa - 1))) & mask).astype(ut).view(dt)


def compressed_tensors_mx_quantize(x, dtype: str | None = None, bits: int = 4) -> tuple:
    """compressed-tensors' MX weight quantizers (``calculate_qparams`` with its MX scales, then the compressor),
    byte for byte: ``(codes, scales)`` for a 2-D weight ``x`` (in a multiple of 32) — with ``bits=4``
    (``mxfp4-pack-quantized``) packed E2M1 codes (uint8 (out, in / 2), fp4sim's packing), with ``bits=6``
    (``mxfp6-pack-quantized``) E2M3 codes packed four to three bytes (uint8 (out, 3 in / 4),
    :func:`fp4sim.layout.pack_fp6`'s little-endian order), with ``bits=8`` (``mxfp8-quantized``) one E4M3 byte
    per element (uint8 (out, in)) — and E8M0 exponent bytes (uint8 (out,
    in / 32)), each operation in the weight's dtype ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``;
    default: the dtype of ``x``):

    - the block's largest magnitude rounded to a power of two ``p``: its binade's, or the next binade's where
      the significand is 1.75 or more (1.9375 for E2M3: the bits of the dtype with 1 << (mantissa - m - 1)
      added, m the element's mantissa width, the mantissa masked off; a subnormal amax gives 0 or the smallest
      normal);
    - the exponent byte ``b = clamp(127 + floor(log2 p) - k, 0, 255)``, k = 2 (E2M1's 6, E2M3's 7.5) or 8 (E4M3's
      448),
      (log2 0 = -inf gives 0), and the scale
      ``s = 2^(b - 127)`` rounded to the dtype — in float16 a scale below 2^-24 is 0 and becomes 1 (its "eps"
      for uint8 scales), so such a block stores byte 127 and all-zero codes;
    - each element ``E2M1_rne(clamp(fl_dtype(x / s), -6, 6))`` (or E2M3's with 7.5, E4M3's with 448), an
      exact zero (of either sign) code 0 (its zero point, +0, is added) and a negative value that rounds to zero
      the negative zero code — MXFP6 copies the sign instead (cast_to_fp6's copysign), so -0.0 is 0x20 there;
    - the stored byte ``127 + floor(log2 s)``.

    For a weight of bfloat16 or float32 values these are fp4sim's ``mxfp4`` with ``scale_mode="even"`` except
    that -0 is code 0; a float16 weight differs where its scales leave float16's range. ValueError for NaN / Inf,
    or a block whose scale overflows the dtype (the rule stores no defined byte for it)."""
    from ..elements import encode
    from ..layout import pack_fp4, pack_fp6
    if bits not in _MX_OFFSET:
        raise ValueError(f"bits={bits!r}: compressed-tensors' MX formats here are 4 (MXFP4), 6 (MXFP6) and 8 "
                         "(MXFP8)")
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[1] % 32:
        raise ValueError(f"x: a 2-D weight (out, in) with in a multiple of 32 is needed, not shape {a.shape}")
    name, dt = _weight_dtype(a, dtype)
    with np.errstate(all="ignore"):
        xd = np.asarray(a, np.float32).astype(dt)
        if not np.isfinite(xd.astype(np.float32)).all():
            raise ValueError(f"x holds NaN or Inf (in {name}): compressed-tensors' MX rule has no scale for them")
        R, K = xd.shape
        amax = np.abs(xd.astype(np.float32)).reshape(R, K // 32, 32).max(-1).astype(dt)
        p = _power_of_two_at_or_above_three_quarters(amax, dt, _MX_ELEM_MANTISSA[bits]).astype(np.float32)
        e = np.float32(127) + np.floor(np.log2(p)) - np.float32(_MX_OFFSET[bits])
        b = np.clip(e, 0, 255).astype(np.int64)
        s = np.ldexp(np.float32(1), b - 127).astype(np.float32).astype(dt).astype(np.float32)
        if not np.isfinite(s).all():
            raise ValueError(f"x: a block amax of {float(amax.astype(np.float32).max())!r} gives a scale beyond "
                             f"{name}'s range, for which compressed-tensors stores no defined byte")
        s = np.where(s == 0, np.float32(1), s)
        y = (xd.astype(np.float32).reshape(R, K // 32, 32) / s[:, :, None]).astype(dt).astype(np.float32)
        top, fmt = {4: (6, "E2M1"), 6: (7.5, "E2M3"), 8: (448, "E4M3")}[bits]
        codes = encode(np.clip(y, -top, top), fmt)
        if bits != 6:                         # MXFP4 / MXFP8 add the +0 zero point; MXFP6 copies the sign (-0: 0x20)
            codes = np.where(y == 0, np.uint8(0), codes)
        codes = codes.reshape(R, K).astype(np.uint8)
        sb = (np.float32(127) + np.floor(np.log2(s))).astype(np.uint8)
    return {4: pack_fp4, 6: pack_fp6, 8: lambda c: c}[bits](codes), sb



MLX_MODES = ("mxfp4", "nvfp4", "mxfp8")


def mlx_quantize(x, mode: str = "mxfp4", dtype: str | None = None) -> tuple:
    """MLX's ``mx.quantize(w, mode=...)`` on the CPU (MLX 0.32, no global scale), byte for byte: ``(codes,
    scales)`` — for ``"mxfp4"`` / ``"nvfp4"`` packed E2M1 codes (uint8 (out, in / 2), fp4sim's packing: MLX packs
    element 0 in the lowest bits of a uint32, which read as little-endian bytes is element 2i in the low nibble
    of byte i) and scale bytes (E8M0 per 32 / E4M3 per 16); for ``"mxfp8"`` the E4M3 element bytes (uint8 (out,
    in)) and E8M0 bytes per 32. The operations in the weight's dtype ``dtype`` (``"float32"``, ``"bfloat16"``,
    ``"float16"``; default: the dtype of ``x``), as MLX's graph computes them:

    - ``s = fl(amax / M)``, M = 6 (FP4) or 448 (FP8);
    - E8M0 (MX modes): ``e = ceil(log2 s)`` (log2 of the dtype's ``s`` in float32; 0 for s = 0: the OCP rule that
      rounds the scale up, fp4sim's ``rceil``), the element ``fl(x / fl(2^e))``, the byte ``e + 127`` as an
      8-bit integer (a block whose e is below -127 wraps around, as MLX's cast does);
    - E4M3 (nvfp4): the byte ``E4M3_rne(s)`` (saturating at 448), the element ``fl(x / E4M3(byte))`` in float32;
    - an FP4 element: the first code in code order (+0, 0.5, ..., 6, -0, ..., -6) whose value is nearest —
      ties go to the smaller magnitude, and a value that rounds to zero is +0 (code 0), whatever its sign; an
      FP8 element ``E4M3_rne``, saturating at 448.

    ValueError for NaN / Inf, another mode, or a shape MLX refuses."""
    from ..elements import encode
    from ..formats import E2M1, E4M3
    from ..layout import pack_fp4
    if mode not in MLX_MODES:
        raise ValueError(f"mode={mode!r}: MLX's float modes are {', '.join(MLX_MODES)}")
    a = np.asarray(x)
    g = 16 if mode == "nvfp4" else 32
    if a.ndim != 2 or a.shape[1] % g:
        raise ValueError(f"x: a 2-D weight (out, in) with in a multiple of {g} is needed, not shape {a.shape}")
    name, dt = _weight_dtype(a, dtype)

    r = _rounder(dt)
    with np.errstate(all="ignore"):
        w = r(np.asarray(a, np.float32))
        if not np.isfinite(w).all():
            raise ValueError(f"x holds NaN or Inf (in {name}): MLX's {mode} rule has no scale for them")
        R, K = w.shape
        wg = w.reshape(R, K // g, g)
        s = r(np.abs(wg).max(-1) / np.float32(6.0 if mode != "mxfp8" else 448.0))
        if mode == "nvfp4":
            sb = encode(s, "E4M3")
            y = r(wg / E4M3.values[sb].astype(np.float32)[:, :, None])
        else:
            e = np.where(s == 0, 0, np.ceil(np.log2(s))).astype(np.int64)
            p = np.ldexp(np.float64(1), e).astype(np.float32)
            p = r(np.where(np.isfinite(p), p, np.inf))
            y = r(wg / p[:, :, None])
            sb = (e + 127).astype(np.int64) & 0xFF
            sb = sb.astype(np.uint8)
        if mode == "mxfp8":
            codes = encode(y.reshape(R, K), "E4M3").astype(np.uint8)
            return codes, sb
        lut = E2M1.values.astype(np.float32).astype(dt).astype(np.float32)
        if mode == "nvfp4":                      # the element is float32 here (times MLX's float32 1.0)
            err = np.abs(y[..., None] - lut)
        else:
            err = np.abs(r(y[..., None] - lut))
        codes = np.argmin(np.where(np.isnan(err), np.inf, err), axis=-1).astype(np.uint8).reshape(R, K)
        nan = np.isnan(y).reshape(R, K)
        codes = np.where(nan, np.uint8(0), codes)
    return pack_fp4(codes), sb


# ----------------------------------------------------------------------------------------------- the registry
@dataclass
class RuleBytes:
    """What one rule writes for one weight: ``codes`` (uint8 (rows, K / 2), fp4sim's packing), ``scales`` (uint8
    (rows, K / block), the scale bytes in the rule's format), ``tensor_scale`` (float32 as the exporter stores it,
    None where it stores none); ``qt``: the fp4sim QuantizedTensor where the rule is one of fp4sim's schemes."""
    codes: np.ndarray
    scales: np.ndarray
    tensor_scale: np.float32 | None = None
    qt: object = field(default=None, repr=False)


@dataclass(frozen=True)
class ExporterRule:
    """One rule of the registry: ``key`` (its name here), ``title`` (how reports name it), ``label`` (its column
    in the requantize study, None where it is not costed there), ``family`` ("NVFP4" or "MXFP4"), ``block``
    (elements per scale byte), ``scale`` (the scale bytes' format), ``tensor_scale`` (what the exporter stores for
    the whole tensor, or None), ``writes`` (the checkpoint formats whose bytes it may have made; empty for a rule
    that is a study's what-if, not an exporter's), ``provenance`` (what it was checked against, and how),
    ``options`` (the keyword options ``fn`` takes), ``fn(x, **options)`` -> :class:`RuleBytes` and ``decode``
    (RuleBytes) -> the values it stands for, float64."""
    key: str
    title: str
    label: str | None
    family: str
    block: int
    scale: str
    tensor_scale: str | None
    writes: tuple
    provenance: str
    options: tuple
    fn: Callable = field(repr=False)
    decode: Callable = field(repr=False)

    def __call__(self, x, **options) -> RuleBytes:
        bad = sorted(set(options) - set(self.options))
        if bad:
            raise TypeError(f"{bad[0]}: the {self.key} rule takes " + (", ".join(self.options) or "no options"))
        return self.fn(np.asarray(x, np.float32), **options)


def _e2m1(codes) -> np.ndarray:
    from ..formats import E2M1
    from ..layout import unpack_fp4
    return E2M1.values[unpack_fp4(np.asarray(codes, np.uint8))].astype(np.float64)


def _per_element(f, codes) -> np.ndarray:
    """Block factors (rows, blocks) repeated over the elements of their blocks: (rows, K)."""
    v = _e2m1(codes)
    return v * np.repeat(np.asarray(f, np.float64), v.shape[1] // f.shape[1], axis=1)


def _decode_e8m0(b: RuleBytes) -> np.ndarray:
    return _per_element(np.ldexp(np.float64(1), b.scales.astype(np.int64) - 127), b.codes)


def _decode_ggml_nvfp4(b: RuleBytes) -> np.ndarray:
    from ..formats import E4M3
    s = b.scales & 0x7F
    return _per_element(np.where(s == 0x7F, 0.0, E4M3.values[s]), b.codes)


def _decode_e4m3_blocks(b: RuleBytes) -> np.ndarray:
    from ..formats import E4M3
    return _per_element(E4M3.values[b.scales].astype(np.float64), b.codes)


def _decode_mxfp8(b: RuleBytes) -> np.ndarray:
    """E4M3 element bytes (not packed) times 2^(e - 127)."""
    from ..formats import E4M3
    v = E4M3.values[b.codes].astype(np.float64)
    return v * np.repeat(np.ldexp(np.float64(1), b.scales.astype(np.int64) - 127), v.shape[1] // b.scales.shape[1],
                         axis=1)


def _decode_mxfp6(b: RuleBytes) -> np.ndarray:
    """E2M3 codes packed four to three bytes (little-endian) times 2^(e - 127)."""
    from ..formats import E2M3
    from ..layout import unpack_fp6
    v = E2M3.values[unpack_fp6(b.codes)].astype(np.float64)
    return v * np.repeat(np.ldexp(np.float64(1), b.scales.astype(np.int64) - 127), v.shape[1] // b.scales.shape[1],
                         axis=1)


def _decode_qt(b: RuleBytes) -> np.ndarray:
    from ..quantize import dequantize
    return np.asarray(dequantize(b.qt), np.float64)


def _decode_nvfp4_export(fmt):
    def decode(b: RuleBytes) -> np.ndarray:
        from ..formats import E4M3
        s = E4M3.values[b.scales].astype(np.float32)
        with np.errstate(all="ignore"):
            f = s * F32(b.tensor_scale) if fmt == "modelopt" else s / F32(b.tensor_scale)
        return _per_element(f.astype(np.float32), b.codes)
    return decode


def _own_amax(x) -> np.float32:
    return F32(np.nanmax(np.abs(x))) if x.size else F32(0)


def _fp4sim_nvfp4(flavor, stores):
    def fn(x, amax=None):
        from ..quantize import quantize
        amax = _own_amax(x) if amax is None else F32(amax)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            q = quantize(x, "nvfp4", flavor=flavor, global_amax=amax)
        with np.errstate(divide="ignore", over="ignore"):
            ts = F32(amax / C2688) if stores == "ws2" else F32(amax)
        return RuleBytes(np.asarray(q.codes), np.asarray(q.scales), ts, q)
    return fn


def _modelopt_fused(x, amax):
    return _fp4sim_nvfp4("modelopt", "ws2")(x, amax)


def _compressed_tensors(x, dtype="float32", amax=None):
    c, s, gs = compressed_tensors_quantize(x, dtype, amax=amax)
    return RuleBytes(c, s, F32(gs))


def _compressed_tensors_fused(x, amax, dtype="float32"):
    return _compressed_tensors(x, dtype, amax)


def _ocp_mxfp4(mode):
    def fn(x):
        from ..quantize import quantize
        q = quantize(x, "mxfp4", scale_mode=mode)
        return RuleBytes(np.asarray(q.codes).reshape(x.shape[0], -1), np.asarray(q.scales).reshape(x.shape[0], -1),
                         None, q)
    return fn


def _te_nvfp4_32(x, amax=None):
    from ..layout import pack_fp4
    c, s, s_dec = te_nvfp4_blocks(x, 32, amax)
    return RuleBytes(pack_fp4(c), s, F32(s_dec))


def _decode_te32(b: RuleBytes) -> np.ndarray:
    from ..formats import E4M3
    return _per_element(E4M3.values[b.scales].astype(np.float64), b.codes) * np.float64(b.tensor_scale)


_CT = ("compressed-tensors 0.20.1's generate_gparam, calculate_qparams and NVFP4 compressor, run by the tests on "
       "real weights and corner cases in float32, bfloat16 and float16")
_MX = ("fp4sim's mxfp4 scale mode {m}: the OCP MX v1.0 rule with that scale rounding, checked block by block "
       "against fp4sim/reference/blocks.py and torchao 0.18's MX modes")

RULES: dict = {r.key: r for r in [
    ExporterRule("modelopt-nvfp4", "ModelOpt's rule", None, "NVFP4", 16, "E4M3",
                 "weight_scale_2 = fl(amax / 2688), a multiplier", ("modelopt",),
                 "nvidia-modelopt 0.47's NVFP4QTensor.quantize (fp4sim's modelopt flavour, float32 whatever the "
                 "weight's dtype), bit for bit in the tests, and checkpoints written by its export_hf_checkpoint",
                 ("amax",), _fp4sim_nvfp4("modelopt", "ws2"), _decode_nvfp4_export("modelopt")),
    ExporterRule("modelopt-nvfp4-fused", "ModelOpt's rule", None, "NVFP4", 16, "E4M3",
                 "weight_scale_2 of the fused group's largest amax, shared by q / k / v and by gate / up",
                 ("modelopt",),
                 "nvidia-modelopt 0.47's export_hf_checkpoint on a small Llama in the tests: every member's block "
                 "scales and codes computed with the group's shared scale", ("amax",), _modelopt_fused,
                 _decode_nvfp4_export("modelopt")),
    ExporterRule("compressed-tensors-nvfp4", "compressed-tensors' rule", None, "NVFP4", 16, "E4M3",
                 "weight_global_scale = fl(fl(1 / amax) · 2688), a divisor", ("compressed-tensors",), _CT,
                 ("dtype", "amax"), _compressed_tensors, _decode_nvfp4_export("compressed-tensors")),
    ExporterRule("compressed-tensors-nvfp4-fused", "compressed-tensors' rule", None, "NVFP4", 16, "E4M3",
                 "weight_global_scale of the fused group's largest amax (llm-compressor's fused q / k / v, "
                 "gate / up)", ("compressed-tensors",), _CT + ", with the group's largest amax", ("amax", "dtype"),
                 _compressed_tensors_fused, _decode_nvfp4_export("compressed-tensors")),
    ExporterRule("compressed-tensors-mxfp4", "compressed-tensors' MXFP4 rule", None, "MXFP4", 32, "E8M0", None,
                 ("compressed-tensors mxfp4",),
                 "compressed-tensors 0.20.1's calculate_qparams (MX scales) and MXFP4PackedCompressor, run by the "
                 "tests on real weights and adversarial blocks in float32, bfloat16 and float16", ("dtype",),
                 lambda x, dtype="float32": RuleBytes(*compressed_tensors_mx_quantize(x, dtype)), _decode_e8m0),
    ExporterRule("compressed-tensors-mxfp8", "compressed-tensors' MXFP8 rule", None, "MXFP8", 32, "E8M0", None,
                 ("compressed-tensors mxfp8",),
                 "compressed-tensors 0.20.1's calculate_qparams (MX scales) and MXFP8QuantizationCompressor, run by "
                 "the tests on real weights and adversarial blocks in float32, bfloat16 and float16", ("dtype",),
                 lambda x, dtype="float32": RuleBytes(*compressed_tensors_mx_quantize(x, dtype, 8)), _decode_mxfp8),
    ExporterRule("compressed-tensors-mxfp6", "compressed-tensors' MXFP6 rule", None, "MXFP6", 32, "E8M0", None,
                 ("compressed-tensors mxfp6",),
                 "compressed-tensors 0.20.1's calculate_qparams (MX scales, E2M3's 3-bit rounding threshold) and "
                 "MXFP6PackedCompressor, run by the tests on real weights and adversarial blocks in float32, bfloat16 "
                 "and float16", ("dtype",),
                 lambda x, dtype="float32": RuleBytes(*compressed_tensors_mx_quantize(x, dtype, 6)), _decode_mxfp6),
    *[ExporterRule(f"mlx-{m}", f"MLX's {m} rule", None, m.upper(), 16 if m == "nvfp4" else 32,
                   "E4M3" if m == "nvfp4" else "E8M0", None, (f"mlx {m}",),
                   f"MLX 0.32.4's mx.quantize(w, mode='{m}') on the CPU, run by the tests on real weights and "
                   "adversarial blocks in float32, bfloat16 and float16", ("dtype",),
                   (lambda m: lambda x, dtype="float32": RuleBytes(*mlx_quantize(x, m, dtype)))(m),
                   _decode_e4m3_blocks if m == "nvfp4" else _decode_e8m0 if m == "mxfp4" else _decode_mxfp8)
      for m in MLX_MODES],
    ExporterRule("te-nvfp4", "the te flavour's rule", "NVFP4 (TE, tensor scale)", "NVFP4", 16, "E4M3",
                 "the amax (S_enc = 2688 / amax)", (),
                 "TransformerEngine 2.20.2's reference NVFP4 quantizer (fp4sim's nvfp4, te flavour), bit for bit "
                 "in the tests", ("amax",), _fp4sim_nvfp4("te", "amax"), _decode_qt),
    ExporterRule("torchao-nvfp4", "the torchao flavour's rule", None, "NVFP4", 16, "E4M3",
                 "the amax (per_tensor_scale = amax / 2688)", (),
                 "torchao 0.18's NVFP4Tensor (fp4sim's nvfp4, torchao flavour), bit for bit in the tests",
                 ("amax",), _fp4sim_nvfp4("torchao", "amax"), _decode_qt),
    ExporterRule("te-nvfp4-32", "NVFP4's scales per 32 elements (TE's rule)", "NVFP4/32 (TE)", "NVFP4", 32,
                 "E4M3", "S_dec = 1 / S_enc", (),
                 "TE's rule with one E4M3 scale per 32 elements: NVFP4's scale format at MXFP4's 4.25 bits per "
                 "value, a study's what-if; with 16 it is fs.quantize(x, 'nvfp4') byte for byte (tested)", ("amax",),
                 _te_nvfp4_32, _decode_te32),
    ExporterRule("ggml-nvfp4", "ggml's NVFP4 quantizer", "ggml NVFP4", "NVFP4", 16, "UE4M3 (ggml's, x 0.5 "
                 "in its integer table)", None, ("gguf",),
                 "llama.cpp's quantize_row_nvfp4_ref, composed in the tests of gguf-py 0.19's own UE4M3 encoder "
                 "and decoder, and decoded by gguf-py's dequantize; a rational oracle of the rule",
                 (), lambda x: RuleBytes(*ggml_nvfp4_quantize(x)), _decode_ggml_nvfp4),
    *[ExporterRule(f"ocp-mxfp4-{m}", f"MXFP4, scale mode {m}", {"floor": "MXFP4 floor", "rceil": "MXFP4 rceil"}
                   .get(m), "MXFP4", 32, "E8M0", None, ("gpt-oss", "gguf", "compressed-tensors mxfp4"), _MX.format(m=m),
                   (), _ocp_mxfp4(m),
                   _decode_e8m0) for m in ("rceil", "floor", "ceil", "even")],
    ExporterRule("ggml-mxfp4", "ggml's MXFP4 quantizer", "ggml MXFP4", "MXFP4", 32, "E8M0", None,
                 ("gguf", "gpt-oss", "compressed-tensors mxfp4"),
                 "gguf-py 0.19's MXFP4.quantize_blocks, byte for byte in the tests on real weights and its ties",
                 (), lambda x: RuleBytes(*ggml_mxfp4_quantize(x)), _decode_e8m0),
]}

MX_RULES = ("rceil", "floor", "ceil", "even", "ggml")        # the MXFP4 rules by their short names, in this order


def mx_rule_key(short: str) -> str:
    """The registry key of an MXFP4 rule's short name (:data:`MX_RULES`): "ggml" -> "ggml-mxfp4", a scale mode
    -> "ocp-mxfp4-MODE"."""
    if short not in MX_RULES:
        raise ValueError(f"rule={short!r}: the MXFP4 rules are {', '.join(MX_RULES)}")
    return "ggml-mxfp4" if short == "ggml" else f"ocp-mxfp4-{short}"


def exact_dtypes(x) -> list:
    """The dtypes among bfloat16, float16 and float32 (always) in which every value of ``x`` is exact: those a
    rule computed in the weight's own dtype may have run in."""
    import ml_dtypes
    a = np.asarray(x, np.float32)
    out = []
    with np.errstate(over="ignore"):
        for name, dt in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
            if np.array_equal(a.astype(dt).astype(np.float32), a):
                out.append(name)
    return out + ["float32"]


def candidates(fmt: str, family: str, x, dtypes: list | None = None) -> list:
    """The rules to try on a ``fmt`` checkpoint's ``family`` tensor whose reference is ``x``: :func:`rules_for`,
    a rule computed in the weight's own dtype once per dtype ``x`` is exact in (``(key, {"dtype": ...})``;
    ``dtypes``: those dtypes where the caller has them, :func:`exact_dtypes` of the whole reference when ``x`` is
    a piece of it)."""
    out = []
    for k in rules_for(fmt, family):
        if "dtype" in rule(k).options:
            out += [(k, {"dtype": dt}) for dt in (exact_dtypes(x) if dtypes is None else dtypes)]
        else:
            out.append(k)
    return out


def _item(item) -> tuple:
    return (item, {}) if isinstance(item, str) else (item[0], dict(item[1]))


def title_of(item) -> str:
    """How reports name a rule: a key, or ``(key, options)`` ("compressed-tensors' MXFP4 rule (in bfloat16)")."""
    key, o = _item(item)
    return rule(key).title + (f" (in {o['dtype']})" if "dtype" in o else "")


def rules_for(fmt: str, family: str) -> list:
    """The keys of the rules whose bytes a ``fmt`` checkpoint's ``family`` tensors ("MXFP4", "NVFP4", "MXFP8",
    "MXFP6") may hold
    ("gguf", "gpt-oss", "modelopt", "compressed-tensors"), in the registry's order."""
    return [k for k, r in RULES.items() if r.family == family and fmt in r.writes and not k.endswith("-fused")]


def rule(key: str) -> ExporterRule:
    """The registry's rule ``key``; ValueError listing the keys for another."""
    if key not in RULES:
        raise ValueError(f"rule {key!r}: the registry's rules are {', '.join(RULES)}")
    return RULES[key]


class Requantized:
    """One weight ``x`` (float32 (rows, K)) under the rules asked for, each rule (with each set of options)
    computed once: :meth:`bytes` and :meth:`values`."""

    def __init__(self, x):
        self.x = np.ascontiguousarray(np.asarray(x, np.float32))
        self._bytes, self._values = {}, {}

    def bytes(self, key: str, **options) -> RuleBytes:
        k = (key, tuple(sorted(options.items())))
        if k not in self._bytes:
            self._bytes[k] = rule(key)(self.x, **options)
        return self._bytes[k]

    def of(self, item) -> RuleBytes:
        """:meth:`bytes` of a key or a ``(key, options)`` pair."""
        key, o = _item(item)
        return self.bytes(key, **o)

    def values(self, key: str, **options) -> np.ndarray:
        """The rule's values of ``x``, float64 (rows, K)."""
        k = (key, tuple(sorted(options.items())))
        if k not in self._values:
            self._values[k] = rule(key).decode(self.bytes(key, **options))
        return self._values[k]


def reproducing(codes, scales, keys, requantized: Requantized) -> list:
    """The titles (:func:`title_of`) of the rules among ``keys`` (keys, or ``(key, options)`` pairs) whose codes
    and scale bytes for the weight of ``requantized`` are ``codes`` and ``scales`` (fp4sim's packing), in the
    order of ``keys``."""
    out = []
    for k in keys:
        b = requantized.of(k)
        if np.array_equal(b.codes, codes) and np.array_equal(b.scales, scales):
            out.append(title_of(k))
    return out


COST_RULES = ("ggml MXFP4", "MXFP4 floor", "MXFP4 rceil", "NVFP4/32 (TE)", "ggml NVFP4", "NVFP4 (TE, tensor scale)")
BITS_PER_VALUE = {"ggml MXFP4": 4.25, "MXFP4 floor": 4.25, "MXFP4 rceil": 4.25, "NVFP4/32 (TE)": 4.25,
                  "ggml NVFP4": 4.5, "NVFP4 (TE, tensor scale)": 4.5}
_COST_KEY = {r.label: r.key for r in RULES.values() if r.label}


def rule_costs(x, requantized: Requantized | None = None) -> dict:
    """What each FP4 rule costs on a high-precision 2-D weight ``x`` (rows, K; K a multiple of 64): ``{"rel_mse":
    {rule: sum (y - x)^2 / sum x^2}, "clipped_blocks": share of 32-element blocks whose largest value exceeds
    6 x the scale ggml's MXFP4 rule chooses (those values clip to 6), "bits_per_value": {rule: bits}}`` for
    :data:`COST_RULES`: ggml's MXFP4 (floor exponent, ties to the smaller magnitude), fp4sim's MXFP4 with the
    floor and the round-up (rceil, TE's and cuBLAS's) scale modes, NVFP4's scales at MXFP4's 4.25 bits per value
    (TE's rule with one E4M3 scale per 32 elements, :func:`te_nvfp4_blocks`), ggml's NVFP4 (no tensor scale),
    and NVFP4 as TransformerEngine quantizes it (E4M3 scales per 16 under an FP32 tensor scale).
    ``requantized``: the :class:`Requantized` of ``x`` whose rules' bytes are reused (naming the rule that made a
    tensor quantizes it by the same rules)."""
    a = np.asarray(x, np.float32)
    if a.ndim != 2 or a.shape[1] % 64:
        raise ValueError(f"x: a 2-D weight (rows, K) with K a multiple of 64 is needed, not shape {a.shape}")
    rq = requantized if requantized is not None else Requantized(a)
    if rq.x.shape != a.shape or not np.array_equal(rq.x, a):
        raise ValueError("requantized: made from another weight than x")
    return cost_ratios(rule_cost_sums(rq))


def rule_cost_sums(rq: Requantized, amax=None) -> dict:
    """The sums behind :func:`rule_costs` for the weight of ``rq`` or a piece of rows of it: ``{"sq_err": {rule:
    sum (y - x)^2}, "sx2": sum x^2, "clipped": blocks clipped under ggml's MXFP4 rule, "blocks": blocks}``, the
    sums in float64 (NumPy's). ``amax``: the whole weight's amax where ``rq`` holds a piece of it (the rules with
    a tensor scale take it; the others work block by block). The pieces' sums add up to the whole weight's, to
    the last bits of the float64 additions."""
    a = rq.x
    R, K = a.shape
    a64 = a.astype(np.float64)
    out = {"sq_err": {}, "sx2": float((a64 * a64).sum())}
    for label in COST_RULES:
        key = _COST_KEY[label]
        y = rq.values(key, amax=amax) if amax is not None and "amax" in rule(key).options else rq.values(key)
        out["sq_err"][label] = float(((y - a64) ** 2).sum())
    e8 = rq.bytes("ggml-mxfp4").scales
    blk = np.abs(a).reshape(R, K // 32, 32).max(-1).astype(np.float64)
    out["clipped"] = int((blk > 6 * np.ldexp(1.0, e8.astype(np.int64) - 127)).sum())
    out["blocks"] = int(blk.size)
    return out


def add_sums(total: dict | None, part: dict) -> dict:
    """The sums of two :func:`rule_cost_sums` (``total`` None: ``part``)."""
    if total is None:
        return {**part, "sq_err": dict(part["sq_err"])}
    return {"sq_err": {k: total["sq_err"][k] + v for k, v in part["sq_err"].items()},
            "sx2": total["sx2"] + part["sx2"], "clipped": total["clipped"] + part["clipped"],
            "blocks": total["blocks"] + part["blocks"]}


def cost_ratios(sums: dict) -> dict:
    """:func:`rule_costs`' dict from the (added) :func:`rule_cost_sums`."""
    ref = sums["sx2"]
    return {"rel_mse": {k: (v / ref if ref else 0.0) for k, v in sums["sq_err"].items()},
            "clipped_blocks": sums["clipped"] / sums["blocks"] if sums["blocks"] else float("nan"),
            "bits_per_value": dict(BITS_PER_VALUE)}


def rules_table() -> str:
    """The registry as the Markdown table of the docs (docs/validation.md holds it; a test keeps them equal)."""
    rows = ["| rule | block, scale | tensor scale | in checkpoints of | checked against |", "|---|---|---|---|---|"]
    for r in RULES.values():
        rows.append(f"| `{r.key}` ({r.title}) | {r.block}, {r.scale} | {r.tensor_scale or 'none'} | "
                    f"{', '.join(r.writes) or '(a study rule)'} | {r.provenance} |")
    return "\n".join(rows)
