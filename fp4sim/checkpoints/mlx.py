"""MLX checkpoints in its float modes, as mlx-lm writes them (``mlx_lm.convert --q-mode mxfp4 | nvfp4 | mxfp8``),
read into fp4sim's conventions.

``config.json`` names the mode: ``"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}`` (and the same
under ``quantization_config``); a module's own entry, ``"quantization": {"MODULE": {...}}``, overrides it for
that module (``false``: left unquantized). Per quantized module ``NAME`` (linears and embeddings alike):

- ``NAME.weight``: U32 (out, in x bits / 32), the elements packed from the lowest bits up — read as
  little-endian bytes, element 2i in the low nibble of byte i for FP4 (fp4sim's packing), one E4M3 byte per
  element for mxfp8;
- ``NAME.scales``: U8 (out, in / group): E8M0 exponents (mxfp4, mxfp8; group 32) or E4M3 bytes (nvfp4, group
  16); no biases (MLX's affine mode has them, and is not a float format).

The rules that write them are the registry's ``mlx-mxfp4``, ``mlx-nvfp4``, ``mlx-mxfp8``
(:func:`fp4sim.checkpoints.rules.mlx_quantize`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .folders import entry_dtype, entry_shape, folder_says, open_folder, read_json
from .records import LAYOUTS, Layout
from .rules import MLX_MODES

__all__ = ["is_mlx", "read_mlx", "MLXCheckpoint", "MLXWeight"]

BITS = {"mxfp4": 4, "nvfp4": 4, "mxfp8": 8}
GROUP = {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32}


def _config(d: Path) -> dict | None:
    """config.json's ``quantization`` (or ``quantization_config``) where it is MLX's (it has a ``mode``, or
    ``bits`` and ``group_size``), else None."""
    p = d / "config.json"
    if not p.is_file():
        return None
    cfg = read_json(p)
    q = cfg.get("quantization") or cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if isinstance(q, dict) and ("mode" in q or {"bits", "group_size"} <= set(q)) and "quant_method" not in q:
        return q
    return None


def is_mlx(d) -> bool:
    """Whether the folder ``d`` holds an MLX-quantized checkpoint (its config.json's ``quantization`` is
    MLX's)."""
    return folder_says(d, _config)


@dataclass
class MLXWeight:
    """One quantized module: ``name``, ``mode`` ("mxfp4", "nvfp4", "mxfp8"), ``shape`` (out, in), where its two
    entries are (``entries``: "codes" / "scales" -> (file, key)) and its ``layout``. ``codes`` (uint8: (out,
    in / 2) packed E2M1 in fp4sim's order, or (out, in) E4M3 bytes for mxfp8), ``scales`` (uint8 (out, in /
    group)) and ``values()`` are read from the files when asked for."""
    name: str
    mode: str
    shape: tuple
    entries: dict = field(default_factory=dict)
    layout: Layout | None = None
    tensor_scale = None                     # MLX's float modes store no tensor scale (nvfp4's global one aside)

    def _read(self, role) -> np.ndarray:
        from .._safetensors import load_safetensors
        path, key = self.entries[role]
        a = np.ascontiguousarray(load_safetensors(path, key))
        return a.view(np.uint8).reshape(a.shape[0], -1) if a.dtype.itemsize == 4 or a.dtype.itemsize == 1 else a

    @property
    def codes(self) -> np.ndarray:
        return self._read("codes")

    @property
    def scales(self) -> np.ndarray:
        return self._read("scales")

    def values(self) -> np.ndarray:
        """float32 (out, in): E2M1 (or E4M3) x 2^(e - 127), or E2M1 x E4M3(s) for nvfp4 — MLX's dequantize, which
        returns them in bfloat16 (each such product is exact in bfloat16 where it is in float32's range)."""
        return self.decode(self.codes, self.scales)

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """float32 (r1 - r0, in): rows ``r0`` to ``r1`` of :meth:`values`, reading only their bytes."""
        from .._safetensors import load_safetensors_rows
        c, s = (load_safetensors_rows(*self.entries[role], self.shape[0], r0, r1) for role in ("codes", "scales"))
        return self.decode(*(a.view(np.uint8) if a.dtype.itemsize in (1, 4) else a for a in (c, s)))

    def decode(self, codes, s) -> np.ndarray:
        """float32 (rows, in) of ``codes`` and scales ``s``: rows of :attr:`codes` and :attr:`scales` (a piece of the
        weight) as :meth:`values` reads them."""
        from ..formats import E2M1, E2M3, E4M3
        from ..layout import unpack_fp4, unpack_fp6
        if self.mode == "nvfp4":
            f = E4M3.values[s].astype(np.float32)
        else:
            f = np.where(s == 255, np.float32(np.nan), np.ldexp(np.float32(1), np.minimum(s, 254).astype(np.int32)
                                                                 - 127)).astype(np.float32)
        v = (E4M3.values[codes] if self.mode == "mxfp8" else E2M3.values[unpack_fp6(codes)] if self.mode == "mxfp6"
             else E2M1.values[unpack_fp4(codes)]).astype(np.float32)
        with np.errstate(over="ignore"):
            return (v * np.repeat(f, v.shape[1] // f.shape[1], axis=1)).astype(np.float32)


@dataclass
class MLXCheckpoint:
    """An MLX folder: ``weights`` (module -> :class:`MLXWeight`), ``other`` (every other entry: name -> (file,
    dtype, shape)), ``config`` (its quantization config), ``broken`` (module -> why its entries or its mode do
    not make a weight fp4sim reads: an affine module, an unknown mode, shapes that disagree) and ``excluded``
    (the modules the config leaves unquantized)."""
    path: Path
    weights: dict
    other: dict
    config: dict
    broken: dict = field(default_factory=dict)
    excluded: list = field(default_factory=list)
    format: str = "mlx"


def _mode_of(q: dict, module: str):
    """(mode, group, bits) of ``module`` under config ``q``: its own entry where there is one (False: None)."""
    own = q.get(module)
    if own is False:
        return None
    src = own if isinstance(own, dict) else q
    mode = src.get("mode", "affine")
    return mode, src.get("group_size"), src.get("bits")


def _problem(files, m, mode, group, bits) -> str | None:
    kc, ks = f"{m}.weight", f"{m}.scales"
    if mode not in MLX_MODES:
        what = ("MLX's affine (integer) quantization, not a float format" if mode == "affine" else
                f"an unknown mode {mode!r}")
        return f"mode {mode!r}: {what}; fp4sim reads MLX's {', '.join(MLX_MODES)}"
    if (group, bits) != (GROUP[mode], BITS[mode]):
        return f"{mode} with group_size {group} and bits {bits}; MLX's {mode} is group {GROUP[mode]}, {BITS[mode]} bits"
    if f"{m}.biases" in files:
        return f"{m}.biases is there: affine quantization's, not {mode}'s"
    cs, ss = entry_shape(files[kc], kc), entry_shape(files[ks], ks)
    if str(entry_dtype(files[kc], kc)) != "U32" or str(entry_dtype(files[ks], ks)) != "U8":
        return f"{kc} is {entry_dtype(files[kc], kc)} and {ks} {entry_dtype(files[ks], ks)}; MLX stores U32 and U8"
    if len(cs) != 2 or len(ss) != 2 or cs[0] != ss[0] or cs[1] * 32 // BITS[mode] != ss[1] * GROUP[mode]:
        return (f"{kc} has shape {cs} and {ks} {ss}; {mode} stores (out, in x {BITS[mode]} / 32) words beside one "
                f"scale byte per {GROUP[mode]} elements")
    return None


def read_mlx(path, strict: bool = True) -> MLXCheckpoint:
    """Read an MLX-quantized folder (sharded or not); ValueError naming the file and what is wrong: no such
    folder, no MLX quantization config, no .safetensors, and — where ``strict`` — a module fp4sim cannot read
    as one of MLX's float modes (listed in ``broken`` with ``strict=False``, the others read)."""
    d, q, files = open_folder(path, _config, "config.json has no MLX quantization config ('quantization' with a "
                                             "mode, or bits and group_size)")
    weights, broken, used, excluded = {}, {}, set(), []
    for key in sorted(files):
        if not key.endswith(".scales"):
            continue
        m = key[: -len(".scales")]
        if f"{m}.weight" not in files:
            why = f"{key} has no {m}.weight beside it"
        else:
            got = _mode_of(q, m)
            if got is None:
                excluded.append(m)
                continue
            why = _problem(files, m, *got)
        used.update(k for k in (key, f"{m}.weight", f"{m}.biases") if k in files)
        if why is None:
            mode = got[0]
            R, words = entry_shape(files[f"{m}.weight"], f"{m}.weight")
            weights[m] = MLXWeight(m, mode, (R, words * 32 // BITS[mode]),
                                   {"codes": (files[f"{m}.weight"], f"{m}.weight"), "scales": (files[key], key)},
                                   LAYOUTS[f"mlx {mode}"])
        elif strict:
            raise ValueError(f"{d}: {m}: {why}")
        else:
            broken[m] = why
    excluded += [m for m, v in q.items() if v is False and m not in excluded]
    other = {n: (f, str(entry_dtype(f, n)), entry_shape(f, n)) for n, f in files.items() if n not in used}
    return MLXCheckpoint(d, weights, other, q, broken, excluded)
