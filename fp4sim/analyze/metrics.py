"""Quantization-error metrics of one tensor under one scheme, computed in row chunks.

The tensor is viewed as (rows, K) with K its last axis (the block axis). Rows are processed in chunks of at
most ``chunk_elems`` elements (a multiple of 128 rows, so 16x16 and 128x128 tiles never straddle chunks);
tensor-wide scales use the whole tensor's amax (``global_amax``), so the result equals quantizing the tensor
in one piece. Gradients are rounded stochastically (Philox, the chunk index as the stream).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import dequantize, quantize
from ..formats import E4M3
from .._xp import table, xp_of
from ..layout import unpack_fp4
from .lazy import absmax, is_lazy

SCALAR_METRICS = ("mse", "rel_mse", "sqnr_db", "max_abs_err", "blockmax_rel_err", "underflow_frac",
                  "saturation_frac", "zero_code_frac", "frac_blocks_amax_max", "binades_per_block", "scale_std",
                  "scale_min", "scale_max", "n_scale_subnormal", "n_scale_zero", "block_err_p50", "block_err_p90",
                  "block_err_p99", "worst1pct_block_err_share", "map_to_4_frac", "lost_frac",
                  "gamax_window_out_frac", "dead_zone_frac")
# NVFP4's g_amax window: a block whose amax b has 28672 * b < g_amax (28672 = 448 / 2^-6) gets a subnormal E4M3
# scale (one with b > g_amax, possible only with a stale tensor amax, a saturated one)
WINDOW = 28672.0
BLOCK_FIELDS = ("row", "block", "scale_byte", "amax", "sq_err", "lost")


@dataclass(frozen=True)
class SchemeSpec:
    """One column of the analysis: a label, the fp4sim scheme and its options, and which roles it applies to."""
    label: str
    scheme: str
    kwargs: dict = field(default_factory=dict)
    roles: tuple = ("weight", "activation", "gradient")
    fp4: bool = False
    block: int = 1

    def options(self, role: str) -> dict:
        kw = dict(self.kwargs)
        if self.scheme == "fp8_blockwise" and role == "weight":
            kw["block"] = (128, 128)
        return kw


DEFAULT_SCHEMES = (
    SchemeSpec("nvfp4", "nvfp4", fp4=True, block=16),
    SchemeSpec("nvfp4_2d", "nvfp4_2d", roles=("weight",), fp4=True, block=16),
    SchemeSpec("nvfp4_4over6", "nvfp4", {"four_over_six": "mse"}, roles=("weight", "activation"), fp4=True,
               block=16),
    SchemeSpec("mxfp4_rceil", "mxfp4", {"scale_mode": "rceil"}, fp4=True, block=32),
    SchemeSpec("mxfp4_floor", "mxfp4", {"scale_mode": "floor"}, fp4=True, block=32),
    SchemeSpec("mxfp8_e4m3", "mxfp8_e4m3", block=32),
    SchemeSpec("fp8_blockwise", "fp8_blockwise", block=128),
    SchemeSpec("fp8_e4m3", "fp8_e4m3", block=1),
    SchemeSpec("bf16", "bf16", block=1),
)
# NVFP4 variants, chosen with --schemes: TE's per-row second-level scale (alone and with 4over6), torchao without a
# tensor scale
EXTRA_SCHEMES = (
    SchemeSpec("nvfp4_row_scaled", "nvfp4", {"row_scaled": True}, fp4=True, block=16),
    SchemeSpec("nvfp4_4over6_row_scaled", "nvfp4", {"four_over_six": "mse", "row_scaled": True},
               roles=("weight", "activation"), fp4=True, block=16),
    SchemeSpec("nvfp4_torchao_no_tensor_scale", "nvfp4", {"flavor": "torchao", "per_tensor_scale": False}, fp4=True,
               block=16),
    # the other OCP MX formats: FP6 (E2M3, E3M2) and INT8 elements, 32-element blocks, UE8M0 scales
    SchemeSpec("mxfp6_e2m3", "mxfp6_e2m3", block=32),
    SchemeSpec("mxfp6_e3m2", "mxfp6_e3m2", block=32),
    SchemeSpec("mxint8", "mxint8", block=32),
    SchemeSpec("mxfp8_e5m2", "mxfp8_e5m2", block=32),
)
SCHEMES_BY_LABEL = {s.label: s for s in DEFAULT_SCHEMES + EXTRA_SCHEMES}


def as_rows(x: np.ndarray) -> np.ndarray:
    """The (rows, last axis) view of ``x`` (one row for a vector; a :class:`~fp4sim.analyze.lazy.LazyTensor`'s
    rows view, read chunk by chunk)."""
    if is_lazy(x):
        return x.rows_view()
    return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)


def chunks(x2: np.ndarray, chunk_elems: int):
    step = max(128, (chunk_elems // max(x2.shape[1], 1)) // 128 * 128)
    for i, r0 in enumerate(range(0, x2.shape[0], step)):
        yield i, x2[r0:r0 + step]


def quantize_chunk(c, spec: SchemeSpec, role: str, amax, seed: int, stream: int, qfn=quantize):
    """One row chunk's quantization under ``spec`` (``qfn``: :func:`fp4sim.quantize`, or a backend's)."""
    kw = spec.options(role)
    tensor_scale = not kw.get("row_scaled") and kw.get("per_tensor_scale", True)  # the variants bring their own
    if spec.scheme in ("nvfp4", "nvfp4_2d", "fp8_e4m3", "fp8_e5m2") and tensor_scale:
        kw["global_amax"] = amax
    if role == "gradient" and spec.fp4 and not kw.get("four_over_six"):
        kw.update(rounding="sr", seed=seed, stream=stream)
    return qfn(c, spec.scheme, **kw)


def tensor_amax(x: np.ndarray) -> np.float32:
    """max |x| with NaN ignored (0 for an all-NaN tensor): the tensor-wide scale input of chunked schemes."""
    if is_lazy(x):
        return absmax(x.rows_view())
    return absmax(as_rows(np.ascontiguousarray(x, np.float32)))


def _window(spec: SchemeSpec) -> str | None:
    """How an NVFP4 scheme's second-level amax is taken: "tensor", "row" (row-scaled), None (no tensor scale, or
    not NVFP4: the g_amax window does not apply)."""
    if not spec.scheme.startswith("nvfp4") or not spec.kwargs.get("per_tensor_scale", True):
        return None
    return "row" if spec.kwargs.get("row_scaled") else "tensor"


def _scales(q, spec: SchemeSpec, c, acc: dict, scale_hist, scale_vals: list):
    """The scale statistics of one chunk's FP4 quantization (its scale histogram, values and 4over6 choices)."""
    if not spec.fp4:
        return
    if "map_to_4" in q.extras:
        acc["map4"] = acc.get("map4", 0) + int(q.extras["map_to_4"].sum())
        acc["map4_n"] = acc.get("map4_n", 0) + int(q.extras["map_to_4"].size)
    s = _scale_bytes(q, spec)
    xp = xp_of(s)
    scale_hist += _host(xp.bincount(s.ravel().astype(np.intp), minlength=256))
    if spec.scheme.startswith("nvfp4"):
        scale_vals.append(table(xp, E4M3.values)[s].ravel())
    else:
        scale_vals.append(xp.exp2(s.astype(np.float64).ravel() - 127))


def _scale_bytes(q, spec: SchemeSpec):
    """The scale bytes of an NVFP4 (one row per tensor row) or MX quantization, (rows, blocks)."""
    return q.scales_per_row() if spec.scheme.startswith("nvfp4") else q.linear_scales()


def _host(a) -> np.ndarray:
    """A NumPy array of ``a`` (a CuPy array is copied to the host)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _block_records(q, spec: SchemeSpec, xm, eb, r0: int, c, y) -> dict:
    """One chunk's per-block records (:data:`BLOCK_FIELDS`) from its block amaxes ``xm`` and squared errors ``eb``
    (rows x blocks), its quantization ``q``, the chunk ``c`` and its dequantized values ``y`` (NumPy arrays; ``q``
    may hold device arrays); ``r0``: the chunk's first row. A block in which finite values come back Inf or NaN
    (``lost``: how many) has an unbounded error: its ``sq_err`` is +Inf, as the tensor's mse is then (its other
    elements' errors are not a bound on it)."""
    nr, nbk = xm.shape
    sb = np.full((nr, nbk), -1, np.int16)
    if spec.fp4 or spec.scheme.startswith("mx"):
        sb[:] = _host(_scale_bytes(q, spec))
    lost = np.isfinite(c) & ~np.isfinite(y)
    if lost.any():
        K = c.shape[1]
        B = -(-K // nbk)
        lost = np.pad(lost, ((0, 0), (0, nbk * B - K))).reshape(nr, nbk, B).sum(-1, dtype=np.int32)
        eb = np.where(lost > 0, np.inf, eb)
    else:
        lost = np.zeros((nr, nbk), np.int32)
    return {"row": np.repeat(np.arange(r0, r0 + nr, dtype=np.int32), nbk),
            "block": np.tile(np.arange(nbk, dtype=np.int32), nr), "scale_byte": sb.ravel(),
            "amax": xm.ravel().astype(np.float32), "sq_err": eb.ravel(), "lost": lost.ravel()}


def _chunk_fused(c, q, spec: SchemeSpec, win, amax, acc: dict, code_hist, blk_errs: list, blocks, r0: int,
                 sx2: dict | None = None) -> int:
    """One chunk's share of every statistic but the scales', from one pass of
    :func:`fp4sim.cpu.analysis.block_stats` and the pairwise sums of :func:`~fp4sim.cpu.analysis.chunk_sums`:
    the same numbers as the NumPy expressions of the reference path, bit for bit. ``sx2``: the chunks' sums of
    x^2 by (first row, rows), shared by the schemes of one tensor (they do not depend on the scheme). Returns
    the next chunk's first row."""
    from ..cpu import analysis as ka
    R, K = c.shape
    c = np.ascontiguousarray(c, np.float32)
    y = np.ascontiguousarray(dequantize(q), np.float32)
    B = spec.block if spec.block > 1 else K
    nbk = -(-K // B)
    codes = unpack_fp4(q.codes.reshape(R, -1)) if spec.fp4 else np.zeros((1, 1), np.uint8)
    counts = np.empty((R, ka.N_COUNTS), np.int64)
    max_err, row_amax = np.empty(R), np.empty(R)
    eb, xm, ym = np.empty((R, nbk)), np.empty((R, nbk)), np.empty((R, nbk))
    blk_max = np.zeros((R, nbk) if spec.fp4 else (1, 1), np.bool_)
    binades = np.zeros((R, nbk) if spec.fp4 else (1, 1), np.uint8)
    hist = np.zeros((R, 16) if spec.fp4 else (1, 16), np.int64)
    window = {None: 0, "tensor": 1, "row": 2}[win]
    ka.block_stats(c, y, codes, B, spec.fp4, window, float(amax), counts, max_err, row_amax, eb, xm, ym, blk_max,
                   binades, hist)
    tot = counts.sum(0)
    acc["fin"] += int(tot[ka.FIN])
    acc["lost"] += int(tot[ka.LOST])
    cf, yf = c.reshape(-1), y.reshape(-1)
    key = (r0, R, K)
    if sx2 is None or key not in sx2:
        if tot[ka.FIN] == c.size:
            v = float(ka.chunk_sums(cf, yf, 1))
        else:
            c64 = c.astype(np.float64)
            v = float(np.sum(c64[np.isfinite(c64)] ** 2))
        if sx2 is not None:
            sx2[key] = v
    acc["sx2"] += sx2[key] if sx2 is not None else v
    acc["se2"] += float(ka.chunk_sums(cf, yf, 0))
    acc["max_err"] = max(acc["max_err"], float(max_err.max()))
    acc["nz"] += int(tot[ka.NZ])
    acc["under"] += int(tot[ka.UNDER])
    acc["n"] += c.size
    blk_errs.append(eb.ravel())
    ok = xm > 0
    acc["bm_err"] += float(np.sum(np.abs(ym[ok] - xm[ok]) / xm[ok]))
    acc["bm_n"] += int(ok.sum())
    if win is not None:
        g = np.float64(amax) if win == "tensor" else row_amax[:, None]
        acc["win_out"] += int((ok & (xm * WINDOW < g)).sum())
        acc["dead"] += int(tot[ka.DEAD])
    if blocks is not None:
        blocks.append(_block_records(q, spec, xm, eb, r0, c, y))
    acc["zero"] += int(tot[ka.ZERO])
    if spec.fp4:
        code_hist += hist.sum(0)
        acc["sat"] += int(tot[ka.SAT])
        acc["nblk"] += int(ok.sum())
        acc["blk_max"] += int((blk_max & ok).sum())
        acc["binades"] += float(binades[ok].sum())
    return r0 + R


_FUSED = True      # the one-pass kernels; False: the NumPy reference path (the tests compare the two)


def scheme_metrics(x: np.ndarray, spec: SchemeSpec, role: str, seed: int = 0, chunk_elems: int = 1 << 22,
                   amax=None, blocks: list | None = None, _fused: bool | None = None, shared: dict | None = None,
                   device=None):
    """(scalar metrics dict, E2M1 code histogram (16,), scale-byte histogram (256,)) of x under ``spec``.

    Per-block statistics use 1 x B row segments (B = the scheme's block length along the last axis), also
    for 16x16 and 128x128 tiles. ``amax``: the tensor's |x| max, when the caller has it already. ``blocks``: a
    list to which one dict of per-block arrays per row chunk is appended (:data:`BLOCK_FIELDS`: the segment's
    row and block index, its scale byte — E4M3 for NVFP4, UE8M0 for MX, -1 for schemes without byte scales —
    its amax, its squared error and how many of its finite values came back Inf or NaN (``lost``; such a block's
    squared error is +Inf); the tensor's squared error is their sum). ``shared``: a dict the caller
    passes to every scheme of one tensor ``x`` (same ``chunk_elems``), where the scheme-independent sums are
    kept between the calls.

    NVFP4 schemes also give the g_amax window (``gamax_window_out_frac``: the share of nonzero blocks whose amax b
    falls outside ``b <= g_amax <= 28672 b``, g_amax the tensor's amax or, row-scaled, the row's, so that only the
    right-hand side can fail: those blocks get subnormal E4M3 scales) and the dead zone
    (``dead_zone_frac``: the share of nonzero elements below b / 24, which round to 0 even with the block's exact
    scale b / 6). ``device``: a :class:`fp4sim.analyze.device.Device` holding ``x`` (the chunks' statistics then
    taken there)."""
    x2 = as_rows(x)
    _fused = _FUSED if _fused is None else _fused
    if amax is None:
        amax = tensor_amax(x2) if device is None else device.amax(x2)
    amax = np.float32(amax)
    acc = dict(sx2=0.0, se2=0.0, se=0.0, max_err=0.0, nz=0, under=0, sat=0, zero=0, n=0, bm_err=0.0, bm_n=0,
               nblk=0, blk_max=0, binades=0.0, fin=0, lost=0, win_out=0, dead=0)
    win = _window(spec)
    r0 = 0
    code_hist = np.zeros(16, np.int64)
    scale_hist = np.zeros(256, np.int64)
    scale_vals, blk_errs = [], []
    for i, c in chunks(x2, chunk_elems):
        if device is not None:
            q = quantize_chunk(c, spec, role, amax, seed, i, qfn=device.quantize)
            if c.size:
                r0 = device.chunk_stats(c, q, spec, win, amax, acc, code_hist, blk_errs, blocks, r0, shared)
                _scales(q, spec, c, acc, scale_hist, scale_vals)
            continue
        q = quantize_chunk(c, spec, role, amax, seed, i)
        if _fused and c.size:
            r0 = _chunk_fused(c, q, spec, win, amax, acc, code_hist, blk_errs, blocks, r0, shared)
            _scales(q, spec, c, acc, scale_hist, scale_vals)
            continue
        y = dequantize(q).astype(np.float64)
        c64 = c.astype(np.float64)
        fin = np.isfinite(c64)
        lost = fin & ~np.isfinite(y)                   # a finite input that comes back Inf / NaN: no finite error
        acc["fin"] += int(fin.sum())
        acc["lost"] += int(lost.sum())
        err = np.where(fin & ~lost, y - c64, 0.0)
        acc["sx2"] += float(np.sum(c64[fin] ** 2))
        acc["se2"] += float(np.sum(err ** 2))
        acc["max_err"] = max(acc["max_err"], float(np.max(np.abs(err))) if err.size else 0.0)
        nzm = (c64 != 0) & fin
        acc["nz"] += int(nzm.sum())
        acc["under"] += int((nzm & (y == 0)).sum())
        acc["n"] += c.size
        B = spec.block if spec.block > 1 else c.shape[1]
        K = c.shape[1]
        Kp = -(-K // B) * B
        pad = lambda a: np.pad(a, ((0, 0), (0, Kp - K)))  # noqa: E731
        eb = pad(err ** 2).reshape(c.shape[0], -1, B).sum(-1)
        blk_errs.append(eb.ravel())
        xa = pad(np.where(fin, np.abs(c64), 0)).reshape(c.shape[0], -1, B)
        ya = pad(np.abs(y)).reshape(c.shape[0], -1, B)
        arg = xa.argmax(-1)
        xm = np.take_along_axis(xa, arg[..., None], -1)[..., 0]
        ym = np.take_along_axis(ya, arg[..., None], -1)[..., 0]
        ok = xm > 0
        acc["bm_err"] += float(np.sum(np.abs(ym[ok] - xm[ok]) / xm[ok]))
        acc["bm_n"] += int(ok.sum())
        if win is not None:
            g = np.float64(amax) if win == "tensor" else np.where(fin, np.abs(c64), 0).max(1, keepdims=True)
            acc["win_out"] += int((ok & (xm * WINDOW < g)).sum())     # (b <= g holds: g is the current amax)
            acc["dead"] += int(((xa > 0) & (xa < xm[..., None] / 24.0)).sum())
        if blocks is not None:
            blocks.append(_block_records(q, spec, xm, eb, r0, c, y))
        r0 += c.shape[0]
        if spec.fp4:
            codes = unpack_fp4(q.codes.reshape(c.shape[0], -1))
            code_hist += np.bincount(codes[:, :K].ravel(), minlength=16)
            mag = codes & 7
            acc["zero"] += int((mag[:, :K] == 0).sum())
            acc["sat"] += int(((mag[:, :K] == 7) & (np.abs(c64) > np.abs(y) * (1 + 1e-7)) & fin).sum())
            mb = mag.reshape(c.shape[0], -1, B)
            acc["nblk"] += int(ok.sum())
            acc["blk_max"] += int(((mb.max(-1) == 7) & ok).sum())
            binade = np.where(mb >= 2, mb >> 1, np.where(mb == 1, 0, -1))
            used = sum((binade == b).any(-1).astype(np.int64) for b in range(4))
            acc["binades"] += float(used[ok].sum())
            _scales(q, spec, c, acc, scale_hist, scale_vals)
        else:
            acc["zero"] += int(((y == 0) & fin).sum())
    return summarise(acc, blk_errs, scale_vals, scale_hist, code_hist, spec, win, np if device is None else device.xp)


def percentile_of_sorted(sb, q) -> float:
    """``np.percentile(a, q)`` (its default 'linear' method) from ``sb``, ``a`` sorted (a NumPy or device array),
    or partitioned at :func:`percentile_indices`: NumPy's virtual index and interpolation rule applied on the host
    to the two order statistics around it, so that a device's percentiles are NumPy's bit for bit (reading two
    values, not the array)."""
    n = sb.size
    v = (n - 1) * np.true_divide(q, 100)
    if np.isnan(float(sb[n - 1])):
        return float("nan")
    if v >= n - 1:
        i0 = i1 = -1
    elif v < 0:
        i0 = i1 = 0
    else:
        i0 = int(np.floor(v))
        i1 = i0 + 1
    a, b = (float(sb[i]) for i in (i0, i1))
    g = float(v - i0)
    d = b - a
    return b - d * (1 - g) if g >= 0.5 else a + d * g


def percentile_indices(n: int, qs) -> list:
    """The order statistics :func:`percentile_of_sorted` reads for the percentiles ``qs`` of ``n`` values, and the
    largest (``n - 1``, whose NaN makes every percentile NaN): an array partitioned at these (``np.partition(a,
    idx)``) gives the percentiles of a sorted one, with one partial sort instead of one per percentile."""
    out = {n - 1}
    for q in qs:
        v = (n - 1) * np.true_divide(q, 100)
        if 0 <= v < n - 1:
            i0 = int(np.floor(v))
            out.update((i0, i0 + 1))
        else:
            out.add(0 if v < 0 else n - 1)
    return sorted(out)


def summarise(acc: dict, blk_errs: list, scale_vals: list, scale_hist, code_hist, spec: SchemeSpec, win, xp=np):
    """The metrics dict and histograms of :func:`scheme_metrics` from its chunks' sums ``acc``, block errors and
    scale values (arrays of the module ``xp``)."""
    mse = acc["se2"] / max(acc["n"], 1)
    ms = acc["sx2"] / max(acc["n"], 1)
    # the per-block arrays are as large as a float64 per block: each list is dropped once joined, and each joined
    # array once its statistics are taken, so that no two of them are held at once beside the lists
    be = xp.concatenate(blk_errs) if blk_errs else xp.zeros(1)
    blk_errs.clear()
    ntop = max(1, be.size // 100)
    if xp is np:
        # one partition at the percentiles' order statistics (np.percentile's bits) and at the worst 1%'s edge;
        # the worst 1% summed in ascending order, as the device path sums them from its sorted copy
        part = np.partition(be, sorted(set(percentile_indices(be.size, (50, 90, 99))) | {be.size - ntop}))
        pct = [percentile_of_sorted(part, q) for q in (50, 90, 99)]
        top = np.sort(part[be.size - ntop:]).sum()
        del part
    else:                        # on a device: sorted there, NumPy's interpolation on the host
        be = xp.sort(be)
        top = be[be.size - ntop:].sum()
        pct = [percentile_of_sorted(be, q) for q in (50, 90, 99)]
    total = be.sum()
    out = dict(mse=mse, rel_mse=mse / ms if ms else np.nan,
               sqnr_db=10 * np.log10(ms / mse) if mse > 0 and ms > 0 else np.inf,
               max_abs_err=acc["max_err"], blockmax_rel_err=acc["bm_err"] / max(acc["bm_n"], 1),
               underflow_frac=acc["under"] / max(acc["nz"], 1), saturation_frac=acc["sat"] / max(acc["n"], 1),
               zero_code_frac=acc["zero"] / max(acc["n"], 1),
               frac_blocks_amax_max=acc["blk_max"] / acc["nblk"] if acc["nblk"] else np.nan,
               binades_per_block=acc["binades"] / acc["nblk"] if acc["nblk"] else np.nan,
               block_err_p50=pct[0], block_err_p90=pct[1], block_err_p99=pct[2],
               worst1pct_block_err_share=float(top / total) if total > 0 else 0.0,
               map_to_4_frac=acc["map4"] / acc["map4_n"] if acc.get("map4_n") else np.nan,
               lost_frac=acc["lost"] / acc["fin"] if acc["fin"] else 0.0,
               gamax_window_out_frac=acc["win_out"] / acc["bm_n"] if win is not None and acc["bm_n"] else np.nan,
               dead_zone_frac=acc["dead"] / acc["nz"] if win is not None and acc["nz"] else np.nan)
    del be, top
    if acc["lost"]:                     # finite values the scheme turns into Inf / NaN: an unbounded error
        out.update(mse=np.inf, rel_mse=np.inf, sqnr_db=-np.inf, max_abs_err=np.inf)
    if scale_vals:
        sv = xp.concatenate(scale_vals)
        scale_vals.clear()
        out.update(scale_std=float(xp.std(sv)), scale_min=float(sv.min()), scale_max=float(sv.max()))
        if spec.scheme.startswith("nvfp4"):
            out.update(n_scale_subnormal=int(scale_hist[1:8].sum()), n_scale_zero=int(scale_hist[0]))
        else:
            out.update(n_scale_subnormal=0, n_scale_zero=0)
    else:
        out.update(scale_std=np.nan, scale_min=np.nan, scale_max=np.nan, n_scale_subnormal=np.nan,
                   n_scale_zero=np.nan)
    if not spec.fp4:
        code_hist[:] = 0
    return out, code_hist, scale_hist
