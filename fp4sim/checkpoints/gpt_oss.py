"""gpt-oss's MXFP4 safetensors checkpoints (OpenAI's open-weight MoE models), read into fp4sim's conventions, and
which MXFP4 rule reproduces a tensor of one from its high-precision weights.

A quantized weight ``NAME`` (the experts' ``gate_up_proj`` and ``down_proj``) is stored as two entries:

- ``NAME_blocks``: uint8 [experts, rows, K / 32, 16], 16 bytes = 32 E2M1 codes per block, element 2j in the low
  nibble of byte j and 2j + 1 in the high one (fp4sim's own packing);
- ``NAME_scales``: uint8 [experts, rows, K / 32], the E8M0 exponent bytes (value = E2M1 x 2^(e - 127)).

``config.json`` names it: ``quantization_config: {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.
transformers' ``convert_moe_packed_tensors`` dequantizes a weight in bfloat16 (the E2M1 value times ``ldexp``)
and transposes it to [experts, K, rows], the layout its forward pass multiplies; :meth:`MXFP4Weight.values` gives
the float32 values in the stored [experts, rows, K] order (rounded to bfloat16 and transposed: transformers'
tensor, bit for bit, for every scale byte but 255, which OCP's E8M0 reads as NaN and ldexp as 2^128).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .folders import entry_dtype, entry_shape, folder_says, not_bytes, open_folder, read_json
from .records import LAYOUTS, Layout
from .rules import MX_RULES, Requantized, mx_rule_key, reproducing
from .rules import rule as registry_rule

__all__ = ["is_gpt_oss", "read_gpt_oss", "GptOssCheckpoint", "MXFP4Weight", "reproducing_rules", "MX_RULES",
           "rule_bytes", "reference_orientations", "reference_rows", "matching_orientation", "match_readings", "STORED",
           "TRANSPOSED"]



def _config(d: Path) -> dict | None:
    p = d / "config.json"
    if not p.is_file():
        return None
    cfg = read_json(p)
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return qc if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4" else None


def is_gpt_oss(d) -> bool:
    """Whether the folder ``d`` holds a gpt-oss-style MXFP4 checkpoint (its config.json's quantization_config
    says ``quant_method: mxfp4``)."""
    return folder_says(d, _config)


@dataclass
class MXFP4Weight:
    """One quantized MXFP4 weight of a safetensors folder: ``name`` (gpt-oss: the entry names without ``_blocks``
    / ``_scales``; compressed-tensors: the module's), ``shape`` ((experts,) rows, K), where its two entries are
    (``entries``: "blocks" / "scales" -> (file, key)) and its ``layout`` (gpt-oss's, or compressed-tensors'
    ``mxfp4-pack-quantized``: the same bytes, codes (out, in / 2) and scales (out, in / 32)). ``codes`` (uint8
    (experts x rows, K / 2), fp4sim's packing), ``scales`` (uint8 (experts x rows, K / 32), E8M0 bytes) and
    ``values()`` are read from the files when asked for."""
    name: str
    shape: tuple
    entries: dict = field(default_factory=dict)
    layout: Layout = LAYOUTS["gpt-oss"]

    def _read(self, role):
        from .._safetensors import load_safetensors
        path, key = self.entries[role]
        a = load_safetensors(path, key)
        return np.ascontiguousarray(a).view(np.uint8) if a.dtype.itemsize == 1 else a

    def _rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def codes(self) -> np.ndarray:
        return self._read("blocks").reshape(self._rows(), -1)

    @property
    def scales(self) -> np.ndarray:
        return self._read("scales").reshape(self._rows(), -1)

    tensor_scale = None                     # MXFP4 stores no tensor scale

    def quantized(self):
        """The weight as an fp4sim :class:`~fp4sim.QuantizedTensor` of scheme ``mxfp4``, (experts x rows, K) along
        K."""
        from ..qtensor import QuantizedTensor
        from ..schemes import get_scheme
        n = int(np.prod(self.shape[:-1], dtype=np.int64))
        return QuantizedTensor(codes=self.codes, scales=self.scales, global_amax=None, scheme=get_scheme("mxfp4"),
                               axis=1, shape=(n, self.shape[-1]))

    def values(self) -> np.ndarray:
        """float32 (experts, rows, K): E2M1 x 2^(e - 127), E8M0 255 as NaN (OCP) — ``fs.dequantize`` of
        :meth:`quantized`."""
        return self.decode(self.codes, self.scales).reshape(self.shape)

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """float32 (r1 - r0, K): rows ``r0`` to ``r1`` of the (experts x rows, K) view of :meth:`values`, reading
        only their bytes (a weight of any size in pieces)."""
        from .._safetensors import load_safetensors_rows
        n = self._rows()
        c, s = (load_safetensors_rows(*self.entries[role], n, r0, r1) for role in ("blocks", "scales"))
        return self.decode(c.view(np.uint8), s.view(np.uint8))

    def decode(self, codes, scales) -> np.ndarray:
        """float32 (rows, K) of ``codes`` and ``scales``: rows of :attr:`codes` and :attr:`scales` (a piece of the
        weight) as :meth:`values` reads them."""
        from ..qtensor import QuantizedTensor
        from ..quantize import dequantize
        from ..schemes import get_scheme
        q = QuantizedTensor(codes=codes, scales=scales, global_amax=None, scheme=get_scheme("mxfp4"), axis=1,
                            shape=(codes.shape[0], self.shape[-1]))
        return np.asarray(dequantize(q), np.float32)


@dataclass
class GptOssCheckpoint:
    """A gpt-oss MXFP4 folder: the quantized weights by name, the modules left in high precision
    (``modules_to_not_convert``), every other entry (name -> (file, dtype, shape)), the quantization config, and
    the weights whose entries do not make a weight (``broken``: name -> what is wrong; filled where the folder
    was read with ``strict=False``)."""
    path: Path
    weights: dict
    excluded: list
    other: dict
    config: dict
    broken: dict = field(default_factory=dict)


def _entry_problem(files, key, skey):
    """What keeps ``key`` (a ``_blocks`` entry) and ``skey`` (its ``_scales``) from making an MXFP4 weight, or
    None: a missing partner, shapes that do not agree, entries that are not bytes."""
    if skey not in files:
        return f"{key} has no {skey} beside it (the E8M0 scales of its blocks)"
    bs, ss = entry_shape(files[key], key), entry_shape(files[skey], skey)
    if len(bs) < 2 or bs[-1] != 16 or tuple(bs[:-1]) != tuple(ss):
        return (f"{key} has shape {bs} and {skey} {ss}; gpt-oss stores blocks as [..., rows, K/32, 16] bytes "
                "beside scales [..., rows, K/32]")
    return not_bytes(files, (key, skey))


def read_gpt_oss(path, strict: bool = True) -> GptOssCheckpoint:
    """Read a gpt-oss MXFP4 checkpoint folder (sharded or not); ValueError naming the file and what is wrong:
    no such folder, no MXFP4 quantization_config, no .safetensors, and — where ``strict`` — a weight whose
    entries do not make one: a ``_blocks`` entry without its ``_scales`` (or the reverse), shapes that do not
    agree, blocks that are not 16 bytes. With ``strict=False`` such a weight is listed in ``broken`` (name ->
    what is wrong) and the others are read: validate names it as a fault, analyze skips it with the reason."""
    d, qc, files = open_folder(path, _config, "config.json has no quantization_config with quant_method 'mxfp4' "
                                              "(not a gpt-oss MXFP4 checkpoint)")
    weights, used, broken = {}, set(), {}
    for key in sorted(files):
        if not key.endswith("_blocks"):
            continue
        name = key[: -len("_blocks")]
        skey = name + "_scales"
        used.update(k for k in (key, skey) if k in files)
        why = _entry_problem(files, key, skey)
        if why is None:
            bs = entry_shape(files[key], key)
            weights[name] = MXFP4Weight(name, tuple(bs[:-2]) + (bs[-2] * 32,),
                                        {"blocks": (files[key], key), "scales": (files[skey], skey)})
        elif strict:
            raise ValueError(f"{d}: {why}")
        else:
            broken[name] = why
    for k in sorted(files):
        if k.endswith("_scales") and k not in used:
            if strict:
                raise ValueError(f"{d}: {k} has no _blocks entry beside it")
            broken[k[: -len("_scales")]] = f"{k} has no {k[: -len('_scales')]}_blocks entry beside it"
            used.add(k)
    other = {n: (f, str(entry_dtype(f, n)), entry_shape(f, n)) for n, f in files.items() if n not in used}
    return GptOssCheckpoint(d, weights, list(qc.get("modules_to_not_convert") or []), other, qc, broken)


def rule_bytes(x2, rule):
    """(codes in fp4sim's packing, E8M0 bytes) of ``x2`` (rows, K) under one of :data:`MX_RULES`: fp4sim's
    ``mxfp4`` in that scale mode, or ggml's quantizer (the registry's ``ocp-mxfp4-MODE`` and ``ggml-mxfp4``,
    :mod:`fp4sim.checkpoints.rules`)."""
    b = registry_rule(mx_rule_key(rule))(x2)
    return b.codes, b.scales


STORED, TRANSPOSED = "the stored order [experts, rows, K]", "transformers' order [experts, K, rows]"


def reference_orientations(w, reference) -> list:
    """The readings of the reference of a weight or FP4 tensor ``w`` as float32 (rows, K) in the stored order:
    ``[(orientation, x2)]`` — one where the shape decides (the stored order, or, for an [experts, rows, K]
    weight, transformers' [experts, K, rows] transposed), both for a square weight (rows = K, such as
    gpt-oss-20b's and 120b's ``down_proj``: hidden = intermediate = 2880), the stored order first, where only the
    data can tell (:data:`STORED`, :data:`TRANSPOSED`). ValueError naming the shapes, or for NaN / Inf."""
    x = np.asarray(reference, np.float32)
    shape = tuple(w.shape)
    alt = shape[:-2] + (shape[-1], shape[-2])
    if x.shape != shape and not (len(shape) == 3 and x.shape == alt):
        also = f" (or {alt} as transformers lays it out)" if len(shape) == 3 else ""
        raise ValueError(f"reference: shape {x.shape}; {w.name} holds {shape}{also}")
    if not np.isfinite(x).all():
        raise ValueError(f"reference: {w.name}'s reference holds NaN or Inf")
    out = []
    if x.shape == shape:
        out.append((STORED, np.ascontiguousarray(x.reshape(-1, shape[-1]))))
    if len(shape) == 3 and x.shape == alt:
        out.append((TRANSPOSED, np.ascontiguousarray(np.swapaxes(x, -1, -2).reshape(-1, shape[-1]))))
    return out


def reference_rows(w, reference) -> np.ndarray:
    """The reference of ``w`` as float32 (rows, K) in the stored order: the first of
    :func:`reference_orientations` (for a square weight the stored order; :func:`matching_orientation` lets the
    bytes decide)."""
    return reference_orientations(w, reference)[0][1]


def match_readings(codes, scales, readings, keys) -> tuple:
    """``(titles, i, requantized)``: the first reading ``readings[i] = (orientation, x2)`` from which some rules
    of the registry among ``keys`` give ``codes`` and ``scales`` byte for byte, their titles and the
    :class:`~fp4sim.checkpoints.rules.Requantized` of that reading (each rule computed once per reading: reuse it
    for the costs); ``([], 0, the first reading's)`` where none does."""
    first = None
    for i, (_, x2) in enumerate(readings):
        rq = Requantized(x2)
        first = first or rq
        hit = reproducing(codes, scales, keys, rq)
        if hit:
            return hit, i, rq
    return [], 0, first


def matching_orientation(w, reference) -> tuple:
    """``(rules, orientation, x2)``: the :data:`MX_RULES` that give ``w``'s stored codes and scale bytes, byte for
    byte, from the reference read in ``orientation`` (x2: that reading, float32 (rows, K)) — the first reading
    of :func:`reference_orientations` that some rule reproduces, else ``([], STORED or the only reading, its
    x2)``."""
    readings = reference_orientations(w, reference)
    keys = [mx_rule_key(r) for r in MX_RULES]
    titles, i, _ = match_readings(w.codes, w.scales, readings, keys)
    short = {registry_rule(mx_rule_key(r)).title: r for r in MX_RULES}
    return [short[t] for t in titles], readings[i][0], readings[i][1]


def reproducing_rules(w: MXFP4Weight, reference) -> list:
    """The MXFP4 rules (:data:`MX_RULES`: fp4sim's scale modes with round-to-nearest-even elements, and ggml's
    quantizer) that give ``w``'s stored codes and scale bytes, byte for byte, from ``reference``: the weight's
    high-precision values, in the stored order (experts, rows, K) or transformers' (experts, K, rows) — for a
    square weight, whichever reading the bytes match (:func:`matching_orientation`)."""
    return matching_orientation(w, reference)[0]
