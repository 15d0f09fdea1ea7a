"""A checkpoint's quantized weight against the high-precision weight it was made from, byte for byte, with the
known export faults named (see :mod:`fp4sim.validate.checkpoint`).

The reference is quantized again by each exporter's rule (the registry, :mod:`fp4sim.checkpoints.rules`): ModelOpt's (fp4sim's
``modelopt`` flavour, float32 whatever the weight's dtype, as ModelOpt computes) and compressed-tensors' (in each
dtype the reference's values are exact in: bfloat16, float16, float32). Each rule's tensor scale is expected in
the checkpoint's own direction, either as the rule writes it or converted from the other format (``1 / x`` in
float32, as compressed-tensors' ModelOpt converter and its reverse compute it). The weight is exact when one
rule reproduces codes, scale bytes and tensor scale; the rule is named."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from ..analyze.inputs import reference_source, reference_sources, reference_weight
from ..checkpoints.nvfp4 import KEYS, excluded_by
from ..checkpoints.rules import Requantized, rule
from ..layout import swizzle_scales, swizzled_size

__all__ = ["CheckpointReport", "compare_to_reference", "count_compared", "excluded_findings", "reference_sources",
           "reference_weight"]

C2688 = np.float32(2688.0)
F32 = np.float32


def _fail(t: dict, msg: str):
    t["faults"].append(msg)
    t["ok"] = False


@dataclasses.dataclass
class Rule:
    """One exporter's bytes for the reference (the registry's :class:`~fp4sim.checkpoints.rules.RuleBytes`, as the
    checkpoint's format holds them): ``codes``, ``scales`` (rows x blocks) and the tensor scale as the
    checkpoint's format stores it (``ts``) and as the other direction would hold it (``inverse``: the value a
    checkpoint that did not invert it stores); ``native``: the rule is the format's own (not converted)."""
    name: str
    codes: np.ndarray
    scales: np.ndarray
    ts: np.float32
    inverse: np.float32
    native: bool


def _rule(name, b, native):
    """A rule whose bytes are ``b`` (its own tensor-scale value ``b.tensor_scale``), in the checkpoint's direction
    when ``native``."""
    own = b.tensor_scale
    conv = F32(F32(1.0) / own)
    return Rule(name, b.codes, b.scales, own if native else conv, conv if native else own, native)


def _exact_in(x, dtype) -> bool:
    import ml_dtypes
    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    with np.errstate(over="ignore"):
        return bool(np.array_equal(x.astype(dt).astype(np.float32), x))


def _rules(rq: Requantized, fmt: str, amax=None) -> list:
    """The exporters' rules of the registry for the reference of ``rq`` (float32), the checkpoint format's own
    first: ModelOpt's, and compressed-tensors' in each dtype the reference is exact in; ``amax``: the amax a
    fused group's shared tensor scale comes from (its largest, see
    :func:`fp4sim.validate.checkpoint.shared_scale_groups`; the rules' ``-fused`` entries), else the weight's own."""
    x = rq.x
    fused = {} if amax is None else {"amax": F32(amax)}
    suffix = "-fused" if fused else ""
    with np.errstate(divide="ignore", over="ignore"):
        mo = _rule(rule(f"modelopt-nvfp4{suffix}").title, rq.bytes(f"modelopt-nvfp4{suffix}", **fused),
                   fmt == "modelopt")
        cts = []
        if x.shape[1] % 16 == 0:
            key = f"compressed-tensors-nvfp4{suffix}"
            for dt in ("bfloat16", "float16", "float32"):
                if dt == "float32" or _exact_in(x, dt):
                    cts.append(_rule(f"{rule(key).title} (in {dt})", rq.bytes(key, dtype=dt, **fused),
                                     fmt != "modelopt"))
    if fmt == "modelopt":
        rules = [mo] + cts
    else:
        rules = cts + [mo]
    for r in rules:
        if not r.native:
            r.name += (", converted (weight_global_scale = 1 / weight_scale_2)" if fmt != "modelopt" else
                       ", converted (weight_scale_2 = 1 / weight_global_scale)")
    return rules


def compare_to_reference(w, fmt: str, refs: dict, t: dict, x=None, amax=None, group=None):
    """Fill ``t`` (a tensor entry of the report) with the comparison of ``w`` against its reference weight ``x``
    (default: read from ``refs``); ``amax``: the amax the tensor scale comes from when ``w`` shares it with the
    weights of ``group`` (their largest), else the weight's own. Sets ``t["compared"]``."""
    t["compared"] = False
    if x is None:
        x, why = reference_weight(w, refs)
        if x is None:
            t["notes"].append(f"{why}: not compared")
            return
    src = reference_source(w, refs)
    if x.shape != tuple(w.shape):
        _fail(t, f"the reference {src.name} has shape {x.shape}; the checkpoint's codes hold {tuple(w.shape)}")
        return
    if not np.isfinite(x).all():
        t["notes"].append(f"the reference {src.name} holds NaN or Inf: not compared")
        return
    kg = KEYS[fmt][2]
    t["compared"] = True
    rq = Requantized(x)
    rules = _rules(rq, fmt, amax)
    got_c = np.asarray(w.codes)
    got_s = w.scales
    got_s = None if got_s is None else np.asarray(got_s).reshape(-1)
    ts = None if w.tensor_scale is None else F32(w.tensor_scale)

    def same_bytes(r):
        return (got_c.shape == r.codes.shape and np.array_equal(got_c, r.codes) and got_s is not None
                and got_s.size == r.scales.size and np.array_equal(got_s, r.scales.reshape(-1)))

    exact = [r for r in rules if same_bytes(r) and ts == r.ts]
    if exact:
        t["exact"] = True
        t["rule"] = exact[0].name
        t["rules"] = [r.name for r in exact]
        if not any(r.native for r in exact):
            t["notes"].append(f"made by {exact[0].name}" + "".join(f" (or, the same bytes here, {r.name})"
                                                                  for r in exact[1:]))
        return
    match = next((r for r in rules if same_bytes(r)), None)
    t["exact"] = False
    main = match or rules[0]
    t["rule"] = main.name if match else None
    ts_rule = next((r for r in rules if ts == r.ts), None) if match is not None else None
    if ts_rule is not None:
        from ..layout import unpack_fp4
        same = " / ".join(r.name.split(",")[0] for r in rules if same_bytes(r))
        nd = int((match.scales != ts_rule.scales).sum())
        ne = int((unpack_fp4(match.codes) != unpack_fp4(ts_rule.codes)).sum())
        _fail(t, f"a mixed export: the codes and scales are those of {same}, the {kg} that of {ts_rule.name} "
                 f"(the rules' bytes differ where a block scale or an element falls on a rounding boundary: "
                 f"{nd} blocks' scales and {ne} elements here)")
        return
    if ts is not None and ts != main.ts:
        inv = next((r for r in rules if ts == r.inverse), None)
        want = ("amax / 2688, a multiplier" if fmt == "modelopt" else "2688 / amax, a divisor")
        if inv is not None:
            _fail(t, f"{kg} is {float(ts)!r}, the inverse of the {float(inv.ts)!r} that {inv.name} gives "
                     f"({want}): the global scale was not inverted (the other format's direction written)")
        else:
            whose = (f"the largest amax of the weights that share it ({', '.join(group)})" if group else
                     "the reference")
            _fail(t, f"{kg} is {float(ts)!r}; {main.name} gives {float(main.ts)!r} ({want}) for {whose}")
    if match is not None:
        return
    scales = main.scales
    if got_s is not None and got_s.size != scales.size:       # the size itself is a fault of the checks without
        R, nb = scales.shape                                   # a reference; here, what the bytes are
        if got_s.size == swizzled_size(R, nb) and np.array_equal(got_s,
                                                                  np.asarray(swizzle_scales(scales)).reshape(-1)):
            _fail(t, f"the block scales are {main.name}'s in cuBLAS's swizzled 128x4 layout, not the linear rows x "
                     "blocks layout")
        return
    if got_s is None or got_c.shape != main.codes.shape:
        return
    _layout_fault(t, rq, main, rules, got_c, got_s.reshape(scales.shape))


def _layout_fault(t, rq: Requantized, main: Rule, rules: list, got_c, got_s):
    """Codes or scale bytes of the reference's shape that differ: the layout faults fp4sim.validate names in a
    kernel's output (locate.layout_findings: swapped nibbles, scales one binade off or transposed, rows, blocks
    or columns permuted, another row stride), else another rule's or flavour's rounding order, else where they
    differ."""
    from ..layout import unpack_fp4
    from .locate import layout_findings
    sw = np.asarray(swizzle_scales(main.scales)).reshape(-1)
    if sw.size == got_s.size and not np.array_equal(got_s, main.scales) and np.array_equal(sw, got_s.reshape(-1)):
        _fail(t, f"against {main.name}: the block scales are in cuBLAS's swizzled 128x4 layout, written where the "
                 "linear rows x blocks layout belongs (same size here)")
        if np.array_equal(got_c, main.codes):
            return
        got_s = main.scales
    q = dataclasses.replace(rq.bytes("modelopt-nvfp4").qt, codes=main.codes, scales=main.scales)
    found = layout_findings(q, got_c, got_s, "linear", unpack_fp4(main.codes), unpack_fp4(got_c), main.scales,
                            got_s)
    for f in found:
        _fail(t, f"against {main.name}: {f}")
    if found:
        return
    others = [(r.name, r.codes, r.scales) for r in rules if r is not main]
    others += [(rule(k).title, rq.bytes(k).codes, rq.bytes(k).scales) for k in ("te-nvfp4", "torchao-nvfp4")]
    for name, oc, os_ in others:
        if np.array_equal(os_, got_s) and np.array_equal(oc, got_c):
            _fail(t, f"the codes and scales are those of {name}, not {main.name} (they differ where a block scale "
                     f"or an element falls on a rounding boundary: {int((os_ != main.scales).sum())} blocks' "
                     "scales here)")
            return
    bad = np.argwhere((got_s != main.scales) | (unpack_fp4(got_c) != unpack_fp4(main.codes))
                      .reshape(*main.scales.shape, 16).any(-1))
    _fail(t, f"{len(bad)} of {main.scales.size} blocks differ from the reference quantized with {main.name} "
             f"(first at row {int(bad[0][0])}, block {int(bad[0][1])})")


@dataclass
class CheckpointReport:
    """``tensors``: {module: {"ok": bool, "faults": [...], "notes": [...], "shape", "global_amax", "exact",
    "rule", "rules"}} (``exact``: equal to the reference re-quantized by ``rule``, the first of the exporters'
    rules that reproduces its bytes; ``rules``: every rule that does);
    ``faults`` / ``notes`` of the checkpoint as a whole (excluded modules, ...); ``ok``: no fault anywhere."""
    path: str
    format: str
    reference: str | None
    tensors: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.faults and all(t["ok"] for t in self.tensors.values())

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=1, default=float)

    def summary(self) -> str:
        bad = [n for n, t in self.tensors.items() if not t["ok"]]
        exact = sum(1 for t in self.tensors.values() if t.get("exact"))
        parts = ([f"{len(bad)} of {len(self.tensors)} with faults"] if bad else []) + (
            [f"{len(self.faults)} fault{'s' if len(self.faults) > 1 else ''} of the checkpoint as a whole"]
            if self.faults else [])
        head = (f"fp4sim.validate checkpoint: {self.path} ({self.format}), {len(self.tensors)} quantized linears: "
                + ("CONSISTENT" if self.ok else "; ".join(parts)))
        if self.reference:
            head += f"; {exact} of {len(self.tensors)} equal to the reference re-quantized, byte for byte"
        lines = [head]
        rules = {}
        for t in self.tensors.values():
            if t.get("exact"):
                rules[t["rule"]] = rules.get(t["rule"], 0) + 1
        for r, n in rules.items():
            lines.append(f"  equal by {r}: {n} tensors")
        for n, t in self.tensors.items():
            for f in t["faults"]:
                lines.append(f"  FAULT {n}: {f}")
        for f in self.faults:
            lines.append(f"  FAULT: {f}")
        for n, t in self.tensors.items():
            for f in t["notes"]:
                lines.append(f"  note {n}: {f}")
        for f in self.notes:
            lines.append(f"  note: {f}")
        if not self.reference and self.tensors:
            lines.append("  note: checked without a reference: the structure, shapes and scale bytes each tensor holds "
                         "on its own. A byte-level fault (nibbles swapped, scales one binade off, another rule's "
                         "rounding) shows only against the high-precision weights: --reference checks the bytes")
        return "\n".join(lines)


def count_compared(rep: CheckpointReport):
    """A reference that leaves quantized weights uncompared is a fault: nothing is passed unseen."""
    missing = [n for n, t in rep.tensors.items() if not t.get("compared")]
    if not missing:
        return
    n = len(rep.tensors)
    if len(missing) == n:
        rep.faults.append(f"none of the {n} quantized weights was compared: --reference {rep.reference} holds none "
                          f"of them usably (first: {missing[0]}; the per-tensor notes say why). Give the "
                          "high-precision weights this checkpoint was made from")
    else:
        rep.faults.append(f"{len(missing)} of {n} quantized weights were not compared with the reference (first: "
                          f"{', '.join(missing[:3])}; the per-tensor notes say why)")


def excluded_findings(ck, rep: CheckpointReport):
    """The checkpoint's excluded modules (``ck.excluded``) against what it holds: each present in high precision
    (a fault where it is quantized, or stored in a low-precision dtype; a note where it has no weight)."""
    weights = {n[: -len(".weight")]: v for n, v in ck.other.items() if n.endswith(".weight")}
    for e in ck.excluded:
        hits = [m for m in weights if excluded_by(m, e)]
        qhits = [m for m in ck.weights if excluded_by(m, e)]
        if qhits:
            rep.faults.append(f"excluded module {e!r} is quantized ({', '.join(qhits[:3])})")
        elif not hits:
            rep.notes.append(f"excluded module {e!r} has no weight in the checkpoint (tied to another tensor, or "
                             "named differently)")
        else:
            low = [m for m in hits if weights[m][1] not in ("F32", "F16", "BF16", "F64")]
            if low:
                rep.faults.append(f"excluded module {low[0]!r} is stored as {weights[low[0]][1]}, not in high "
                                  "precision")
