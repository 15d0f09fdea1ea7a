"""``compare_matmul``: which tensor-core model reproduces a 16-bit GEMM kernel's output (``torch.matmul`` of
bfloat16 or float16 tensors, cuBLAS, a custom kernel), bit for bit; and the BF16 witness sets that tell the
models apart (``python -m fp4sim.validate gemm-witnesses --format bf16``).

Candidates (the labels of ``.best`` / ``.matches``):

- ``"hopper"``: H100 / H200's 16-bit block-FMA chain over the whole K (16 products per step, 25 fraction bits,
  the sum truncated to 23; :mod:`fp4sim.tensorcore`), the float32 accumulator rounded to nearest-even into the
  output dtype. B200's ``mma.sync`` has the same 16-bit step (``b200_mma``): no operands tell them apart.
- ``"ampere"``: A100's chain (8 products per step, 24 fraction bits); Ada's 16-bit step is the same (``ada``).
- ``"exact"``: fp4sim's rule for BF16 (``fs.gemm``'s): the inner product in float64, rounded once to float32.
- ``"float32_seq"``: the emulation route: the float32 products (exact for 16-bit operands) added in K order in
  float32, as a kernel that widens the operands and runs a float32 matmul computes them, up to its summation
  order.

Every model gives a float32 accumulator; a bfloat16 / float16 output is its nearest-even rounding (what the
H200's cuBLAS gave for ``torch.matmul``, benchmarks/results/h200-2026-12-04). Rounded outputs hide most float32
differences: the witnesses hold cells near bfloat16 midpoints, on the side each model's arithmetic puts them.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from .gemm import GemmReport, fresh_dir, model_report, record_witness

__all__ = ["compare_matmul", "MATMUL_CANDIDATES", "matmul_outputs", "write_bf16_witnesses", "check_bf16_witnesses"]

# label -> the fp4sim.tensorcore model (None: not a chain) and the chips whose 16-bit step it is
MATMUL_CANDIDATES = {"hopper": ("hopper", "H100 / H200 (B200's mma.sync: the same 16-bit step)"),
                     "ampere": ("ampere", "A100 (Ada: the same 16-bit step)"),
                     "exact": (None, "the float64 inner product rounded once to float32 (fs.gemm's BF16 rule)"),
                     "float32_seq": (None, "float32 products added in K order (a widening emulation)")}
_FAMILY = {"bfloat16": "bf16", "float16": "fp16"}
_NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _operand16(x, name):
    """(float32 values, dtype name) of a bfloat16 / float16 matrix (torch tensor, ml_dtypes or NumPy array)."""
    if type(x).__module__.startswith("torch"):
        import torch
        n = str(x.dtype).replace("torch.", "")
        if n not in _FAMILY:
            raise TypeError(f"{name} is a {n} tensor: compare_matmul takes bfloat16 or float16 operands (FP8: "
                            "compare_scaled_mm)")
        return x.detach().cpu().to(torch.float32).contiguous().numpy(), n
    a = np.asarray(x)
    n = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}.get(a.dtype)
    if n is None:
        raise TypeError(f"{name} has dtype {a.dtype}: give bfloat16 (ml_dtypes) or float16 values, as the kernel "
                        "read them")
    if a.ndim != 2:
        raise ValueError(f"{name} has shape {a.shape}: a matrix is 2-D")
    return a.astype(np.float32), n


def _output16(out, out_dtype):
    """(the output as an array of its dtype, dtype name): float32, bfloat16 or float16."""
    from .scaled_mm import output_array
    if out_dtype is not None and out_dtype not in _NP:
        raise ValueError(f"out_dtype={out_dtype!r}: a 16-bit GEMM's output is float32, bfloat16 or float16")
    try:
        o, n = output_array(out, out_dtype)
    except TypeError:
        n = str(getattr(out, "dtype", type(out).__name__)).replace("torch.", "")
    if n not in _NP:
        raise TypeError(f"out is {n}: a 16-bit GEMM's output is float32, bfloat16 or float16 (or its bits as "
                        "uint16 / uint32 with out_dtype= naming the dtype)")
    return o, n


def matmul_outputs(A, W, fam: str, out: str, names=None) -> dict:
    """{label: output (M, N) in dtype ``out``} of each candidate for float32 values A (M, K), W (N, K) of the
    16-bit family ``fam`` ("bf16" / "fp16")."""
    from ..tensorcore import accumulate
    ys = {}
    for n in names or MATMUL_CANDIDATES:
        model = MATMUL_CANDIDATES[n][0]
        if model is not None:
            acc = accumulate(A, W, fam, fam, model, fam, fast=True)
        elif n == "exact":
            acc = (A.astype(np.float64) @ W.astype(np.float64).T).astype(np.float32)
        else:
            acc = np.zeros((A.shape[0], W.shape[0]), np.float32)
            with np.errstate(invalid="ignore", over="ignore"):
                for k in range(A.shape[1]):
                    acc = acc + A[:, k, None] * W[None, :, k]
        with np.errstate(over="ignore"):
            ys[n] = acc.astype(_NP[out])
    return ys


def compare_matmul(a, b, out, *, out_dtype=None, candidates=None, max_mismatches: int = 10) -> GemmReport:
    """Which model reproduces ``out``, a kernel's ``a @ b`` of bfloat16 or float16 operands.

    a: (M, K), b: (K, N) (``torch.matmul``'s arguments, typically ``x @ w.t()``), both bfloat16 or both float16
    (torch tensors or ml_dtypes / NumPy arrays); out: the kernel's (M, N) output in its dtype (float32, bfloat16,
    float16), or its bits with ``out_dtype`` naming the dtype. candidates: labels of ``MATMUL_CANDIDATES``
    (default: all). Returns a GemmReport (``.best``: the first candidate that reproduces every element)."""
    names = list(candidates or MATMUL_CANDIDATES)
    bad = [n for n in names if n not in MATMUL_CANDIDATES]
    if bad:
        raise ValueError(f"candidates {bad}: choose from {', '.join(MATMUL_CANDIDATES)}")
    A, da = _operand16(a, "a")
    Bk, db = _operand16(b, "b")
    if da != db:
        raise ValueError(f"a is {da} and b {db}: a 16-bit tensor-core GEMM takes two operands of one format")
    if A.shape[1] != Bk.shape[0]:
        raise ValueError(f"a is {A.shape} and b {Bk.shape}: a @ b needs a's columns = b's rows (b is (K, N), "
                         "typically w.t())")
    o, dname = _output16(out, out_dtype)
    M, N = A.shape[0], Bk.shape[1]
    if o.shape != (M, N):
        raise ValueError(f"out has shape {o.shape}; a @ b of a {A.shape} and b {Bk.shape} is ({M}, {N})")
    if o.size == 0:
        raise ValueError(f"out has shape {o.shape}: an empty output matches every model")
    if not (np.isfinite(A).all() and np.isfinite(Bk).all()):
        raise ValueError("the operands hold Inf or NaN: the 16-bit models are compared on finite operands")
    ys = matmul_outputs(A, np.ascontiguousarray(Bk.T), _FAMILY[da], dname, names)
    rep = model_report(o, ys, f"{da} x {db}", max_mismatches)
    matches = rep.matches
    for n in matches:
        if MATMUL_CANDIDATES[n][0] is not None:
            rep.notes.append(f"{n}: {MATMUL_CANDIDATES[n][1]}")
    if dname != "float32" and len(matches) > 1:
        rep.notes.append(f"{dname} outputs hide float32 differences: compare float32 outputs where the kernel can "
                         "write them, or run the witnesses (python -m fp4sim.validate gemm-witnesses --format bf16)")
    return rep


# ------------------------------------------------------------------------------------------ BF16 witnesses
BF16_README = """fp4sim BF16 GEMM witnesses: operand sets whose outputs tell the 16-bit tensor-core models apart.

Each folder holds one bfloat16 GEMM, y = A . B^T:
  a.npy, b.npy          uint16 (M, K) and (N, K): the bfloat16 bits (B as its N rows, so the call is
                        torch.matmul(a, b.t()) with a and b viewed as torch.bfloat16)
  expected/LABEL.npy    each candidate's output, float32 (M, N), computed by fp4sim
Run the GEMM on the device, save its output (bfloat16 as the tensor's bits, or float32 where the kernel writes
it) as OUTDIR/NAME.npy and check with
  python -m fp4sim.validate gemm --witnesses THIS_FOLDER --outputs OUTDIR [--out-dtype bfloat16]
manifest.json lists each witness's purpose and how many cells separate each pair of models (float32 and
bfloat16 outputs).
"""


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def _bf16_witness_operands(seed: int = 0) -> dict:
    """{name: (purpose, a, b)} with a (M, K), b (N, K) bfloat16 (fixed seeds: the same files on every machine)."""
    rng = np.random.default_rng(seed)
    out = {}
    a, b = np.abs(rng.standard_normal((32, 1024))), np.abs(rng.standard_normal((32, 1024)))
    out["positive_k1024"] = ("positive operands, K = 1024: the running sum grows, so each model's truncation "
                             "(25 or 24 fraction bits, 16 or 8 products per step) and float32 rounding show",
                             _bf16(a), _bf16(b))
    K = 512
    ea, eb = rng.integers(-12, 12, (32, K)), rng.integers(-12, 12, (32, K))
    a = rng.choice([-1, 1], (32, K)) * (1 + rng.integers(0, 128, (32, K)) / 128) * np.exp2(ea)
    b = rng.choice([-1, 1], (32, K)) * (1 + rng.integers(0, 128, (32, K)) / 128) * np.exp2(eb)
    a[:, 1::2] = -a[:, ::2] * np.where(rng.random((32, K // 2)) < 0.5, 1, 1 + 2.0 ** -7)
    out["spread_cancellation"] = ("signed operands over 24 binades with near-cancelling pairs: each step's "
                                  "alignment to its largest product and the truncation below it", _bf16(a), _bf16(b))
    out["bf16_midpoints"] = ("cells within a few float32 ulps of a bfloat16 midpoint, on the side each model's "
                             "arithmetic puts them: bfloat16 outputs that differ for every pair of models "
                             "(selected from 4,096 such dot products)", *_midpoint_cells(rng))
    return out


def _midpoint_cells(rng, n=64, K=256, per_pair=4):
    """Rows of A and B whose diagonal cells separate every pair of models after rounding to bfloat16.

    Every row's first 8 products sum to V = 1 + 2^-8 (the midpoint between the bfloat16 neighbours 1 and
    1 + 2^-7; a tie goes down to 1). A's rows then hold six small elements at random positions (magnitudes
    2^-13 to 2^-10, either sign) against B's small values (2^-13 to 2^-10), products of 2^-26 to 2^-20: around
    the float32 ulp of V (2^-23) and the chains' truncation units (2^-25, 2^-24). Each cell of the (n, n)
    product lands within a few float32 ulps of V, on the side its model puts it; a cell that rounds to
    different bfloat16 values under two models is kept, ``per_pair`` for each pair."""
    a = np.zeros((n, K))
    a[:, :8] = [2.0 ** -1, 2.0 ** -2, 2.0 ** -3, 2.0 ** -4, 2.0 ** -5, 2.0 ** -6, 2.0 ** -7, 1.5 * 2.0 ** -7]
    b = np.zeros((n, K))
    b[:, :8] = 1.0                                      # the head: (1 - 2^-7) + 1.5 * 2^-7 = 1 + 2^-8
    for r in range(n):
        for k in rng.choice(np.arange(8, K), size=6, replace=False):
            a[r, k] = rng.choice([-1, 1]) * (1 + rng.integers(0, 4) / 4) * 2.0 ** -int(rng.integers(10, 14))
    b[:, 8:] = rng.choice([-1, 1], (n, K - 8)) * (1 + rng.integers(0, 4, (n, K - 8)) / 4) * \
        np.exp2(-rng.integers(10, 14, (n, K - 8)).astype(float))
    A, B = _bf16(a), _bf16(b)
    ys = {m: y.view(np.uint16) for m, y in
          matmul_outputs(A.astype(np.float32), B.astype(np.float32), "bf16", "bfloat16").items()}
    names = list(ys)
    keep = []
    for i, m1 in enumerate(names):
        for m2 in names[i + 1:]:                      # at least `per_pair` diagonal cells for every pair
            have = sum(ys[m1][r, c] != ys[m2][r, c] for r, c in keep)
            for r, c in np.argwhere(ys[m1] != ys[m2])[:max(0, per_pair - have)]:
                keep.append((int(r), int(c)))
    rows, cols = [r for r, _ in keep] or [0], [c for _, c in keep] or [0]
    return A[rows], B[cols]


def write_bf16_witnesses(out_dir, seed: int = 0) -> dict:
    """Write the BF16 witness folders, their expected outputs and manifest.json under ``out_dir`` (new or empty);
    return the manifest."""
    out_dir = fresh_dir(out_dir)
    man = {"format": "bf16", "models": list(MATMUL_CANDIDATES), "seed": seed, "witnesses": {}}
    for name, (purpose, a, b) in _bf16_witness_operands(seed).items():
        d = out_dir / name
        (d / "expected").mkdir(parents=True)
        np.save(d / "a.npy", a.view(np.uint16))
        np.save(d / "b.npy", b.view(np.uint16))
        record_witness(d, man, name, {"purpose": purpose, "M": a.shape[0], "N": b.shape[0], "K": a.shape[1]},
                       matmul_outputs(a.astype(np.float32), b.astype(np.float32), "bf16", "float32"))
    (out_dir / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    (out_dir / "README.txt").write_text(BF16_README)
    return man


def read_bf16_witness(d):
    """(a, b, {label: expected float32 output}) of one BF16 witness folder (a, b as ml_dtypes bfloat16)."""
    d = Path(d)
    a = np.load(d / "a.npy").view(ml_dtypes.bfloat16)
    b = np.load(d / "b.npy").view(ml_dtypes.bfloat16)
    return a, b, {p.stem: np.load(p) for p in sorted((d / "expected").glob("*.npy"))}


def _compare_bf16_witness(d, entry, out):
    a, b, _ = read_bf16_witness(d)
    return compare_matmul(a, b.T, out)


def check_bf16_witnesses(witness_dir, outputs_dir, dtype: str = "float32") -> dict:
    """:func:`fp4sim.validate.gemm.check_witnesses` for a folder written by :func:`write_bf16_witnesses`."""
    from .gemm import check_witnesses
    return check_witnesses(witness_dir, outputs_dir, dtype, compare=_compare_bf16_witness)
