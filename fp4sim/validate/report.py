"""The validation report: verdict, mismatch counts, first mismatches, diagnosis, SR statistics."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Report:
    """Outcome of :func:`fp4sim.validate.compare`.

    verdict: ``"exact"`` (codes, scales and global scale identical), ``"mismatch"``, ``"sr_consistent"``
    (stochastic rounding without the kernel's bits: every code is a neighbour of its scaled input and the
    rounding-up frequency matches delta) or ``"sr_inconsistent"``.
    """
    scheme: str
    flavor: str | None
    verdict: str
    n_codes: int
    n_scales: int
    code_mismatches: int
    scale_mismatches: int
    global_amax_mismatch: bool = False
    mismatches: list = field(default_factory=list)
    scale_mismatch_examples: list = field(default_factory=list)
    diagnosis: dict = field(default_factory=dict)
    where: dict = field(default_factory=dict)
    sr: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    @property
    def ok(self) -> bool:
        return self.verdict in ("exact", "sr_consistent")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 1), default=float, **kw)

    def summary(self) -> str:
        """A readable multi-line summary (what the CLI prints)."""
        fl = f" ({self.flavor})" if self.flavor else ""
        lines = [f"fp4sim.validate: scheme {self.scheme}{fl}: {self.verdict.upper()}",
                 f"  codes:  {self.code_mismatches} of {self.n_codes} differ",
                 f"  scales: {self.scale_mismatches} of {self.n_scales} differ"]
        if self.global_amax_mismatch:
            lines.append("  global amax: differs from the tensor's |x| max")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.scale_mismatch_examples:
            lines.append("  first scale mismatches (scale row, block: expected -> actual):")
            for m in self.scale_mismatch_examples:
                e, a = m["expected"], m["actual"]
                shown = (f"{e:.9g} -> {a:.9g}" if isinstance(e, float) else f"{e} -> {a}") + (
                    " (its reciprocal)" if m.get("reciprocal") else "")
                lines.append(f"    [{m['row']}, {m['block']}]: {shown}")
        if self.mismatches:
            blocks = self.mismatches[0].get("block") is not None
            lines.append(f"  first code mismatches (index in input{', block, element' if blocks else ''}: x, "
                         "expected -> actual code (value)):")
            for m in self.mismatches:
                at = f"({', '.join(str(int(i)) for i in m['index'])})" + (
                    f" blk {m['block']} el {m['element']}" if m.get("block") is not None else "")
                lines.append(f"    {at}: x={m['x']:.9g} "
                             f"{m['expected_code']:#x} ({m['expected_value']:.6g}) -> {m['actual_code']:#x} "
                             f"({m['actual_value']:.6g})")
        if self.sr:
            s = self.sr
            lines.append(f"  stochastic rounding: {s['n_inexact']} inexact elements, {s['not_neighbour']} not a "
                         f"neighbour of the scaled input; round-up rate {s['up_rate']:.4f} vs expected "
                         f"{s['expected_up_rate']:.4f} (z = {s['z']:.2f}, p = {s['p_value']:.3g}); relative bias "
                         f"{s['relative_bias']:.3g}")
            bins = [b for b in s.get("per_bin", []) if b["n"]]
            if bins:
                lines.append("    round-up rate by delta bin (observed / expected): " + ", ".join(
                    f"[{b['delta_lo']:.3g},{b['delta_hi']:.3g}) {b['up_rate']:.3f}/{b['expected']:.3f}" for b in bins))
            for v in s.get("findings", []):
                lines.append(f"    -> {v}")
            if np.isfinite(s.get("detectable_rate_shift", np.nan)):
                lines.append(f"    power: a shift of the overall round-up rate above {s['detectable_rate_shift']:.2g} "
                             f"(= {s['detectable_rate_shift'] * 256:.2g}/256) is detected at this size; smaller "
                             "biases (an off-by-one comparison shifts it by 1/2^n) need more elements")
        w = self.where
        if w.get("first_bad"):
            lines.append(f"  where: first bad block at row {w['first_bad']['row']}, block {w['first_bad']['block']}; "
                         f"{w['pattern']}")
        d = self.diagnosis
        for f in d.get("layout", []):
            lines.append(f"  layout: {f}")
        if d:
            if d.get("exact_match"):
                lines.append(f"  diagnosis: the output matches exactly with {d['best']['label']}")
            elif d.get("best"):
                b = d["best"]
                lines.append(f"  diagnosis: no configuration matches exactly; closest is {b['label']} "
                             f"({b['code_mismatches']} code / {b['scale_mismatches']} scale mismatches)")
            for c in d.get("candidates", [])[:5]:
                lines.append(f"    {c['code_mismatches']:>8} codes {c['scale_mismatches']:>6} scales   {c['label']}")
        return "\n".join(lines)
