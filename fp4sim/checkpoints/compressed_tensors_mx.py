"""compressed-tensors' MX checkpoints (``quantization_config.format: "mxfp4-pack-quantized"``,
``"mxfp6-pack-quantized"`` or ``"mxfp8-quantized"``, as llm-compressor writes them), read into fp4sim's
conventions.

Per quantized linear ``NAME``: ``NAME.weight_packed`` U8 (out, in / 2), element 2i in the low nibble of byte i
(fp4sim's packing, as for its NVFP4 format), and ``NAME.weight_scale`` U8 (out, in / 32), the E8M0 exponent
bytes (value = E2M1 x 2^(e - 127)); no global scale. The config's ``ignore`` lists the modules left in high
precision. compressed-tensors' own decompressor reads a scale as ``2^(e - 127)`` in bfloat16. MXFP8 stores
``NAME.weight`` F8_E4M3 (out, in), one E4M3 byte per element, beside the same ``NAME.weight_scale``; MXFP6 stores
``NAME.weight_packed`` U8 (out, 3 in / 4): E2M3 codes c0..c3 as the 24-bit word c0 | c1 << 6 | c2 << 12 | c3 << 18,
low byte first.

A folder whose config names this format while its tensors hold another (a ``weight_global_scale`` beside the
codes, E4M3 scale bytes, one scale per 16 elements: NVFP4's) is read with each such weight listed in ``broken``
with what its tensors are; the rule that writes these bytes is the registry's ``compressed-tensors-mxfp4``
(:func:`fp4sim.checkpoints.rules.compressed_tensors_mx_quantize`), and ``compressed-tensors-mxfp8``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .folders import entry_dtype, entry_shape, folder_says, not_bytes, open_folder, read_json
from .gpt_oss import GptOssCheckpoint, MXFP4Weight
from .mlx import MLXWeight
from .records import LAYOUTS

__all__ = ["FORMAT", "FORMATS", "is_compressed_tensors_mx", "read_compressed_tensors_mx", "MXCheckpoint",
           "MXFP8Weight", "MXFP6Weight"]

FORMAT = "mxfp4-pack-quantized"
FORMATS = {FORMAT: "mxfp4", "mxfp8-quantized": "mxfp8", "mxfp6-pack-quantized": "mxfp6"}   # format -> the MX mode


def _mode(qc: dict) -> str | None:
    """The MX mode a quantization_config names: its format, or the first config group's that is MX."""
    groups = [g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    return next((FORMATS[f] for f in [qc.get("format"), *groups] if f in FORMATS), None)


def _config(d: Path) -> dict | None:
    """The quantization_config of ``d``'s config.json where it names one of compressed-tensors' MX formats
    (:data:`FORMATS`; the top-level format, or a config group's), else None."""
    p = d / "config.json"
    if not p.is_file():
        return None
    cfg = read_json(p)
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(qc, dict):
        return None
    return qc if _mode(qc) is not None else None


def is_compressed_tensors_mx(d) -> bool:
    """Whether the folder ``d`` holds a compressed-tensors MX export (its config.json says
    ``mxfp4-pack-quantized`` or ``mxfp8-quantized``)."""
    return folder_says(d, _config)


@dataclass
class MXCheckpoint(GptOssCheckpoint):
    """A compressed-tensors MXFP4 folder, with the fields of a gpt-oss one: ``weights`` (module ->
    :class:`~fp4sim.checkpoints.gpt_oss.MXFP4Weight` with the compressed-tensors layout), ``excluded`` (the
    config's ``ignore``), ``other`` (every other entry: name -> (file, dtype, shape)), ``config`` (the quantization
    config) and ``broken`` (module -> why its entries do not make an MXFP4 weight: filled where read with
    ``strict=False``)."""
    format: str = "compressed-tensors mxfp4"


class MXFP8Weight(MLXWeight):
    """One compressed-tensors MXFP8 weight: the record of an MLX mxfp8 module (``codes``: one E4M3 byte per
    element, (out, in); ``scales``: E8M0 bytes per 32; ``values()``), read from ``NAME.weight`` and
    ``NAME.weight_scale``."""


class MXFP6Weight(MLXWeight):
    """One compressed-tensors MXFP6 weight (mode "mxfp6"): ``codes`` E2M3 packed four to three bytes, (out, 3 in /
    4), compressed-tensors' little-endian order (:func:`fp4sim.layout.unpack_fp6`); ``scales`` E8M0 bytes per 32;
    read from ``NAME.weight_packed`` and ``NAME.weight_scale``."""


def _packed_problem(files, m, fmt: str, config: str) -> str | None:
    """What packed codes ``m.weight_packed`` (MXFP4 or MXFP6: ``fmt``) lack beside them, or hold that belongs
    to NVFP4 (a tensor scale, E4M3 scale bytes), under a config naming ``config``; None if neither."""
    kc, ks = f"{m}.weight_packed", f"{m}.weight_scale"
    if ks not in files:
        return f"{kc} has no {ks} beside it (the E8M0 scales of its blocks)"
    if f"{m}.weight_global_scale" in files:
        return (f"{m}.weight_global_scale is there: a tensor scale beside the codes is NVFP4's "
                f"(nvfp4-pack-quantized), not {fmt}'s, under a config that names {config}")
    if str(entry_dtype(files[ks], ks)) == "F8_E4M3":
        return (f"{ks} is F8_E4M3: E4M3 block scales are NVFP4's, not {fmt}'s E8M0 exponent bytes (U8), under a "
                f"config that names {config}")
    return None


def _problem6(files, m) -> str | None:
    """Why module ``m``'s entries do not make an MXFP6 weight, or None."""
    kc, ks = f"{m}.weight_packed", f"{m}.weight_scale"
    why = _packed_problem(files, m, "MXFP6", "mxfp6-pack-quantized")
    if why:
        return why
    cs, ss = entry_shape(files[kc], kc), entry_shape(files[ks], ks)
    if len(cs) != 2 or len(ss) != 2 or cs[0] != ss[0] or 4 * cs[1] != 3 * 32 * ss[1]:
        per = ""
        if len(cs) == 2 == len(ss) and ss[1]:
            per = (f" (one scale per {2 * cs[1] // ss[1]} elements if these were packed FP4: mxfp4-pack-quantized)"
                   if 2 * cs[1] == 32 * ss[1] else f" ({cs[1]} bytes for {32 * ss[1]} elements)")
        return (f"{kc} has shape {cs} and {ks} {ss}{per}; MXFP6 stores codes four to three bytes (out, 3 in / 4) "
                "beside one E8M0 byte per 32 elements (out, in / 32)")
    return not_bytes(files, (kc, ks))


def _problem(files, m) -> str | None:
    """Why module ``m``'s entries do not make an MXFP4 weight, or None."""
    kc, ks = f"{m}.weight_packed", f"{m}.weight_scale"
    why = _packed_problem(files, m, "MXFP4", FORMAT)
    if why:
        return why
    cs, ss = entry_shape(files[kc], kc), entry_shape(files[ks], ks)
    if len(cs) != 2 or len(ss) != 2 or cs[0] != ss[0] or 2 * cs[1] != 32 * ss[1]:
        per = f" (one scale per {2 * cs[1] // ss[1]} elements)" if len(cs) == 2 == len(ss) and ss[1] else ""
        return (f"{kc} has shape {cs} and {ks} {ss}{per}; MXFP4 stores codes (out, in / 2) beside one E8M0 byte "
                "per 32 elements (out, in / 32)")
    return not_bytes(files, (kc, ks))


def _problem8(files, m) -> str | None:
    """Why module ``m``'s entries do not make an MXFP8 weight, or None."""
    kw, ks = f"{m}.weight", f"{m}.weight_scale"
    if f"{m}.weight_packed" in files:
        return (f"{m}.weight_packed is there: packed FP4 codes (mxfp4-pack-quantized or nvfp4-pack-quantized) under a "
                "config that names mxfp8-quantized")
    if kw not in files:
        return f"{ks} has no {kw} beside it (the FP8 elements of its blocks)"
    if f"{m}.weight_global_scale" in files:
        return f"{m}.weight_global_scale is there: a tensor scale is not MXFP8's"
    wd, sd = str(entry_dtype(files[kw], kw)), str(entry_dtype(files[ks], ks))
    if wd != "F8_E4M3" or sd not in ("U8", "I8"):
        return f"{kw} is {wd} and {ks} {sd}; MXFP8 stores F8_E4M3 elements beside E8M0 exponent bytes (U8)"
    ws, ss = entry_shape(files[kw], kw), entry_shape(files[ks], ks)
    if len(ws) != 2 or len(ss) != 2 or ws[0] != ss[0] or ws[1] != 32 * ss[1]:
        return (f"{kw} has shape {ws} and {ks} {ss}; MXFP8 stores (out, in) elements beside one E8M0 byte per 32 "
                "elements (out, in / 32)")
    return None


def read_compressed_tensors_mx(path, strict: bool = True) -> MXCheckpoint:
    """Read a compressed-tensors MX folder (MXFP4 or MXFP8, sharded or not); ValueError naming the file and what
    is wrong: no such folder, no MX quantization_config, no .safetensors, and — where ``strict`` — a module whose
    entries do not make a weight of its format (listed in ``broken`` with ``strict=False``, the others read)."""
    d, qc, files = open_folder(path, _config, "config.json has no quantization_config with format "
                                              + " or ".join(map(repr, FORMATS)))
    mode = _mode(qc)
    fp8 = mode == "mxfp8"
    anchor = ".weight_scale" if fp8 else ".weight_packed"      # the entry every quantized module of the format has
    problem = {"mxfp8": _problem8, "mxfp6": _problem6}.get(mode, _problem)
    weights, broken, used = {}, {}, set()
    for key in sorted(files):
        if not key.endswith(anchor):
            continue
        m = key[: -len(anchor)]
        used.update(k for k in (f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_global_scale")
                    + ((f"{m}.weight",) if fp8 else ()) if k in files)
        why = problem(files, m)
        if why is None:
            weights[m] = _record(files, m, mode)
        elif strict:
            raise ValueError(f"{d}: {why}")
        else:
            broken[m] = why
    other = {n: (f, str(entry_dtype(f, n)), entry_shape(f, n)) for n, f in files.items() if n not in used}
    return MXCheckpoint(d, weights, list(qc.get("ignore") or []), other, qc, broken, "compressed-tensors " + mode)


def _record(files, m, mode):
    """The weight record of module ``m``: an MXFP8 one (``NAME.weight`` E4M3 bytes), an MXFP6 one (packed E2M3), or
    an MXFP4 one."""
    ks = f"{m}.weight_scale"
    if mode == "mxfp6":
        kc = f"{m}.weight_packed"
        R, nb = entry_shape(files[kc], kc)
        return MXFP6Weight(m, "mxfp6", (R, nb * 4 // 3), {"codes": (files[kc], kc), "scales": (files[ks], ks)},
                           LAYOUTS["compressed-tensors mxfp6"])
    if mode == "mxfp8":
        R, K = entry_shape(files[f"{m}.weight"], f"{m}.weight")
        return MXFP8Weight(m, "mxfp8", (R, K), {"codes": (files[f"{m}.weight"], f"{m}.weight"),
                                                "scales": (files[ks], ks)}, LAYOUTS["compressed-tensors mxfp8"])
    kc = f"{m}.weight_packed"
    R, half = entry_shape(files[kc], kc)
    return MXFP4Weight(m, (R, 2 * half), {"blocks": (files[kc], kc), "scales": (files[ks], ks)},
                       LAYOUTS["compressed-tensors mxfp4"])
