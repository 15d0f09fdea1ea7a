"""Studies beyond plain error: outliers, the Hadamard transform, and gradient-rounding bias."""
from __future__ import annotations


import numpy as np

from .. import fake_quantize, rht
from ..cpu import analysis as ka
from .lazy import absmax, is_lazy
from .metrics import as_rows, chunks

RHT_DIMS = (2, 4, 16, 32, 128)
RHT_SIGNS = ("te", "random", "none")
RHT_SCHEMES = ("nvfp4", "mxfp4")


def kurtosis(x: np.ndarray, device=None) -> float:
    """Pearson kurtosis E[(x-mu)^4]/sigma^4 (3 for a Gaussian), over finite values (``device``: a
    :class:`fp4sim.analyze.device.Device` holding ``x``)."""
    m = _moments(device)
    for _, c in chunks(as_rows(x), 1 << 20):
        m.add1(c)
    for _, c in chunks(as_rows(x), 1 << 20):
        m.add2(c)
    return m.kurtosis()


class _Moments:
    """Two-pass moments over row chunks: pass 1 count/sum/sum of squares/max|x| over finite values, pass 2
    the centred 2nd and 4th powers (the kurtosis). Finite-or-not float32 chunks take the one-read kernels of
    :mod:`fp4sim.cpu.analysis` (compensated sums); others, and every chunk with ``_FAST`` off, the masked NumPy
    reference path."""

    def __init__(self):
        self.n = 0
        self.s1 = self.s2 = self.c2 = self.c4 = 0.0
        self.amax = 0.0

    def add1(self, c):
        """Pass 1 over chunk ``c``; returns the chunk's max |x| with NaN ignored (float32) on the kernel path,
        else None."""
        f = _flat(c)
        if f is not None:
            out, ab = ka.moments1(f)
            self.n += int(out[0])
            self.s1 += out[1]
            self.s2 += out[2]
            self.amax = max(self.amax, out[3])
            return np.uint32(ab).view(np.float32)
        v = c[np.isfinite(c)].astype(np.float64)
        self.n += v.size
        self.s1 += float(v.sum())
        self.s2 += float(np.dot(v, v))
        if v.size:
            self.amax = max(self.amax, abs(float(v.max())), abs(float(v.min())))      # max |v|, no |v| copy
        return None

    @property
    def mean(self):
        return self.s1 / self.n if self.n else 0.0

    @property
    def sd(self):
        return float(np.sqrt(max(self.s2 / self.n - self.mean ** 2, 0.0))) if self.n else 0.0

    def add2(self, c, ya=None, yb=None) -> np.ndarray | None:
        """Pass 2 over chunk ``c``; with the dequantized chunks ``ya`` / ``yb`` also returns their error sums
        [[sum (ya-x)^2, sum x^2], [sum (yb-x)^2, sum x^2]] over the finite x, from the same read."""
        ys = [y for y in (ya, yb) if y is not None]
        f = _flat(c, *ys)
        if f is not None:
            fy = [_flat(y) for y in ys] + [f] * (2 - len(ys))
            out = ka.err_moments(f, fy[0], fy[1], len(ys), self.mean)
            self.c2 += out[3]
            self.c4 += out[4]
            return np.array([[out[1], out[0]], [out[2], out[0]]])[:len(ys)] if ys else None
        d = c[np.isfinite(c)].astype(np.float64) - self.mean
        d2 = d * d
        self.c2 += float(d2.sum())
        self.c4 += float(np.dot(d2, d2))
        return np.array([_err_sums(c, y) for y in ys]) if ys else None

    def add_sums(self, out) -> np.ndarray:
        """:meth:`add2` from a chunk's :func:`fp4sim.cpu.analysis.err_moments` sums ``out`` (both error terms),
        taken against :attr:`mean`."""
        self.c2 += out[3]
        self.c4 += out[4]
        return np.array([[out[1], out[0]], [out[2], out[0]]])

    def kurtosis(self):
        if self.n < 2 or self.c2 <= 0:
            return float("nan")
        m2 = self.c2 / self.n
        return float(self.c4 / self.n / m2 ** 2)


_FAST = True       # the one-read kernels; False: the masked NumPy path (the tests compare them)


def _flat(c, *like):
    """The float32 chunk ``c`` as a flat contiguous array for the kernels (and each of ``like`` of its shape and
    dtype), or None when the masked NumPy path must take it (``_FAST`` off, another dtype or shape)."""
    if not (_FAST and c.dtype == np.float32 and all(y.dtype == np.float32 and y.shape == c.shape for y in like)):
        return None
    return np.ascontiguousarray(c).reshape(-1)


def _err_sums(c, y):
    """(sum of squared error, sum of x^2) over the finite elements of a chunk (the masked reference;
    the kernel path takes them from :func:`fp4sim.cpu.analysis.err_moments`)."""
    fin = np.isfinite(c)
    x = c[fin].astype(np.float64)
    e = y[fin].astype(np.float64) - x
    return float(np.dot(e, e)), float(np.dot(x, x))


def _err_sums_pair(c, ya, yb):
    """:func:`_err_sums` of one chunk under two quantizations (NVFP4's and MXFP4's), from one read."""
    f = _flat(c, ya, yb)
    if f is not None:
        out = ka.err_moments(f, _flat(ya), _flat(yb), 2, 0.0)
        return np.array([[out[1], out[0]], [out[2], out[0]]])
    return np.array([_err_sums(c, ya), _err_sums(c, yb)])


def _fq_consts():
    """The kernel constants of the study's two schemes (``RHT_SCHEMES``, their defaults: NVFP4 1x16 blocks with
    a tensor scale, MXFP4), or None where a default is one :func:`fp4sim.cpu.analysis.fq_err_moments` does not
    cover (then the study quantizes with :func:`fp4sim.fake_quantize`)."""
    global _FQ
    if _FQ is None:
        from ..formats import E2M1, E4M3
        from ..ids import FLAVOR_IDS, SCALE_MODE_IDS
        from ..planning import POW2_DEC, POW2_ENC
        from ..schemes import get_scheme
        nv, mx = (get_scheme(s) for s in RHT_SCHEMES)
        ok = (nv.block == (1, 16) and FLAVOR_IDS[nv.flavor] < 2 and nv.per_tensor_scale and not nv.row_scaled
              and not nv.four_over_six and nv.elem is E2M1 and mx.block == (1, 32) and mx.elem is E2M1)
        _FQ = (nv.flavor, FLAVOR_IDS[nv.flavor], E4M3.values, SCALE_MODE_IDS[mx.scale_mode], E2M1.emax, E2M1.mbits,
               np.float32(1.0) / np.float32(E2M1.max), POW2_ENC, POW2_DEC) if ok else False
    return _FQ or None


_FQ = None


def _fq_sums(c, amax, mean=0.0):
    """:func:`fp4sim.cpu.analysis.err_moments` of chunk ``c`` under NVFP4 (tensor amax ``amax``) and MXFP4 fake
    quantization, the dequantized chunks never made (:func:`fp4sim.cpu.analysis.fq_err_moments`), or None where
    that kernel does not apply (``_FAST`` off, not float32, rows not a multiple of 32 long)."""
    k = _fq_consts()
    if k is None or not (_FAST and c.dtype == np.float32 and c.ndim == 2 and c.shape[1] % 32 == 0):
        return None
    from ..planning import nvfp4_constants_rows
    flavor, fid, e4m3, smode, emax, mbits, rcp, enc, dec = k
    c0, c1, dq = nvfp4_constants_rows(flavor, np.float32(amax))
    return ka.fq_err_moments(np.ascontiguousarray(c).reshape(-1), fid, c0[0], c1[0], np.ascontiguousarray(dq[0]),
                             e4m3, smode, emax, mbits, rcp, enc, dec, float(mean))


def _moments(device):
    """A two-pass moments accumulator on the CPU, or on ``device`` (:class:`fp4sim.analyze.device.Moments`)."""
    return _Moments() if device is None else device.moments()


def _ratio(a, b):
    return a / b if b > 0 else float("nan")


def outliers(x: np.ndarray, k: float = 6.0, chunk_elems: int = 1 << 20, amax=None, device=None) -> dict:
    """Kurtosis, max/RMS, outlier rows/columns (any |x| > k*sigma), NVFP4 error with and without the outlier
    columns, and the share of NVFP4 error carried by 1x16 blocks that hold an outlier. Computed in row chunks
    (NVFP4 with the whole tensor's amax), so memory stays a small multiple of one chunk. ``device``: a
    :class:`fp4sim.analyze.device.Device` holding ``x``."""
    x2 = as_rows(x)
    R, K = x2.shape
    if amax is None:
        amax = _amax(x2) if device is None else device.amax(x2)
    amax = np.float32(amax)
    m = _moments(device)
    for _, c in chunks(x2, chunk_elems):
        m.add1(c)
    sd = m.sd
    Kp = -(-K // 16) * 16
    cols = np.zeros(K, bool)
    col_err, col_x2 = np.zeros(K), np.zeros(K)
    n_rows = 0
    eb_all = eb_out = 0.0
    n_out_blocks = n_blocks = 0
    with np.errstate(over="ignore"):      # |c| > k * sd compares in float32 (NumPy 2's weak Python float)
        thr = np.float32(k * sd) if sd > 0 else np.float32(np.inf)
    for _, c in chunks(x2, chunk_elems):
        m.add2(c)
        if device is not None:
            cb, rb, ce, cx, eb, bb = device.outlier_sums(c, device.fake(c, "nvfp4", global_amax=amax), thr)
            cols |= cb
            n_rows += int(rb.sum())
            col_err += ce
            col_x2 += cx
            eb_all += float(eb.sum())
            eb_out += float(eb[bb].sum())
            n_out_blocks += int(bb.sum())
            n_blocks += bb.size
            continue
        y = fake_quantize(c, "nvfp4", global_amax=amax)
        if _FAST and c.dtype == np.float32:
            c = np.ascontiguousarray(c)
            nbk = -(-K // 16)
            ce, cx, cb = np.empty(K), np.empty(K), np.empty(K, bool)
            rb, eb, bb = np.empty(c.shape[0], bool), np.empty((c.shape[0], nbk)), np.empty((c.shape[0], nbk), bool)
            ka.outlier_sums(c, np.ascontiguousarray(y, np.float32), thr, ce, cx, cb, rb, eb, bb)
            cols |= cb
            n_rows += int(rb.sum())
            col_err += ce
            col_x2 += cx
        else:
            with np.errstate(invalid="ignore"):
                big = np.abs(c) > k * sd if sd > 0 else np.zeros(c.shape, bool)
            cols |= big.any(0)
            n_rows += int(big.any(1).sum())
            fin = np.isfinite(c)
            err = np.where(fin, (y.astype(np.float64) - c) ** 2, 0.0)
            col_err += err.sum(0)
            col_x2 += np.where(fin, c.astype(np.float64) ** 2, 0.0).sum(0)
            eb = np.pad(err, ((0, 0), (0, Kp - K))).reshape(c.shape[0], -1, 16).sum(-1)
            bb = np.pad(big, ((0, 0), (0, Kp - K))).reshape(c.shape[0], -1, 16).any(-1)
        eb_all += float(eb.sum())
        eb_out += float(eb[bb].sum())
        n_out_blocks += int(bb.sum())
        n_blocks += bb.size
    keep = ~cols
    rms = float(np.sqrt(m.s2 / m.n)) if m.n else 0.0
    return dict(kurtosis=m.kurtosis(), max_over_rms=m.amax / rms if rms > 0 else np.nan,
                n_outlier_rows=n_rows, n_outlier_cols=int(cols.sum()),
                nvfp4_rel_mse=_ratio(col_err.sum(), col_x2.sum()),
                nvfp4_rel_mse_without_outlier_cols=_ratio(col_err[keep].sum(), col_x2[keep].sum())
                if keep.any() else np.nan,
                outlier_block_err_share=eb_out / eb_all if eb_all > 0 else 0.0,
                outlier_block_frac=n_out_blocks / max(n_blocks, 1))


def _amax(x2):
    return absmax(x2)


def absmax_map(x: np.ndarray, size: int = 64, chunk_elems: int = 1 << 20) -> np.ndarray:
    """max |x| pooled onto a size x size grid of the (rows, K) view (NaN-free; for outlier maps)."""
    x2 = as_rows(x)
    R, K = x2.shape
    pr, pc = -(-R // size), -(-K // size)
    rows, cols = -(-R // pr), -(-K // pc)
    out = np.full((size, size), np.nan, np.float32)
    m = np.zeros((rows, cols), np.float32)
    starts = np.arange(0, K, pc)
    r0 = 0
    for _, c in chunks(x2, chunk_elems):
        a = np.abs(np.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0))
        per_row = np.maximum.reduceat(a, starts, axis=1)
        np.maximum.at(m, (np.arange(r0, r0 + c.shape[0]) // pr), per_row)
        r0 += c.shape[0]
    out[:rows, :cols] = m
    return out


def hadamard_effect(x: np.ndarray, seed: int = 0, kurt0: float | None = None, chunk_elems: int = 1 << 20,
                    amax=None, device=None):
    """rel-MSE of NVFP4 and MXFP4 on rht(x) and its kurtosis, for each d and sign mode (NaN where the last axis
    is not a multiple of d, or 'te' with d != 16). Index [0] of the d axis is no transform (``kurt0``: the
    kurtosis of x when the caller has it already). The transform runs along the last axis, row chunk by row
    chunk (NVFP4 with the transformed tensor's own amax, found in a first pass). ``device``: a
    :class:`fp4sim.analyze.device.Device` holding ``x``."""
    x2 = as_rows(x)
    K = x2.shape[1]
    dims = (0,) + RHT_DIMS
    err = np.full((len(dims), len(RHT_SIGNS), len(RHT_SCHEMES)), np.nan)
    kur = np.full((len(dims), len(RHT_SIGNS)), np.nan)
    amax_of = _amax if device is None else device.amax
    amax0 = amax_of(x2) if amax is None else np.float32(amax)
    e = np.zeros((len(RHT_SCHEMES), 2))
    for _, c in chunks(x2, chunk_elems):  # d = 0: no transform, any signs
        e += _pair_err_sums(c, amax0, device)
    err[0, :] = [_ratio(*v) for v in e]
    kur[0, :] = kurtosis(x2, device) if kurt0 is None else kurt0
    for di, d in enumerate(dims[1:], 1):
        if K % d:
            continue
        for si, sg in enumerate(RHT_SIGNS):
            if sg == "te" and d != 16:
                continue
            signs = {"te": "te", "random": seed + 1, "none": None}[sg]
            m = _moments(device)
            a_r = np.float32(0)
            # the transformed chunks, kept for the second pass (one float32 copy of x), or, for a tensor read
            # from its file chunk by chunk, transformed again
            xrs = []

            def transformed():
                for _, c in chunks(x2, chunk_elems):
                    yield rht(c, d, signs, out="fp32") if device is None else device.rht(c, d, signs)
            for xr in transformed():
                a = m.add1(xr)
                a_r = max(a_r, amax_of(xr) if a is None else a)
                if not is_lazy(x2):
                    xrs.append(xr)
            e = np.zeros((len(RHT_SCHEMES), 2))
            for xr in transformed() if is_lazy(x2) else _drain(xrs):
                e += _pass2_err_sums(m, xr, a_r, device)
            kur[di, si] = m.kurtosis()
            err[di, si, :] = [_ratio(*v) for v in e]
    return dims, err, kur


def _drain(items: list):
    """The items of a list, each dropped from it as it is given."""
    while items:
        yield items.pop(0)


def _pair_err_sums(c, amax, device=None) -> np.ndarray:
    """[[sum (y - x)^2, sum x^2]] of chunk ``c`` under NVFP4 (tensor amax ``amax``) and MXFP4 (the finite x)."""
    if device is not None:
        return _moments(device).add2(c, device.fake(c, "nvfp4", global_amax=amax), device.fake(c, "mxfp4"))
    out = _fq_sums(c, amax)
    if out is None:
        return _err_sums_pair(c, fake_quantize(c, "nvfp4", global_amax=amax), fake_quantize(c, "mxfp4"))
    return np.array([[out[1], out[0]], [out[2], out[0]]])


def _pass2_err_sums(m, xr, amax, device=None) -> np.ndarray:
    """The second moments pass of ``m`` over the transformed chunk ``xr`` with its NVFP4 / MXFP4 error sums."""
    if device is None:
        out = _fq_sums(xr, amax, m.mean)
        if out is not None:
            return m.add_sums(out)
    fq = fake_quantize if device is None else device.fake
    return m.add2(xr, fq(xr, "nvfp4", global_amax=amax), fq(xr, "mxfp4"))


class _Host:
    """The array operations :func:`gradient_bias` and :func:`wgrad_gemm` run on, here NumPy and the CPU kernels; a
    :class:`fp4sim.analyze.device.Device` has the same names on a GPU (``xp``, ``fake``, ``rht``, ``f64``, ``amax``,
    and ``host``: an array to NumPy)."""
    xp = np
    fake = staticmethod(fake_quantize)
    amax = staticmethod(lambda x: _amax(x))

    @staticmethod
    def rht(x, d, signs, axis=-1, out="bf16"):
        return rht(x, d, signs, axis=axis, out=out)

    @staticmethod
    def f64(a):
        return a.astype(np.float64)

    @staticmethod
    def host(a):
        return a


def _on(device):
    """The operations of the CPU (:class:`_Host`) or of ``device``."""
    return _Host if device is None else device


def gradient_bias(g: np.ndarray, seed: int = 0, sample: int = 1 << 16, chunk_elems: int = 1 << 20,
                  device=None) -> dict:
    """NVFP4 rounding bias of a gradient. On the whole tensor (row chunks; SR bits from Philox with the chunk
    index as the stream): the mean signed error relative to mean |g| under RNE and SR. On a sample (the first
    rows, up to ``sample`` elements; the tensor amax still sets the scale): the error along sign(g) (negative =
    toward zero) under RNE, SR with one seed, and SR's exact expectation (all 256 random bytes enumerated, the
    same byte for every element of a pass). ``device``: a :class:`fp4sim.analyze.device.Device` holding ``g``
    (the whole-tensor sums taken there by its sums kernel, the 256 passes there too, their mean in float64; the
    sample's sums on the host)."""
    ops = _on(device)
    xp = ops.xp
    g2 = as_rows(g)
    amax = ops.amax(g2)
    sums, rel = _bias_sums, _bias_rel
    rne = np.zeros(3)
    sr = np.zeros(3)
    for i, c in chunks(g2, chunk_elems):
        y_rne = ops.fake(c, "nvfp4", global_amax=amax)
        y_sr = ops.fake(c, "nvfp4", rounding="sr", seed=seed, stream=i, global_amax=amax)
        if device is None:
            rne += sums(y_rne, c)
            sr += sums(y_sr, c)
        else:                               # both passes' sums in one launch of the device's sums kernel
            a, b = device.bias_sums(c, y_rne, y_sr)
            rne += a
            sr += b
    rows = max(1, min(g2.shape[0], sample // max(g2.shape[1], 1)))
    s = xp.ascontiguousarray(g2[:rows])
    acc = xp.zeros(s.shape)
    for r in range(256):
        acc += ops.f64(ops.fake(s, "nvfp4", rounding="sr", rbits=xp.full(s.shape, r, np.uint8), global_amax=amax))
    exp = ops.host(acc / 256)
    sh = ops.host(s)
    y_rne = ops.host(ops.fake(s, "nvfp4", global_amax=amax))
    y_sr = ops.host(ops.fake(s, "nvfp4", rounding="sr", seed=seed, global_amax=amax))
    return dict(grad_bias_rne=rel(rne), grad_bias_sr=rel(sr), grad_bias_sr_expected=rel(sums(exp, sh)),
                sample_elements=int(sh.size), grad_shrink_rne=rel(sums(y_rne, sh, True)),
                grad_shrink_sr=rel(sums(y_sr, sh, True)), grad_shrink_sr_expected=rel(sums(exp, sh, True)))


def _bias_sums(y, x, along_sign=False):
    """[sum of the error y - x (times sign(x) when ``along_sign``), sum |x|, count] over the finite x (float64)."""
    fin = np.isfinite(x)
    e = y[fin].astype(np.float64) - x[fin]
    if along_sign:
        e = e * np.sign(x[fin])
    return np.array([e.sum(), np.abs(x[fin]).astype(np.float64).sum(), fin.sum()])


def _bias_rel(t):
    """The mean error relative to the mean |x| of :func:`_bias_sums`'s totals ``t``."""
    return float((t[0] / t[2]) / ((t[1] / t[2]) or 1.0)) if t[2] else float("nan")


def _rne_along_tokens(X, use_rht, cols, ops=_Host):
    """fake_quantize(rht(X) along tokens, NVFP4, blocks along tokens) built ``cols`` columns at a time (the
    transform and the blocks never mix columns; the tensor amax of the transformed X comes from a first pass)."""
    xp = ops.xp
    f = (lambda a: ops.rht(a, 16, "te", axis=0, out="bf16")) if use_rht else (lambda a: a)  # noqa: E731
    amax = np.float32(0)
    for c0 in range(0, X.shape[1], cols):
        amax = max(amax, ops.amax(xp.ascontiguousarray(f(X[:, c0:c0 + cols]))))
    out = xp.empty(X.shape, np.float32)
    for c0 in range(0, X.shape[1], cols):
        out[:, c0:c0 + cols] = ops.fake(xp.ascontiguousarray(f(X[:, c0:c0 + cols])), "nvfp4", axis=0,
                                        global_amax=amax)
    return out


def wgrad_gemm(x: np.ndarray, g: np.ndarray, seeds: int = 8, budget_bytes: int | None = None,
               device=None) -> dict:
    """The weight-gradient GEMM W = G^T X of a linear layer with both operands in NVFP4 as the paper's recipe:
    16-point RHT ('te' signs) along the token dimension, blocks along tokens, SR for the gradient (RNE for
    the activation), against the exact float64 product; also with RNE for both. Bias = mean(W_q - W)/mean|W|
    (SR averaged over seeds), relative error = ||W_q - W|| / ||W||, relative variance of SR across seeds.

    W is never held whole: it is computed in column tiles (and the products in token chunks) whose float64
    buffers fit in half of ``budget_bytes`` (default: the larger operand's size), and only running sums are
    kept; the quantized operands add about two operand sizes, so the study's extra memory stays near 3x the
    larger operand. ``device``: a :class:`fp4sim.analyze.device.Device` holding ``x`` and ``g``: the same
    operands made by its kernels and the products in float64 there, in one piece (no budget: device memory
    about 8 float64 copies of the weight gradient; the SR operands made per seed, not kept)."""
    ops = _on(device)
    xp = ops.xp
    X, G = as_rows(x), as_rows(g)
    if X.shape[0] != G.shape[0]:
        raise ValueError(f"activation has {X.shape[0]} tokens and gradient {G.shape[0]}")
    T, Nx, Ng = X.shape[0], X.shape[1], G.shape[1]
    use_rht = T % 16 == 0
    if device is None:
        budget = max(X.nbytes, G.nbytes) if budget_bytes is None else budget_bytes
        cols = max(16, budget // max(1, 64 * T))                       # transients ~1/4 of the budget
        bx = int(max(1, min(Nx, budget // 2 // max(1, Ng * 8 * 6))))   # six float64 tiles: W, d, s1, s2, ws, mean
        bt = int(max(16, min(T, budget // max(1, 8 * (Ng + bx) * 4))))
        cached = seeds * G.nbytes <= budget
    else:
        cols, bx, bt, cached = Nx, Nx, T, False
    Xq = _rne_along_tokens(X, use_rht, cols, ops)
    # G transposed once (tokens last): quantized along tokens without a per-call transposed copy; the SR bits
    # then follow the flat index of Gᵀ
    GT = xp.ascontiguousarray(G.T)
    GrT = ops.rht(GT, 16, "te", out="bf16") if use_rht else GT
    Gq_rne = ops.fake(GrT, "nvfp4").T

    def gq(s):
        return ops.fake(GrT, "nvfp4", rounding="sr", seed=s).T

    gqs = [gq(s) for s in range(seeds)] if cached else None

    def prod(A, B):  # A^T B in float64, summed over token chunks
        acc = xp.zeros((A.shape[1], B.shape[1]))
        for t0 in range(0, T, bt):
            acc += ops.f64(A[t0:t0 + bt]).T @ ops.f64(B[t0:t0 + bt])
        return acc

    tot = dict(abs_w=0.0, w2=0.0, d_rne=0.0, d2_rne=0.0, d_sr=0.0, d2_sr=0.0, d2_one=0.0, var=0.0)
    for c0 in range(0, Nx, bx):
        Xc, Xqc = X[:, c0:c0 + bx], Xq[:, c0:c0 + bx]
        W = prod(G, Xc)
        tot["abs_w"] += float(xp.abs(W).sum())
        tot["w2"] += float((W * W).sum())
        d = prod(Gq_rne, Xqc) - W
        tot["d_rne"] += float(d.sum())
        tot["d2_rne"] += float((d * d).sum())
        s1 = xp.zeros_like(W)
        s2 = xp.zeros_like(W)
        for s in range(seeds):
            ws = prod(gqs[s] if cached else gq(s), Xqc)
            if s == 0:
                tot["d2_one"] += float(((ws - W) ** 2).sum())
            s1 += ws
            s2 += ws * ws
        mean = s1 / seeds
        tot["d_sr"] += float((mean - W).sum())
        tot["d2_sr"] += float(((mean - W) ** 2).sum())
        tot["var"] += float(xp.maximum(s2 / seeds - mean * mean, 0).sum())
    n = Ng * Nx
    mW, nW = tot["abs_w"] / n, np.sqrt(tot["w2"])
    return dict(tokens=T, rht=use_rht, wgrad_bias_rne=tot["d_rne"] / n / mW, wgrad_bias_sr=tot["d_sr"] / n / mW,
                wgrad_rel_err_rne=float(np.sqrt(tot["d2_rne"]) / nW),
                wgrad_rel_err_sr_one_seed=float(np.sqrt(tot["d2_one"]) / nW),
                wgrad_rel_err_sr_mean=float(np.sqrt(tot["d2_sr"]) / nW),
                wgrad_rel_var_sr=float(tot["var"] / n / (tot["w2"] / n)))
