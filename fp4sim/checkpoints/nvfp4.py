"""NVFP4 checkpoints as exporters write them: ModelOpt's and compressed-tensors' Hugging Face folders, read into
fp4sim's conventions.

The two formats side by side (per quantized linear ``NAME``):

================  =======================================  ==============================================
                  ModelOpt (``hf_quant_config.json``)      compressed-tensors (``config.json``)
================  =======================================  ==============================================
codes             ``NAME.weight`` U8 (out, in/2)           ``NAME.weight_packed`` U8 (out, in/2)
block scales      ``NAME.weight_scale`` F8_E4M3 (out,      ``NAME.weight_scale`` F8_E4M3 (out, in/16)
                  in/16)
tensor scale      ``NAME.weight_scale_2`` F32 = amax /     ``NAME.weight_global_scale`` F32 = 2688 /
                  2688, a multiplier                       amax, a divisor
activation scale  ``NAME.input_scale`` = amax / 2688       ``NAME.input_global_scale`` = 2688 / amax
config            ``quantization.quant_algo: "NVFP4"``,    ``quantization_config.format:
                  ``group_size``, ``exclude_modules``      "nvfp4-pack-quantized"``, ``ignore``
================  =======================================  ==============================================

Both pack element 2i of a row in the low nibble of byte i (fp4sim's order) and store the block scales row by
row (the linear layout). A value decodes as ``e2m1 · scale · weight_scale_2`` (ModelOpt) or ``e2m1 · scale /
weight_global_scale`` (compressed-tensors). fp4sim holds the tensor scale as the tensor amax it stands for
(``global_amax``): ``2688 · weight_scale_2`` or ``2688 / weight_global_scale``, rounded to float32.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .folders import entry_dtype, entry_files, entry_shape, read_json
from .records import LAYOUTS

__all__ = ["read_checkpoint", "Checkpoint", "QuantWeight", "FORMATS", "is_checkpoint", "dequantize_weight",
           "excluded_by", "detect", "KEYS"]

FORMATS = ("modelopt", "compressed-tensors")
# per format: the key suffixes of codes, block scales, tensor scale, activation scale
KEYS = {"modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
        "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}


@dataclass
class QuantWeight:
    """One quantized linear of a checkpoint, as stored: ``codes`` (uint8, two E2M1 codes per byte), ``scales``
    (the E4M3 block-scale bytes as uint8, in the shape stored; None when missing), ``tensor_scale`` (the stored
    float32 value, None when the entry is missing) and its meaning in fp4sim's convention, ``global_amax`` (None
    when missing or not finite and positive); ``files``: where each entry was read; ``layout`` and ``values()``
    as every reader's record has them (:mod:`fp4sim.checkpoints.records`). The codes and scales are read
    from their files when asked for (not kept), so a checkpoint of any size is held as its headers and scalars."""
    name: str
    tensor_scale: np.float32 | None
    global_amax: np.float32 | None
    input_scale: np.float32 | None
    entries: dict = field(default_factory=dict)          # role -> (file path, key, stored shape)
    dtypes: dict = field(default_factory=dict)           # role -> the dtype label of its header ("U8", "F8_E4M3")
    format: str | None = None                            # "modelopt" or "compressed-tensors" (read_checkpoint's)

    @property
    def layout(self):
        """The format's :class:`~fp4sim.checkpoints.records.Layout`."""
        return LAYOUTS[self._format()]

    def _format(self) -> str:
        if self.format not in FORMATS:
            raise ValueError(f"{self.name}: its format is not known (read it with read_checkpoint)")
        return self.format

    def values(self) -> np.ndarray:
        """float32 (out, in): :func:`dequantize_weight` in the checkpoint's format."""
        return dequantize_weight(self, self._format())

    @property
    def files(self) -> dict:
        """{role: the file name its entry is in} (codes, scales, tensor_scale, input_scale)."""
        return {r: Path(p).name for r, (p, _, _) in self.entries.items()}

    def _read(self, role):
        from .._safetensors import load_safetensors
        path, key, _ = self.entries[role]
        a = load_safetensors(path, key)
        return np.ascontiguousarray(a).view(np.uint8) if a.dtype.itemsize == 1 else a

    def read_rows(self, role, r0: int, r1: int) -> np.ndarray:
        """Rows ``r0`` to ``r1`` of entry ``role`` ("codes", "scales") as bytes, (r1 - r0, bytes per row): only
        those bytes read."""
        from .._safetensors import load_safetensors_rows
        path, key, _ = self.entries[role]
        a = load_safetensors_rows(path, key, self.shape[0], r0, r1)
        return a.view(np.uint8) if a.dtype.itemsize == 1 else a

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """float32 (r1 - r0, in): rows ``r0`` to ``r1`` of :meth:`values`, reading only their bytes."""
        return dequantize_weight(self, self._format(), r0, r1)

    @property
    def codes(self) -> np.ndarray:
        return self._read("codes")

    @property
    def scales(self) -> np.ndarray | None:
        return self._read("scales") if "scales" in self.entries else None

    @property
    def shape(self) -> tuple:
        """(out_features, in_features) implied by the codes (from the file's header)."""
        sh = self.entries["codes"][2]
        return (sh[0], 2 * sh[1]) if len(sh) == 2 else tuple(sh)


@dataclass
class Checkpoint:
    """An NVFP4 checkpoint folder: its ``format`` ("modelopt" or "compressed-tensors"), ``group_size``, the
    quantized linears by module name (``weights``), the module names or globs it excludes from quantization
    (``excluded``), every other tensor entry by name (``other``: name -> (file, dtype, shape)), and the config it
    was detected from."""
    path: Path
    format: str
    group_size: int
    weights: dict
    excluded: list
    other: dict
    config: dict

    def is_excluded(self, module: str) -> bool:
        """Whether one of the checkpoint's exclude entries names ``module`` (:func:`excluded_by`)."""
        return any(excluded_by(module, e) for e in self.excluded)


def excluded_by(module: str, entry: str) -> bool:
    """Whether an exclude entry names ``module``: the name itself, a suffix of its dotted components, or a glob."""
    return module == entry or module.endswith("." + entry) or fnmatch.fnmatchcase(module, entry)


def detect(d: Path, names) -> tuple[str, dict, int, list]:
    """(format, config, group size, excluded modules) from the folder's config files, else from its key names."""
    hq, cfg = d / "hf_quant_config.json", d / "config.json"
    if hq.is_file():
        q = read_json(hq).get("quantization", {})
        if str(q.get("quant_algo", "")).upper() != "NVFP4":
            raise ValueError(f"{hq}: quant_algo {q.get('quant_algo')!r} is not NVFP4 (fp4sim reads NVFP4 exports)")
        return "modelopt", q, int(q.get("group_size") or 16), list(q.get("exclude_modules") or [])
    qc = read_json(cfg).get("quantization_config") if cfg.is_file() else None
    if isinstance(qc, dict):
        if qc.get("quant_method") == "modelopt" or "quant_algo" in qc:
            algo = str(qc.get("quant_algo", "")).upper()
            if algo and algo != "NVFP4":
                raise ValueError(f"{cfg}: quant_algo {algo!r} is not NVFP4")
            return "modelopt", qc, int(qc.get("group_size") or 16), list(qc.get("exclude_modules")
                                                                         or qc.get("ignore") or [])
        fmt = qc.get("format") or ""
        groups = qc.get("config_groups") or {}
        sizes = {(g.get("weights") or {}).get("group_size") for g in groups.values() if isinstance(g, dict)}
        if fmt == "nvfp4-pack-quantized" or any(isinstance(g, dict) and g.get("format") == "nvfp4-pack-quantized"
                                                for g in groups.values()):
            size = next((s for s in sizes if s), 16)
            return "compressed-tensors", qc, int(size), list(qc.get("ignore") or [])
        raise ValueError(f"{cfg}: quantization_config format {fmt!r} is not NVFP4 (nvfp4-pack-quantized)")
    if any(n.endswith(".weight_packed") for n in names):
        return "compressed-tensors", {}, 16, []
    if any(n.endswith(".weight_scale_2") for n in names):
        return "modelopt", {}, 16, []
    raise ValueError(f"{d}: no NVFP4 checkpoint found (no hf_quant_config.json, no quantization_config in "
                     "config.json, and no *.weight_scale_2 / *.weight_packed entries)")


def _scalar(a) -> np.float32 | None:
    a = np.asarray(a)
    if a.size != 1 or a.dtype.kind != "f":
        return None
    return np.float32(a.reshape(-1)[0])


def read_checkpoint(path) -> Checkpoint:
    """Read an NVFP4 checkpoint folder (sharded or not); ValueError naming the file and what is wrong."""
    from .._safetensors import load_safetensors
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{d}: not a folder (give the checkpoint's folder, with its config and .safetensors)")
    files = entry_files(d)
    if not files:
        raise ValueError(f"{d}: no .safetensors files")
    fmt, cfg, group, excluded = detect(d, files)
    if group != 16:
        raise ValueError(f"{d}: group_size {group}; NVFP4 blocks are 16 elements")
    kc, ks, kg, ki = KEYS[fmt]
    # a module is quantized when its codes entry is one-byte integers or its block / tensor scale is there (so that
    # codes a writer labelled I8, or stored in another dtype, are checked and named, not dropped as a plain weight)
    mods = sorted({n[: -len(kc) - 1] for n, f in files.items() if n.endswith("." + kc)
                   and (str(entry_dtype(f, n)) in ("U8", "I8") or fmt != "modelopt"
                        or any(f"{n[: -len(kc)]}{k}" in files for k in (ks, kg)))})
    weights, used = {}, set()
    for m in mods:
        got, entries, dtypes = {}, {}, {}
        for role, suf in (("codes", kc), ("scales", ks), ("tensor_scale", kg), ("input_scale", ki)):
            key = f"{m}.{suf}"
            if key in files:
                entries[role] = (files[key], key, entry_shape(files[key], key))
                dtypes[role] = str(entry_dtype(files[key], key))
                if role in ("tensor_scale", "input_scale"):       # scalars: read now
                    got[role] = load_safetensors(files[key], key)
                used.add(key)
        ts = _scalar(got["tensor_scale"]) if "tensor_scale" in got else None
        amax = None
        if ts is not None and np.isfinite(ts) and ts > 0:
            with np.errstate(over="ignore", divide="ignore"):
                amax = np.float32(np.float32(2688.0) * ts) if fmt == "modelopt" else np.float32(
                    np.float32(2688.0) / ts)
        inp = _scalar(got["input_scale"]) if "input_scale" in got else None
        weights[m] = QuantWeight(m, ts, amax, inp, entries, dtypes, fmt)
    other = {n: (f, str(entry_dtype(f, n)), entry_shape(f, n)) for n, f in files.items() if n not in used}
    return Checkpoint(d, fmt, group, weights, excluded, other, cfg)


def is_checkpoint(d) -> bool:
    """Whether the folder ``d`` holds an NVFP4 export, by its config files (a ModelOpt FP8 export, or a folder
    whose config files cannot be read, is not one)."""
    try:
        detect(Path(d), ())
        return True
    except ValueError:
        return False


def dequantize_weight(w: QuantWeight, fmt: str, r0: int = 0, r1: int | None = None) -> np.ndarray:
    """The weight's values, float32 (out, in): E2M1 value x decoded E4M3 block scale x the tensor scale, in the
    format's own operations (ModelOpt: ``fl(s · weight_scale_2)``; compressed-tensors: ``fl(s /
    weight_global_scale)``, then times the element). ``r0``, ``r1``: only those rows (only their bytes read)."""
    from ..formats import E2M1, E4M3
    from ..layout import unpack_fp4
    R, K = w.shape
    r1 = R if r1 is None else r1
    nb = -(-K // 16)
    whole = (r0, r1) == (0, R)
    ns = (w.scales.size if whole else int(np.prod(w.entries["scales"][2], dtype=np.int64))) \
        if "scales" in w.entries else None
    if ns != R * nb or w.tensor_scale is None:
        raise ValueError(f"{w.name}: its block scales or tensor scale are missing or of the wrong size "
                         "(python -m fp4sim.validate checkpoint says which)")
    sc, codes = (w.scales, w.codes) if whole else (w.read_rows(role, r0, r1) for role in ("scales", "codes"))
    n = r1 - r0
    s = E4M3.values[np.asarray(sc, np.uint8).reshape(n, nb)].astype(np.float32)
    with np.errstate(all="ignore"):
        fac = s * np.float32(w.tensor_scale) if fmt == "modelopt" else s / np.float32(w.tensor_scale)
        v = E2M1.values[unpack_fp4(codes)].astype(np.float32)
        return (v.reshape(n, nb, 16) * fac[:, :, None]).reshape(n, nb * 16)[:, :K].astype(np.float32)
