"""The weight record every reader of :mod:`fp4sim.checkpoints` gives, whatever the file: ``name``, ``shape`` (the
weight's, in the stored order), ``codes`` (uint8, fp4sim's packing: element 2i in the low nibble of byte i,
whatever the file's own order), ``scales`` (the scale bytes as stored), ``tensor_scale`` (the stored float32
tensor scale, None where the format has none), ``layout`` (a :class:`Layout`: how the file lays them out and what
they mean) and ``values()`` (float32, the format's own reading of the bytes, as its library dequantizes them)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "LAYOUTS"]


@dataclass(frozen=True)
class Layout:
    """How a format stores one weight: ``family`` ("NVFP4" or "MXFP4"), ``block`` (elements per scale byte),
    ``scale`` (the scale bytes' format), ``tensor_scale`` (what the stored tensor scale is, or None),
    ``element_order`` (how a byte holds two codes in the file: "pairs", elements 2i and 2i + 1; "halves", elements
    j and j + block / 2 of a block) and ``value`` (how a value is read)."""
    format: str
    family: str
    block: int
    scale: str
    tensor_scale: str | None
    element_order: str
    value: str


LAYOUTS = {l.format: l for l in [
    Layout("modelopt", "NVFP4", 16, "E4M3", "weight_scale_2 = amax / 2688, a multiplier", "pairs",
           "e2m1 · fl(E4M3(s) · weight_scale_2)"),
    Layout("compressed-tensors", "NVFP4", 16, "E4M3", "weight_global_scale = 2688 / amax, a divisor", "pairs",
           "e2m1 · fl(E4M3(s) / weight_global_scale)"),
    Layout("gpt-oss", "MXFP4", 32, "E8M0", None, "pairs", "e2m1 · 2^(e - 127)"),
    Layout("compressed-tensors mxfp4", "MXFP4", 32, "E8M0", None, "pairs", "e2m1 · 2^(e - 127)"),
    Layout("compressed-tensors mxfp8", "MXFP8", 32, "E8M0", None, "one E4M3 byte per element", "e4m3 · 2^(e - 127)"),
    Layout("compressed-tensors mxfp6", "MXFP6", 32, "E8M0", None,
           "E2M3 codes four to three bytes (c0 | c1 << 6 | c2 << 12 | c3 << 18, low byte first)", "e2m3 · 2^(e - 127)"),
    Layout("mlx mxfp4", "MXFP4", 32, "E8M0", None, "pairs (uint32 words, lowest bits first)", "e2m1 · 2^(e - 127)"),
    Layout("mlx nvfp4", "NVFP4", 16, "E4M3", None, "pairs (uint32 words, lowest bits first)", "e2m1 · E4M3(s)"),
    Layout("mlx mxfp8", "MXFP8", 32, "E8M0", None, "one E4M3 byte per element", "e4m3 · 2^(e - 127)"),
    Layout("gguf MXFP4", "MXFP4", 32, "E8M0", None, "halves", "e2m1 · 2^(e - 127)"),
    Layout("gguf NVFP4", "NVFP4", 16, "UE4M3 (0x7F reads as zero, the sign bit is not read)", None, "halves",
           "e2m1 · E4M3(s & 0x7F)"),
]}
