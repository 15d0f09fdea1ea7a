"""``compare_scaled_mm``: which tensor-core model reproduces an FP8 GEMM kernel's output (``torch._scaled_mm``,
cuBLAS, TransformerEngine, a custom kernel), bit for bit.

Candidates (the labels of ``.best`` / ``.matches``): ``"hopper"`` and ``"hopper_fast_accum"`` (cuBLAS's FP8
GEMMs on H100 / H200: slow accumulation restarts the chain every 128 K elements, fast accumulation does not),
``"ada"`` and ``"ada_fast_accum"`` (sm_89), ``"b200_mma"`` (B200's mma.sync, one chain), ``"exact"`` (fp4sim's
exact rule: each 128-element block rounded once to float32) and ``"dequant_f32"`` (the emulation route: both
operands decoded and scaled to float32, float32 products added in K order, as a kernel that dequantizes and calls
a float32 matmul computes them — up to its summation order, which a BLAS chooses: an output that agrees with it
only within float32 summation-order error is reported as such in the notes).
"""
from __future__ import annotations

import numpy as np

from ..tensorcore.scaled_mm import (FP8_OPERANDS, OUT_DTYPES, epilogue, fp8_operand, operand_family, out_dtype_name,
                                    per_tensor_scale, scaled_mm)
from .gemm import GemmReport, model_report

__all__ = ["compare_scaled_mm", "pair_family", "WITNESS_FAMILIES", "SCALED_MM_CANDIDATES", "FNUZ_CANDIDATES",
           "FP6_CANDIDATES", "output_array"]

# label -> (model, use_fast_accum)
# the candidates for AMD's FNUZ FP8 operands (MI300) and for OCP FP6 operands (Blackwell's kind::f8f6f4)
FNUZ_CANDIDATES = {"cdna3": ("cdna3", False), "exact": ("exact", False), "dequant_f32": (None, None)}
FP6_CANDIDATES = {"b200": ("b200", True), "exact": ("exact", False), "dequant_f32": (None, None)}
SCALED_MM_CANDIDATES = {"hopper": ("hopper", False), "hopper_fast_accum": ("hopper", True),
                        "ada": ("ada", False), "ada_fast_accum": ("ada", True), "b200": ("b200", True),
                        "b200_mma": ("b200_mma", True),
                        "exact": ("exact", False), "dequant_f32": (None, None)}


def _dequant_f32(A, Bt, sa, sb):
    """float32 (M, N): fl(a · scale_a) and fl(b · scale_b) in float32, their float32 products added in K order."""
    Af = (A * np.float32(sa)).astype(np.float32)
    Bf = (Bt * np.float32(sb)).astype(np.float32)
    acc = np.zeros((A.shape[0], Bt.shape[0]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(A.shape[1]):
            acc = acc + Af[:, k, None] * Bf[None, :, k]
    return acc, Af, Bf


def _to_out(y32, out):
    """A float32 result in the output dtype: RNE, FP8 saturating, canonical NaN (cuBLAS's conversion)."""
    return epilogue(y32, np.float32(1.0), np.float32(1.0), out)


def output_array(o, want_dtype):
    """(a kernel's output as a NumPy / ml_dtypes array of its dtype, the dtype's name): a torch tensor or an array
    of one of :data:`~fp4sim.tensorcore.scaled_mm.OUT_DTYPES`, or raw integer bits with ``want_dtype`` naming the
    dtype; TypeError otherwise."""
    if type(o).__module__.startswith("torch"):
        import torch
        t = o.detach().cpu().contiguous()
        name = str(t.dtype).replace("torch.", "")
        if name not in OUT_DTYPES:
            raise TypeError(f"out is a {name} tensor: give the kernel's output in its dtype (float32, bfloat16, "
                            "float16, float8_e4m3fn or float8_e5m2)")
        bits = t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).numpy()
        return bits.view(OUT_DTYPES[name]), name
    o = np.asarray(o)
    name = {np.dtype(v): k for k, v in OUT_DTYPES.items()}.get(o.dtype)
    if name is None and want_dtype is not None and o.dtype.kind in "ui":
        name = out_dtype_name(want_dtype, None)                       # raw bits with the dtype named
        o = o.view(OUT_DTYPES[name])
    if name is None:
        raise TypeError(f"out has dtype {o.dtype}: give the kernel's output in its dtype (float32, bfloat16, float16, "
                        "float8_e4m3fn or float8_e5m2 as ml_dtypes arrays), or its bits with out_dtype=")
    return o, name


def pair_family(a, b) -> str:
    """The operand family of a GEMM (``tensorcore.scaled_mm.operand_family``): a's, or b's where a is OCP FP8 (an
    E4M3 operand beside an FP6 one is a kind::f8f6f4 GEMM)."""
    fam = operand_family(a)
    return fam if fam != "ocp" else operand_family(b)


def compare_scaled_mm(a, b, scale_a, scale_b, out, *, out_dtype=None, candidates=None, split_k=1,
                      max_mismatches: int = 10) -> GemmReport:
    """Which model reproduces ``out``, a kernel's ``a @ b · scale_a · scale_b`` of FP8 operands.

    a: (M, K) FP8, b: (K, N) FP8 (``torch._scaled_mm``'s arguments: torch float8 tensors or ml_dtypes arrays);
    scale_a, scale_b: the per-tensor float32 decode scales; out: the kernel's (M, N) output in its dtype (float32,
    bfloat16, float16, float8_e4m3fn, float8_e5m2), or its raw bits with ``out_dtype`` naming the dtype.
    candidates: labels of ``SCALED_MM_CANDIDATES`` to try (default: all; AMD's float8_e4m3fnuz / float8_e5m2fnuz
    operands take ``FNUZ_CANDIDATES``: cdna3, exact, dequant_f32; OCP FP6 operands ``FP6_CANDIDATES``: b200, exact,
    dequant_f32); split_k: the split the kernel used, for
    the models that know it (``fp4sim.tensorcore.scaled_mm``). Returns a GemmReport (``.best``: the first
    candidate that reproduces every element, None if none does)."""
    fam = pair_family(a, b)
    table = {"fnuz": FNUZ_CANDIDATES, "fp6": FP6_CANDIDATES}.get(fam, SCALED_MM_CANDIDATES)
    names = list(candidates or table)
    bad = [n for n in names if n not in table]
    if bad:
        what = {"fnuz": "AMD FNUZ operands", "fp6": "FP6 operands"}.get(fam, "OCP FP8 operands")
        raise ValueError(f"candidates {bad}: for {what} choose from {', '.join(table)}")
    A, fa, na, _ = fp8_operand(a, "a", fnuz=fam == "fnuz", fp6=fam == "fp6")
    Bk, fb, nb_, _ = fp8_operand(b, "b", fnuz=fam == "fnuz", fp6=fam == "fp6")
    o, dname = output_array(out, out_dtype)
    M, N = A.shape[0], Bk.shape[1] if Bk.ndim == 2 else 0
    if o.shape != (M, N):
        raise ValueError(f"out has shape {o.shape}; a @ b of a {A.shape} and b {Bk.shape} is ({M}, {N}) (b is "
                         "(K, N), typically w.t())")
    if o.size == 0:
        raise ValueError(f"out has shape {o.shape}: an empty output matches every model")
    sa, sb = per_tensor_scale(scale_a, "scale_a", finite=True), per_tensor_scale(scale_b, "scale_b", finite=True)
    ys = {}
    skipped = {}
    for n in names:
        model, fast = table[n]
        if model is None:
            continue
        try:
            ys[n] = scaled_mm(a, b, scale_a, scale_b, out_dtype=dname, use_fast_accum=fast, model=model,
                              split_k=split_k if model != "exact" else 1)
        except ValueError as e:
            skipped[n] = str(e)
    if skipped and len(skipped) == sum(table[n][0] is not None for n in names):
        # no tensor-core model can compute these operands: bad input (a shape torch refuses, E5M2 x E5M2, a
        # split no model's library uses), not a kernel that matches no model
        why = list(dict.fromkeys(skipped.values()))
        raise ValueError("no candidate model computes this GEMM: " + "; ".join(why))
    if "dequant_f32" in names:
        acc, Af, Bf = _dequant_f32(A, np.ascontiguousarray(Bk.T), sa, sb)
        ys["dequant_f32"] = _to_out(acc, dname)
    ys = {n: (np.asarray(y) if not type(y).__module__.startswith("torch") else output_array(y, None)[0])
          for n, y in ys.items()}
    rep = model_report(o, ys, f"fp8 {fa} x {fb}", max_mismatches)
    matches = rep.matches
    for n, why in skipped.items():
        rep.notes.append(f"{n} not tried: {why}")
    if not matches and "dequant_f32" in ys and dname == "float32":
        # within float32 summation-order error of the decoded product: |y - y_seq| <= 2 (K - 1) u sum |a_k b_k|
        with np.errstate(invalid="ignore", over="ignore"):
            absum = np.abs(Af.astype(np.float64)) @ np.abs(Bf.astype(np.float64)).T
            bound = 2 * (A.shape[1] - 1) * 2.0 ** -24 * absum
            ok = np.abs(o.astype(np.float64) - acc.astype(np.float64)) <= bound
            ok |= np.isnan(o) & np.isnan(acc)
        if ok.all():
            rep.notes.append("the output agrees with dequant_f32 (decoded float32 operands, a float32 matmul) to "
                             "within float32 summation-order error, not bit for bit: an emulating kernel that "
                             "sums in another order (a BLAS), not a tensor core's FP8 GEMM")
    if not matches:
        split = "no split" if split_k == 1 else f"split_k={split_k!r}"
        rep.notes.append(f"the models assumed {split}: cuBLAS splits K for some shapes by its own heuristics "
                         "(hopper's library as 'contiguous', ada's as 'serial' or 'pairwise'); if the kernel may have "
                         "split K, try split_k=(S, scheme) (python -m fp4sim.validate gemm --split-k S,scheme)")
    if dname != "float32" and len(matches) > 1:
        rep.notes.append(f"{dname} outputs hide float32 differences: compare float32 outputs where the kernel can "
                         "write them")
    return rep


# ------------------------------------------------------------------------------------------ FP8 witnesses
FP8_README = """fp4sim FP8 GEMM witnesses: operand sets whose outputs tell the tensor-core models apart.

Each folder holds one FP8 GEMM as torch._scaled_mm computes it, y = (A . B^T) * scale_a * scale_b:
  a.npy, b.npy              uint8 (M, K) and (N, K): the FP8 bytes (formats in manifest.json; B as its N rows,
                            so the call is torch._scaled_mm(a, b.t(), scale_a, scale_b, out_dtype=torch.float32))
  scale_a.npy, scale_b.npy  float32 (1,): the per-tensor decode scales
  expected/LABEL.npy        float32 (M, N): each candidate's output, computed by fp4sim
Run the GEMM on the device (float32 output; once with use_fast_accum=False, once with True), save each output as
OUTDIR/NAME.npy and check with
  python -m fp4sim.validate gemm --witnesses THIS_FOLDER --outputs OUTDIR
A set written with --format fp8-fnuz holds AMD's E4M3FNUZ / E5M2FNUZ bytes (torch.float8_e4m3fnuz /
float8_e5m2fnuz on an MI300); one written with --format fp6 holds E4M3 rows A against E2M3 rows B, one FP6 code per
byte in the low six bits (Blackwell's kind::f8f6f4; torch has no FP6 dtype: run your kernel on the bytes).
"""


# the operand dtypes of each witness family: (first format's dtype, second's)
def _family_dtypes(family: str):
    import ml_dtypes
    return {"ocp": (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2),
            "fnuz": (ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz),
            "fp6": (ml_dtypes.float8_e4m3fn, ml_dtypes.float6_e2m3fn)}[family]


FAMILY_CANDIDATES = {"ocp": SCALED_MM_CANDIDATES, "fnuz": FNUZ_CANDIDATES, "fp6": FP6_CANDIDATES}
WITNESS_FAMILIES = {"fp8": "ocp", "fp8-fnuz": "fnuz", "fp6": "fp6"}   # gemm-witnesses --format -> operand family


def _fp8_witness_operands(seed: int = 0, family: str = "ocp"):
    import ml_dtypes
    rng = np.random.default_rng(seed)
    e4, e5 = _family_dtypes(family)
    # FP6: B is always FP6 (E2M3) against E4M3 rows: FP6 x FP6 products sit on a 2^-6 grid that float32 holds
    # exactly at these sizes, so no model would differ from another on them
    eb_ = e5 if family == "fp6" else e4

    def q(x, dt):
        top = float(ml_dtypes.finfo(dt).max)
        return np.clip(x, -top, top).astype(dt)
    out = {}
    a, b = np.abs(rng.standard_normal((32, 1024))), np.abs(rng.standard_normal((32, 1024)))
    out["positive_k1024"] = ("positive operands of the first format, K = 1024: the running sum grows, so the "
                             "steps' truncation, the 128-element restarts and the products per step all show",
                             q(a * 4, e4), q(b * 4, eb_))
    ea, eb = rng.integers(-9, 9, (32, 512)), rng.integers(-12, 12, (32, 512))
    a = rng.choice([-1, 1], (32, 512)) * (1 + rng.integers(0, 8, (32, 512)) / 8) * np.exp2(ea)
    b = rng.choice([-1, 1], (32, 512)) * (1 + rng.integers(0, 4, (32, 512)) / 4) * np.exp2(eb)
    out["spread_e4m3_e5m2"] = ("operands of the two formats (E4M3 x E5M2, or E4M3 x E2M3) whose exponents "
                               "spread over both formats' ranges: the alignment to each step's largest product",
                               q(a, e4), q(b, e5))
    a = rng.choice([-448.0, 448.0, -0.0625, 0.0625, 2.0 ** -6], (32, 256))
    a[:, 1::2] = -a[:, ::2]
    a[:, 5::16] = rng.standard_normal((32, 16))
    b = np.repeat(rng.choice([-1.0, 1.0, 0.0078125], (32, 128)), 2, axis=1)
    out["cancellation"] = ("large products cancelling in pairs beside small survivors: the truncation below "
                           "each step's largest exponent", q(a, e4), q(b, eb_))
    return out


def write_fp8_witnesses(out_dir, seed: int = 0, family: str = "ocp") -> dict:
    """Write the FP8 witness folders, their expected outputs and manifest.json under ``out_dir`` (new or empty);
    return the manifest. ``family``: "ocp" (E4M3 / E5M2: the NVIDIA models), "fnuz" (E4M3FNUZ / E5M2FNUZ: AMD's
    cdna3) or "fp6" (E4M3 rows against E2M3 columns: Blackwell's b200)."""
    import json

    from .gemm import fresh_dir, record_witness
    if family not in FAMILY_CANDIDATES:
        raise ValueError(f"family={family!r}: use one of {', '.join(FAMILY_CANDIDATES)}")
    out_dir = fresh_dir(out_dir)
    sa, sb = np.float32(0.5), np.float32(0.25)
    fmt = {v: k for k, v in WITNESS_FAMILIES.items()}[family]
    man = {"format": fmt, "models": list(FAMILY_CANDIDATES[family]), "seed": seed, "witnesses": {}}
    for name, (purpose, a, b) in _fp8_witness_operands(seed, family).items():
        d = out_dir / name
        (d / "expected").mkdir(parents=True)
        np.save(d / "a.npy", a.view(np.uint8))
        np.save(d / "b.npy", b.view(np.uint8))
        np.save(d / "scale_a.npy", np.array([sa], np.float32))
        np.save(d / "scale_b.npy", np.array([sb], np.float32))
        record_witness(d, man, name, {"purpose": purpose, "M": a.shape[0], "N": b.shape[0], "K": a.shape[1],
                                      "a_format": _fmt(a), "b_format": _fmt(b)}, fp8_outputs(a, b, sa, sb),
                       bf16=False)
    (out_dir / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    (out_dir / "README.txt").write_text(FP8_README)
    return man


def _fmt(x) -> str:
    from ..tensorcore.scaled_mm import FNUZ_OPERANDS, FP6_OPERANDS
    table = {**FP8_OPERANDS, **FNUZ_OPERANDS, **FP6_OPERANDS}
    return table[str(x.dtype)][0] if str(x.dtype) in table else str(x.dtype)


def fp8_outputs(a, b, sa, sb) -> dict:
    """{label: float32 (M, N) output} of every candidate for FP8 (or FNUZ / FP6) operands a (M, K), b (N, K)
    (ml_dtypes): the candidates of the operands' family."""
    out = {}
    fam = pair_family(a, b)
    for n, (model, fast) in FAMILY_CANDIDATES[fam].items():
        if model is None:
            A, Bt = a.astype(np.float32), b.astype(np.float32)
            out[n] = _to_out(_dequant_f32(A, Bt, sa, sb)[0], "float32")
        else:
            out[n] = scaled_mm(a, b.T, sa, sb, out_dtype="float32", use_fast_accum=fast, model=model)
    return out


def read_fp8_witness(d, manifest_entry):
    """(a, b, scale_a, scale_b, {label: expected output}) of one FP8 witness folder."""
    import ml_dtypes
    from pathlib import Path
    d = Path(d)
    dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
          "e5m2fnuz": ml_dtypes.float8_e5m2fnuz, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}
    a = np.load(d / "a.npy").view(dt[manifest_entry["a_format"]])
    b = np.load(d / "b.npy").view(dt[manifest_entry["b_format"]])
    exp = {p.stem: np.load(p) for p in sorted((d / "expected").glob("*.npy"))}
    return a, b, np.float32(np.load(d / "scale_a.npy")[0]), np.float32(np.load(d / "scale_b.npy")[0]), exp


def _compare_fp8_witness(d, entry, out):
    a, b, sa, sb, _ = read_fp8_witness(d, entry)
    return compare_scaled_mm(a, b.T, sa, sb, out)


def check_fp8_witnesses(witness_dir, outputs_dir, dtype: str = "float32") -> dict:
    """:func:`fp4sim.validate.gemm.check_witnesses` for a folder written by :func:`write_fp8_witnesses`."""
    from .gemm import check_witnesses
    return check_witnesses(witness_dir, outputs_dir, dtype, compare=_compare_fp8_witness)
