"""The layout faults fp4sim names in FP4 checkpoints, as one table (:data:`FAULTS`), beside the exporter rules of
:mod:`fp4sim.checkpoints.rules`, and the byte transforms that undo the faults it can undo (:func:`undo_mxfp4`,
:func:`undo_gguf`): ``validate checkpoint`` names a fault where undoing it makes a rule reproduce the stored
bytes from the reference.

``faults_table()`` renders the table as the docs hold it (a test keeps the two equal)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FAULTS", "LayoutFault", "undo_mxfp4", "undo_nvfp4", "undo_mxfp8", "undo_mxfp6", "undo_gguf",
           "faults_table"]


@dataclass(frozen=True)
class LayoutFault:
    """A fault ``key``: ``title`` (what it is), ``formats`` (the checkpoint formats it is looked for in) and
    ``found`` (how: from the bytes alone, or against the reference re-quantized by the rules)."""
    key: str
    title: str
    formats: tuple
    found: str


_REF = "against the reference: undone, a rule reproduces the bytes"
FAULTS: dict = {f.key: f for f in [
    LayoutFault("swapped-nibbles", "the nibbles are swapped (element 2j in the high nibble of byte j)",
                ("modelopt", "compressed-tensors", "gpt-oss", "compressed-tensors mxfp4", "mlx"), _REF),
    LayoutFault("ggml-halves", "the codes are in ggml's order (byte j holds elements j and j + 16 of a block: a "
                "GGUF block copied as is) where pairs belong", ("gpt-oss", "compressed-tensors mxfp4"), _REF),
    LayoutFault("pairs", "the codes are in gpt-oss's pair order (elements 2j and 2j + 1 in byte j) where ggml's "
                "halves belong", ("gguf",), _REF),
    LayoutFault("scale-bias", "the scale bytes are one binade high or low (E8M0 with bias 128; an E4M3 exponent "
                "field off by one)", ("modelopt", "compressed-tensors", "gpt-oss", "compressed-tensors mxfp4",
                                     "compressed-tensors mxfp8", "compressed-tensors mxfp6", "mlx", "gguf"), _REF),
    LayoutFault("fp6-big-endian", "the FP6 codes packed big-endian (c0 in the top bits of the first byte, "
                "torchao's former pack_uint6) where compressed-tensors' little-endian order belongs",
                ("compressed-tensors mxfp6",), _REF),
    LayoutFault("half-factor", "ggml's UE4M3 0.5 factor left out or applied twice (NVFP4 scale bytes one binade "
                "off)", ("gguf",), _REF),
    LayoutFault("transposed-blocks", "the blocks (or the block-scale matrix) written transposed",
                ("modelopt", "compressed-tensors", "gpt-oss", "compressed-tensors mxfp4", "gguf"),
                "from the scale matrix's shape or structure alone; against the reference"),
    LayoutFault("swizzled-scales", "the block scales in cuBLAS's swizzled 128x4 layout where the linear rows x "
                "blocks layout belongs", ("modelopt", "compressed-tensors"),
                "from the size or structure alone; against the reference"),
    LayoutFault("inverted-tensor-scale", "the tensor scale in the other format's direction (weight_scale_2 and "
                "weight_global_scale are inverses)", ("modelopt", "compressed-tensors"),
                "from its implied amax alone; against the reference"),
    LayoutFault("mixed-export", "codes and scales of one rule, the tensor scale of another",
                ("modelopt", "compressed-tensors"), "against the reference"),
    LayoutFault("half-size-scales", "a scale tensor half the size the codes need (one scale per 32 elements, or "
                "half of them dropped)", ("modelopt", "compressed-tensors"), "from the shapes alone"),
    LayoutFault("codes-not-u8", "packed codes labelled I8 (or another dtype) in the header",
                ("modelopt", "compressed-tensors"), "from the header alone"),
    LayoutFault("nan-scales", "scale bytes that are NaN (E8M0 255, E4M3 0x7F / 0xFF) or, for ggml's UE4M3, 0x7F "
                "or a set sign bit", ("modelopt", "compressed-tensors", "gpt-oss", "compressed-tensors mxfp4", "mlx",
                                      "gguf"), "from the bytes alone"),
    LayoutFault("another-format", "tensors of another format than the config names (NVFP4's global scale or E4M3 "
                "scales under an MXFP4 config; MXFP4's E8M0 bytes under an NVFP4 one)",
                ("compressed-tensors", "compressed-tensors mxfp4", "compressed-tensors mxfp8",
                 "compressed-tensors mxfp6"), "from the tensors' names, dtypes and shapes"),
    LayoutFault("unknown-mode", "a mode fp4sim does not read as a float format (MLX's affine integer mode, a mode "
                "it does not know), said with the mode", ("mlx",), "from the config and the tensors' names"),
    LayoutFault("truncated-data", "the file ends before a tensor's data does (any tensor type)", ("gguf",),
                "from the file's size alone"),
    LayoutFault("other-fp4-type", "the other FP4 type's blocks under this type (NVFP4 blocks labelled MXFP4, or "
                "the reverse)", ("gguf",), "from the data region's size; against the reference"),
    LayoutFault("overlapping-regions", "a data region shorter than the tensor's type and shape need (it runs "
                "into the next tensor's)", ("gguf",), "from the offsets alone"),
]}


def undo_mxfp4(w) -> list:
    """[(fault key, what it is, codes, scales)]: a gpt-oss weight's bytes with each known fault undone —
    nibbles swapped, ggml's element order, the scale bytes one binade high or low, blocks transposed (where rows
    differ from K / 32)."""
    from ..layout import pack_fp4
    from .gguf import from_ggml_order
    codes, scales = w.codes, w.scales
    n, nb = scales.shape
    out = [("swapped-nibbles", "the nibbles are swapped (element 2j in the high nibble of byte j)",
            ((codes >> 4) | (codes << 4)).astype(np.uint8), scales),
           ("ggml-halves", "the codes are in ggml's order (byte j holds elements j and j + 16 of a block: a GGUF "
            "block copied as is)", pack_fp4(from_ggml_order(codes, 32)), scales),
           ("scale-bias", "the scale bytes are one binade high (E8M0 written with bias 128)", codes,
            (scales.astype(np.int16) - 1).clip(0, 255).astype(np.uint8)),
           ("scale-bias", "the scale bytes are one binade low (E8M0 read with bias 128)", codes,
            (scales.astype(np.int16) + 1).clip(0, 255).astype(np.uint8))]
    E = int(np.prod(w.shape[:-2], dtype=np.int64))
    R = w.shape[-2]
    if R != nb:
        bt = codes.reshape(E, nb, R, 16).transpose(0, 2, 1, 3).reshape(n, nb * 16)
        st = scales.reshape(E, nb, R).transpose(0, 2, 1).reshape(n, nb)
        out.append(("transposed-blocks", "the blocks are transposed (rows and K / 32 exchanged)", bt, st))
    return out


def undo_nvfp4(codes, scales) -> list:
    """[(fault key, what it is, codes, scales)]: an NVFP4 weight's bytes (fp4sim's packing, E4M3 scale bytes per
    16) with each known fault undone — nibbles swapped, the scale bytes one binade high or low (the E4M3 exponent
    field off by one)."""
    s = scales.astype(np.int16)
    return [("swapped-nibbles", "the nibbles are swapped (element 2j in the high nibble of byte j)",
             ((codes >> 4) | (codes << 4)).astype(np.uint8), scales),
            ("scale-bias", "the scale bytes are one binade high (the E4M3 exponent field one too high)", codes,
             (s - 8).clip(0, 255).astype(np.uint8)),
            ("scale-bias", "the scale bytes are one binade low (the E4M3 exponent field one too low)", codes,
             (s + 8).clip(0, 255).astype(np.uint8))]


def undo_mxfp8(codes, scales) -> list:
    """[(fault key, what it is, codes, scales)]: an MXFP8 weight's bytes (E4M3 elements, E8M0 scales per 32) with
    the E8M0 bias undone both ways."""
    s = scales.astype(np.int16)
    return [("scale-bias", "the scale bytes are one binade high (E8M0 written with bias 128)", codes,
             (s - 1).clip(0, 255).astype(np.uint8)),
            ("scale-bias", "the scale bytes are one binade low (E8M0 read with bias 128)", codes,
             (s + 1).clip(0, 255).astype(np.uint8))]


def undo_mxfp6(codes, scales) -> list:
    """[(fault key, what it is, codes, scales)]: an MXFP6 weight's bytes (E2M3 codes packed four to three bytes,
    E8M0 scales per 32) read as big-endian packing, and with the E8M0 bias undone both ways."""
    from ..layout import pack_fp6, unpack_fp6
    return [("fp6-big-endian", "the FP6 codes are packed big-endian (torchao's former pack_uint6), not "
             "compressed-tensors' little-endian order", pack_fp6(unpack_fp6(codes, "big")), scales)] + [
        (k, what, codes, s) for k, what, _, s in undo_mxfp8(codes, scales)]


def undo_gguf(t, rows: int) -> list:
    """[(fault key, what it is, codes, scales)]: a GGUF FP4 tensor's bytes with each known fault undone —
    gpt-oss's pair order where ggml's halves belong, the scale bytes one binade high or low, the blocks written
    column by column."""
    from ..layout import unpack_fp4
    from .gguf import GGUFTensor, block_layout, to_ggml_order
    codes, scales = t.codes, t.scales
    n, nbytes, _, sub = block_layout(t.type)
    # the stored bytes are the true codes in fp4sim / gpt-oss pair packing; the reader took them for ggml's
    # halves: packing its codes back in ggml's order gives those bytes, i.e. the true codes in fp4sim's packing
    pairs = to_ggml_order(unpack_fp4(codes), sub)
    step = 1 if t.type == "MXFP4" else 8                  # one binade: E8M0 + 1, E4M3's exponent field + 1
    bias = "scale-bias" if step == 1 else "half-factor"
    out = [("pairs", "the codes are in gpt-oss's pair order (elements 2j and 2j + 1 in byte j), not ggml's halves "
            f"(elements j and j + {sub // 2})", pairs, scales),
           (bias, "the scale bytes are one binade high" + (" (E8M0 written with bias 128)" if step == 1 else
                                                           " (the 0.5 factor of ggml's UE4M3 left out)"),
            codes, (scales.astype(np.int16) - step).clip(0, 255).astype(np.uint8)),
           (bias, "the scale bytes are one binade low" + (" (E8M0 read with bias 128)" if step == 1 else
                                                          " (ggml's UE4M3 0.5 factor applied twice)"),
            codes, (scales.astype(np.int16) + step).clip(0, 255).astype(np.uint8))]
    # blocks written column by column: the file's block i is block (i % rows, i // rows) of the (rows, K / n) grid
    nb = t.shape[-1] // n
    raw = np.ascontiguousarray(t.stored(), np.uint8).reshape(nb, rows, nbytes).transpose(1, 0, 2)
    tt = GGUFTensor(t.name, t.type, t.shape, np.ascontiguousarray(raw))
    out.append(("transposed-blocks", f"the blocks are transposed (written by K / {n} first, then rows)", tt.codes,
                tt.scales))
    return out


def faults_table() -> str:
    """:data:`FAULTS` as the Markdown table of the docs."""
    rows = ["| fault | what it is | looked for in | found |", "|---|---|---|---|"]
    for f in FAULTS.values():
        rows.append(f"| `{f.key}` | {f.title} | {', '.join(f.formats)} | {f.found} |")
    return "\n".join(rows)
