"""The CUDA backend's kernel entry points (the interface of :mod:`fp4sim.planning`), and the public entry
points run on a given CUDA backend (``encode(be, x, ...)`` etc., as the tests call them).

``be.xp`` is CuPy on a GPU; the tests pass a host-compiled build of the same kernels with NumPy arrays.
Results stay on the device. A quantize of NVFP4 (with its tensor amax), MX or FP8 reads nothing back: the tensor
amax, the per-tensor constants made from it and the NaN / Inf flags stay on the device, and the warnings about
the input are read later (:meth:`GpuKernels.defer_warnings`). Every device-to-host read goes through
:meth:`GpuKernels.to_host` (4over6's choices, row-scaled NVFP4's row amaxes, an explicit host value).
"""
from __future__ import annotations

import atexit
import math
import warnings
import weakref

import ml_dtypes
import numpy as np

from .. import ids, planning
from ..formats import E2M1, E4M3
from ..four_over_six import second_level
from ..planning import POW2_DEC, POW2_ENC, kernel_params
from ..rng import seed_key

i64, i32, u32, u64, f32, f64 = np.int64, np.int32, np.uint32, np.uint64, np.float32, np.float64
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
# inputs the block kernels read as they are (bfloat16: NumPy arrays of ml_dtypes' type, on the host build)
IN_KINDS = {np.dtype(np.float32): ids.IN_F32, np.dtype(np.float16): ids.IN_F16,
            np.dtype(ml_dtypes.bfloat16): ids.IN_BF16}
NULL = u64(0)                    # a null pointer argument
R6_D, INV2688_D = float(planning.R6), float(planning.INV2688)


def backend():
    from .backend import default_backend
    return default_backend()


class StridedRows:
    """The (R, K) rows of a C-contiguous tensor blocked along an axis that is not the last, as the NVFP4 and MX
    kernels read them in place (no moved copy): ``a`` the tensor, ``S`` the axis's stride in elements (rows are
    the other axes flattened in C order). ``contiguous(xp)`` makes the moved copy for the kernels that need it."""

    def __init__(self, a, axis: int):
        self.a, self.axis = a, axis
        self.K = a.shape[axis]
        self.shape = (a.size // self.K, self.K)
        self.S = math.prod(a.shape[axis + 1:])
        self.dtype, self.size = a.dtype, a.size

    def contiguous(self, xp):
        return xp.ascontiguousarray(xp.moveaxis(self.a, self.axis, -1)).reshape(self.shape)


def _base(x2):
    """(array, S) of the block kernels' input: an (R, K) array (S = 1), or a StridedRows read in place."""
    return (x2.a, x2.S) if isinstance(x2, StridedRows) else (x2, 1)


class GpuKernels:
    """The kernels of ``kernels.cu`` launched through a backend (CuPy, or the host build)."""

    philox_in_kernel = True      # nvfp4 / mx generate seeded SR bits themselves (planning.PhiloxRows)
    amax_on_device = True        # planning.run_quantize's no-round-trip path (absmax_device, defer_warnings)

    def __init__(self, be):
        self.be = be
        self.xp = be.xp
        self._tables = {}
        self._pending = []       # deferred warnings: (scheme, amax override, device flags, host copy, event)
        _LIVE.add(self)

    def as_float32(self, x, name="x", order="C"):
        if x.dtype == np.dtype(ml_dtypes.bfloat16) and self.xp is np:
            return np.ascontiguousarray(x, dtype=np.float32) if order == "C" else np.asarray(x, np.float32)
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {x.dtype}; on the GPU fp4sim takes float16, float32 or float64 CuPy "
                            f"arrays (bfloat16 tensors: pass them through fp4sim.torch or .float() first)")
        return self.xp.ascontiguousarray(x, dtype=np.float32) if order == "C" else self.xp.asarray(x, np.float32)

    def as_block_input(self, x, name="x"):
        """``x`` as the block kernels read it (any layout): float32, float16 and bfloat16 as they are (no widening
        copy), float64 rounded to float32."""
        if x.dtype in IN_KINDS and (x.dtype != np.dtype(ml_dtypes.bfloat16) or self.xp is np):
            return x
        return self.as_float32(x, name, order="K")

    def f32_rows(self, x2):
        """float32 rows for the kernels that read float32 only (4over6, the element and BF16 kernels): a 16-bit
        input widens exactly (its values are float32 normals, so CuPy's FTZ cast cannot change them)."""
        if isinstance(x2, StridedRows):
            x2 = x2.contiguous(self.xp)
        return x2 if x2.dtype == np.float32 else self.xp.ascontiguousarray(x2, dtype=np.float32)

    def to_host(self, a):
        """A device array's values on the host (a NumPy array): the one place this backend reads the device, so a
        test can count the synchronising reads."""
        return np.asarray(a.get() if hasattr(a, "get") else a)

    # -------------------------------------------------------------------------------- deferred warnings
    def defer_warnings(self, sch, acc=None, flags=None, amax_g=None):
        """Queue the warnings of :func:`fp4sim.planning.warn_specials` for one call, from device values it does not
        wait for: ``acc`` (absmax_device's amax bits and NaN flag) or ``flags`` (mx's NaN / Inf bits); ``amax_g``
        the host's second-level amax where it is not the tensor's. On a GPU the values are copied to pinned host
        memory behind the call's kernels; earlier calls' warnings are emitted now when their copies have landed
        (never waiting), the rest by :func:`flush_warnings` (or at exit)."""
        self.poll_warnings()
        src = acc if acc is not None else flags
        if hasattr(src, "get"):
            import cupy
            import cupyx
            host = cupyx.empty_pinned(src.shape, src.dtype)
            src.get(out=host, blocking=False)
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record()
        else:
            host, event = src.copy(), None
        self._pending.append((sch, amax_g, acc is not None, host, event))

    def poll_warnings(self, wait=False):
        """Emit the queued warnings whose values have reached the host (all of them with ``wait``)."""
        keep = []
        for item in self._pending:
            sch, amax_g, is_acc, host, event = item
            if event is not None and not event.done:
                if not wait:
                    keep.append(item)
                    continue
                event.synchronize()
            if is_acc:
                amax_t, has_nan = np.uint32(host[0]).view(np.float32), bool(host[1])
                has_inf = bool(np.isinf(amax_t))
            else:
                has_nan, has_inf = bool(host[0] & 1), bool(host[0] & 2)
                amax_t = np.float32(np.inf if has_inf else 0.0)
            planning.warn_specials(sch, amax_t if amax_g is None else amax_g, has_nan, has_inf, stacklevel=3)
        self._pending = keep

    def axis_last(self, a, axis):
        """``a`` with ``axis`` moved last, C-contiguous."""
        return self.xp.ascontiguousarray(self.xp.moveaxis(a, axis, -1))

    def moved_rows(self, a, axis):
        """``a``'s (R, K) rows along ``axis`` for the NVFP4 and MX kernels: a view where the axis is last, a
        :class:`StridedRows` read in place where it is not and ``a`` is a C-contiguous float tensor (no moved copy:
        training quantizes its Wgrad and Dgrad operands along their first axis), else the moved copy."""
        if axis in (-1, a.ndim - 1) and a.flags.c_contiguous:
            return a.reshape(-1, a.shape[-1])
        if a.flags.c_contiguous and a.dtype in IN_KINDS and math.prod(a.shape[axis + 1:]) > 1:
            return StridedRows(a, axis)
        return self.axis_last(a, axis).reshape(-1, a.shape[axis])

    def _device(self):
        return self.xp.cuda.Device().id if self.xp is not np else None

    def table(self, t: np.ndarray):
        """A small float64 lookup table on the current device (exact float32 values), uploaded once per device."""
        key = (t.ctypes.data, t.size, self._device())
        if key not in self._tables:
            self._tables[key] = self.xp.asarray(np.asarray(t, np.float64))
        return self._tables[key]

    def sr_bytes(self, sr, shape):
        xp = self.xp
        n = int(np.prod(shape, dtype=np.int64))
        if sr.kind == ids.SR_PHILOX:
            k0, k1 = seed_key(sr.seed)
            per = xp.empty(n, np.uint8)
            self.be.launch("philox_bytes", -(-n // 16), u64(0), i64(n), u32(k0), u32(k1), u32(sr.stream), per)
        else:
            per = xp.asarray(sr.per)
        if sr.nsr < 8:
            per = per & np.uint8((1 << sr.nsr) - 1)
        return xp.ascontiguousarray(per).reshape(shape)

    def encode(self, xs, fmt, mode, sat, nsr, sr):
        xp = self.xp
        xs = self.f32_rows(xs)
        per = self.sr_bytes(sr, xs.shape) if sr.kind != ids.SR_NONE else None
        out = xp.empty(xs.shape, fmt.code_dtype)
        rb = per if per is not None else self._unused(np.uint8)
        self.be.launch("encode_elements", xs.size, xs, out, i64(xs.size), i32(fmt.bits > 8), i32(mode), rb,
                       i32(per is not None), i32(nsr), i32(bool(sat)), *[i32(v) for v in kernel_params(fmt)],
                       i32(fmt.name == "ue8m0"), i32(fmt.name == "e2m1"))
        return out

    def absmax_device(self, x2, rht=None):
        """max |x| (NaN ignored) as float32 bits and a NaN flag: a (2,) uint32 array left on the device. ``rht``
        (a device (16, 16) diag(s) @ H_16, the scale, bfloat16 output?): the amax of the rows' 16-point RHT."""
        acc = self.xp.zeros(2, np.uint32)
        n = x2.size
        base, S = _base(x2)
        if rht is None:            # the elements in any order: a strided tensor's own flat layout
            self.be.launch("absmax_bits", min(-(-n // 32), 1 << 20), base, i32(IN_KINDS[x2.dtype]), i64(n),
                           acc[0:1], acc[1:2])
        else:
            R, K = x2.shape
            self.be.launch("rht_absmax_bits", min(-(-n // 16), 1 << 20), base, i32(IN_KINDS[x2.dtype]), i64(R),
                           i64(K), i64(S), rht[0], f64(rht[1]), i32(rht[2]), acc[0:1], acc[1:2])
        return acc

    def rht_operand(self, sh, scale, to_bf16):
        """The ``rht`` argument of absmax_device and nvfp4 (the RHT fused into them): ``sh`` on the device."""
        return (self.xp.asarray(sh), float(scale), int(bool(to_bf16)))

    def absmax(self, x2):
        host = self.to_host(self.absmax_device(x2))
        return host[:1].view(np.float32)[0], bool(host[1])

    @staticmethod
    def device_amax(acc):
        """absmax_device's amax as a 0-d float32 array on the device (a QuantizedTensor's global_amax)."""
        return acc[0:1].view(np.float32).reshape(())

    def nvfp4_tensor_constants(self, amax_bits, flavor):
        """(c0, c1, dq0, dq1) of an NVFP4 flavour from a float32 tensor amax on the device (its bits, a (1,) or
        (2,) uint32 array), computed on the device: a (4,) float64 array there."""
        out = self.xp.empty(4, np.float64)
        self.be.launch("nvfp4_tensor_constants", 1, amax_bits, i32(ids.FLAVOR_IDS[flavor]), f64(R6_D),
                       f64(INV2688_D), out)
        return out

    def nvfp4_4over6(self, x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4=False):
        xp = self.xp
        x2 = self.f32_rows(x2)
        R, K = x2.shape
        nbk = -(-K // 16)
        g = np.asarray(amax_g, np.float32).reshape(-1)            # one, or one per row (row-scaled, 1x16)
        s_enc, s_dec, denom = second_level(g, e4m3_max)
        sec = xp.asarray(np.stack([s_enc, s_dec, g], axis=1).astype(np.float64).reshape(-1))
        codes = xp.empty((R, nbk * 8), np.uint8)
        scales = xp.empty((-(-R // tile), nbk), np.uint8)
        pick = xp.empty(scales.shape, np.uint8)
        self.be.launch("nvfp4_4over6_quantize", scales.size, x2, i64(R), i64(K), i32(tile), sec, i32(g.size > 1),
                       f64(denom), i32(err_mode == "mse"), i32(bool(fast_math)), i32(bool(ties_map4)),
                       self.table(E4M3.values), codes, scales, pick)
        return codes, scales, self.to_host(pick).astype(bool)

    def row_absmax(self, x2):
        """max |x| of each row, NaN ignored, from the bits (CuPy's abs and max flush subnormals): host float32."""
        from .._xp import absmax
        return self.to_host(absmax(self.f32_rows(x2), axis=1)).astype(np.float32)

    def _vec(self, v):
        return self.xp.asarray(np.asarray(v, np.float64).reshape(-1))

    def _fake(self, R, K, fake):
        """The (R, K) float32 bit patterns the kernels write with ``fake``; else an unused placeholder."""
        return self.xp.empty((R, K), np.uint32) if fake else self._unused(np.uint32)

    def _unused(self, dtype):
        """A one-element array passed where a kernel takes an array it will not touch in this call (one per
        device and dtype, made once: a call then allocates nothing for it)."""
        key = ("unused", self._device(), np.dtype(dtype).str)
        if key not in self._tables:
            self._tables[key] = self.xp.zeros(1, dtype)
        return self._tables[key]

    def _rb_args(self, rb, use_rb):
        """The kernels' random-byte arguments (rb, use_rb, ph, k0, k1, stream, mask, stride): a byte array, or a
        planning.PhiloxRows whose bits the kernel generates itself."""
        if isinstance(rb, planning.PhiloxRows):
            return (self._unused(np.uint8), i32(0), i32(rb.layout), u32(rb.k0), u32(rb.k1), u32(rb.stream),
                    u32(rb.mask), i64(rb.stride))
        return (rb, i32(use_rb), i32(0), u32(0), u32(0), u32(0), u32(0), i64(1))

    def nvfp4(self, x2, rb, use_rb, mode, nsr, flavor, tile, c0, c1, dq, fake, cst=None, rht=None, flags=None):
        """NVFP4 codes, scale bytes and (``fake``) values; the constants as host vectors ``c0``, ``c1``, ``dq``, or
        ``cst``: nvfp4_tensor_constants' (4,) array on the device. ``rht`` (rht_operand's): the rows' 16-point RHT
        first, in the kernel (K a multiple of 16). ``flags``: a zeroed (1,) uint32 device array in which the kernel
        sets bit 0 for a NaN input and bit 1 for an Inf (as mx's)."""
        xp = self.xp
        R, K = x2.shape
        nbk = -(-K // 16)
        codes = xp.empty((R, nbk * 8), np.uint8)
        scales = xp.empty((-(-R // tile), nbk), np.uint8)
        fv = self._fake(R, K, fake)
        if cst is not None:
            cs, per_row = (cst[0:1], cst[1:2], cst[2:3], cst[3:4]), 0
        else:
            dq = np.asarray(dq, np.float32).reshape(-1, 2)
            cs, per_row = (self._vec(c0), self._vec(c1), self._vec(dq[:, 0]), self._vec(dq[:, 1])), int(dq.shape[0] > 1)
        base, S = _base(x2)
        self.be.launch("nvfp4_quantize", scales.size, base, i32(IN_KINDS[x2.dtype]), i64(R), i64(K), i64(S),
                       *self._rb_args(rb, use_rb), i32(mode), i32(nsr), i32(flavor), i32(tile), *cs, i32(per_row),
                       self.table(E4M3.values), codes, scales, fv, i32(fake),
                       *((NULL, f64(0.0), i32(0)) if rht is None else (rht[0], f64(rht[1]), i32(rht[2]))),
                       NULL if flags is None else flags)
        return codes, scales, fv.view(np.float32)

    def mx(self, x2, rb, use_rb, mode, nsr, scale_mode, fmt, fake):
        xp = self.xp
        R, K = x2.shape
        nbk = -(-K // 32)
        is_fp4 = fmt is E2M1
        codes = xp.empty((R, nbk * (16 if is_fp4 else 32)), np.uint8)
        scales = xp.empty((R, nbk), np.uint8)
        fv = self._fake(R, K, fake)
        flags = xp.zeros(1, np.uint32)
        base, S = _base(x2)
        self.be.launch("mx_quantize", scales.size, base, i32(IN_KINDS[x2.dtype]), i64(R), i64(K), i64(S),
                       *self._rb_args(rb, use_rb), i32(mode), i32(nsr), i32(scale_mode), i32(fmt.emax),
                       i32(fmt.mbits), f64(f32(1.0) / f32(fmt.max)), self.table(POW2_ENC), self.table(POW2_DEC),
                       *[i32(v) for v in kernel_params(fmt)], i32(is_fp4), self.table(fmt.values), codes, scales, fv,
                       i32(fake), flags)
        return codes, scales, fv.view(np.float32), flags   # flags: NaN (1) / Inf (2) seen, left on the device

    def fp8(self, x2, rb, use_rb, mode, nsr, fmt, tile, scale, fake, amax_dev=None):
        """FP8 codes, scales and (``fake``) values: blockwise (``scale`` None, no ``amax_dev``), per-tensor with the
        host's ``scale``, or per-tensor from ``amax_dev`` (absmax_device's array: the scale made on the device)."""
        xp = self.xp
        R, K = x2.shape
        codes = xp.empty((R, K), np.uint8)
        fv = self._fake(R, K, fake)
        common = (x2, i32(IN_KINDS[x2.dtype]), i64(R), i64(K), rb, i32(use_rb), i32(mode), i32(nsr))
        if scale is not None or amax_dev is not None:
            scales = xp.empty(1, np.uint32)
            self.be.launch("fp8_quantize", R * -(-K // 128), *common, i32(1), i64(128),
                           f64(1.0 if scale is None else scale), NULL if amax_dev is None else amax_dev, i32(0),
                           *[i32(v) for v in kernel_params(fmt)], self.table(fmt.values), codes, scales, fv,
                           i32(fake))
            if amax_dev is None:
                scales = xp.asarray(np.array([f32(1.0) / scale], np.float32))
        else:
            scales = xp.empty((-(-R // tile), -(-K // 128)), np.uint32)
            self.be.launch("fp8_quantize", scales.size, *common, i32(tile), i64(128), f64(1.0), NULL, i32(1),
                           *[i32(v) for v in kernel_params(fmt)], self.table(fmt.values), codes, scales, fv,
                           i32(fake))
        return codes, scales.view(np.float32), fv.view(np.float32)

    def dequantize(self, q, p):
        """One kernel; float32 products computed without FTZ."""
        xp = self.xp
        sch = q.scheme
        R, K = p.R, p.K
        codes = xp.ascontiguousarray(q.codes.reshape(R, -1))
        if p.kind < 0:  # bf16
            return (codes.astype(np.uint32) << 16).view(np.float32)
        dummy8, dummy32 = self._unused(np.uint8), self._unused(np.uint32)
        dq0 = dq1 = 0.0
        dq0v = dq1v = self._vec([0.0])
        per_row = 0
        sbytes, sfloat = dummy8, dummy32
        if p.kind == ids.DQ_NVFP4:
            if p.dq is None:     # a tensor amax on the device: its constants made there
                cst = self.nvfp4_tensor_constants(xp.ascontiguousarray(q.global_amax, np.float32).reshape(1)
                                                  .view(np.uint32), q.scheme.flavor)
                dq0v, dq1v, per_row = cst[2:3], cst[3:4], 0
            else:
                dq0v, dq1v, per_row = self._vec(p.dq[:, 0]), self._vec(p.dq[:, 1]), int(p.dq.shape[0] > 1)
            sbytes = xp.ascontiguousarray(q.scales_per_row())
        elif p.kind == ids.DQ_MX:
            sbytes = xp.ascontiguousarray(q.linear_scales())
        elif p.kind == ids.DQ_FP8_TENSOR:
            sfloat = xp.ascontiguousarray(q.scales.reshape(-1)[:1], dtype=np.float32).view(np.uint32)
        else:
            sfloat = xp.ascontiguousarray(q.scales.reshape(-(-R // p.tile), -1)).view(np.uint32)
        out = xp.empty((R, K), np.uint32)
        self.be.launch("dequantize_blocks", R * -(-K // 16), codes, i32(sch.elem is E2M1), i64(codes.shape[1]), sbytes, sfloat,
                       i64(R), i64(K), i64(p.bk), i32(p.tile), i32(p.kind), i32(p.flavor), f64(dq0), f64(dq1), dq0v,
                       dq1v, i32(per_row), self.table(sch.elem.values), self.table(E4M3.values),
                       self.table(POW2_DEC), out)
        return out.view(np.float32)

    def nvfp4_gemm_models(self, A, B, SA, SB, group, mode, grid):
        """The accumulator (M, N) float32 of fp4sim.gemm's NVFP4 models (``_nvfp4_model``) for integer operands."""
        xp = self.xp
        M, Kp = A.shape
        N = B.shape[0]
        out = xp.empty((M, N), np.float32)
        self.be.launch("nvfp4_gemm_models", M * N, xp.ascontiguousarray(A), xp.ascontiguousarray(B),
                       xp.ascontiguousarray(SA, dtype=np.int64), xp.ascontiguousarray(SB, dtype=np.int64), i64(M),
                       i64(N), i64(Kp), i32(group // 16), i32(mode), i32(grid), out)
        return out

    def f64(self, a):
        """``a`` as a C-contiguous float64 array, exactly: float32 (and float16) values are widened by a kernel
        from their bits, because CuPy compiles its own casts with -ftz=true, which flushes float32 subnormals."""
        xp = self.xp
        if a.dtype == np.float64:
            return xp.ascontiguousarray(a)
        a = xp.ascontiguousarray(a, dtype=np.float32)      # float16 -> float32 is exact (no subnormal float32)
        y = xp.empty(a.shape, np.float64)
        self.be.launch("widen_f32", a.size, a.view(np.uint32), i64(a.size), y)
        return y

    def f32(self, a):
        """float64 ``a`` rounded to float32 (nearest-even, subnormals kept: CuPy's own cast flushes them)."""
        a = self.xp.ascontiguousarray(a, dtype=np.float64)
        y = self.xp.empty(a.shape, np.uint32)
        self.be.launch("narrow_f64", a.size, a, i64(a.size), y)
        return y.view(np.float32)

    def tc_chain(self, A, EA, B, EB, idx, nfma, frac, frac_out, min_exp, late, c_emin, C):
        """float32 (M, N): fp4sim.tensorcore's block-FMA chain (``fp4sim.cpu.tensorcore.chain``'s arguments)."""
        xp = self.xp
        M, K = A.shape
        N = B.shape[0]
        out = xp.empty((M, N), np.uint32)
        C = xp.zeros((M, N), np.float32) if C is None else xp.asarray(C, dtype=np.float32)
        self.be.launch("tc_chain", M * N, self.f64(A), xp.ascontiguousarray(EA, dtype=np.int32), self.f64(B),
                       xp.ascontiguousarray(EB, dtype=np.int32), xp.ascontiguousarray(idx, dtype=np.int64), i64(M),
                       i64(N), i64(K), i64(len(idx)), i32(nfma), i32(frac), i32(frac_out), i32(min_exp), i32(late),
                       i32(c_emin), xp.ascontiguousarray(C).view(np.uint32), out)
        return out.view(np.float32)

    def tc_group_chain(self, A, B, SA, SB, ESA, ESB, L, G, bs, F, e_zero):
        """float32 (M, N): Blackwell's block-scaled instruction chain (``fp4sim.cpu.tensorcore.group_chain``)."""
        xp = self.xp
        M, K = A.shape
        N = B.shape[0]
        out = xp.empty((M, N), np.uint32)
        self.be.launch("tc_group_chain", M * N, self.f64(A), self.f64(B), self.f64(SA), self.f64(SB),
                       xp.ascontiguousarray(ESA, dtype=np.int64),
                       xp.ascontiguousarray(ESB, dtype=np.int64), i64(M), i64(N), i64(K), i64(SA.shape[1]), i32(L),
                       i32(G), i32(bs), i32(F), i32(e_zero), out)
        return out.view(np.float32)

    def rht(self, x2, d, sh, scale, to_bf16):
        y = self.xp.empty(x2.shape, np.uint32)
        self.be.launch("rht", x2.size // d, x2, i64(x2.shape[0]), i64(x2.shape[1]), i32(d), self.xp.asarray(sh),
                       f64(scale), i32(to_bf16), y)
        return y.view(np.float32)


_KERNELS: dict = {}
_LIVE: "weakref.WeakSet[GpuKernels]" = weakref.WeakSet()


def flush_warnings():
    """Emit every warning about GPU inputs that is still queued (NaN or Inf in an input, a tensor amax beyond
    FLT_MAX/448, ...), waiting for their values: the GPU quantize reads them from the device only after its
    kernels have run, so that it never synchronises."""
    for k in list(_LIVE):
        k.poll_warnings(wait=True)


def _flush_at_exit():
    try:
        flush_warnings()
    except Exception:  # noqa: BLE001 - the CUDA context may be gone at exit: nothing left to read then
        pass


atexit.register(_flush_at_exit)


def kernels(be) -> GpuKernels:
    """The (cached) GpuKernels of a backend."""
    k = _KERNELS.get(id(be))
    if k is None or k.be is not be:
        k = _KERNELS[id(be)] = GpuKernels(be)
    return k


def encode(be, x, fmt, rounding="rne", saturate=True, rbits=None, seed=None, sr_bits=8, stream=0,
           rbits_mapping="te"):
    """:func:`fp4sim.encode` on the backend ``be``."""
    return planning.run_encode(kernels(be), x, fmt, rounding, saturate, rbits, seed, sr_bits, stream, rbits_mapping)


def quantize(be, x, scheme, axis=-1, rounding="rne", flavor=None, block=None, scale_mode=None, global_amax=None,
             rbits=None, seed=None, stream=0, sr_bits=8, rbits_mapping="te", scale_layout="linear", fake=False,
             row_scaled=None, per_tensor_scale=None, four_over_six=None, four_over_six_fast_math=None,
             four_over_six_e4m3_max=None, four_over_six_ties=None):
    """:func:`fp4sim.quantize` / :func:`fp4sim.fake_quantize` (``fake=True``) on the backend ``be``."""
    if four_over_six is not None or four_over_six_fast_math is not None or four_over_six_e4m3_max is not None:
        from ..schemes import get_scheme
        scheme = get_scheme(scheme, flavor=flavor, block=block, scale_mode=scale_mode, four_over_six=four_over_six,
                            four_over_six_fast_math=four_over_six_fast_math,
                            four_over_six_e4m3_max=four_over_six_e4m3_max, four_over_six_ties=four_over_six_ties)
        flavor = block = scale_mode = None
    return planning.run_quantize(kernels(be), x, scheme, axis, rounding, flavor, block, scale_mode, global_amax,
                                 rbits, seed, stream, sr_bits, rbits_mapping, scale_layout, fake, False, row_scaled,
                                 per_tensor_scale)


def rht_quantize(be, x, d, signs, rht_out, scheme, axis=-1, fake=False, **kw):
    """``quantize(rht(x, d, signs, axis, rht_out), scheme, axis, **kw)`` on the backend ``be``: the RHT inside the
    NVFP4 kernels where it can be (:func:`fp4sim.quantize.rht_quantize`)."""
    return planning.run_quantize(kernels(be), x, scheme, axis, fake=fake, pre_rht=(d, signs, rht_out), **kw)


def dequantize(be, q):
    """:func:`fp4sim.dequantize` on the backend ``be`` (one kernel)."""
    return planning.run_dequantize(kernels(be), q)


def rht(be, x, d=16, signs="te", axis=-1, out="bf16"):
    """:func:`fp4sim.rht` on the backend ``be``."""
    return planning.run_rht(kernels(be), x, d, signs, axis, out)
