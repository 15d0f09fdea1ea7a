"""The Numba backend's kernel entry points (the interface of :mod:`fp4sim.planning`): NumPy arrays in and out."""
from __future__ import annotations

import numpy as np

from .. import ids
from ..formats import E2M1, E4M3
from ..planning import POW2_DEC, POW2_ENC, PhiloxRows, SRPlan, as_float32, kernel_params
from ..rng import philox_bytes, seed_key
from . import blocks as _b
from . import elements as _e
from .four_over_six import nvfp4_4over6
from .hadamard import rht_axis_kernel, rht_kernel
from .transpose import MovedRows, axis_last, chunk_rows, moved_rows, row_chunks

f32 = np.float32


def _sr_args(rb, r0, r1, buf):
    """The kernels' random-byte arguments (rb, ph, k0, k1, stream, mask, stride, row offset) for rows r0 .. r1 - 1
    from a byte array (R, K; (1, 1) when unused), the same as :class:`MovedRows` (gathered into ``buf``) or a
    PhiloxRows (the bytes then come from Philox inside the kernel)."""
    if isinstance(rb, PhiloxRows):
        return (np.zeros((1, 1), np.uint8), rb.layout, np.uint64(rb.k0), np.uint64(rb.k1), np.uint64(rb.stream),
                np.uint8(rb.mask), rb.stride, np.int64(r0))
    if isinstance(rb, MovedRows):
        rb = rb.rows(r0, r1, buf)
    elif rb.shape[0] > 1:
        rb = rb[r0:r1]
    return rb, 0, np.uint64(0), np.uint64(0), np.uint64(0), np.uint8(0xFF), 1, np.int64(0)


def _chunks(x2, rb):
    """(r0, r1, rows r0 .. r1 - 1 of x2, their SR arguments): the whole of x2 at once, or chunks of it where x2 or
    the random bytes are a :class:`MovedRows` (no tensor-sized copy of an input blocked along another axis)."""
    R, K = x2.shape
    moved = isinstance(x2, MovedRows) or isinstance(rb, MovedRows)
    rows = chunk_rows(K) if moved else R
    rbuf = np.empty((min(rows, R), K), np.uint8) if isinstance(rb, MovedRows) else None
    for r0, r1, xc in row_chunks(x2, rows):
        yield r0, r1, xc, _sr_args(rb, r0, r1, rbuf)


def _lut_dequant(codes, lut, fac, tile, bk, R, K):
    """(R, K) float32: lut[codes] times the factor of each row tile x bk block (:func:`lut_dequant_kernel`)."""
    out = np.empty((R, K), np.float32)
    if R and K:
        _b.lut_dequant_kernel(codes, np.ascontiguousarray(lut, np.float32), np.ascontiguousarray(fac, np.float32),
                              tile, max(bk, 1), out)
    return out


class CpuKernels:
    """Numba kernels on NumPy arrays."""

    xp = np
    philox_in_kernel = True

    @staticmethod
    def as_float32(x, order="C"):
        return as_float32(x, order=order)

    @staticmethod
    def axis_last(a, axis):
        """``a`` with ``axis`` moved last, C-contiguous: a tiled copy (NumPy's strided copy of a large transpose
        is several times slower)."""
        return axis_last(a, axis)

    @staticmethod
    def sr_bytes(sr, shape):
        if sr.kind == ids.SR_GIVEN:
            return np.asarray(sr.per).reshape(shape)
        per = philox_bytes(sr.seed, int(np.prod(shape, dtype=np.int64)), sr.stream)
        if sr.nsr < 8:
            per &= np.uint8((1 << sr.nsr) - 1)
        return per.reshape(shape)

    @staticmethod
    def encode(xs, fmt, mode, sat, nsr, sr, generic=False):
        out = np.empty(xs.shape, dtype=fmt.code_dtype)
        if not xs.size:
            return out
        k0, k1 = seed_key(sr.seed) if sr.kind == ids.SR_PHILOX else (0, 0)
        rb = np.ascontiguousarray(sr.per).reshape(-1) if sr.kind == ids.SR_GIVEN else np.zeros(1, np.uint8)
        flat = np.ascontiguousarray(xs).reshape(-1)
        _e.encode_kernel(flat, flat.view(np.uint32), out.reshape(-1), mode, rb, sr.kind, np.uint64(k0), np.uint64(k1),
                         np.uint64(sr.stream), nsr, bool(sat), *kernel_params(fmt), fmt.name == "ue8m0",
                         fmt.name == "e2m1" and not generic)
        return out

    moved_rows = staticmethod(moved_rows)

    @staticmethod
    def absmax(x2):
        a, n = _b.absmax_nan(x2.flat if isinstance(x2, MovedRows) else x2)
        return f32(a), bool(n)

    @staticmethod
    def absmax_blocks(x2):
        """:meth:`absmax` in the same pass as every 16-element block's amax, which wait inside the NVFP4 code array
        that :meth:`nvfp4` then fills, and every row's amax (as :meth:`row_absmax`): (amax, has_nan, codes, row
        amaxes), or codes and row amaxes None where the input is read a chunk of rows at a time (then the kernel
        reduces the blocks)."""
        if not isinstance(x2, np.ndarray) or not x2.flags.c_contiguous:
            return (*CpuKernels.absmax(x2), None, None)
        R, K = x2.shape
        codes = np.empty((R, -(-K // 16) * 8), np.uint8)
        part = np.zeros(R, np.uint32)
        nans = np.zeros(R, np.uint32)
        if R and K:
            _b.absmax_blocks_kernel(x2, part, nans, codes.view(np.uint32))
        return (*_b.tensor_amax(part, nans), codes, part.view(np.float32))

    @staticmethod
    def nvfp4_4over6(x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4=False):
        def encode(v, fmt):
            return CpuKernels.encode(np.ascontiguousarray(v, np.float32), fmt, 0, True, 8, SRPlan(0))
        return nvfp4_4over6(x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4, encode)

    @staticmethod
    def row_absmax(x2):
        R = x2.shape[0]
        part = np.empty(R, np.uint32)
        nans = np.empty(R, np.uint32)
        for r0, r1, xc in row_chunks(x2):
            _b.row_absmax_nan(xc, part[r0:r1], nans[r0:r1])
        return part.view(np.float32)

    @staticmethod
    def nvfp4(x2, rb, use_rb, mode, nsr, flavor, tile, c0, c1, dq, fake, codes=None):
        R, K = x2.shape
        nbk = -(-K // 16)
        pre = codes is not None                   # the block amaxes wait in codes (absmax_blocks)
        codes = np.empty((R, nbk * 8), np.uint8) if codes is None else codes
        scales = np.empty((-(-R // tile), nbk), np.uint8)
        fv = np.empty((R, K) if fake else (1, 1), np.float32)
        c0, c1 = np.ascontiguousarray(c0, np.float32), np.ascontiguousarray(c1, np.float32)
        dq = np.ascontiguousarray(dq, np.float32).reshape(-1, 2)
        for r0, r1, xc, sra in _chunks(x2, rb):   # r0 is a multiple of 16 (a tile, a 16-row Philox group)
            g0, g1 = r0 // tile, -(-r1 // tile)
            per = slice(g0, g1) if c0.shape[0] > 1 else slice(None)      # row-scaled: one set of constants per row
            _b.nvfp4_kernel(xc, *sra, mode, nsr, flavor, tile, c0[per], c1[per], dq[per], E4M3.values,
                            codes[r0:r1], scales[g0:g1], fv[r0:r1] if fake else fv, fake, pre)
        return codes, scales, fv

    @staticmethod
    def mx(x2, rb, use_rb, mode, nsr, scale_mode, fmt, fake):
        R, K = x2.shape
        nbk = -(-K // 32)
        is_fp4 = fmt is E2M1
        codes = np.empty((R, nbk * (16 if is_fp4 else 32)), np.uint8)
        scales = np.empty((R, nbk), np.uint8)
        fv = np.empty((R, K) if fake else (1, 1), np.float32)
        part = np.zeros(R, np.uint32)                # each row's amax and NaN flag, from the same read
        nans = np.zeros(R, np.uint32)
        for r0, r1, xc, sra in _chunks(x2, rb):
            _b.mx_kernel(xc, *sra, mode, nsr, scale_mode, fmt.emax, f32(1.0) / f32(fmt.max), POW2_ENC, POW2_DEC,
                         *kernel_params(fmt), is_fp4, fmt.values, codes[r0:r1], scales[r0:r1],
                         fv[r0:r1] if fake else fv, fake, part[r0:r1], nans[r0:r1])
        return codes, scales, fv, _b.tensor_amax(part, nans)

    @staticmethod
    def fp8(x2, rb, use_rb, mode, nsr, fmt, tile, scale, fake):
        R, K = x2.shape
        codes = np.empty((R, K), np.uint8)
        fv = np.empty((R, K) if fake else (1, 1), np.float32)
        if scale is not None:
            _b.fp8_kernel(x2, rb, use_rb, mode, nsr, 1, K, scale, False, *kernel_params(fmt), fmt.values, codes,
                          np.empty((1, 1), np.float32), fv, fake)
            return codes, np.array([f32(1.0) / scale], np.float32), fv
        scales = np.empty((-(-R // tile), -(-K // 128)), np.float32)
        _b.fp8_kernel(x2, rb, use_rb, mode, nsr, tile, 128, f32(1.0), True, *kernel_params(fmt), fmt.values, codes,
                      scales, fv, fake)
        return codes, scales, fv

    @staticmethod
    def dequantize(q, p):
        sch = q.scheme
        R, K = p.R, p.K
        codes = np.ascontiguousarray(q.codes.reshape(R, -1))
        if p.kind < 0:  # bf16
            return (codes.astype(np.uint32) << 16).view(np.float32)
        if p.kind in (ids.DQ_NVFP4, ids.DQ_MX):
            if p.kind == ids.DQ_NVFP4:
                s = E4M3.values[q.scales_per_row()]
                dq0, dq1 = p.dq[:, 0:1], p.dq[:, 1:2]          # one row, or one per tensor row
                with np.errstate(invalid="ignore", over="ignore"):
                    fac = (s * dq0) * dq1 if p.flavor <= ids.PAPER else s * dq0
            else:
                fac = POW2_DEC[q.linear_scales()]
            if sch.elem is E2M1:  # one fused pass
                y2 = np.empty((R, K), np.float32)
                _b.fp4_dequant_kernel(codes, np.ascontiguousarray(fac, np.float32), p.bk, y2)
                return y2
            return _lut_dequant(codes, sch.elem.values, fac, 1, p.bk, R, K)
        if p.kind == ids.DQ_FP8_TENSOR:
            s = np.asarray(q.scales, np.float32).reshape(-1)[0:1].reshape(1, 1)
            return _lut_dequant(codes, sch.elem.values, s, max(R, 1), K, R, K)
        s = np.asarray(q.scales).reshape(-(-R // p.tile), -1)
        if s.dtype != np.float32:       # blockwise scales of another dtype: NumPy's promotion, as before
            s = np.repeat(np.repeat(s, p.tile, axis=0)[:R], 128, axis=1)[:, :K]
            return sch.elem.values[codes] * s
        return _lut_dequant(codes, sch.elem.values, s, p.tile, 128, R, K)

    @staticmethod
    def rht(x2, d, sh, scale, to_bf16):
        y = np.empty(x2.shape, np.uint32)
        if x2.size:
            x2 = np.ascontiguousarray(x2, np.float32)
            rht_kernel(x2.view(np.uint32), np.ascontiguousarray(sh[:, 0]), sh, scale, to_bf16, y)
        return y.view(np.float32)

    @staticmethod
    def rht_axis(a3, d, sh, scale, to_bf16, axis_last=False):
        """The RHT along axis 1 of a C-contiguous (outer, K, inner) float32 array, in that layout, or as
        (outer, inner, K) with ``axis_last``."""
        O, K, I = a3.shape
        y = np.empty((O, I, K) if axis_last else (O, K, I), np.uint32)
        if a3.size:
            rht_axis_kernel(a3.view(np.uint32), np.ascontiguousarray(sh[:, 0]), sh, scale, to_bf16, axis_last, y)
        return y.view(np.float32)


CPU = CpuKernels()
