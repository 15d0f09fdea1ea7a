"""``python -m fp4sim.validate checkpoint`` on a gpt-oss MXFP4 folder (:mod:`fp4sim.gpt_oss`) and on a GGUF file
(:func:`check_gguf`, whose docstring says what it checks).

Without a reference, per quantized weight: E8M0 byte 255 (NaN: the whole block decodes to NaN), the blocks'
shape against the config's dimensions (``num_local_experts``, ``hidden_size``, ``intermediate_size``: gate_up
[experts, 2 x intermediate, hidden], down [experts, hidden, intermediate]), and blocks whose codes are all zero
under a non-zero scale (a note: a rule that writes the scale of an all-zero block as 0 does not). With
``--reference`` (the high-precision weights, [experts, rows, K] or transformers' [experts, K, rows], any layout
analyze reads), the MXFP4 rules that reproduce the stored bytes are named (:func:`fp4sim.gpt_oss.reproducing_rules`:
fp4sim's scale modes rceil / floor / ceil / even, ggml's quantizer); where none does, the known faults that do:
nibbles swapped (element 2j read from the high nibble), ggml's element order (j and j + 16 in one byte, a GGUF
block copied as is), the E8M0 bias off by one (the scale bytes one binade off: e read with bias 128), blocks
transposed (rows and K / 32 exchanged).
"""
from __future__ import annotations

import numpy as np

__all__ = ["check_gpt_oss", "check_gguf"]


def _expected_shapes(cfg: dict) -> dict:
    """{suffix: (experts, rows, K)} from a gpt-oss config.json (empty where it does not say)."""
    E, H, inter = (cfg.get(k) for k in ("num_local_experts", "hidden_size", "intermediate_size"))
    if not all(isinstance(v, int) and v > 0 for v in (E, H, inter)):
        return {}
    return {"gate_up_proj": (E, 2 * inter, H), "down_proj": (E, H, inter)}


def _check(w, expected, t):
    s = w.scales
    nan = int((s == 255).sum())
    if nan:
        t["faults"].append(f"{nan} E8M0 scale bytes are 255, NaN: their blocks decode to NaN")
    want = next((v for k, v in expected.items() if w.name.endswith(k)), None)
    if want is not None and tuple(w.shape) != tuple(want):
        t["faults"].append(f"its blocks hold {tuple(w.shape)} (experts, rows, K); the config's dimensions give "
                           f"{tuple(want)}")
    from ..layout import unpack_fp4
    c = unpack_fp4(w.codes)
    zero = ((c & 7) == 0).reshape(s.shape[0], s.shape[1], 32).all(-1) & (s > 0)
    if zero.any():
        t["notes"].append(f"{int(zero.sum())} blocks hold only zeros under a non-zero scale byte")


def _rule_name(rule: str) -> str:
    return "ggml's MXFP4 quantizer" if rule == "ggml" else f"MXFP4, scale mode {rule}"


def _mx_candidates(x2) -> list:
    """[(rule name, codes, scales)]: the bytes of each MXFP4 rule (:data:`fp4sim.gpt_oss.MX_RULES`) for ``x2``,
    each quantized once."""
    from ..gpt_oss import MX_RULES, rule_bytes
    return [(_rule_name(r), *rule_bytes(x2, r)) for r in MX_RULES]


def _gguf_candidates(kind: str, x2) -> list:
    """[(rule name, codes, scales)] of the rules a GGUF ``kind`` tensor may have been written by, for ``x2``."""
    if kind == "NVFP4":
        from ..gguf import ggml_nvfp4_quantize
        return [("ggml's NVFP4 quantizer", *ggml_nvfp4_quantize(x2))]
    return _mx_candidates(x2)


def _matches(cands, codes, scales) -> list:
    """The names of the candidates whose codes and scale bytes are ``codes`` and ``scales``."""
    return [n for n, c, s in cands if np.array_equal(c, codes) and np.array_equal(s, scales)]


def _gguf_rules(t, x2) -> list:
    """The rules that give the GGUF FP4 tensor ``t``'s codes and scale bytes from ``x2`` (rows, K)."""
    return _matches(_gguf_candidates(t.type, x2), t.codes, t.scales)


def _block_diff(codes, scales, c, s) -> np.ndarray:
    """bool (rows, blocks): the scale blocks whose scale byte or any of whose codes differ."""
    from ..layout import unpack_fp4
    R, nb = scales.shape
    a, b = unpack_fp4(codes), unpack_fp4(c)
    return (a != b).reshape(R, nb, -1).any(-1) | (scales != s)


def _mx_fixes(w) -> list:
    """[(fault, codes, scales)]: a gpt-oss weight's bytes with each known fault undone — nibbles swapped, ggml's
    element order, the scale bytes one binade high or low, blocks transposed (where rows differ from K / 32)."""
    from ..gguf import from_ggml_order
    from ..layout import pack_fp4
    codes, scales = w.codes, w.scales
    n, nb = scales.shape
    out = [("the nibbles are swapped (element 2j in the high nibble of byte j)",
            ((codes >> 4) | (codes << 4)).astype(np.uint8), scales),
           ("the codes are in ggml's order (byte j holds elements j and j + 16 of a block: a GGUF block "
            "copied as is)", pack_fp4(from_ggml_order(codes, 32)), scales),
           ("the scale bytes are one binade high (E8M0 written with bias 128)", codes,
            (scales.astype(np.int16) - 1).clip(0, 255).astype(np.uint8)),
           ("the scale bytes are one binade low (E8M0 read with bias 128)", codes,
            (scales.astype(np.int16) + 1).clip(0, 255).astype(np.uint8))]
    E = int(np.prod(w.shape[:-2], dtype=np.int64))
    R = w.shape[-2]
    if R != nb:
        bt = codes.reshape(E, nb, R, 16).transpose(0, 2, 1, 3).reshape(n, nb * 16)
        st = scales.reshape(E, nb, R).transpose(0, 2, 1).reshape(n, nb)
        out.append(("the blocks are transposed (rows and K / 32 exchanged)", bt, st))
    return out


def _verdict(e, codes, scales, readings, candidates, fixes, none_msg, where):
    """Fill the tensor entry ``e`` with the rules that reproduce the stored ``codes`` and ``scales`` from the
    reference — ``readings``: [(orientation, x2)], the reference's possible readings in order (one, or two for a
    square gpt-oss weight); ``candidates(x2)``: each rule's bytes of a reading — or, where none does, the known
    fault whose undoing (``fixes()``: [(fault, codes, scales)]) makes one reproduce them, else ``none_msg`` with
    the count of scale blocks that differ from the closest rule's bytes and the first of them (``where(row,
    block)`` names it). Returns the reading used (the matching one, else the first)."""
    e["compared"] = True
    e["exact"], e["rules"], e["rule"] = False, [], None
    cache = {}

    def cands(i):
        if i not in cache:
            cache[i] = candidates(readings[i][1])
        return cache[i]

    say = (lambda o: f" (the reference is square: read in {o})") if len(readings) > 1 else (lambda o: "")
    for i, (orientation, _) in enumerate(readings):
        rules = _matches(cands(i), codes, scales)
        if rules:
            e["exact"], e["rules"], e["rule"] = True, rules, rules[0]
            if len(readings) > 1:
                e["notes"].append(f"the reference is square: its bytes match it read in {orientation}")
            return readings[i]
    for fault, c, s in fixes():
        for i, (orientation, _) in enumerate(readings):
            hit = _matches(cands(i), c, s)
            if hit:
                e["faults"].append(f"{fault}: with that undone, {', '.join(hit)} reproduces it{say(orientation)}")
                return readings[i]
    n, name, d, i = min(((int(d.sum()), name, d, i) for i in range(len(readings)) for name, c, s in cands(i)
                         for d in [_block_diff(codes, scales, c, s)]), key=lambda v: v[0])
    r, b = (int(v) for v in np.argwhere(d)[0])
    e["faults"].append(f"{none_msg}: {n} of {d.size} scale blocks differ from the bytes of {name}, the closest "
                       f"(first at {where(r, b)}){say(readings[i][0])}")
    return readings[i]


def check_gpt_oss(path, reference=None):
    """The :class:`~fp4sim.validate.checkpoint.CheckpointReport` of a gpt-oss MXFP4 folder (the module docstring
    says what is checked). A weight whose entries do not make one (a ``_blocks`` entry without its ``_scales``,
    shapes that disagree) is a fault of that weight; the others are checked."""
    from ..gpt_oss import read_gpt_oss, reference_orientations
    from .checkpoint_ref import CheckpointReport, _count_compared, _reference_sources, reference_weight
    ck = read_gpt_oss(path, strict=False)
    rep = CheckpointReport(str(path), "gpt-oss mxfp4", str(reference) if reference else None)
    import json
    cfg = {}
    try:
        cfg = json.loads((ck.path / "config.json").read_text())
    except (OSError, ValueError):
        pass
    expected = _expected_shapes(cfg)
    refs = _reference_sources(reference) if reference else None
    if not ck.weights and not ck.broken:
        rep.faults.append("no quantized weight found (no *_blocks entry): nothing was checked")
    for name, why in ck.broken.items():
        rep.tensors[name] = {"ok": False, "faults": [f"its entries do not make an MXFP4 weight: {why}"], "notes": [],
                             "shape": None, "global_amax": None, "shared_scale": [], "exact": None, "rule": None,
                             "rules": [], "compared": False}
    for name, w in ck.weights.items():
        t = {"ok": True, "faults": [], "notes": [], "shape": list(w.shape), "global_amax": None,
             "shared_scale": [], "exact": None, "rule": None, "rules": [], "compared": False}
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
                R = w.shape[-2]
                _, x2 = _verdict(t, w.codes, w.scales, readings, _mx_candidates, lambda w=w: _mx_fixes(w),
                                 "no MXFP4 rule (fp4sim's scale modes rceil / floor / ceil / even with round-to-"
                                 "nearest-even elements, ggml's quantizer) reproduces its bytes from the reference",
                                 lambda r, b, R=R: f"expert {r // R}, row {r % R}, block {b}")
                _add_costs(t, x2)
        t["ok"] = not t["faults"]
        rep.tensors[name] = t
    if refs is not None:
        _count_compared(ck, rep)
        _cost_note(rep)
    return rep


def _add_costs(t, x2):
    """The rules' costs on the reference ``x2`` (float32 (rows, K) in the stored order;
    :func:`fp4sim.gguf.rule_costs`) in the tensor's entry, where K is a multiple of 64 (NVFP4's GGUF blocks)."""
    from ..gguf import rule_costs
    if x2.shape[-1] % 64 == 0:
        t["costs"] = rule_costs(x2)


def _cost_note(rep):
    """One line: each rule's relative MSE on the reference (median over the tensors compared) and the share of
    blocks whose largest values clip under ggml's MXFP4 rule."""
    from ..gguf import COST_RULES
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
def _gguf_fixes(t, rows: int) -> list:
    """[(fault, codes, scales)]: a GGUF FP4 tensor's bytes with each known fault undone — gpt-oss's pair order
    where ggml's halves belong, the scale bytes one binade high or low, the blocks written column by column."""
    from ..gguf import GGUFTensor, block_layout, to_ggml_order
    from ..layout import unpack_fp4
    codes, scales = t.codes, t.scales
    n, nbytes, _, sub = block_layout(t.type)
    # the stored bytes are the true codes in fp4sim / gpt-oss pair packing; the reader took them for ggml's
    # halves: packing its codes back in ggml's order gives those bytes, i.e. the true codes in fp4sim's packing
    pairs = to_ggml_order(unpack_fp4(codes), sub)
    step = 1 if t.type == "MXFP4" else 8                  # one binade: E8M0 + 1, E4M3's exponent field + 1
    out = [("the codes are in gpt-oss's pair order (elements 2j and 2j + 1 in byte j), not ggml's halves "
            f"(elements j and j + {sub // 2})", pairs, scales),
           ("the scale bytes are one binade high" + (" (E8M0 written with bias 128)" if step == 1 else
                                                     " (the 0.5 factor of ggml's UE4M3 left out)"),
            codes, (scales.astype(np.int16) - step).clip(0, 255).astype(np.uint8)),
           ("the scale bytes are one binade low" + (" (E8M0 read with bias 128)" if step == 1 else
                                                    " (ggml's UE4M3 0.5 factor applied twice)"),
            codes, (scales.astype(np.int16) + step).clip(0, 255).astype(np.uint8))]
    # blocks written column by column: the file's block i is block (i % rows, i // rows) of the (rows, K / n) grid
    nb = t.shape[-1] // n
    raw = np.ascontiguousarray(t.stored(), np.uint8).reshape(nb, rows, nbytes).transpose(1, 0, 2)
    tt = GGUFTensor(t.name, t.type, t.shape, np.ascontiguousarray(raw))
    out.append((f"the blocks are transposed (written by K / {n} first, then rows)", tt.codes, tt.scales))
    return out


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
    from ..gguf import other_fp4_bytes
    other, ob = other_fp4_bytes(t.type, t.shape)
    fits_other = ob is not None and ob <= t.region < ob + align
    sizes = f"{t.type} blocks of shape {tuple(t.shape)} need {t.n_bytes} bytes" + (
        f", {other} ones {ob}" if ob is not None else "")
    if fits_other and t.region < t.n_bytes or fits_other and t.region >= t.n_bytes + align:
        return [f"its data region holds {t.region} bytes: {sizes} — {other} blocks under an {t.type} type "
                f"(a GGUF {other} tensor read as {t.type}?)"]
    return _data_faults(t)


def _prefix_rules(t, x2, kind: str, n: int) -> list:
    """The ``kind`` rules (ggml's NVFP4 quantizer; the MXFP4 rules) whose GGUF bytes of ``x2`` agree with the
    first ``n`` bytes of the tensor's region (those the file holds)."""
    from ..gguf import to_gguf_blocks
    got = t.region_bytes()[:n]
    return [name for name, c, s in _gguf_candidates(kind, x2)
            if got.size == n and np.array_equal(to_gguf_blocks(c, s, kind).reshape(-1)[:n], got)]


def _region_with_reference(t, x2) -> str | None:
    """With the reference: the rules whose bytes the region holds — the other FP4 type's, or, in a truncated
    tensor, its own type's up to where the file ends."""
    from ..gguf import other_fp4_bytes
    other, ob = other_fp4_bytes(t.type, t.shape)
    hit = _prefix_rules(t, x2, other, ob) if ob is not None else []
    if hit:
        return f"its bytes are {', '.join(hit)}'s from the reference: {other} blocks under an {t.type} type"
    n = t.n_bytes - t.missing
    hit = _prefix_rules(t, x2, t.type, n) if t.missing and n > 0 else []
    return f"the {n} bytes the file holds are {', '.join(hit)}'s from the reference: only the end is " \
           "missing" if hit else None


def _gguf_reference(t, refs, e):
    """The reference of GGUF tensor ``t`` as float32 (rows, K), or None with the reason in its entry ``e``: a
    note where there is none or it holds NaN / Inf, a fault where its shape is another."""
    from .checkpoint_ref import reference_weight
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
    from ..gguf import read_gguf
    from .checkpoint_ref import CheckpointReport, _count_compared, _reference_sources
    f = read_gguf(path)
    rep = CheckpointReport(str(path), "gguf", str(reference) if reference else None)
    refs = _reference_sources(reference) if reference else None
    if not f.fp4:
        rep.faults.append("no MXFP4 or NVFP4 tensor in the file: nothing was checked (other types: "
                          + ", ".join(sorted({t.type for t in f.tensors.values()})[:8]) + ")")
    for name, t in f.tensors.items():
        if not t.fp4:
            rep.faults += [f"{name} ({t.type}, not quantized to FP4): {why}" for why in _data_faults(t)]
    from ..layout import unpack_fp4
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
        c = unpack_fp4(t.codes)
        sub = 32 if t.type == "MXFP4" else 16
        zero = ((c & 7) == 0).reshape(s.shape[0], s.shape[1], sub).all(-1) & (s > 0)
        if zero.any():
            e["notes"].append(f"{int(zero.sum())} blocks hold only zeros under a non-zero scale byte")
        x2 = _gguf_reference(t, refs, e) if refs is not None else None
        if x2 is not None:
            _add_costs(e, x2)
            _verdict(e, t.codes, s, [(None, x2)], lambda x2, k=t.type: _gguf_candidates(k, x2),
                     lambda t=t, R=x2.shape[0]: _gguf_fixes(t, R),
                     f"no {t.type} rule fp4sim knows reproduces its bytes from the reference",
                     lambda r, b, sub=sub: f"row {r}, elements {b * sub} to {b * sub + sub - 1}")
        e["ok"] = not e["faults"]
        rep.tensors[name] = e
    if refs is not None:
        _count_compared(f, rep)
        _cost_note(rep)
    return rep
