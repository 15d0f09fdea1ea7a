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

from .analyze.inputs import TensorError, load, reference_names, reference_source, reference_sources
from .analyze.metrics import as_rows
from .checkpoints.gguf import read_gguf
from .checkpoints.gpt_oss import STORED, TRANSPOSED, is_gpt_oss, read_gpt_oss
from .checkpoints.mlx import is_mlx, read_mlx
from .checkpoints.compressed_tensors_mx import is_compressed_tensors_mx, read_compressed_tensors_mx
from .checkpoints.rules import (BITS_PER_VALUE, COST_RULES, Requantized, add_sums, candidates, cost_ratios,
                                exact_dtypes, reproducing, rule_cost_sums, title_of)
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


PIECE_ELEMS = 1 << 21
"""Reference values per piece: the study holds a few float64 copies of one piece per rule, never the weight."""


def _readings(t, x) -> list:
    """``[(orientation, pieces)]``: the readings of ``t``'s reference ``x`` (an array or a
    :class:`~fp4sim.analyze.lazy.LazyTensor`) in the file's (rows, K) order, as
    :func:`fp4sim.checkpoints.gpt_oss.reference_orientations` gives them (a GGUF tensor: the first only), each a
    function yielding ``(r0, r1, x2)``: rows ``r0`` to ``r1`` of that reading, float32, in pieces of about
    :data:`PIECE_ELEMS` (a transposed reading one expert's slab at a time); ValueError naming the shapes."""
    shape, K = tuple(t.shape), int(t.shape[-1])
    alt = shape[:-2] + (shape[-1], shape[-2])
    if tuple(x.shape) != shape and not (len(shape) == 3 and tuple(x.shape) == alt):
        also = f" (or {alt} as transformers lays it out)" if len(shape) == 3 else ""
        raise ValueError(f"reference: shape {tuple(x.shape)}; {t.name} holds {shape}{also}")
    x2 = as_rows(x)
    rows = max(1, PIECE_ELEMS // K)

    def stored():
        for r0 in range(0, x2.shape[0], rows):
            yield r0, min(r0 + rows, x2.shape[0]), np.ascontiguousarray(x2[r0:r0 + rows], np.float32)

    def transposed():                              # reference [experts, K, R]: an expert's (R, K) is its slab's .T
        E, R = shape[0], shape[1]
        for e in range(E):
            slab = np.ascontiguousarray(x2[e * K:(e + 1) * K], np.float32).T
            for r0 in range(0, R, rows):
                yield e * R + r0, e * R + min(r0 + rows, R), np.ascontiguousarray(slab[r0:r0 + rows])
    out = []
    if tuple(x.shape) == shape:
        out.append((STORED, stored))
    if len(shape) == 3 and tuple(x.shape) == alt:
        out.append((TRANSPOSED, transposed))
    return out[:1] if getattr(t, "type", None) in ("MXFP4", "NVFP4") else out


def _first_pass(t, x) -> tuple:
    """(amax, the dtypes every value is exact in) of the reference ``x``, read in pieces; ValueError for NaN or
    Inf, as :func:`~fp4sim.checkpoints.gpt_oss.reference_orientations` says it."""
    x2 = as_rows(x)
    rows = max(1, PIECE_ELEMS // int(t.shape[-1]))
    amax, exact = np.float32(0), None
    for r0 in range(0, x2.shape[0], rows):
        p = np.ascontiguousarray(x2[r0:r0 + rows], np.float32)
        if not np.isfinite(p).all():
            raise ValueError(f"reference: {t.name}'s reference holds NaN or Inf")
        if p.size:
            amax = max(amax, np.float32(np.abs(p).max()))
        got = exact_dtypes(p)
        exact = got if exact is None else [d for d in exact if d in got]
    return amax, exact or ["float32"]


def _family(t) -> str:
    """"MXFP4" or "NVFP4": a GGUF tensor's type, else its layout's family."""
    return getattr(t, "type", None) or t.layout.family


def _clipped_count(t, s, x2) -> int:
    """Blocks of ``x2`` (rows of the reference) whose amax exceeds 6 x the stored scale bytes ``s`` of those rows."""
    n = x2.shape[1] // s.shape[1]
    amax = np.abs(x2).reshape(s.shape[0], s.shape[1], n).max(-1).astype(np.float64)
    if _family(t) == "NVFP4":
        scale = np.where((s & 0x7F) == 0x7F, 0.0, E4M3.values[s & 0x7F]).astype(np.float64)
    else:
        scale = np.ldexp(1.0, s.astype(np.int64) - 127)
    return int((amax > 6 * scale).sum())


def _study_tensor(f, t, x) -> dict:
    """One tensor's row of :func:`requantize_study` from its reference ``x`` (an array or a LazyTensor), reading
    the reference in pieces of rows: each rule's bytes of a piece are compared with the file's bytes of those rows
    (a rule reproduces the tensor when it reproduces every piece) and its errors summed, so that memory holds the
    tensor's stored bytes and a few copies of one piece. The first reading some rule reproduces is the tensor's
    (a square gpt-oss weight's reference may be in either order); where none does, the first reading's costs."""
    if t.shape[-1] % 64:
        raise ValueError(f"K = {t.shape[-1]} is no multiple of 64 (NVFP4's GGUF blocks): the rules cannot be compared")
    readings = _readings(t, x)
    amax, dtypes = _first_pass(t, x)
    gguf = getattr(t, "type", None) in ("MXFP4", "NVFP4")
    codes, scales = t.codes, t.scales
    chosen = None
    for i, (_, pieces) in enumerate(readings):
        keys = candidates("gguf" if gguf else t.layout.format, t.layout.family, None, dtypes)
        alive, sums, st, clipped, nblk = list(keys), None, 0.0, 0, 0
        for r0, r1, x2 in pieces():
            rq = Requantized(x2)
            alive = [k for k in alive if reproducing(codes[r0:r1], scales[r0:r1], [k], rq)]
            if not alive and i:                       # another reading is only wanted where some rule matches
                break
            sums = add_sums(sums, rule_cost_sums(rq, amax))
            a = x2.astype(np.float64)
            st += float(((np.asarray(t.decode(codes[r0:r1], scales[r0:r1]), np.float64) - a) ** 2).sum())
            clipped += _clipped_count(t, scales[r0:r1], x2)
            nblk += scales[r0:r1].size
        if i == 0 or alive:
            chosen = (alive, sums, st, clipped, nblk)
        if alive:
            break
    alive, sums, st, clipped, nblk = chosen
    c = cost_ratios(sums)
    ref = sums["sx2"]
    return {"tensor": t.name, "file": str(f), "type": _family(t), "shape": list(t.shape),
            "file_rule": [title_of(k) for k in alive], "stored": st / ref if ref else 0.0, "rel_mse": c["rel_mse"],
            "clipped_stored": clipped / nblk if nblk else float("nan"),
            "clipped_ggml_mxfp4": c["clipped_blocks"], "bits_per_value": c["bits_per_value"]}


def requantize_study(paths, reference) -> dict:
    """``{"reference": REF, "tensors": [per-tensor rows], "median_ratio": {rule: median over the tensors of the
    rule's relative error over the stored values'},
    "not_compared": [[name, why]]}``; a row: ``tensor``, ``file``, ``type``, ``shape``, ``file_rule`` (the rules
    that reproduce its bytes, [] for none), ``stored`` (its stored values' relative error), ``rel_mse``
    ({rule: relative error}), ``clipped_stored`` and ``clipped_ggml_mxfp4`` (shares of blocks), and
    ``bits_per_value``. ValueError when ``paths`` hold no FP4 tensor or the reference no tensor. A large
    reference tensor is read a piece of rows at a time (:func:`fp4sim.analyze.inputs.load`'s lazy tensors), so
    memory holds one FP4 tensor's stored bytes and a few copies of one piece; a tensor's sums over the pieces
    equal the whole tensor's to the last bits of the float64 additions (one piece: bit for bit)."""
    skipped = []
    found = fp4_tensors(paths, skipped)
    if not found:
        raise ValueError("--requantize: none of the paths holds an FP4 tensor of a GGUF file (MXFP4, NVFP4), a "
                         "gpt-oss MXFP4 folder or a compressed-tensors MXFP4 folder")
    refs = reference_sources(reference)
    rows = []
    for f, t in found:
        src = reference_source(t, refs)
        try:
            if src is None:
                raise ValueError("no reference tensor " + " or ".join(reference_names(t)))
            try:
                x = load(src, lazy=True)
            except TensorError as e:
                raise ValueError(f"the reference {src.name} {e}") from None
            rows.append(_study_tensor(f, t, x))
        except ValueError as e:
            skipped.append([t.name, str(e)])
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
