"""``fp4sim.analyze`` on a GPU (``--device cuda``): the studies of :mod:`~fp4sim.analyze.metrics` and
:mod:`~fp4sim.analyze.studies` with the tensor on the device, its quantizations made by the CUDA kernels of
:mod:`fp4sim.gpu` and its statistics by the analysis kernels of ``kernels.cu``.

The numbers are the CPU path's: codes, scale bytes, histograms, counts, extrema and per-block values exactly (a
block's squared error is summed in the CPU's order); the chunk-wide float64 sums (squared errors, moments, the
outlier study's column sums, the weight-gradient GEMM's float64 products) are the same terms added in another order,
so they agree with the CPU's to the reassociation tolerance of float64 sums (a relative 1e-12 on real tensors).

Everything here takes a :class:`Device`: a CUDA backend of :mod:`fp4sim.gpu.backend` (CuPy on a GPU; the tests pass
the host build of the same kernels, with NumPy arrays).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import metrics as _metrics
from .studies import _Moments
from .metrics import WINDOW, SchemeSpec, _block_records, _host, as_rows, chunks

i64, i32, f64 = np.int64, np.int32, np.float64
SEG = 32                  # an_sums: elements per thread
TILE = 32                 # an_outlier_cols: rows per thread
# an_sums's columns
N, S1, S2, EA2, EB2, D2, D4, EA, EB, SABS, NNAN, NINF, EAS, EBS = range(14)
NCOL = 14


class Device:
    """A CUDA backend (``be.xp``, ``be.launch``) with the quantize entry points and statistics the studies use."""

    def __init__(self, be):
        from ..gpu import ops
        self.be, self.xp, self.ops = be, be.xp, ops
        self.k = ops.kernels(be)

    def upload(self, x: np.ndarray):
        """A host tensor (float32, or bfloat16 as stored) on the device as float32: bfloat16 is copied as it is (half
        the bytes) and widened there from its bits, exactly."""
        xp = self.xp
        if x.dtype == np.dtype(ml_dtypes.bfloat16):
            bits = xp.asarray(np.ascontiguousarray(x).view(np.uint16))
            return xp.ascontiguousarray((bits.astype(np.uint32) << 16).view(np.float32))
        return xp.ascontiguousarray(xp.asarray(x), dtype=np.float32)

    def quantize(self, x, scheme, **kw):
        return self.ops.quantize(self.be, x, scheme, **kw)

    def fake(self, x, scheme, **kw):
        return self.ops.quantize(self.be, x, scheme, fake=True, **kw)

    def dequantize(self, q):
        return self.xp.ascontiguousarray(self.ops.dequantize(self.be, q))

    def rht(self, x, d, signs, axis=-1, out="fp32"):
        return self.ops.rht(self.be, x, d, signs, axis, out)

    def bias_sums(self, x, ya, yb) -> tuple:
        """:func:`fp4sim.analyze.studies.gradient_bias`'s sums of two passes in one launch: ([sum of ya - x, sum |x|,
        count], the same for yb) over the finite x."""
        t, _ = self.sums(x, ya, yb)
        return [t[EA], t[SABS], t[N]], [t[EB], t[SABS], t[N]]

    def host(self, a) -> np.ndarray:
        """A device array as a NumPy array on the host."""
        return _host(a)

    def f64(self, a):
        """float64 of a float32 array, exactly (subnormals kept)."""
        return self.k.f64(a)

    def moments(self) -> Moments:
        """A two-pass moments accumulator whose sums are taken on this device."""
        return Moments(self)

    def chunk_stats(self, *args) -> int:
        """:func:`chunk_stats` on this device."""
        return chunk_stats(self, *args)

    def outlier_sums(self, c, y, thr):
        """One chunk's share of the outlier study (:func:`fp4sim.cpu.analysis.outlier_sums`'s) from the chunk
        ``c`` and its NVFP4 values ``y``, ``thr`` the float32 threshold: (column holds a big value, row holds one,
        column sums of the squared error and of x^2, each 16-block's squared error, block holds a big value); the
        column arrays on the host, the others on the device."""
        xp = self.xp
        c = xp.ascontiguousarray(c)
        R, K = c.shape
        nbk, ntile = -(-K // 16), -(-R // TILE)
        cols = xp.zeros(K, np.uint8)
        perr, px2 = xp.empty((ntile, K)), xp.empty((ntile, K))
        self.be.launch("an_outlier_cols", ntile * K, c, y, i64(R), i64(K), i64(TILE), f64(thr), perr, px2, cols)
        eb, bb, rb = xp.empty((R, nbk)), xp.empty((R, nbk), np.uint8), xp.zeros(R, np.uint8)
        self.be.launch("an_outlier_blocks", R * nbk, c, y, i64(R), i64(K), f64(thr), eb, bb, rb)
        return _host(cols) != 0, rb != 0, _host(perr.sum(0)), _host(px2.sum(0)), eb, bb != 0

    def amax(self, x) -> np.float32:
        """max |x| with NaN ignored (0 for an all-NaN tensor)."""
        return self.k.absmax(as_rows(self.xp.ascontiguousarray(x)))[0]

    def sums(self, x, ya=None, yb=None, mean=0.0):
        """The an_sums columns (:data:`N` ...) over the flat float32 ``x`` with the dequantized ``ya`` / ``yb`` (as
        long as ``x``), and (max |x| NaN ignored, max finite |x|) as float32: NumPy values on the host."""
        xp = self.xp
        xf = xp.ascontiguousarray(x).reshape(-1)
        n = xf.size
        ys = [xp.ascontiguousarray(y).reshape(-1) for y in (ya, yb) if y is not None]
        nwarps = -(-max(n, 1) // (32 * SEG))
        part = xp.zeros((nwarps, NCOL))
        amax2 = xp.zeros(2, np.uint32)
        if n:
            self.be.launch("an_sums", 32 * nwarps, xf, *(ys + [xf] * (2 - len(ys))), i64(n), i32(len(ys)),
                           f64(mean), i32(SEG), part, amax2)
        tot = _host(part.sum(0))
        am = _host(amax2).view(np.float32)
        return tot, am


class Moments(_Moments):
    """:class:`fp4sim.analyze.studies._Moments` with each chunk's sums taken on the device (:meth:`Device.sums`)."""

    def __init__(self, dv: Device):
        super().__init__()
        self.dv = dv

    def add1(self, c) -> np.float32:
        """Pass 1 over chunk ``c``; returns its max |x| with NaN ignored."""
        s, am = self.dv.sums(c)
        self.n += int(s[N])
        self.s1 += s[S1]
        self.s2 += s[S2]
        self.amax = max(self.amax, float(am[1]))
        return am[0]

    def add2(self, c, ya=None, yb=None) -> np.ndarray:
        """Pass 2 over chunk ``c``; with ``ya`` / ``yb`` also their error sums [[sum (y-x)^2, sum x^2], ...]."""
        ys = [y for y in (ya, yb) if y is not None]
        s, _ = self.dv.sums(c, *ys, mean=self.mean)
        self.c2 += s[D2]
        self.c4 += s[D4]
        return np.array([[s[EA2], s[S2]], [s[EB2], s[S2]]])[:len(ys)]


def specials(dv: Device, x) -> tuple[int, int, np.float32]:
    """(NaN count, Inf count, max |x| with NaN ignored) of the tensor, from one read."""
    s, am = dv.sums(x)
    return int(s[NNAN]), int(s[NINF]), am[0]


# ------------------------------------------------------------------------------------------------ scheme metrics
def scheme_metrics(dv: Device, x, spec: SchemeSpec, role: str, seed: int = 0, chunk_elems: int = 1 << 22,
                   amax=None, blocks: list | None = None, shared: dict | None = None):
    """:func:`fp4sim.analyze.metrics.scheme_metrics` of the device tensor ``x``."""
    return _metrics.scheme_metrics(x, spec, role, seed, chunk_elems, amax, blocks, shared=shared, device=dv)


def chunk_stats(dv: Device, c, q, spec: SchemeSpec, win, amax, acc: dict, code_hist, blk_errs: list, blocks, r0: int,
           sx2: dict | None) -> int:
    """:func:`fp4sim.analyze.metrics._chunk_fused` on the device: one an_block_stats and one an_sums; returns the
    next chunk's first row."""
    from ..cpu import analysis as ka
    xp, k = dv.xp, dv.k
    R, K = c.shape
    c = xp.ascontiguousarray(c)
    y = dv.dequantize(q)
    B = spec.block if spec.block > 1 else K
    nbk = -(-K // B)
    codes = xp.ascontiguousarray(q.codes).reshape(R, -1) if spec.fp4 else k._unused(np.uint8)
    window = {None: 0, "tensor": 1, "row": 2}[win]
    counts = xp.zeros(8, np.uint64)
    max_err = xp.zeros(1, np.uint64)
    row_amax = xp.zeros(R, np.uint64) if window == 2 else k._unused(np.uint64)
    eb, xm, ym = (xp.empty((R, nbk)) for _ in range(3))
    blk_max = xp.empty((R, nbk), np.uint8) if spec.fp4 else k._unused(np.uint8)
    binades = xp.empty((R, nbk), np.uint8) if spec.fp4 else k._unused(np.uint8)
    hist = xp.zeros(16, np.uint64)
    dv.be.launch("an_block_stats", R * nbk, c, y, codes, i64(codes.shape[1] if spec.fp4 else 0), i64(R), i64(K),
                 i64(B), i64(nbk), i32(spec.fp4), i32(window), counts, max_err, row_amax, eb, xm, ym, blk_max,
                 binades, hist)
    s, _ = dv.sums(c, y)        # an Inf / NaN y of a finite x makes se2 non-finite: the mse is Inf then anyway
    tot = _host(counts).astype(np.int64)
    acc["fin"] += int(tot[ka.FIN])
    acc["lost"] += int(tot[ka.LOST])
    key = (r0, R, K)
    if sx2 is None or key not in sx2:
        v = float(s[S2])
        if sx2 is not None:
            sx2[key] = v
    acc["sx2"] += sx2[key] if sx2 is not None else v
    acc["se2"] += float(s[EA2])
    acc["max_err"] = max(acc["max_err"], float(_host(max_err).view(np.float64)[0]))
    acc["nz"] += int(tot[ka.NZ])
    acc["under"] += int(tot[ka.UNDER])
    acc["n"] += c.size
    blk_errs.append(eb.ravel())
    ok = xm > 0
    acc["bm_err"] += float(xp.sum(xp.abs(ym[ok] - xm[ok]) / xm[ok]))
    acc["bm_n"] += int(ok.sum())
    if win is not None:
        g = np.float64(amax) if win == "tensor" else row_amax.view(np.float64)[:, None]
        acc["win_out"] += int((ok & (xm * WINDOW < g)).sum())
        acc["dead"] += int(tot[ka.DEAD])
    if blocks is not None:
        blocks.append(_block_records(q, spec, _host(xm), _host(eb), r0, _host(c), _host(y)))
    acc["zero"] += int(tot[ka.ZERO])
    if spec.fp4:
        code_hist += _host(hist).astype(np.int64)
        acc["sat"] += int(tot[ka.SAT])
        acc["nblk"] += int(ok.sum())
        acc["blk_max"] += int(((blk_max != 0) & ok).sum())
        acc["binades"] += float(binades[ok].sum())
    return r0 + R


# ------------------------------------------------------------------------------------------------ studies
def outliers(dv: Device, x, k: float = 6.0, chunk_elems: int = 1 << 20, amax=None) -> dict:
    """:func:`fp4sim.analyze.studies.outliers` of the device tensor ``x``."""
    from .studies import outliers
    return outliers(x, k, chunk_elems, amax, device=dv)


def absmax_map(dv: Device, x, size: int = 64, chunk_elems: int = 1 << 20) -> np.ndarray:
    """:func:`fp4sim.analyze.studies.absmax_map` of the device tensor ``x`` (exactly: a maximum)."""
    xp = dv.xp
    x2 = as_rows(x)
    R, K = x2.shape
    pr, pc = -(-R // size), -(-K // size)
    rows, cols = -(-R // pr), -(-K // pc)
    m = xp.zeros((rows, cols), np.uint32)
    r0 = 0
    for _, c in chunks(x2, chunk_elems):
        dv.be.launch("an_absmax_map", c.shape[0] * cols, xp.ascontiguousarray(c), i64(c.shape[0]), i64(K), i64(r0),
                     i64(pr), i64(pc), i64(cols), m)
        r0 += c.shape[0]
    out = np.full((size, size), np.nan, np.float32)
    out[:rows, :cols] = _host(m).view(np.float32)
    return out


def hadamard_effect(dv: Device, x, seed: int = 0, kurt0: float | None = None, chunk_elems: int = 1 << 20,
                    amax=None):
    """:func:`fp4sim.analyze.studies.hadamard_effect` of the device tensor ``x``."""
    from .studies import hadamard_effect
    return hadamard_effect(x, seed, kurt0, chunk_elems, amax, device=dv)


def gradient_bias(dv: Device, g, seed: int = 0, sample: int = 1 << 16, chunk_elems: int = 1 << 20) -> dict:
    """:func:`fp4sim.analyze.studies.gradient_bias` of the device tensor ``g`` (one function with the CPU's)."""
    from .studies import gradient_bias
    return gradient_bias(g, seed, sample, chunk_elems, device=dv)


def wgrad_gemm(dv: Device, x, g, seeds: int = 8) -> dict:
    """:func:`fp4sim.analyze.studies.wgrad_gemm` of the device tensors ``x`` and ``g`` (one function with the
    CPU's: the products in float64 on the device in one piece)."""
    from .studies import wgrad_gemm
    return wgrad_gemm(x, g, seeds, device=dv)
