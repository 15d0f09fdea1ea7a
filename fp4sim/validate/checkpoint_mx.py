"""``python -m fp4sim.validate checkpoint`` on a gpt-oss MXFP4 folder (:mod:`fp4sim.checkpoints.gpt_oss`), a
compressed-tensors MXFP4 folder (:func:`check_compressed_tensors_mx`) and a GGUF file (:func:`check_gguf`, whose
docstring says what it checks).

Without a reference, per quantized weight: E8M0 byte 255 (NaN: the whole block decodes to NaN), the blocks'
shape against the config's dimensions (``num_local_experts``, ``hidden_size``, ``intermediate_size``: gate_up
[experts, 2 x intermediate, hidden], down [experts, hidden, intermediate]), and blocks whose codes are all zero
under a non-zero scale (a note: a rule that writes the scale of an all-zero block as 0 does not). With
``--reference`` (the high-precision weights, [experts, rows, K] or transformers' [experts, K, rows], any layout
analyze reads), the MXFP4 rules that reproduce the stored bytes are named (:func:`fp4sim.checkpoints.gpt_oss.reproducing_rules`:
fp4sim's scale modes rceil / floor / ceil / even, ggml's quantizer); where none does, the known faults that do:
nibbles swapped (element 2j read from the high nibble), ggml's element order (j and j + 16 in one byte, a GGUF
block copied as is), the E8M0 bias off by one (the scale bytes one binade off: e read with bias 128), blocks
transposed (rows and K / 32 exchanged).
"""
from __future__ import annotations

import numpy as np

from ..analyze.inputs import reference_sources, reference_weight
from ..checkpoints.faults import undo_gguf, undo_mxfp4, undo_mxfp6, undo_mxfp8, undo_nvfp4
from ..checkpoints.gguf import other_fp4_bytes, read_gguf, to_gguf_blocks
from ..checkpoints.gpt_oss import read_gpt_oss, reference_orientations
from ..checkpoints.mlx import read_mlx
from ..checkpoints.compressed_tensors_mx import read_compressed_tensors_mx
from ..checkpoints.rules import (COST_RULES, Requantized, candidates, reproducing, rule, rule_costs, rules_for,
                                 title_of)
from ..layout import unpack_fp4, unpack_fp6
from .checkpoint_ref import CheckpointReport, count_compared, excluded_findings

__all__ = ["check_gpt_oss", "check_compressed_tensors_mx", "check_mlx", "check_gguf"]


def _expected_shapes(cfg: dict) -> dict:
    """{suffix: (experts, rows, K)} from a gpt-oss config.json (empty where it does not say)."""
    E, H, inter = (cfg.get(k) for k in ("num_local_experts", "hidden_size", "intermediate_size"))
    if not all(isinstance(v, int) and v > 0 for v in (E, H, inter)):
        return {}
    return {"gate_up_proj": (E, 2 * inter, H), "down_proj": (E, H, inter)}


def _check(w, expected, t):
    """A weight's bytes on their own (:func:`_check_bytes`), and a gpt-oss weight's shape against the config's
    dimensions (``expected``: {suffix: shape})."""
    want = next((v for k, v in expected.items() if w.name.endswith(k)), None)
    if want is not None and tuple(w.shape) != tuple(want):
        t["faults"].append(f"its blocks hold {tuple(w.shape)} (experts, rows, K); the config's dimensions give "
                           f"{tuple(want)}")
    _check_bytes(w, t)


def _keys(fmt: str, kind: str) -> list:
    """The registry's rules (:mod:`fp4sim.checkpoints.rules`) a ``fmt`` file's ``kind`` tensor may have been
    written by."""
    return rules_for(fmt, kind)


def _block_diff(codes, scales, c, s) -> np.ndarray:
    """bool (rows, blocks): the scale blocks whose scale byte or any of whose code bytes differ (packed FP4 or
    one byte per element alike: a block's bytes are contiguous in its row)."""
    R, nb = scales.shape
    return (np.asarray(codes) != np.asarray(c)).reshape(R, nb, -1).any(-1) | (scales != s)


def _verdict(e, codes, scales, readings, keys, fixes, none_msg, where):
    """Fill the tensor entry ``e`` with the rules that reproduce the stored ``codes`` and ``scales`` from the
    reference — ``readings``: [(orientation, x2)], the reference's possible readings in order (one, or two for a
    square gpt-oss weight); ``keys``: the registry's rules to try, each computed once per reading — or, where none
    does, the known fault whose undoing (``fixes()``: [(fault key, fault, codes, scales)],
    :mod:`fp4sim.checkpoints.faults`) makes one reproduce them, else ``none_msg`` with the count of scale blocks
    that differ from the closest rule's bytes and the first of them (``where(row, block)`` names it). Returns
    ``(the reading used (the matching one, else the first), its Requantized)``: its rules' bytes, for the costs."""
    e["compared"] = True
    e["exact"], e["rules"], e["rule"] = False, [], None
    rqs = [Requantized(x2) for _, x2 in readings]

    say = (lambda o: f" (the reference is square: read in {o})") if len(readings) > 1 else (lambda o: "")
    for i, (orientation, _) in enumerate(readings):
        rules = reproducing(codes, scales, keys, rqs[i])
        if rules:
            e["exact"], e["rules"], e["rule"] = True, rules, rules[0]
            if len(readings) > 1:
                e["notes"].append(f"the reference is square: its bytes match it read in {orientation}")
            return readings[i], rqs[i]
    for _, fault, c, s in fixes():
        for i, (orientation, _) in enumerate(readings):
            hit = reproducing(c, s, keys, rqs[i])
            if hit:
                e["faults"].append(f"{fault}: with that undone, {', '.join(hit)} reproduces it{say(orientation)}")
                return readings[i], rqs[i]
    n, name, d, i = min(((int(d.sum()), title_of(k), d, i) for i in range(len(readings)) for k in keys
                         for b in [rqs[i].of(k)] for d in [_block_diff(codes, scales, b.codes, b.scales)]),
                        key=lambda v: v[0])
    r, b = (int(v) for v in np.argwhere(d)[0])
    e["faults"].append(f"{none_msg}: {n} of {d.size} scale blocks differ from the bytes of {name}, the closest "
                       f"(first at {where(r, b)}){say(readings[i][0])}")
    return readings[i], rqs[i]


def check_gpt_oss(path, reference=None):
    """The :class:`~fp4sim.validate.checkpoint.CheckpointReport` of a gpt-oss MXFP4 folder (the module docstring
    says what is checked). A weight whose entries do not make one (a ``_blocks`` entry without its ``_scales``,
    shapes that disagree) is a fault of that weight; the others are checked."""
    ck = read_gpt_oss(path, strict=False)
    import json
    cfg = {}
    try:
        cfg = json.loads((ck.path / "config.json").read_text())
    except (OSError, ValueError):
        pass
    return _check_mx_folder(
        ck, path, reference, "gpt-oss mxfp4", _expected_shapes(cfg), "no *_blocks entry",
        lambda w, x2: rules_for("gpt-oss", "MXFP4"),
        "no MXFP4 rule (fp4sim's scale modes rceil / floor / ceil / even with round-to-nearest-even elements, "
        "ggml's quantizer) reproduces its bytes from the reference",
        lambda R: lambda r, b: f"expert {r // R}, row {r % R}, block {b}")


def check_compressed_tensors_mx(path, reference=None):
    """The :class:`~fp4sim.validate.checkpoint.CheckpointReport` of a compressed-tensors MX folder
    (``mxfp4-pack-quantized``, ``mxfp6-pack-quantized`` or ``mxfp8-quantized``,
    :mod:`fp4sim.checkpoints.compressed_tensors_mx`): per weight the checks of a gpt-oss one (E8M0 bytes 255,
    all-zero FP4 / FP6 blocks under a non-zero scale; NaN FP8 elements);
    with ``reference``, compressed-tensors' own rule
    in each dtype the reference is exact in, then fp4sim's MX scale modes and ggml's quantizer, or the fault
    whose undoing makes one reproduce the bytes; the modules of ``ignore`` present in high precision and none
    quantized. A module whose tensors are another format's (a ``weight_global_scale``, E4M3 scales: NVFP4's under
    an MXFP4 config) is a fault of that module."""
    ck = read_compressed_tensors_mx(path, strict=False)
    rep = _check_mx_folder(
        ck, path, reference, ck.format, {}, "no *.weight_scale entry beside its codes",
        lambda w, x2: candidates(w.layout.format, w.layout.family, x2),
        "no rule (compressed-tensors' own in each dtype the reference is exact in; for MXFP4 also fp4sim's scale "
        "modes rceil / floor / ceil / even and ggml's quantizer) reproduces its bytes from the reference",
        lambda R: lambda r, b: f"row {r}, block {b}")
    excluded_findings(ck, rep)
    return rep


def check_mlx(path, reference=None):
    """The :class:`~fp4sim.validate.checkpoint.CheckpointReport` of an MLX folder in its float modes
    (:mod:`fp4sim.checkpoints.mlx`): per module its scale bytes (E8M0 255, E4M3 NaN or negative) and, for mxfp8,
    NaN element bytes; all-zero FP4 blocks under a non-zero scale (a note); with ``reference``, MLX's rule for the
    module's mode in each dtype the reference is exact in (:func:`fp4sim.checkpoints.rules.mlx_quantize`), or
    the fault whose undoing makes it reproduce the bytes (nibbles swapped, ggml's order, the scale bytes one
    binade off, blocks transposed), and the FP4 rules' costs. A module fp4sim cannot read as a float mode (MLX's
    affine mode, an unknown mode, shapes that disagree) is a fault naming it; the others are checked."""
    ck = read_mlx(path, strict=False)
    rep = _check_mx_folder(
        ck, path, reference, "mlx", {}, "no NAME.scales beside a NAME.weight",
        lambda w, x2: candidates(w.layout.format, w.layout.family, x2),
        "MLX's rule for its mode (in each dtype the reference is exact in) does not reproduce its bytes from the "
        "reference", lambda R: lambda r, b: f"row {r}, block {b}", "not read as one of MLX's float modes")
    excluded_findings(ck, rep)
    return rep


def _check_bytes(w, t):
    """A weight's bytes on their own, by its layout's family: NaN scale bytes (E8M0 255; E4M3 0x7F / 0xFF),
    negative E4M3 scales, NaN E4M3 elements (MXFP8), all-zero FP4 blocks under a non-zero scale (a note)."""
    s = w.scales
    family = w.layout.family
    if family == "NVFP4":
        nan, neg = int(((s & 0x7F) == 0x7F).sum()), int(((s & 0x80) != 0).sum())
        if nan:
            t["faults"].append(f"{nan} E4M3 scale bytes are NaN (0x7F / 0xFF)")
        if neg:
            t["faults"].append(f"{neg} E4M3 scale bytes have the sign bit set: scales are magnitudes")
    elif int((s == 255).sum()):
        t["faults"].append(f"{int((s == 255).sum())} E8M0 scale bytes are 255, NaN: their blocks decode to NaN")
    if family == "MXFP8":
        n = int(((w.codes & 0x7F) == 0x7F).sum())
        if n:
            t["faults"].append(f"{n} E4M3 element bytes are NaN (0x7F / 0xFF)")
        return
    zero = _zero_blocks(w.codes, s, w.layout.block, family == "MXFP6")
    if zero:
        t["notes"].append(f"{zero} blocks hold only zeros under a non-zero scale byte")


PIECE_ELEMS = 1 << 22
"""Values per piece where a weight's codes are unpacked to check them (memory: a few bytes per value of one piece)."""


def _zero_blocks(codes, s, g: int, fp6: bool = False) -> int:
    """Blocks of ``g`` values whose codes are all zero magnitudes under a non-zero scale byte ``s``, the packed
    ``codes`` (FP4, or ``fp6``: E2M3 four to three bytes) unpacked a piece of rows at a time."""
    step = max(1, PIECE_ELEMS // max(2 * codes.shape[1], 1))
    zero = 0
    for r0 in range(0, codes.shape[0], step):
        sp = s[r0:r0 + step]
        mag = (unpack_fp6(codes[r0:r0 + step]) & 0x1F) if fp6 else (unpack_fp4(codes[r0:r0 + step]) & 7)
        zero += int(((mag == 0).reshape(sp.shape[0], sp.shape[1], g).all(-1) & (sp > 0)).sum())
    return zero


def _undo(w) -> list:
    """The fault transforms of a weight's family (:mod:`fp4sim.checkpoints.faults`)."""
    family = w.layout.family
    if family == "MXFP8":
        return undo_mxfp8(w.codes, w.scales)
    if family == "MXFP6":
        return undo_mxfp6(w.codes, w.scales)
    return undo_nvfp4(w.codes, w.scales) if family == "NVFP4" else undo_mxfp4(w)


def _check_mx_folder(ck, path, reference, label, expected, none_found, keys, none_msg, where,
                     broken_as="its entries do not make an MXFP4 weight"):
    """The report of a block-scaled safetensors folder ``ck`` (gpt-oss's MXFP4, compressed-tensors' MXFP4 or
    MXFP8, MLX's float modes): its
    broken weights as faults (``broken_as``: what they fail to be); per weight the checks of :func:`_check`; with ``reference`` each weight's verdict over the rules ``keys(w, x2)``
    (``where(rows)(row, block)`` names a block) and the FP4 rules' costs."""
    rep = CheckpointReport(str(path), label, str(reference) if reference else None)
    refs = reference_sources(reference) if reference else None
    if not ck.weights and not ck.broken:
        rep.faults.append(f"no quantized weight found ({none_found}): nothing was checked")
    for name, why in ck.broken.items():
        rep.tensors[name] = {"ok": False, "faults": [f"{broken_as}: {why}"], "notes": [],
                             "shape": None, "global_amax": None, "shared_scale": [], "exact": None, "rule": None,
                             "rules": [], "compared": False}
    for name, w in ck.weights.items():
        t = {"ok": True, "faults": [], "notes": [], "shape": list(w.shape), "global_amax": None,
             "shared_scale": [], "exact": None, "rule": None, "rules": [], "compared": False}
        fp8 = w.layout.family in ("MXFP8", "MXFP6")     # (the costs below are the FP4 rules')
        try:
            _check(w, expected, t)
        except ValueError as e:                     # a shard cut short, offsets that do not fit its file
            t["faults"].append(f"its bytes cannot be read: {e}")
            t["ok"] = False
            rep.tensors[name] = t
            continue
        if refs is not None:
            x, why = reference_weight(w, refs)
            readings = None
            if x is None:
                t["notes"].append(f"{why}: not compared")
            else:
                try:
                    readings = reference_orientations(w, x)
                except ValueError as e:
                    t["faults"].append(str(e))
            if readings is not None:
                (_, x2), rq = _verdict(t, w.codes, w.scales, readings, keys(w, readings[0][1]),
                                       lambda w=w: _undo(w), none_msg, where(w.shape[-2]))
                if not fp8:
                    _add_costs(t, x2, rq)
        t["ok"] = not t["faults"]
        rep.tensors[name] = t
    if refs is not None:
        count_compared(rep)
        _cost_note(rep)
    return rep


def _add_costs(t, x2, rq):
    """The rules' costs on the reference ``x2`` (float32 (rows, K) in the stored order;
    :func:`fp4sim.checkpoints.rules.rule_costs`, reusing the rules' bytes of ``rq``) in the tensor's entry, where K
    is a multiple of 64 (NVFP4's GGUF blocks)."""
    if x2.shape[-1] % 64 == 0:
        t["costs"] = rule_costs(x2, rq)


def _cost_note(rep):
    """One line: each rule's relative MSE on the reference (median over the tensors compared) and the share of
    blocks whose largest values clip under ggml's MXFP4 rule."""
    got = [t["costs"] for t in rep.tensors.values() if t.get("costs")]
    if not got:
        return
    med = {r: float(np.median([c["rel_mse"][r] for c in got])) for r in COST_RULES}
    clip = float(np.median([c["clipped_blocks"] for c in got]))
    rep.notes.append("what each rule costs on the reference (relative MSE, median over the "
                     f"{len(got)} tensors compared): " + ", ".join(f"{r} {v:.4g}" for r, v in med.items())
                     + f"; under ggml's MXFP4 rule {100 * clip:.1f}% of the 32-element blocks clip their largest "
                     "values to 6 (MXFP4 4.25 bits per value, NVFP4 4.5)")


# ------------------------------------------------------------------------------------------------ GGUF files
def _data_faults(t) -> list:
    """A tensor's data (any type) against the file: truncated (the file ends before its data does), or a region
    shorter than its type and shape need (it runs into the next tensor's)."""
    if t.truncation:
        return [t.truncation]
    if t.region < t.n_bytes:
        return [f"its data region holds {t.region} bytes before the next tensor's begins; a {t.type} tensor of "
                f"shape {tuple(t.shape)} needs {t.n_bytes}: the two overlap"]
    return []


def _region_faults(t, align: int) -> list:
    """What an FP4 tensor's data region (the bytes to the next tensor or the file's end) says against its type and
    shape: the other FP4 type's bytes under this type (NVFP4 blocks labelled MXFP4: the region holds more than
    MXFP4 needs; the reverse: less), a truncated file, a region that runs into the next tensor."""
    other, ob = other_fp4_bytes(t.type, t.shape)
    fits_other = ob is not None and ob <= t.region < ob + align
    sizes = f"{t.type} blocks of shape {tuple(t.shape)} need {t.n_bytes} bytes" + (
        f", {other} ones {ob}" if ob is not None else "")
    if fits_other and t.region < t.n_bytes or fits_other and t.region >= t.n_bytes + align:
        return [f"its data region holds {t.region} bytes: {sizes} — {other} blocks under an {t.type} type "
                f"(a GGUF {other} tensor read as {t.type}?)"]
    return _data_faults(t)


def _prefix_rules(t, rq, kind: str, n: int) -> list:
    """The ``kind`` rules (ggml's NVFP4 quantizer; the MXFP4 rules) whose GGUF bytes of the reference (``rq``)
    agree with the first ``n`` bytes of the tensor's region (those the file holds)."""
    got = t.region_bytes()[:n]
    return [rule(k).title for k in _keys("gguf", kind) for b in [rq.bytes(k)]
            if got.size == n and np.array_equal(to_gguf_blocks(b.codes, b.scales, kind).reshape(-1)[:n], got)]


def _region_with_reference(t, x2) -> str | None:
    """With the reference: the rules whose bytes the region holds — the other FP4 type's, or, in a truncated
    tensor, its own type's up to where the file ends."""
    other, ob = other_fp4_bytes(t.type, t.shape)
    rq = Requantized(x2)
    hit = _prefix_rules(t, rq, other, ob) if ob is not None else []
    if hit:
        return f"its bytes are {', '.join(hit)}'s from the reference: {other} blocks under an {t.type} type"
    n = t.n_bytes - t.missing
    hit = _prefix_rules(t, rq, t.type, n) if t.missing and n > 0 else []
    return f"the {n} bytes the file holds are {', '.join(hit)}'s from the reference: only the end is " \
           "missing" if hit else None


def _gguf_reference(t, refs, e):
    """The reference of GGUF tensor ``t`` as float32 (rows, K), or None with the reason in its entry ``e``: a
    note where there is none or it holds NaN / Inf, a fault where its shape is another."""
    x, why = reference_weight(t, refs)
    if x is None:
        e["notes"].append(f"{why}: not compared")
    elif tuple(x.shape) != tuple(t.shape):
        e["faults"].append(f"the reference has shape {tuple(x.shape)}; the file's tensor {tuple(t.shape)}")
    elif not np.isfinite(x).all():
        e["notes"].append("the reference holds NaN or Inf: not compared")
    else:
        return np.ascontiguousarray(x.reshape(-1, t.shape[-1]), np.float32)
    return None


def check_gguf(path, reference=None):
    """The :class:`~fp4sim.validate.checkpoint.CheckpointReport` of a GGUF file's FP4 tensors (MXFP4, NVFP4).
    Without a reference: MXFP4 scale bytes 255 (NaN blocks), NVFP4 scale bytes with the sign bit set or 0x7F
    (ggml's quantizer writes neither; ggml reads 0x7F as zero), all-zero blocks under a non-zero scale (a
    note). With ``reference`` (the high-precision tensors under the GGUF names, any format analyze reads, an
    F32 / F16 / BF16 .gguf included): the rules that reproduce each tensor's bytes — ggml's MXFP4 quantizer and
    fp4sim's MXFP4 scale modes, ggml's NVFP4 quantizer — or the fault that explains them: gpt-oss's pair order
    written where ggml's halves belong, the scale bytes one binade off (E8M0's bias 128; NVFP4's 0.5 factor), the
    blocks transposed; where none does, how many scale blocks differ from the closest rule's and the first.
    Every tensor's data region against its type and shape, FP4 or not, with or without a reference: a truncated
    file (a fault naming each tensor it cuts; the other tensors are still checked), the other FP4 type's blocks
    under this type, regions that overlap. An FP4 tensor whose bytes are not its type's whole data is not
    compared with the reference (the rules whose bytes its region holds are noted)."""
    f = read_gguf(path)
    rep = CheckpointReport(str(path), "gguf", str(reference) if reference else None)
    refs = reference_sources(reference) if reference else None
    if not f.fp4:
        rep.faults.append("no MXFP4 or NVFP4 tensor in the file: nothing was checked (other types: "
                          + ", ".join(sorted({t.type for t in f.tensors.values()})[:8]) + ")")
    for name, t in f.tensors.items():
        if not t.fp4:
            rep.faults += [f"{name} ({t.type}, not quantized to FP4): {why}" for why in _data_faults(t)]
    for name, t in f.fp4.items():
        e = {"ok": True, "faults": [], "notes": [], "shape": list(t.shape), "global_amax": None,
             "shared_scale": [], "exact": None, "rule": None, "rules": [], "compared": False, "type": t.type}
        region = _region_faults(t, f.alignment)
        e["faults"] += region
        if region:
            x2 = _gguf_reference(t, refs, e) if refs is not None else None
            if x2 is not None:
                said = _region_with_reference(t, x2)
                e["notes"].append((said + "; " if said else "") + "its bytes are not its type's whole data: not "
                                  "compared")
            e["ok"] = False
            rep.tensors[name] = e
            continue
        s = t.scales
        if t.type == "MXFP4":
            n = int((s == 255).sum())
            if n:
                e["faults"].append(f"{n} E8M0 scale bytes are 255, NaN: their blocks decode to NaN")
        else:
            n, m = int(((s & 0x80) != 0).sum()), int((s == 0x7F).sum())
            if n:
                e["faults"].append(f"{n} UE4M3 scale bytes have the sign bit set: the scales are unsigned (ggml "
                                   "does not read the bit)")
            if m:
                e["faults"].append(f"{m} scale bytes are 0x7F, which ggml reads as zero and its quantizer never "
                                   "writes")
        sub = 32 if t.type == "MXFP4" else 16
        zero = _zero_blocks(t.codes, s, sub)
        if zero:
            e["notes"].append(f"{zero} blocks hold only zeros under a non-zero scale byte")
        x2 = _gguf_reference(t, refs, e) if refs is not None else None
        if x2 is not None:
            _, rq = _verdict(e, t.codes, s, [(None, x2)], _keys("gguf", t.type),
                             lambda t=t, R=x2.shape[0]: undo_gguf(t, R),
                             f"no {t.type} rule fp4sim knows reproduces its bytes from the reference",
                             lambda r, b, sub=sub: f"row {r}, elements {b * sub} to {b * sub + sub - 1}")
            _add_costs(e, x2, rq)
        e["ok"] = not e["faults"]
        rep.tensors[name] = e
    if refs is not None:
        count_compared(rep)
        _cost_note(rep)
    return rep
