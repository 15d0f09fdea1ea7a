"""``python -m fp4sim.validate checkpoint DIR`` on a gpt-oss MXFP4 folder (:mod:`fp4sim.gpt_oss`).

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

__all__ = ["check_gpt_oss"]


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


def _fault_rules(w, x):
    """(fault, rules) for the known faults whose fix makes a rule reproduce ``w`` from ``x``, else None."""
    from ..gguf import from_ggml_order
    from ..gpt_oss import reproducing_rules
    from ..layout import pack_fp4
    codes, scales = w.codes, w.scales
    n, nb = scales.shape
    cands = [("the nibbles are swapped (element 2j in the high nibble of byte j)",
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
        cands.append(("the blocks are transposed (rows and K / 32 exchanged)", bt, st))
    for fault, c, s in cands:
        fixed = _Fixed(w, c, s)
        rules = reproducing_rules(fixed, x)
        if rules:
            return fault, rules
    return None


def _rule_name(rule: str) -> str:
    return "ggml's MXFP4 quantizer" if rule == "ggml" else f"MXFP4, scale mode {rule}"


class _Fixed:
    """A weight with other codes and scales (the stored bytes with a fault undone)."""

    def __init__(self, w, codes, scales):
        self.name, self.shape, self.codes, self.scales = w.name, w.shape, codes, scales


def check_gpt_oss(path, reference=None):
    """The :class:`~fp4sim.validate.checkpoint.CheckpointReport` of a gpt-oss MXFP4 folder (the module docstring
    says what is checked)."""
    from ..gpt_oss import read_gpt_oss, reproducing_rules
    from .checkpoint_ref import CheckpointReport, _count_compared, _reference_sources, reference_weight
    ck = read_gpt_oss(path)
    rep = CheckpointReport(str(path), "gpt-oss mxfp4", str(reference) if reference else None)
    import json
    cfg = {}
    try:
        cfg = json.loads((ck.path / "config.json").read_text())
    except (OSError, ValueError):
        pass
    expected = _expected_shapes(cfg)
    refs = _reference_sources(reference) if reference else None
    if not ck.weights:
        rep.faults.append("no quantized weight found (no *_blocks entry): nothing was checked")
    for name, w in ck.weights.items():
        t = {"ok": True, "faults": [], "notes": [], "shape": list(w.shape), "global_amax": None,
             "shared_scale": [], "exact": None, "rule": None, "rules": [], "compared": False}
        _check(w, expected, t)
        if refs is not None:
            x, why = reference_weight(w, refs)
            if x is None:
                t["notes"].append(f"{why}: not compared")
            else:
                try:
                    rules = reproducing_rules(w, x)
                except ValueError as e:
                    t["faults"].append(str(e))
                    rules = None
                if rules is not None:
                    t["compared"] = True
                    t["exact"] = bool(rules)
                    t["rules"] = [_rule_name(r) for r in rules]
                    t["rule"] = t["rules"][0] if rules else None
                    if not rules:
                        hit = _fault_rules(w, x)
                        t["faults"].append(
                            f"{hit[0]}: with that undone, {', '.join(map(_rule_name, hit[1]))} reproduces it" if hit else
                            "no MXFP4 rule (fp4sim's scale modes rceil / floor / ceil / even with round-to-nearest-"
                            "even elements, ggml's quantizer) reproduces its bytes from the reference")
        t["ok"] = not t["faults"]
        rep.tensors[name] = t
    if refs is not None:
        _count_compared(ck, rep)
    return rep
