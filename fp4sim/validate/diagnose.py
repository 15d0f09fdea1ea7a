"""Diagnosis: which emulator configuration a kernel's output matches, or which explains most of it.

Configurations: the NVFP4 flavour (te, paper, torchao, modelopt) or MX scale mode (rceil, floor, ceil, even,
and each mode's scales one binade low or high), the E2M1 tie rule (to even, away from zero, toward zero), the
nibble order of the packed codes and the layout the scale bytes are read in; for stochastic rounding with
given bits, the byte mapping of uint32 random words.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings

import numpy as np

from ..planning import is_fp4
from ..quantize import quantize
from ..schemes import NVFP4, FLAVORS, SCALE_MODES
from .readout import codes_from_scaled, codes_unpacked, fp6_packed, scaled, scales_per_row, x2_padded

__all__ = ["diagnose"]


def _scale_variants(sch):
    """(label, scheme, binade offset) for every flavour / scale mode."""
    if isinstance(sch, NVFP4):
        out = []
        for f in FLAVORS:
            for rs, pts in ((False, True), (True, True), (False, False)):
                try:
                    v = dataclasses.replace(sch, flavor=f, row_scaled=rs, per_tensor_scale=pts)
                except ValueError:
                    continue                  # a variant that does not exist (e.g. row-scaled torchao)
                what = ", one tensor scale per row" if rs else (", no tensor scale" if not pts else "")
                v = dataclasses.replace(v, four_over_six=None)
                out.append((f"flavor={f!r}{what}", v, 0))
        for mode, emax, fast, ties, rs in itertools.product(("mae", "mse"), (448, 256), (False, True),
                                                             ("map_to_6", "map_to_4"), (False, True)):
            try:                                      # TE's 4over6 block scales, every error rule
                v = dataclasses.replace(sch, flavor="te", row_scaled=rs, per_tensor_scale=True, four_over_six=mode,
                                        four_over_six_e4m3_max=emax, four_over_six_fast_math=fast,
                                        four_over_six_ties=ties)
            except ValueError:
                continue                              # row-scaled 16x16 does not exist
            tie = "" if ties == "map_to_6" else ", equal errors choose map-to-4 (not TE's rule)"
            out.append((f"flavor='te', 4over6 {mode.upper()}{' fast-math' if fast else ''}, "
                        f"E4M3 max {emax}{tie}{', one tensor scale per row' if rs else ''}", v, 0))
        return out
    out = []
    for m in SCALE_MODES:
        for off, what in ((0, ""), (-1, ", scales one binade low"), (1, ", scales one binade high")):
            out.append((f"scale_mode={m!r}{what}", dataclasses.replace(sch, scale_mode=m), off))
    return out


def _variant_amax(var, g):
    """The second-level amax a variant is tried with: the kernel's own where it fits the variant (a vector for
    row-scaled, a number otherwise), else the variant computes its own from x."""
    if g is None or not var.per_tensor_scale:
        return None
    vec = np.ndim(g) > 0 and np.size(g) > 1
    return g if vec == var.row_scaled else None


def diagnose(x, q, codes, scales, scale_layout, rounding, rbits, rbits_mapping, sr_bits, top=8) -> dict:
    """Try every configuration; return {'exact_match', 'best', 'candidates'} (candidates sorted)."""
    with warnings.catch_warnings():  # the variants re-warn what the main quantize already said
        warnings.simplefilter("ignore", RuntimeWarning)
        return _diagnose(x, q, codes, scales, scale_layout, rounding, rbits, rbits_mapping, sr_bits, top)


def _diagnose(x, q, codes, scales, scale_layout, rounding, rbits, rbits_mapping, sr_bits, top):
    sch = q.scheme
    g = q.global_amax
    xs = np.asarray(x, dtype=np.float32)
    x2 = np.ascontiguousarray(np.moveaxis(xs, q.axis, -1)).reshape(-1, q.K)
    xp = x2_padded(q, x2)
    readings = []  # (label, actual codes unpacked, actual per-row scales)
    for order, layout in itertools.product(("low_first", "high_first"), ("linear", "swizzled")):
        try:
            ac = codes_unpacked(codes, q, order)
            as_ = scales_per_row(scales, q, layout)
        except ValueError:
            continue
        if fp6_packed(codes, q):
            lab = ("FP6 packed little-endian" if order == "low_first"
                   else "FP6 packed big-endian (torchao's former pack_uint6)")
        elif not is_fp4(q.scheme):
            if order != "low_first":
                continue                              # one code per byte: no packing order to try
            lab = "one code per byte"
        else:
            lab = "low nibble first" if order == "low_first" else "high nibble first (swapped nibbles)"
        lab += f", {layout} scales" + (" (not the layout given)" if layout != scale_layout else "")
        readings.append((lab, ac, as_))
    sr = rounding == "sr"
    # with the kernel's bits given: each byte order and each SR rule (the midpoint rule reads TE's order)
    mappings = (("te", "msb_first") if np.asarray(rbits).dtype == np.uint32 else ("te",)) + ("midpoint",) \
        if (sr and rbits is not None) else (rbits_mapping,)
    mappings = tuple(dict.fromkeys((rbits_mapping,) + mappings))
    cands = []
    for slab, var, off in _scale_variants(sch):
        for mapping in mappings:
            kw = dict(axis=q.axis, global_amax=_variant_amax(var, g) if isinstance(sch, NVFP4) else None)
            if sr:
                kw.update(rounding="sr", rbits=rbits, rbits_mapping=mapping, sr_bits=sr_bits)
            try:
                qv = quantize(xs, var, **kw)
            except ValueError:
                continue                      # e.g. 4over6 has no stochastic-rounding form
            fos = getattr(var, "four_over_six", None)
            exp_s = qv.scales_per_row()
            if off:
                exp_s = np.clip(exp_s.astype(np.int16) + off, 0, 254).astype(np.uint8)
            base = codes_unpacked(qv.codes, qv)
            ties = {"ties to even": base}
            if off:
                y, nanfac = scaled(xp, var, exp_s, qv.global_amax if qv.global_amax is not None else 0)
                ties = {"ties to even": codes_from_scaled(y, xp, nanfac, var, "even")}
            if not sr and not fos:
                y, nanfac = scaled(xp, var, exp_s, qv.global_amax if qv.global_amax is not None else 0)
                for tie in ("away", "zero"):
                    c = codes_from_scaled(y, xp, nanfac, var, tie)
                    if not np.array_equal(c, ties["ties to even"]):  # only where the input has exact ties
                        ties[f"ties {'away from' if tie == 'away' else 'toward'} zero"] = c
            for tlab, ec in ties.items():
                for rlab, ac, as_ in readings:
                    label = f"{slab}, {tlab}, {rlab}" + (f", rbits_mapping={mapping!r}" if len(mappings) > 1 else "")
                    cands.append(dict(label=label, code_mismatches=int((ec != ac).sum()),
                                      scale_mismatches=int((exp_s != as_).sum())))
    cands.sort(key=lambda c: (c["code_mismatches"] + c["scale_mismatches"], c["scale_mismatches"]))
    best = cands[0] if cands else None
    return dict(exact_match=bool(best and best["code_mismatches"] == 0 and best["scale_mismatches"] == 0),
                best=best, candidates=cands[:top])
