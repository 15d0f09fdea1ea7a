"""What an FP4 file's rule cost: each FP4 tensor of a GGUF file (MXFP4, NVFP4), a gpt-oss or compressed-tensors
MXFP4 folder against its high-precision weights, beside what fp4sim's other FP4 rules would have cost on the same weights
(``python -m fp4sim.analyze FILE.gguf | DIR --requantize REF``).

Per tensor: the rule that reproduces its bytes (ggml's quantizers, fp4sim's MXFP4 scale modes; "none" where none
does), the relative error of its stored values, ``sum (stored - x)^2 / sum x^2``, and the same for every rule of
:data:`fp4sim.checkpoints.rules.COST_RULES` re-quantizing ``x`` — among them the round-up (rceil) scale mode against ggml's
floor, and NVFP4's E4M3 scales at MXFP4's 4.25 bits per value (one per 32 elements) — and the share of blocks
whose largest values clip: under the file's own scales (the reference's block amax above 6 x the stored scale)
and under ggml's MXFP4 rule.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .analyze.inputs import reference_sources, reference_weight
from .checkpoints.gguf import read_gguf
from .checkpoints.gpt_oss import is_gpt_oss, match_readings, read_gpt_oss, reference_orientations, reference_rows
from .checkpoints.mlx import is_mlx, read_mlx
from .checkpoints.compressed_tensors_mx import is_compressed_tensors_mx, read_compressed_tensors_mx
from .checkpoints.rules import BITS_PER_VALUE, COST_RULES, candidates, rule_costs
from .formats import E4M3

__all__ = ["fp4_tensors", "requantize_study", "requantize_table"]


def fp4_tensors(paths, broken: list | None = None) -> list:
    """(file, tensor) for every FP4 tensor under ``paths``: GGUF files (given, or inside a folder), gpt-oss MXFP4
    folders and compressed-tensors MXFP4 folders; ValueError naming a file that cannot be read. A weight whose
    entries do not make one (:attr:`fp4sim.checkpoints.gpt_oss.GptOssCheckpoint.broken`) is left out, and listed
    as [name, why] in ``broken`` where a list is given (else the folder is a ValueError)."""
    out = []
    for p in map(Path, paths):
        mx = read_gpt_oss if p.is_dir() and is_gpt_oss(p) else read_compressed_tensors_mx if p.is_dir() and \
            is_compressed_tensors_mx(p) else read_mlx if p.is_dir() and is_mlx(p) else None
        if mx is not None:
            ck = mx(p, strict=broken is None)
            out += [(p, w) for w in ck.weights.values() if w.layout.family in ("MXFP4", "NVFP4")]
            if broken is not None:
                broken += [[n, f"{w.layout.family} is not an FP4 format: its rules are not costed here"]
                           for n, w in ck.weights.items() if w.layout.family not in ("MXFP4", "NVFP4")]
            if broken is not None:
                broken += [[name, f"its entries do not make an MXFP4 weight: {why}"] for name, why in ck.broken.items()]
            continue
        files = sorted(p.rglob("*.gguf")) if p.is_dir() else [p] if p.suffix.lower() == ".gguf" else []
        for f in files:
            out += [(f, t) for t in read_gguf(f).fp4.values()]
    return out


def _oriented(t, x) -> tuple:
    """``(x2, rules, requantized)``: the reference ``x`` of tensor ``t`` as (rows, K) float32 in the file's order
    (:func:`fp4sim.checkpoints.gpt_oss.reference_orientations`; a square gpt-oss weight's reference in the reading
    its bytes match), the titles of the registry's rules that reproduce the tensor's bytes from it, and its
    :class:`~fp4sim.checkpoints.rules.Requantized` (each rule computed once: the costs reuse it); ValueError
    saying why the rules cannot be compared on it."""
    if t.shape[-1] % 64:
        raise ValueError(f"K = {t.shape[-1]} is no multiple of 64 (NVFP4's GGUF blocks): the rules cannot be compared")
    gguf = getattr(t, "type", None) in ("MXFP4", "NVFP4")
    readings = [(None, reference_rows(t, x))] if gguf else reference_orientations(t, x)
    keys = candidates("gguf" if gguf else t.layout.format, t.layout.family, readings[0][1])
    rules, i, rq = match_readings(t.codes, t.scales, readings, keys)
    return readings[i][1], rules, rq


def _family(t) -> str:
    """"MXFP4" or "NVFP4": a GGUF tensor's type, else its layout's family."""
    return getattr(t, "type", None) or t.layout.family


def _stored_clipped(t, x2) -> float:
    """Share of the file's blocks whose reference amax exceeds 6 x the stored scale."""
    s = t.scales
    n = x2.shape[1] // s.shape[1]
    amax = np.abs(x2).reshape(s.shape[0], s.shape[1], n).max(-1).astype(np.float64)
    if _family(t) == "NVFP4":
        scale = np.where((s & 0x7F) == 0x7F, 0.0, E4M3.values[s & 0x7F]).astype(np.float64)
    else:
        scale = np.ldexp(1.0, s.astype(np.int64) - 127)
    return float((amax > 6 * scale).mean())


def requantize_study(paths, reference) -> dict:
    """``{"reference": REF, "tensors": [per-tensor rows], "median_ratio": {rule: median over the tensors of the
    rule's relative error over the stored values'},
    "not_compared": [[name, why]]}``; a row: ``tensor``, ``file``, ``type``, ``shape``, ``file_rule`` (the rules
    that reproduce its bytes, [] for none), ``stored`` (its stored values' relative error), ``rel_mse``
    ({rule: relative error}), ``clipped_stored`` and ``clipped_ggml_mxfp4`` (shares of blocks), and
    ``bits_per_value``. ValueError when ``paths`` hold no FP4 tensor or the reference no tensor."""
    skipped = []
    found = fp4_tensors(paths, skipped)
    if not found:
        raise ValueError("--requantize: none of the paths holds an FP4 tensor of a GGUF file (MXFP4, NVFP4), a "
                         "gpt-oss MXFP4 folder or a compressed-tensors MXFP4 folder")
    refs = reference_sources(reference)
    rows = []
    for f, t in found:
        x, why = reference_weight(t, refs)
        try:
            if x is None:
                raise ValueError(why)
            x2, file_rules, rq = _oriented(t, x)
            stored = np.asarray(t.values(), np.float64).reshape(x2.shape)
        except ValueError as e:
            skipped.append([t.name, str(e)])
            continue
        a = x2.astype(np.float64)
        ref = float((a * a).sum())
        c = rule_costs(x2, rq)
        rows.append({"tensor": t.name, "file": str(f), "type": _family(t),
                     "shape": list(t.shape), "file_rule": file_rules,
                     "stored": float(((stored - a) ** 2).sum() / ref) if ref else 0.0, "rel_mse": c["rel_mse"],
                     "clipped_stored": _stored_clipped(t, x2), "clipped_ggml_mxfp4": c["clipped_blocks"],
                     "bits_per_value": c["bits_per_value"]})
    ratio = {}
    if rows:
        ratio = {k: float(np.median([r["rel_mse"][k] / r["stored"] if r["stored"] else np.nan for r in rows]))
                 for k in rows[0]["rel_mse"]}
    return {"reference": str(reference), "tensors": rows, "median_ratio": ratio, "not_compared": skipped}


SHORT = {"ggml MXFP4": "ggml MX", "MXFP4 floor": "MX floor", "MXFP4 rceil": "MX rceil",
         "NVFP4/32 (TE)": "NV/32 TE", "ggml NVFP4": "ggml NV", "NVFP4 (TE, tensor scale)": "NV TE"}


def requantize_table(study: dict) -> str:
    """The study as text: one line per tensor (the file's rule, its stored error, each rule's error as a ratio to
    the stored one, the clipped shares), the median ratios, and the tensors not compared with the reason."""
    rows = study["tensors"]
    out = [f"What each FP4 rule costs on the reference weights ({study['reference']}): the relative error "
           "sum (y - x)^2 / sum x^2 of the stored values, and each rule's re-quantizing x as a ratio to it (below 1: "
           "that rule would have done better); " + ", ".join(f"{SHORT[k]} = {k}" for k in COST_RULES)
           + "; clipped: blocks whose largest reference values exceed 6 x the scale, under the file's scales and "
           "under ggml's MXFP4 rule"]
    if rows:
        w = min(max(max(len(r["tensor"]) for r in rows), 6), 48)
        cols = "".join(f"{SHORT[k]:>10}" for k in COST_RULES)
        bits = "".join(f"{f'{BITS_PER_VALUE[k]:g} bits':>10}" for k in COST_RULES)
        out.append(f"  {'tensor':<{w}}  {'type':<5}  {'file rule':<22}  {'stored':>9}{cols}  clipped file / ggml")
        out.append(f"  {'':<{w}}  {'':<5}  {'':<22}  {'':>9}{bits}")
        for r in rows:
            rule = ", ".join(r["file_rule"]) or "none"
            rule = rule if len(rule) <= 22 else rule[:21] + "…"
            cells = "".join(f"{r['rel_mse'][k] / r['stored'] if r['stored'] else float('nan'):>10.3f}"
                            for k in COST_RULES)
            out.append(f"  {r['tensor'][-w:]:<{w}}  {r['type']:<5}  {rule:<22}  {r['stored']:>9.4g}{cells}  "
                       f"{100 * r['clipped_stored']:.1f}% / {100 * r['clipped_ggml_mxfp4']:.1f}%")
        if len(rows) > 1:
            cells = "".join(f"{study['median_ratio'][k]:>10.3f}" for k in COST_RULES)
            out.append(f"  {'median ratio over the tensors':<{w + 43}}{cells}")
    for name, why in study["not_compared"]:
        out.append(f"  not compared {name}: {why}")
    return "\n".join(out)
