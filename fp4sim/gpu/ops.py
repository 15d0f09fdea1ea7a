"""GPU implementations of the public entry points (same arguments, same bits as the Numba backend).

Every function takes a backend ``be`` (``be.xp`` is CuPy on a GPU; the tests pass a host-compiled build of
the same kernels with NumPy arrays). Results stay on the device; the only host transfer is the tensor amax
scalar that NVFP4 and FP8 need for their per-tensor constants.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _inputs
from ..cpu.elements import MODES
from ..elements import ROUNDINGS, kernel_params
from ..formats import E2M1, E4M3, get_format
from ..hadamard import rht_args
from ..qtensor import QuantizedTensor
from ..rng import seed_key
from ..schemes import MX, NVFP4, BF16Cast, FP8Tensor, get_scheme

i64, i32, u32, u64, f32, f64 = np.int64, np.int32, np.uint32, np.uint64, np.float32, np.float64
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def backend():
    from .backend import default_backend
    return default_backend()


def _as_f32(be, x, name="x"):
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} has dtype {x.dtype}; on the GPU fp4sim takes float16, float32 or float64 CuPy "
                        f"arrays (bfloat16 tensors: pass them through fp4sim.torch or .float() first)")
    return be.xp.ascontiguousarray(x, dtype=np.float32)


def _sr_bits(be, shape, n, rounding, rbits, seed, nsr, stream, mapping):
    """Per-element random bytes in the input's shape (or None when not rounding stochastically)."""
    xp = be.xp
    if rounding != "sr":
        for name, v in (("rbits", rbits), ("seed", seed)):
            if v is not None:
                raise ValueError(f"{name} is only used with rounding='sr' (rounding={rounding!r}); drop it or pass "
                                 "rounding='sr'")
        return None
    if (rbits is None) == (seed is None):
        raise ValueError("rounding='sr' needs exactly one of rbits= (uint8 per element or uint32 words) or seed=")
    if seed is not None:
        k0, k1 = seed_key(seed)
        out = xp.empty(n, np.uint8)
        be.launch("philox_bytes", -(-n // 16), u64(0), i64(n), u32(k0), u32(k1), u32(stream), out)
        per = out
    else:
        _, per = _inputs.sr_bytes(n, shape, rounding, rbits, None, nsr, mapping)
    if nsr < 8:
        per = per & np.uint8((1 << nsr) - 1)
    return xp.ascontiguousarray(per).reshape(shape)


def encode(be, x, fmt, rounding="rne", saturate=True, rbits=None, seed=None, sr_bits=8, stream=0,
           rbits_mapping="te"):
    """GPU twin of :func:`fp4sim.encode`."""
    fmt = get_format(fmt)
    xs = _as_f32(be, x)
    rounding = _inputs.check_choice(rounding, "rounding", ROUNDINGS)
    nsr = _inputs.check_int(sr_bits, "sr_bits", 1, 8)
    mode = MODES[rounding]
    if fmt.name == "ue8m0":
        if mode == 4:
            raise ValueError("rounding='sr' is not defined for UE8M0 scales; use 'rz', 'rp'/'ru' or 'rne'")
        mode = 1 if mode == 3 else mode
    if mode == 4 and not saturate and fmt.name != "e2m1":
        raise ValueError("saturate=False is not defined with rounding='sr'; use saturate=True")
    per = _sr_bits(be, xs.shape, xs.size, rounding, rbits, seed, nsr, stream, rbits_mapping)
    out = be.xp.empty(xs.shape, fmt.code_dtype)
    rb = per if per is not None else be.xp.zeros(1, np.uint8)
    be.launch("encode_elements", xs.size, xs, out, i64(xs.size), i32(fmt.bits > 8), i32(mode), rb,
              i32(per is not None), i32(nsr), i32(bool(saturate)), *[i32(v) for v in kernel_params(fmt)],
              i32(fmt.name == "ue8m0"), i32(fmt.name == "e2m1"))
    return out


_TABLES: dict = {}


def _device_table(be, t: np.ndarray):
    """A small float64 lookup table on the backend's device, uploaded once per process."""
    key = (id(be), t.ctypes.data, t.size)
    if key not in _TABLES:
        _TABLES[key] = be.xp.asarray(np.asarray(t, np.float64))
    return _TABLES[key]


def _absmax(be, x2):
    xp = be.xp
    acc = xp.zeros(2, np.uint32)
    n = x2.size
    be.launch("absmax_bits", min(-(-n // 8), 1 << 20), x2, i64(n), acc[0:1], acc[1:2])
    host = np.asarray(acc.get() if hasattr(acc, "get") else acc)
    return host[:1].view(np.float32)[0], bool(host[1])


def quantize(be, x, scheme, axis=-1, rounding="rne", flavor=None, block=None, scale_mode=None, global_amax=None,
             rbits=None, seed=None, stream=0, sr_bits=8, rbits_mapping="te", scale_layout="linear", fake=False):
    """GPU twin of :func:`fp4sim.quantize` / :func:`fp4sim.fake_quantize` (``fake=True``)."""
    from ..quantize import (_POW2_DEC, _POW2_ENC, _check_global_amax, _nvfp4_constants, _warn_specials, finish,
                            fp8_tensor_scale)
    xp = be.xp
    sch = get_scheme(scheme, flavor=flavor, block=block, scale_mode=scale_mode)
    scale_layout = _inputs.check_choice(scale_layout, "scale_layout", ("linear", "swizzled"))
    xs = _as_f32(be, x)
    ax = _inputs.check_axis(axis, xs.ndim, "a block-scaled scheme")
    K = xs.shape[ax]
    if K == 0 or xs.size == 0:
        raise ValueError(f"x has shape {xs.shape}: nothing to quantize along axis {axis}")
    rounding = _inputs.check_choice(rounding, "rounding", ROUNDINGS)
    nsr = _inputs.check_int(sr_bits, "sr_bits", 1, 8)
    mode = MODES[rounding]
    per = _sr_bits(be, xs.shape, xs.size, rounding, rbits, seed, nsr, stream, rbits_mapping)
    g = _check_global_amax(global_amax)
    if g is not None and not isinstance(sch, (NVFP4, FP8Tensor)):
        raise ValueError(f"global_amax applies to NVFP4 and FP8 per-tensor schemes only, not {sch.name!r}")
    to2d = lambda a: xp.ascontiguousarray(xp.moveaxis(a, ax, -1)).reshape(-1, K)  # noqa: E731
    x2 = to2d(xs)
    R = x2.shape[0]
    lead = tuple(s for i, s in enumerate(xs.shape) if i != ax)
    rb = to2d(per) if per is not None else xp.zeros(1, np.uint8)
    use_rb = i32(per is not None)
    fake_out = xp.empty((R, K) if fake else (1,), np.uint32)  # float32 bit patterns written by the kernels
    back = lambda y2: xp.moveaxis(y2.reshape(lead + (K,)), -1, ax)  # noqa: E731
    if isinstance(sch, BF16Cast):
        c = encode(be, x2, sch.elem, rounding, saturate=rounding == "sr",
                   rbits=rb if per is not None else None, sr_bits=nsr)
        if fake:
            return back((c.astype(np.uint32) << 16).view(np.float32))
        return QuantizedTensor(c.reshape(lead + (K,)), None, None, sch, ax, xs.shape)
    d64 = lambda t: _device_table(be, t)  # noqa: E731  float64 tables (exact float32 values), cached
    amax_t, has_nan = _absmax(be, x2)
    gamax = None
    if isinstance(sch, NVFP4):
        amax_g = amax_t if g is None else g
        _warn_specials(sch, amax_g, has_nan, bool(np.isinf(amax_t)))
        (c0, c1, _), dq = _nvfp4_constants(sch.flavor, amax_g)
        tile, nbk = sch.block[0], -(-K // 16)
        codes = xp.empty((R, nbk * 8), np.uint8)
        scales = xp.empty((-(-R // tile), nbk), np.uint8)
        be.launch("nvfp4_quantize", scales.size, x2, i64(R), i64(K), rb, use_rb, i32(mode), i32(nsr),
                  i32({"te": 0, "paper": 1, "torchao": 2, "modelopt": 3}[sch.flavor]), i32(tile), f64(c0), f64(c1),
                  f64(dq[0]), f64(dq[1]), d64(E4M3.values), codes, scales, fake_out, i32(fake))
        gamax = f32(amax_g)
    elif isinstance(sch, MX):
        _warn_specials(sch, amax_t, has_nan, bool(np.isinf(amax_t)))
        fmt, nbk = sch.elem, -(-K // 32)
        is_fp4 = fmt is E2M1
        codes = xp.empty((R, nbk * (16 if is_fp4 else 32)), np.uint8)
        scales = xp.empty((R, nbk), np.uint8)
        be.launch("mx_quantize", scales.size, x2, i64(R), i64(K), rb, use_rb, i32(mode), i32(nsr),
                  i32({"rceil": 0, "floor": 1, "ceil": 2, "even": 3}[sch.scale_mode]), i32(fmt.emax), i32(fmt.mbits),
                  f64(f32(1.0) / f32(fmt.max)), d64(_POW2_ENC), d64(_POW2_DEC),
                  *[i32(v) for v in kernel_params(fmt)], i32(is_fp4), d64(fmt.values), codes, scales,
                  fake_out, i32(fake))
    else:
        fmt = sch.elem
        codes = xp.empty((R, K), np.uint8)
        if isinstance(sch, FP8Tensor):
            scale = fp8_tensor_scale(fmt, amax_t if g is None else g)
            dummy = xp.empty(1, np.uint32)
            be.launch("fp8_quantize", R * -(-K // 128), x2, i64(R), i64(K), rb, use_rb, i32(mode), i32(nsr), i32(1),
                      i64(128), f64(scale), i32(0), *[i32(v) for v in kernel_params(fmt)], d64(fmt.values), codes,
                      dummy, fake_out, i32(fake))
            scales = xp.asarray(np.array([f32(1.0) / scale], np.float32))
        else:
            tile = sch.block[0]
            scales = xp.empty((-(-R // tile), -(-K // 128)), np.uint32)
            be.launch("fp8_quantize", scales.size, x2, i64(R), i64(K), rb, use_rb, i32(mode), i32(nsr), i32(tile),
                      i64(128), f64(1.0), i32(1), *[i32(v) for v in kernel_params(fmt)], d64(fmt.values),
                      codes, scales, fake_out, i32(fake))
            scales = scales.view(np.float32)
    if fake:
        return back(fake_out.view(np.float32))
    if scale_layout == "swizzled" and not isinstance(sch, (NVFP4, MX)):
        raise ValueError(f"scale_layout='swizzled' applies to NVFP4 and MX schemes, not {sch.name!r}")
    return finish(sch, codes, scales, gamax, lead, ax, xs.shape, scale_layout)


def dequantize(be, q):
    """GPU twin of :func:`fp4sim.dequantize` (one kernel; float32 products computed without FTZ)."""
    from ..quantize import _POW2_DEC, _nvfp4_constants
    xp = be.xp
    sch = q.scheme
    K, lead = q.K, q.lead
    R = int(np.prod(lead, dtype=np.int64))
    codes = xp.ascontiguousarray(q.codes.reshape(R, -1))
    if isinstance(sch, BF16Cast):
        y2 = (codes.astype(np.uint32) << 16).view(np.float32)
        return xp.moveaxis(y2.reshape(tuple(lead) + (K,)), -1, q.axis)
    dummy8, dummy32 = xp.zeros(1, np.uint8), xp.zeros(1, np.uint32)
    dq0 = dq1 = 0.0
    tile, flavor, bk = 1, 0, K
    sbytes, sfloat = dummy8, dummy32
    if isinstance(sch, NVFP4):
        kind, bk, flavor = 0, 16, {"te": 0, "paper": 1, "torchao": 2, "modelopt": 3}[sch.flavor]
        _, dq = _nvfp4_constants(sch.flavor, f32(q.global_amax))
        dq0, dq1 = float(dq[0]), float(dq[1])
        sbytes = xp.ascontiguousarray(q.scales_per_row())
    elif isinstance(sch, MX):
        kind, bk = 1, 32
        sbytes = xp.ascontiguousarray(q.linear_scales())
    elif isinstance(sch, FP8Tensor):
        kind = 3
        dq0 = float(xp.asnumpy(q.scales.reshape(-1)[:1])[0]) if xp is not np else float(q.scales.reshape(-1)[0])
    else:
        kind, bk, tile = 2, 128, sch.block[0]
        sfloat = xp.ascontiguousarray(q.scales.reshape(-(-R // tile), -1)).view(np.uint32)
    out = xp.empty((R, K), np.uint32)
    be.launch("dequantize_blocks", R * K, codes, i32(sch.elem is E2M1), i64(codes.shape[1]), sbytes, sfloat,
              i64(R), i64(K), i64(bk), i32(tile), i32(kind), i32(flavor), f64(dq0), f64(dq1),
              _device_table(be, sch.elem.values), _device_table(be, E4M3.values), _device_table(be, _POW2_DEC), out)
    return xp.moveaxis(out.view(np.float32).reshape(tuple(lead) + (K,)), -1, q.axis)


def rht(be, x, d=16, signs="te", axis=-1, out="bf16"):
    """GPU twin of :func:`fp4sim.rht`."""
    xp = be.xp
    xs = _as_f32(be, x)
    axis, K, sh, to_bf16 = rht_args(xs, d, signs, axis, out)
    xm = xp.ascontiguousarray(xp.moveaxis(xs, axis, -1))
    x2 = xm.reshape(-1, K)
    y = xp.empty(x2.shape, np.uint32)
    be.launch("rht", x2.size, x2, i64(x2.shape[0]), i64(K), i32(d), xp.asarray(sh), f64(math.sqrt(1.0 / d)),
              i32(to_bf16), y)
    return xp.moveaxis(y.view(np.float32).reshape(xm.shape), -1, axis)
