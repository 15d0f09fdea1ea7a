"""``compare_gemm``: which accumulation model reproduces a kernel's GEMM output, bit for bit; the witness operand
sets that tell the models apart (``python -m fp4sim.validate gemm`` / ``gemm-witnesses``).

A model's output is :func:`fp4sim.gemm` under that ``accumulate`` name (``CANDIDATES``); a bfloat16 output is
compared with the model's float32 result rounded to bfloat16 (nearest-even). ``k16_rne`` is not a candidate: it
equals ``te_reference`` on every input (both exact per 16-element block, nearest-even sums in block order).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ..gemm import gemm
from ..qtensor import QuantizedTensor
from ..schemes import MX, NVFP4, get_scheme

__all__ = ["compare_gemm", "GemmReport", "CANDIDATES", "gemm_operand", "write_witnesses", "check_witnesses"]

# name -> (accumulate, grid); the order in which .best is chosen when several models reproduce an output
CANDIDATES = {"te_reference": ("te_reference", None), "exact_sum": ("exact_sum", None),
              "k64_rtz": ("k64_rtz", None), "k64_rtz_grid1024": ("k64_rtz", 1024), "k64_rne": ("k64_rne", None),
              "k32_rtz": ("k32_rtz", None), "k32_rne": ("k32_rne", None), "k128_rtz": ("k128_rtz", None),
              "k128_rne": ("k128_rne", None), "k16_rtz": ("k16_rtz", None), "tcgen05": ("tcgen05", None)}
NON_NVFP4 = ("te_reference",)          # the one exact model fp4sim defines for the other formats
MX_MODELS = ("te_reference", "tcgen05")   # MXFP4 / MXFP8: the exact rule and Blackwell's instructions


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
                         f"operands cannot separate the {len(self.matches)} models, and {self.best} is named only as "
                         "the first in candidate order (python -m fp4sim.validate gemm-witnesses writes operands "
                         "that separate them)")
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


def _output(out):
    """(bits as int64 for ordering, dtype name, float values) of a kernel output: float32, or bfloat16 (ml_dtypes
    bfloat16 or a torch tensor of that dtype)."""
    if hasattr(out, "detach"):                       # a torch tensor
        import torch
        t = out.detach().cpu()
        out = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    out = np.asarray(out)
    if out.dtype == np.dtype(ml_dtypes.bfloat16):
        return out, "bfloat16"
    if out.dtype != np.float32:
        raise TypeError(f"out has dtype {out.dtype}: give the kernel's float32 or bfloat16 output as it wrote it "
                        "(a bfloat16 array as ml_dtypes.bfloat16, or a torch.bfloat16 tensor)")
    return out, "float32"


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _ordered(a):
    """Integers in the order of the floats (adjacent floats differ by 1), for distances in ulps; any float width
    (float32, bfloat16 / float16, the one-byte FP8 formats)."""
    n = a.dtype.itemsize
    bits = a.view(_UINT[n]).astype(np.int64)
    sign = np.int64(1) << 8 * n - 1
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def _same(a, b):
    """Elementwise: identical bits, or NaN on both sides (a NaN's payload is not the accumulation's)."""
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    w = _UINT[a.dtype.itemsize]
    return np.where(na | nb, na & nb, a.view(w) == b.view(w))


def model_report(o, ys: dict, scheme: str, max_mismatches: int = 10) -> GemmReport:
    """The GemmReport of a kernel output ``o`` (an array of its dtype) against each model's output ``ys`` (the
    same dtype, in candidate order): the matches, each model's share of identical elements, the closest model's
    worst elements."""
    frac = {n: float(_same(o, y).mean()) for n, y in ys.items()}
    matches = [n for n in ys if frac[n] == 1.0]
    closest = max(ys, key=lambda n: frac[n])
    rep = GemmReport(shape=tuple(o.shape), dtype=np.dtype(o.dtype).name, scheme=scheme,
                     best=matches[0] if matches else None, matches=matches, match_fraction=frac, closest=closest)
    same = _same(o, ys[closest])
    bad_cells = np.argwhere(~same)
    if len(bad_cells):
        d = np.abs(_ordered(o) - _ordered(ys[closest]))
        order = np.argsort(-d[~same], kind="stable")[:max_mismatches]
        for r, c in bad_cells[order]:
            rep.mismatches.append({"row": int(r), "col": int(c), "kernel": float(o[r, c]),
                                   "model": float(ys[closest][r, c]), "ulps": int(d[r, c])})
    return rep


def model_outputs(qa, qb, models=None) -> dict:
    """{model: float32 output} of every candidate model for these operands (NVFP4: all; others: te_reference)."""
    names = models or (list(CANDIDATES) if isinstance(qa.scheme, NVFP4) else
                       list(MX_MODELS) if isinstance(qa.scheme, MX) else list(NON_NVFP4))
    bad = [m for m in names if m not in CANDIDATES]
    if bad:
        raise ValueError(f"models {bad}: choose from {', '.join(CANDIDATES)}")
    out = {}
    for m in names:
        acc, grid = CANDIDATES[m]
        out[m] = np.asarray(gemm(qa, qb, accumulate=acc, grid=grid))
    return out


def compare_gemm(qa: QuantizedTensor, qb: QuantizedTensor, out, *, models=None, max_mismatches: int = 10,
                 expected: dict | None = None) -> GemmReport:
    """Which accumulation model reproduces ``out``, a kernel's ``A · Bᵀ`` of the quantized operands ``qa`` (M, K)
    and ``qb`` (N, K) (both quantized along K), bit for bit.

    Parameters
    ----------
    out : the kernel's output, float32 or bfloat16 (ml_dtypes / torch), shape (M, N). A bfloat16 output is
        compared with each model's float32 result rounded to bfloat16 (nearest-even).
    models : the candidate names to try (default: every model of ``CANDIDATES`` for NVFP4 operands,
        ``te_reference`` for other formats).
    expected : {model: float32 output} already computed (e.g. a witness's stored outputs), instead of computing
        them.
    """
    o, dtype = _output(out)
    M, N = qa.lead[0], qb.lead[0]
    if o.shape != (M, N):
        hint = ""
        if o.shape == (N, M) and o.size:
            ys = expected if expected is not None else model_outputs(qa, qb, models)
            hit = [m for m, y in ys.items() if _matches(o.T, y, dtype)]
            if hit:
                hint = (f": it is the transposed output, B . A^T — out.T reproduces {hit[0]} bit for bit (the kernel "
                        "swapped its operands or wrote the output column-major)")
        raise ValueError(f"out has shape {o.shape}; A . B^T of qa ({M} rows) and qb ({N} rows) is ({M}, {N})" + hint)
    if o.size == 0:
        raise ValueError(f"out has shape {o.shape}: an empty output matches every model; give operands with rows and "
                         "columns")
    if max_mismatches < 0:
        raise ValueError(f"max_mismatches={max_mismatches}: give a count >= 0")
    ys = expected if expected is not None else model_outputs(qa, qb, models)
    ys = {m: ys[m] for m in [m for m in CANDIDATES if m in ys] + [m for m in ys if m not in CANDIDATES]}
    frac, eq = {}, {}
    for m, y in ys.items():
        y = np.asarray(y, np.float32)
        ym = y.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else y
        eq[m] = (_same(o, ym), ym)
        frac[m] = float(eq[m][0].mean())
    matches = [m for m in ys if frac[m] == 1.0]
    closest = max(ys, key=lambda m: frac[m])
    same, ym = eq[closest]
    rep = GemmReport(shape=(M, N), dtype=dtype, scheme=qa.scheme.name, best=matches[0] if matches else None,
                     matches=matches, match_fraction=frac, closest=closest)
    bad = np.argwhere(~same)
    if len(bad):
        nan = np.isnan(o.astype(np.float32)) != np.isnan(ym.astype(np.float32))
        rep.nan_mismatches = int(nan.sum())
        d = np.abs(_ordered(o) - _ordered(ym))
        d = np.where(nan, np.iinfo(np.int64).max, d)
        order = np.argsort(-d[~same], kind="stable")[:max_mismatches]
        for r, c in bad[order]:
            rep.mismatches.append({"row": int(r), "col": int(c), "kernel": float(o[r, c]), "model": float(ym[r, c]),
                                   "ulps": "NaN on one side" if nan[r, c] else int(d[r, c])})
    if dtype == "bfloat16" and len(matches) > 1:
        rep.notes.append("bfloat16 outputs hide float32 differences: compare float32 outputs where the kernel can "
                         "write them")
    if not matches:
        _diagnose(rep, o, ys, dtype)
    return rep


def _matches(o, y, dtype) -> bool:
    y = np.asarray(y, np.float32)
    return bool(_same(o, y.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else y).all())


def _truncate_bf16(y):
    """float32 -> bfloat16 by dropping the low 16 bits (round toward zero; NaN stays NaN)."""
    b = (np.asarray(y, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return b.view(ml_dtypes.bfloat16)


def _diagnose(rep, o, ys, dtype):
    """Name the faults that explain an output no model reproduces (rep.faults, rep.notes)."""
    M, N = o.shape
    hit = [m for m, y in ys.items() if M == N and _matches(o.T, y, dtype)]
    if hit:
        rep.faults.append(f"transposed: out.T reproduces {', '.join(hit)} bit for bit (the kernel computed B . A^T, "
                          "or wrote its output column-major)")
    hit = [m for m, y in ys.items() if dtype == "bfloat16" and bool(_same(o, _truncate_bf16(y)).all())]
    if hit:
        rep.faults.append(f"bfloat16 truncated: the output is the float32 result of {', '.join(hit)} with its low 16 "
                          "bits dropped (round toward zero), not rounded to nearest-even")
    fr = set(rep.match_fraction.values())
    if len(rep.match_fraction) > 1 and len(fr) == 1:
        rep.notes.append(f"every model matches the same share of elements ({100 * fr.pop():.3f}%): these operands "
                         "cannot tell the models apart (python -m fp4sim.validate gemm-witnesses writes operands "
                         "that do)")


# ------------------------------------------------------------------------------------------ kernel operands
def gemm_operand(codes, scales, amax, K: int | None = None, *, block=(1, 16), flavor: str = "te",
                 scale_layout: str = "linear", name: str = "operand") -> QuantizedTensor:
    """An NVFP4 GEMM operand from a kernel's inputs: ``codes`` (rows, ceil(K/16)*8) uint8, two E2M1 codes per byte
    (element 2i in the low nibble), ``scales`` the E4M3 block-scale bytes in the linear layout (rows, ceil(K/16);
    for 16x16 tiles one per tile, (ceil(rows/16), ceil(K/16))) or cuBLAS's swizzled layout, ``amax`` the float32
    tensor amax (one per row for row-scaled operands); ``K`` defaults to twice the codes' width."""
    from .readout import as_bytes
    codes = as_bytes(codes, f"{name} codes")
    if codes.ndim != 2:
        raise ValueError(f"{name} codes have shape {codes.shape}: give them as (rows, K/2) bytes")
    R = codes.shape[0]
    K = 2 * codes.shape[1] if K is None else int(K)
    nblk = -(-K // 16)
    if codes.shape[1] != nblk * 8:
        raise ValueError(f"{name} codes have {codes.shape[1]} bytes per row; K={K} needs {nblk * 8} (K padded to "
                         "16, two codes per byte)")
    scales = as_bytes(scales, f"{name} scales")
    block = tuple(block)
    amax = np.asarray(amax, np.float32)
    if amax.size == 0 or not (np.isfinite(amax) & (amax > 0)).all():
        bad = amax.reshape(-1)[~(np.isfinite(amax) & (amax > 0)).reshape(-1)] if amax.size else amax
        raise ValueError(f"{name} amax {float(bad[0]) if bad.size else 'empty'!r}: a tensor amax is finite and "
                         "positive; give the amax the kernel's scales were computed from (an all-zero operand has a "
                         "zero GEMM, which tells no model apart)")
    row_scaled = amax.size > 1
    sch = get_scheme("nvfp4", flavor=flavor, block=block, row_scaled=row_scaled or None)
    srows = -(-R // block[0])
    if scale_layout == "linear":
        if scales.size != srows * nblk:
            raise ValueError(f"{name} scales hold {scales.size} bytes; {srows} scale rows x {nblk} blocks = "
                             f"{srows * nblk} expected in the linear layout (one per {block[0]}x16 block)")
        scales = scales.reshape(srows, nblk)
    elif scale_layout != "swizzled":
        raise ValueError(f"scale_layout={scale_layout!r}: use 'linear' or 'swizzled'")
    if row_scaled and amax.size != R:
        raise ValueError(f"{name} amax holds {amax.size} values: one tensor amax, or one per row ({R})")
    g = amax.reshape(-1) if row_scaled else np.float32(amax.reshape(-1)[0])
    return QuantizedTensor(codes=np.ascontiguousarray(codes), scales=np.ascontiguousarray(scales), global_amax=g,
                           scheme=sch, axis=1, shape=(R, K), scale_layout=scale_layout)


# ------------------------------------------------------------------------------------------ witnesses
def _operand_files(d: Path, side: str, q: QuantizedTensor):
    np.save(d / f"{side}_codes.npy", q.codes)
    np.save(d / f"{side}_scales.npy", q.linear_scales())
    np.save(d / f"{side}_amax.npy", np.asarray(q.global_amax, np.float32))


def _spread(rng, R, K, binades, positive=False, small=1.0):
    nb = -(-K // 16)
    s = np.exp2(rng.uniform(-binades, binades, (R, nb))).repeat(16, 1)[:, :K]
    x = rng.standard_normal((R, K))
    if positive:
        x = np.abs(x)
    return (x * s * small).astype(np.float32)


def _q(x, rng=None):
    from ..quantize import quantize
    return quantize(x, "nvfp4", global_amax=np.float32(2688.0))       # alpha = 1: no rounding after c


def _witness_operands(seed: int = 0):
    """{name: (purpose, qa, qb)}: the witness families (fixed seeds: the same files on every machine)."""
    rng = np.random.default_rng(seed)
    out = {}
    # 1. one near-boundary dot product (blocks over 16 binades), its 32 K blocks in 24 physical orders: the same
    # products on the diagonal cells, another order each
    a, b = _spread(rng, 1, 512, 8), _spread(rng, 1, 512, 8)
    perms = [np.arange(32)] + [rng.permutation(32) for _ in range(23)]
    idx = np.stack([(p[:, None] * 16 + np.arange(16)).reshape(-1) for p in perms])
    out["k_block_permutations"] = ("one dot product's 32 K blocks in 24 physical orders (rows i of A and B hold "
                                   "order i; the diagonal cells are the same products, reordered)",
                                   _q(a[0][idx]), _q(b[0][idx]))
    # 2. same-sign partials straddling float32 rounding boundaries: positive operands, blocks over 16 binades
    out["same_sign_partials"] = ("positive operands (no cancellation) whose group partials straddle float32 "
                                 "rounding boundaries: round-toward-zero vs nearest additions",
                                 _q(_spread(rng, 24, 512, 8, positive=True)), _q(_spread(rng, 24, 512, 8, True)))
    # 3. group-width probes: one large block then small ones, in patterns that put the group boundaries at
    # 16 / 32 / 64 / 128 products in different places
    K = 1024
    pat = []
    for period in (1, 2, 4, 8):                # a large block every `period` blocks
        for phase in range(min(period, 4)):
            s = np.full(K // 16, -7.0)
            s[phase::period] = 7.0
            pat.append(s)
    sc = np.exp2(np.stack(pat) + rng.uniform(-1, 1, (len(pat), K // 16))).repeat(16, 1)
    ga = (rng.standard_normal((len(pat), K)) * sc).astype(np.float32)
    gb = (np.abs(rng.standard_normal((len(pat), K))) * sc).astype(np.float32)
    out["group_width_probes"] = ("one large block every 1 / 2 / 4 / 8 blocks at several phases: group sums of "
                                 "16, 32, 64 and 128 products round at different places", _q(ga), _q(gb))
    # 4. small accumulators: values with bits below 1/1024 (the k64_rtz grid)
    out["grid_1024"] = ("operands small against their tensor amax: accumulators with bits below 1/1024, which the "
                        "1/1024 grid removes", _q(_spread(rng, 16, 256, 4, small=2e-3)),
                        _q(_spread(rng, 16, 256, 4, small=2e-3)))
    # 5. BF16-midpoint cells: the outputs (of many random dot products) whose float32 values under two models
    # round to different bfloat16 values, kept for each pair of models
    out["bf16_midpoints"] = ("cells within a few float32 ulps of a bfloat16 midpoint (64.75), on the side each "
                             "model's rounding puts them: bfloat16 outputs that differ for every pair of models "
                             "(selected from 4,096 such dot products)", *_bf16_cells(rng))
    return out


def _bf16_cells(rng, n=64, K=512):
    """Rows of A and B whose diagonal cells separate every pair of models after rounding to bfloat16.

    Every row's first 16-element block is the same, with both block scales 1.0, and its products sum to
    V = 64.75 = (1 + 3/256) * 2^6: a bfloat16 midpoint whose tie goes up (to 65). Each row of A then holds four
    small elements (0.5 to 1.5, either sign) at random positions, against B's ones, both block scales among
    E4M3's smallest subnormals: products of 2^-19 to 2^-14, around half a float32 ulp of V (2^-18). So every cell of the (n, n) product lands within a few float32 ulps of V, on the side of the
    midpoint that its model's rounding and grouping put it; the cells that round to different bfloat16 values
    under two models are kept for each pair."""
    from ..layout import pack_fp4
    code = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}
    nblk = K // 16

    def head(c, vals):
        c[:, :len(vals)] = [code[v] for v in vals]

    ca = np.zeros((n, K), np.uint8)
    sa = np.zeros((n, nblk), np.uint8)
    head(ca, [6.0] * 10 + [4.0, 1.5])                   # x B's (1,)*11 + (0.5,): 60 + 4 + 0.75 = 64.75
    sa[:, 0] = 0x38                                     # E4M3 1.0
    for r in range(n):                                  # four small products per row, either sign
        for k in rng.choice(np.arange(16, K), size=4, replace=False):
            ca[r, k] = rng.integers(1, 4) | (int(rng.integers(0, 2)) << 3)     # 0.5, 1 or 1.5
            sa[r, k // 16] = rng.integers(1, 5)          # E4M3 subnormals 2^-9 ... 2^-7
    cb = np.full((n, K), code[1.0], np.uint8)
    cb[:, :16] = 0
    head(cb, [1.0] * 11 + [0.5])
    sb = rng.integers(1, 5, size=(n, nblk)).astype(np.uint8)
    sb[:, 0] = 0x38
    mk = lambda c, sc: gemm_operand(pack_fp4(c), sc, np.float32(2688.0))   # noqa: E731
    qa, qb = mk(ca, sa), mk(cb, sb)
    ys = {m: y.astype(ml_dtypes.bfloat16).view(np.uint16) for m, y in model_outputs(qa, qb).items()}
    names = list(ys)
    keep = []
    for i, m1 in enumerate(names):
        for m2 in names[i + 1:]:
            if any(ys[m1][r, c] != ys[m2][r, c] for r, c in keep):
                continue
            diff = np.argwhere(ys[m1] != ys[m2])
            if len(diff):
                keep.append(tuple(diff[0]))
    rows_, cols = [r for r, _ in keep] or [0], [c for _, c in keep] or [0]
    return mk(ca[rows_], sa[rows_]), mk(cb[cols], sb[cols])


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


README = """fp4sim GEMM witnesses: operand sets whose outputs tell NVFP4 accumulation models apart.

Each folder holds one NVFP4 x NVFP4 GEMM, y = A . B^T (A: M x K, B: N x K, both quantized along K):
  a_codes.npy, b_codes.npy    uint8 (rows, K/2): two E2M1 codes per byte, element 2i in the low nibble
  a_scales.npy, b_scales.npy  uint8 (rows, K/16): E4M3 block-scale bytes, linear layout (row, 16-element block)
  a_amax.npy, b_amax.npy      float32: the tensor amax of each operand (alpha = amax_a * amax_b / (6*6*448*448))
  expected/MODEL.npy          float32 (M, N): the output of each model, computed by fp4sim
Run the GEMM on the device with these codes and scales (in the layout the kernel takes), save its output as
OUTDIR/NAME.npy (float32, or bfloat16 saved by ml_dtypes), and verify with
  python -m fp4sim.validate gemm --witnesses THIS_FOLDER --outputs OUTDIR
which names the models consistent with every witness. manifest.json lists each witness's purpose and how many
cells separate each pair of models (float32 and after rounding to bfloat16).
"""


def fresh_dir(out_dir) -> Path:
    """``out_dir`` created, refused if it exists and holds anything (no file of an earlier set is mixed in)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty folder: write the witnesses into a new folder (or "
                         "remove that one first), so that no file of an earlier set is mixed in")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def record_witness(d: Path, manifest: dict, name: str, entry: dict, ys: dict, bf16: bool = True):
    """Save each model's expected output ``ys`` under d/expected and the witness's manifest entry (``entry`` with
    the cells that separate each pair of models, float32 and, with ``bf16``, after rounding to bfloat16), adding
    them to the set's totals."""
    for m, y in ys.items():
        np.save(d / "expected" / f"{m}.npy", y)
    seps = {"separating_cells": separation(ys)}
    if bf16:
        seps["separating_cells_bf16"] = separation(ys, bf16=True)
    manifest["witnesses"][name] = {**entry, **seps}
    for key, sep in seps.items():
        tot = manifest.setdefault(key, {})
        for k, v in sep.items():
            tot[k] = tot.get(k, 0) + v


def write_witnesses(out_dir, seed: int = 0) -> dict:
    """Write the witness folders, their expected outputs and manifest.json under ``out_dir`` (a new or empty
    folder: one that holds anything is refused, so no stale file of an earlier set is mixed in); return the
    manifest."""
    out_dir = fresh_dir(out_dir)
    manifest = {"models": list(CANDIDATES), "seed": seed, "witnesses": {}}
    for name, (purpose, qa, qb) in _witness_operands(seed).items():
        d = out_dir / name
        (d / "expected").mkdir(parents=True, exist_ok=True)
        _operand_files(d, "a", qa)
        _operand_files(d, "b", qb)
        record_witness(d, manifest, name, {"purpose": purpose, "M": qa.lead[0], "N": qb.lead[0], "K": qa.K},
                       model_outputs(qa, qb))
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out_dir / "README.txt").write_text(README)
    return manifest


def read_witness(d) -> tuple:
    """(qa, qb, {model: expected float32 output}) of one witness folder."""
    d = Path(d)
    missing = [f for f in ("a_codes.npy", "a_scales.npy", "a_amax.npy", "b_codes.npy", "b_scales.npy", "b_amax.npy")
               if not (d / f).is_file()]
    if missing:
        raise ValueError(f"{d}: not a witness folder (missing {', '.join(missing)}; write them with python -m "
                         "fp4sim.validate gemm-witnesses --out DIR)")
    qa = gemm_operand(np.load(d / "a_codes.npy"), np.load(d / "a_scales.npy"), np.load(d / "a_amax.npy"), name="a")
    qb = gemm_operand(np.load(d / "b_codes.npy"), np.load(d / "b_scales.npy"), np.load(d / "b_amax.npy"), name="b")
    exp = {p.stem: np.load(p) for p in sorted((d / "expected").glob("*.npy"))}
    return qa, qb, exp


def load_output(spec, dtype: str = "float32"):
    """A kernel's output file: float32, bfloat16 saved by ml_dtypes (NumPy reads it back as 2-byte void), or with
    ``dtype="bfloat16"`` bfloat16 bits as uint16 / int16."""
    from ..arrays_io import load_array
    o = load_array(str(spec))
    if (dtype == "bfloat16" and o.dtype in (np.uint16, np.int16)) or (o.dtype.kind == "V" and o.dtype.itemsize == 2):
        return np.ascontiguousarray(o).view(ml_dtypes.bfloat16)
    if dtype == "bfloat16" and o.dtype != np.dtype(ml_dtypes.bfloat16):
        raise ValueError(f"{spec}: dtype {o.dtype}; a bfloat16 output is read from bfloat16 or its uint16 bits")
    if dtype == "float32" and o.dtype not in (np.float32, np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"{spec}: dtype {o.dtype}; give the kernel's float32 output (or bfloat16 bits as uint16 "
                         "with --out-dtype bfloat16)")
    return o


def _compare_nvfp4_witness(d, entry, out):
    qa, qb, exp = read_witness(d)
    return compare_gemm(qa, qb, out, expected=exp)


def check_witnesses(witness_dir, outputs_dir, dtype: str = "float32", compare=_compare_nvfp4_witness) -> dict:
    """Every witness of ``witness_dir`` against the device's outputs ``outputs_dir/NAME.npy``: {"reports": {name:
    GemmReport}, "consistent": the models that reproduce every witness present bit for bit, in CANDIDATES order,
    "missing": the witnesses without an output (the verdict is over the others; none present is an error)}.
    ``compare(folder, manifest entry, output)``: the report of one witness (the FP8 witnesses pass theirs)."""
    witness_dir, outputs_dir = Path(witness_dir), Path(outputs_dir)
    man = witness_dir / "manifest.json"
    if not man.is_file():
        raise ValueError(f"{witness_dir}: no manifest.json (write the witnesses with python -m fp4sim.validate "
                         "gemm-witnesses --out DIR)")
    manifest = json.loads(man.read_text())
    names = list(manifest["witnesses"])
    models = manifest.get("models", list(CANDIDATES))
    missing = [n for n in names if not (outputs_dir / f"{n}.npy").is_file()]
    if len(missing) == len(names):
        raise ValueError(f"{outputs_dir}: no device output for any witness (save the kernel's output for witness "
                         f"NAME as {outputs_dir}/NAME.npy; the witnesses are {', '.join(names)})")
    reports, consistent = {}, None
    for n in names:
        if n in missing:
            continue
        p = outputs_dir / f"{n}.npy"
        rep = compare(witness_dir / n, manifest["witnesses"][n], load_output(p, dtype))
        reports[n] = rep
        consistent = set(rep.matches) if consistent is None else consistent & set(rep.matches)
    return {"reports": reports, "consistent": [m for m in models if m in (consistent or set())],
            "missing": missing}
