"""The report of a GEMM comparison (``GemmReport``) and the bit comparisons that the NVFP4 and the FP8 GEMM
checks share."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import ml_dtypes
import numpy as np

__all__ = ["GemmReport", "separation"]


@dataclass
class GemmReport:
    """Outcome of :func:`compare_gemm`.

    best: the first model (in ``CANDIDATES`` order) that reproduces every output element bit for bit, or None;
    matches: every model that does (more than one: these operands do not tell them apart — use the witnesses);
    match_fraction: {model: share of elements with identical bits}; closest: the model with the largest share;
    mismatches: the closest model's worst elements (row, col, the kernel's value, the model's, the distance in
    units in the last place of the output dtype); faults: for an output no model reproduces, the known faults
    that do reproduce it (the transposed product B . A^T, bfloat16 bits truncated instead of rounded).
    """
    shape: tuple
    dtype: str
    scheme: str
    best: str | None
    matches: list
    match_fraction: dict
    closest: str
    mismatches: list = field(default_factory=list)
    nan_mismatches: int = 0
    notes: list = field(default_factory=list)
    faults: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.best is not None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 1), default=float, **kw)

    def summary(self) -> str:
        M, N = self.shape
        head = (f"fp4sim.validate gemm: {self.scheme}, {M}x{N} {self.dtype} outputs: "
                + (f"MATCHES {self.best}" if self.best else "NO MODEL MATCHES"))
        lines = [head]
        if len(self.matches) > 1:
            lines.append(f"  also reproduced by {', '.join(m for m in self.matches if m != self.best)}: these "
                         "operands do not tell them apart (python -m fp4sim.validate gemm-witnesses)")
        for m, f in sorted(self.match_fraction.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {m:18s} {100 * f:8.3f}% of elements identical")
        if self.mismatches:
            lines.append(f"  worst mismatches against the closest model, {self.closest} (row, col: kernel vs model, "
                         "ulps):")
            for e in self.mismatches:
                lines.append(f"    [{e['row']}, {e['col']}]: {e['kernel']!r} vs {e['model']!r} ({e['ulps']})")
        for f in self.faults:
            lines.append(f"  fault: {f}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _ordered(a):
    """Integers in the order of the floats (adjacent floats differ by 1), for distances in ulps."""
    bits = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).astype(np.int64)
    sign = np.int64(1) << (16 if a.dtype.itemsize == 2 else 32) - 1
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def _same(a, b):
    """Elementwise: identical bits, or NaN on both sides (a NaN's payload is not the accumulation's)."""
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    w = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    return np.where(na | nb, na & nb, a.view(w) == b.view(w))


def separation(ys: dict, bf16: bool = False) -> dict:
    """{"m1 | m2": number of cells where the two models' outputs differ} for every pair."""
    names = list(ys)
    out = {}
    for i, m1 in enumerate(names):
        for m2 in names[i + 1:]:
            a, b = ys[m1], ys[m2]
            if bf16:
                a, b = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
            out[f"{m1} | {m2}"] = int((~_same(a, b)).sum())
    return out
