"""``compare``: check a kernel's quantized output against the emulator, bit for bit, and explain mismatches."""
from __future__ import annotations

import numpy as np

from .. import _inputs
from ..formats import E4M3
from ..planning import POW2_DEC, nvfp4_constants_rows
from ..quantize import quantize
from ..schemes import MX, NVFP4, BF16Cast, FP8Blockwise, FP8Tensor, get_scheme
from .readout import codes_unpacked, scaled, scales_per_row, x2_padded
from .report import Report

f32 = np.float32


_PY_NAMES = {"global_amax": "global_amax", "tensor_scale": "tensor_scale", "delayed": "expect_tensor_amax=False",
             "scale_layout": "scale_layout={!r}"}
CLI_NAMES = {"global_amax": "--global-amax", "tensor_scale": "--tensor-scale", "delayed": "--delayed-scaling",
             "scale_layout": "--scale-layout {}"}


def amax_of_tensor_scale(scale, name="tensor_scale"):
    """A float32 amax ``a`` with ``fl(a / 2688) == scale`` (the largest such, found from ``fl(scale * 2688)`` by
    stepping ulps), so that the torchao / modelopt constants computed from it are the kernel's own."""
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.size != 1 or not np.isfinite(s[0]) or s[0] <= 0:
        raise ValueError(f"{name} {scale!r}: one positive finite float32 (the per-tensor scale, amax / 2688)")
    s = s[0]
    a = np.array([f32(s * f32(2688.0))], np.float32)
    ok = lambda v: f32(v / f32(2688.0)) == s  # noqa: E731
    for _ in range(8):
        if ok(a[0]):
            nxt = np.nextafter(a, np.float32(np.inf))
            while ok(nxt[0]):
                a, nxt = nxt, np.nextafter(nxt, np.float32(np.inf))
            return f32(a[0])
        a = np.nextafter(a, np.float32(np.inf) if f32(a[0] / f32(2688.0)) < s else np.float32(0))
    raise ValueError(f"{name} {float(s)!r}: no float32 amax gives this scale as fl(amax / 2688)")


# ------------------------------------------------------------------------------------------ the check
def compare(x, codes, scales, scheme="nvfp4", *, axis: int = -1, flavor: str | None = None,
            scale_mode: str | None = None, block=None, global_amax=None, scale_layout: str = "linear",
            rounding: str = "rne", rbits=None, rbits_mapping: str = "te", sr_bits: int = 8,
            expect_tensor_amax: bool = True, max_mismatches: int = 10, diagnose: bool = True,
            alpha: float = 1e-3, tensor_scale=None, _names=None) -> Report:
    """Compare a kernel's quantized output of ``x`` with fp4sim's emulation of ``scheme``.

    Parameters
    ----------
    x : the kernel's input (any float dtype fp4sim takes).
    codes, scales : the kernel's outputs: codes packed two per byte for FP4 (element 2i in the low nibble)
        with as many bytes as ``fp4sim.quantize`` writes (any shape); scale bytes (uint8 or ml_dtypes float8)
        per row and block in the linear layout (for 16x16 NVFP4 one per tile or per row), or the 1-D cuBLAS
        128x4 layout with ``scale_layout="swizzled"``; float32 for FP8 blockwise, the one float32 ``fl(1/scale)``
        for FP8 per-tensor.
    global_amax : the kernel's NVFP4 tensor amax; the emulation uses it. With ``expect_tensor_amax`` it must
        also equal max|x| (current scaling), else that is reported as a global-scale mismatch.
    tensor_scale : instead of ``global_amax``, the per-tensor decode scale as torchao (``per_tensor_scale``) and
        ModelOpt store it: ``pts = fl(amax / 2688)``. The emulation then uses an amax whose ``fl(amax / 2688)``
        is exactly this scale (so the torchao and modelopt flavours compute what the kernel computed from it);
        with ``expect_tensor_amax`` it must equal ``fl(max|x| / 2688)``.
    rounding : ``"rne"`` or ``"sr"``. With ``"sr"`` and ``rbits`` (the kernel's random bits) the check is exact;
        without them it is statistical: every code must be a neighbour of its scaled input and the
        rounding-up frequency must match delta (a z-test at significance ``alpha``) under the SR rule
        ``rbits_mapping`` names (``"midpoint"``: up iff delta + (2r + 1) / 2^(n+1) >= 1; else TE's truncating
        rule); a kernel whose rate fits the other rule is named so.
    diagnose : on a mismatch, re-run the emulation under every flavour / scale mode, tie rule, nibble order
        and scale layout and report which configuration matches or explains most.
    """
    sch = get_scheme(scheme, flavor=flavor, block=block, scale_mode=scale_mode)
    if scales is None and not isinstance(sch, BF16Cast):
        raise ValueError(f"scales is required for scheme {sch.name!r} (the kernel's scale bytes or float32 scales)")
    rounding = _inputs.check_choice(rounding, "rounding", ("rne", "sr"))
    scale_layout = _inputs.check_choice(scale_layout, "scale_layout", ("linear", "swizzled"))
    names = _names or _PY_NAMES
    statistical = rounding == "sr" and rbits is None
    notes = []
    if tensor_scale is not None:
        if global_amax is not None:
            raise ValueError(f"give {names['global_amax']} or {names['tensor_scale']}, not both")
        if not isinstance(sch, NVFP4) or sch.row_scaled or not sch.per_tensor_scale:
            raise ValueError(f"{names['tensor_scale']} is the NVFP4 per-tensor scale; scheme {sch.name!r} "
                             + ("has one per row" if isinstance(sch, NVFP4) and sch.row_scaled else "has none"))
        global_amax = amax_of_tensor_scale(tensor_scale, names["tensor_scale"])
    kw = dict(axis=axis, global_amax=global_amax)
    if rounding == "sr" and rbits is not None:
        kw.update(rounding="sr", rbits=rbits, rbits_mapping=rbits_mapping, sr_bits=sr_bits)
    q = quantize(x, sch, **kw)
    xs = _inputs.as_float32(x)
    x2 = np.ascontiguousarray(np.moveaxis(xs, q.axis, -1)).reshape(-1, q.K)
    gmis = False
    if isinstance(sch, NVFP4) and global_amax is not None and expect_tensor_amax:
        from ..cpu.backend import CPU
        if sch.row_scaled:
            want = CPU.row_absmax(x2)
            gmis = not np.array_equal(np.asarray(global_amax, np.float32).reshape(-1), want)
            if gmis:
                notes.append(f"the per-row global amaxes differ from the rows' |x| maxima (pass "
                             f"{names['delayed']} for delayed scaling)")
        tensor_amax = CPU.absmax(x2)[0]  # NaN ignored (0 for an all-NaN tensor), as the quantizer's amax
        if tensor_scale is not None:
            pts = f32(tensor_amax / f32(2688.0))
            gmis = bool(f32(tensor_scale) != pts)
            if gmis:
                notes.append(f"{names['tensor_scale']} {float(tensor_scale)!r} != fl(max|x| / 2688) {float(pts)!r} "
                             f"(pass {names['delayed']} for delayed scaling)")
        elif not sch.row_scaled:
            gmis = bool(f32(global_amax) != tensor_amax)
            if gmis:
                notes.append(f"{names['global_amax']} {float(global_amax)!r} != max|x| {float(tensor_amax)!r} "
                             f"(pass {names['delayed']} for delayed scaling)")
                if tensor_amax > 0 and abs(float(global_amax) * 2688.0 / float(tensor_amax) - 1) < 1e-5:
                    notes.append(f"{names['global_amax']} is max|x| / 2688: that is the per-tensor scale "
                                 f"torchao and ModelOpt store, not the amax. Give it as {names['tensor_scale']}, "
                                 f"or the amax itself (amax = scale x 2688)")
    if isinstance(sch, (FP8Tensor, FP8Blockwise, BF16Cast)):
        return _compare_plain(q, x2, codes, scales, sch, gmis, notes, max_mismatches)

    exp_s = q.scales_per_row()
    act_s = scales_per_row(scales, q, scale_layout)
    exp_c = codes_unpacked(q.codes, q)
    act_c = codes_unpacked(codes, q)
    s_bad = exp_s != act_s
    rep = Report(sch.name, getattr(sch, "flavor", None) or getattr(sch, "scale_mode", None), "exact",
                 int(exp_c.size), int(exp_s.size), 0, int(s_bad.sum()), gmis, notes=notes)
    rep.scale_mismatch_examples = [dict(row=int(r), block=int(b), expected=int(exp_s[r, b]),
                                        actual=int(act_s[r, b])) for r, b in np.argwhere(s_bad)[:max_mismatches]]
    if statistical:
        from .sr import sr_statistics
        xp = x2_padded(q, x2)
        y, _ = scaled(xp, sch, act_s, q.global_amax if q.global_amax is not None else 0)
        rep.sr = sr_statistics(y, act_c, sch.elem, sr_bits, alpha,
                               rule="midpoint" if rbits_mapping == "midpoint" else "te")
        ok = rep.sr["passed"] and not s_bad.any() and not gmis
        rep.verdict = "sr_consistent" if ok else "sr_inconsistent"
        return rep
    c_bad = exp_c != act_c
    rep.code_mismatches = int(c_bad.sum())
    rep.mismatches = _examples(q, x2, exp_c, act_c, exp_s, act_s, c_bad, max_mismatches)
    if rep.code_mismatches or rep.scale_mismatches or gmis:
        rep.verdict = "mismatch"
        from .locate import layout_findings, where
        rep.where = where(exp_c, act_c, exp_s, act_s, sch.block[1])
        if diagnose:
            from .diagnose import diagnose as _diag
            rep.diagnosis = _diag(x, q, codes, scales, scale_layout, rounding, rbits, rbits_mapping, sr_bits)
            rep.diagnosis["layout"] = layout_findings(q, codes, scales, scale_layout, exp_c, act_c, exp_s, act_s)
            best = rep.diagnosis.get("best") or {}
            other = "swizzled" if scale_layout == "linear" else "linear"
            if rep.diagnosis.get("exact_match") and f"{other} scales (not the layout given)" in best.get("label", ""):
                rep.diagnosis["layout"].insert(0, f"the scale bytes are in the {other} layout, not the {scale_layout} "
                                                  f"one given: pass {names['scale_layout'].format(other)}")
    return rep


def _decode_scaled(sch, codes, s_rows, global_amax):
    """Dequantized values of unpacked codes under per-row scale bytes."""
    bk = sch.block[1]
    vals = sch.elem.values[codes]
    with np.errstate(all="ignore"):
        if isinstance(sch, MX):
            return vals * np.repeat(POW2_DEC[s_rows], bk, axis=1)
        _, _, dq = nvfp4_constants_rows(sch.flavor, 1.0 if global_amax is None else global_amax,
                                         sch.per_tensor_scale, sch.e4m3_max)
        s = E4M3.values[s_rows]
        fac = (s * dq[:, 0:1]) * dq[:, 1:2] if sch.flavor in ("te", "paper") else s * dq[:, 0:1]
        return vals * np.repeat(fac, bk, axis=1)


def _examples(q, x2, exp_c, act_c, exp_s, act_s, bad, n):
    sch = q.scheme
    bk = sch.block[1]
    out = []
    idx = np.argwhere(bad)[:n]
    if not idx.size:
        return out
    g = q.global_amax if q.global_amax is not None else 0
    ev = _decode_scaled(sch, exp_c, exp_s, g)
    av = _decode_scaled(sch, act_c, act_s, g)
    lead = q.lead
    for r, k in idx:
        li = list(np.unravel_index(int(r), lead)) if lead else []
        li.insert(q.axis, int(k))
        out.append(dict(index=[int(i) for i in li], row=int(r), block=int(k // bk), element=int(k % bk),
                        x=float(x2[r, k]) if k < q.K else 0.0, expected_code=int(exp_c[r, k]),
                        actual_code=int(act_c[r, k]), expected_value=float(ev[r, k]),
                        actual_value=float(av[r, k])))
    return out


def _compare_plain(q, x2, codes, scales, sch, gmis, notes, n):
    """FP8 per-tensor / blockwise and BF16: codes (and float32 scales) compared exactly."""
    act_c = codes_unpacked(codes, q)
    exp_c = np.asarray(q.codes).reshape(act_c.shape)
    if isinstance(sch, BF16Cast):
        exp_s = act_s = np.zeros(0, np.float32)
    else:
        exp_s = np.asarray(q.scales, np.float32).reshape(-1)
        act_s = np.asarray(scales, np.float32).reshape(-1)
        if act_s.size != exp_s.size:
            raise ValueError(f"scales have {act_s.size} values; {sch.name} here has {exp_s.size} float32 scales")
    s_bad = exp_s.view(np.uint32) != act_s.view(np.uint32)
    c_bad = exp_c != act_c
    rep = Report(sch.name, None, "exact", int(exp_c.size), int(exp_s.size), int(c_bad.sum()), int(s_bad.sum()),
                 gmis, notes=notes)
    vals = sch.elem.values
    bk = getattr(sch, "block", None)
    bk = int(bk[1]) if bk and not isinstance(sch, BF16Cast) else None         # per-tensor FP8, BF16: no blocks
    for r, k in np.argwhere(c_bad)[:n]:
        li = [int(i) for i in np.unravel_index(int(r), q.lead)] if q.lead else []
        li.insert(q.axis, int(k))
        rep.mismatches.append(dict(index=li, row=int(r), block=None if bk is None else int(k // bk),
                                   element=None if bk is None else int(k % bk), x=float(x2[r, k]),
                                   expected_code=int(exp_c[r, k]), actual_code=int(act_c[r, k]),
                                   expected_value=float(vals[exp_c[r, k]]), actual_value=float(vals[act_c[r, k]])))
    if s_bad.any():
        grid = np.asarray(q.scales).shape if np.asarray(q.scales).ndim == 2 else (1, exp_s.size)
        for i in np.flatnonzero(s_bad)[:n]:
            r, b = (int(v) for v in np.unravel_index(int(i), grid))
            e, a = np.float32(exp_s[i]), np.float32(act_s[i])
            with np.errstate(divide="ignore", over="ignore"):
                recip = bool(e != 0 and np.float32(np.float32(1) / e) == a)
            rep.scale_mismatch_examples.append(dict(row=r, block=b, expected=float(e), actual=float(a),
                                                    reciprocal=recip))
        n_recip = sum(m["reciprocal"] for m in rep.scale_mismatch_examples)
        if n_recip == len(rep.scale_mismatch_examples):
            rep.notes.append("every scale shown is the reciprocal of the expected one: the kernel wrote 1 / scale "
                             "where the scale belongs (a multiplier for a divisor, or the reverse)")
    if c_bad.any() or s_bad.any() or gmis:
        rep.verdict = "mismatch"
    return rep
