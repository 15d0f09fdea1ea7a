"""The CUDA kernels (fp4sim/gpu/kernels.cu) against the Numba backend, bit for bit.

Every test runs twice: on the host — the same .cu source compiled with g++ through a thin shim
(tests/oracles/cuda_host_shim.h), in every CI run — and on a real GPU through CuPy where one is present
(marked ``gpu``; skipped cleanly otherwise). Both go through fp4sim.gpu.ops, the code the public API uses
for CuPy arrays.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from conftest import float32_sweep, oracle_missing
from fp4sim import planning
from fp4sim.gpu import ops
from fp4sim.gpu.backend import NVRTC_OPTIONS, SOURCE, HostBackend, write_ids_header

ORACLES = Path(__file__).parent / "oracles"


class _Cupy:
    """Adapter so a test can hand NumPy inputs to the GPU and get NumPy results back."""

    def __init__(self):
        import cupy
        from fp4sim.gpu.backend import default_backend
        self.cp, self.be = cupy, default_backend()

    def dev(self, a):
        return self.cp.asarray(a) if isinstance(a, np.ndarray) else a

    @staticmethod
    def host(a):
        return a.get() if hasattr(a, "get") else a


class _Host:
    def __init__(self, lib):
        self.be = HostBackend(lib)

    dev = staticmethod(lambda a: a)
    host = staticmethod(lambda a: a)


@pytest.fixture(params=["host", pytest.param("cupy", marks=pytest.mark.gpu)], scope="module")
def dev(request, tmp_path_factory):
    if request.param == "cupy":
        if not fs.gpu.available():
            pytest.skip("no CUDA device with CuPy: the GPU run of these tests needs pip install '.[gpu]' (from the repository root)")
        return _Cupy()
    return _Host(request.getfixturevalue("host_lib"))


def same_bits(a, b):
    """Identical float32 bit patterns, except that NaNs only need to be NaN on both sides: the default NaN of
    an invalid operation differs between x86 (0xFFC00000) and CUDA (0x7FFFFFFF), so dequantized NaNs (a
    NaN-chain flavour, an Inf tensor amax) carry different payloads; codes and scale bytes never do."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    na, nb_ = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb_)
    assert np.array_equal(a[~na].view(np.uint32), b[~nb_].view(np.uint32))


SWEEP = float32_sweep(per_binade=200, seed=1)  # 102k patterns: every exponent, sign, subnormals, specials


@pytest.mark.parametrize("fmt", [fs.E2M1, fs.E4M3, fs.E5M2, fs.UE8M0, fs.UE5M3, fs.BF16, fs.E2M3, fs.E3M2, fs.E3M4,
                                 fs.E4M3FNUZ, fs.E5M2FNUZ, fs.E4M3B11FNUZ, fs.INT8, *fs.formats.P3109],
                         ids=lambda f: f.name)
def test_encode_every_mode(dev, fmt):
    modes = ["rne", "rz", "ru", "rd"] + (["sr"] if fmt is not fs.UE8M0 else [])
    r = np.random.default_rng(2).integers(0, 256, SWEEP.shape, dtype=np.uint8)
    for mode in modes:
        for sat in ((True,) if mode == "sr" else (True, False)):
            kw = {"rbits": r} if mode == "sr" else {}
            want = fs.encode(SWEEP, fmt, rounding=mode, saturate=sat, **kw)
            got = dev.host(ops.encode(dev.be, dev.dev(SWEEP), fmt, mode, sat, **{k: dev.dev(v) for k, v in kw.items()}))
            assert np.array_equal(got, want), (fmt.name, mode, sat, np.flatnonzero(got != want)[:5])
    want = fs.encode(SWEEP, fmt if fmt is not fs.UE8M0 else fs.E2M1, rounding="sr", seed=99, stream=5)
    got = dev.host(ops.encode(dev.be, dev.dev(SWEEP), fmt if fmt is not fs.UE8M0 else fs.E2M1, "sr", seed=99,
                              stream=5))
    assert np.array_equal(got, want)
    if fmt is fs.E2M1:  # fewer random bits: the low bits of each Philox byte
        want = fs.encode(SWEEP, fmt, rounding="sr", seed=7, sr_bits=3)
        assert np.array_equal(dev.host(ops.encode(dev.be, dev.dev(SWEEP), fmt, "sr", seed=7, sr_bits=3)), want)
    if fmt is not fs.UE8M0:  # the midpoint rule, given bytes, Philox bytes and fewer bits
        for kw in ({"rbits": r}, {"seed": 3, "stream": 2}, {"seed": 5, "sr_bits": 4}):
            want = fs.encode(SWEEP, fmt, rounding="sr", rbits_mapping="midpoint", **kw)
            got = dev.host(ops.encode(dev.be, dev.dev(SWEEP), fmt, "sr", rbits_mapping="midpoint",
                                      **{k: dev.dev(v) for k, v in kw.items()}))
            assert np.array_equal(got, want), (fmt.name, kw, np.flatnonzero(got != want)[:5])


def test_widen_keeps_subnormals(dev):
    """The float64 operands of the tensor-core kernels are widened from float32 bits by a kernel: every float32
    class (subnormals of both signs, -0, the extremes, Inf, NaN payloads) gives NumPy's exact float64, which
    CuPy's own cast (compiled with -ftz=true) does not for subnormals; NaNs stay NaN."""
    bits = np.array([0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x3F800001, 0x7F7FFFFF,
                     0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFA00000], np.uint32)
    x = np.concatenate([bits.view(np.float32), SWEEP.reshape(-1)]).reshape(2, -1)
    got = dev.host(ops.kernels(dev.be).f64(dev.dev(x)))
    want = x.astype(np.float64)
    assert got.dtype == np.float64 and got.shape == x.shape
    nan = np.isnan(want)                         # NaN payloads: x86 quiets a signalling NaN, the kernel keeps it
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint64), want[~nan].view(np.uint64))


def test_narrow_rounds_like_numpy(dev):
    """float64 -> float32 by the kernel: NumPy's nearest-even cast for every float32 pattern widened and nudged up
    and down (ties, subnormal results, overflow to Inf, values below the smallest subnormal), NaN as NaN."""
    w = np.concatenate([SWEEP.reshape(-1).astype(np.float64), [2.0**-150, -(2.0**-150), 2.0**-150 * 1.5,
                                                               3.4028235677973366e38, 3.4028236e38 * 2]])
    w = w[np.isfinite(w)]
    x = np.concatenate([w, np.nextafter(w, np.inf), np.nextafter(w, -np.inf), w * (1 + 2.0**-24), w * (1 - 2.0**-25),
                        [np.inf, -np.inf, np.nan]])
    got = dev.host(ops.kernels(dev.be).f32(dev.dev(x)))
    with np.errstate(over="ignore"):
        want = x.astype(np.float32)
    same_bits(got, want)


def test_row_absmax_keeps_subnormal_rows(dev):
    """The per-row amax of row-scaled NVFP4 (GpuKernels.row_absmax): the CPU backend's, rows of subnormals, NaN
    (ignored), Inf, -0 and all-NaN rows included."""
    from fp4sim.cpu.backend import CpuKernels
    x = heavy((12, 40), 14)
    x[1] *= np.float32(1e-39)
    x[2] = -0.0
    x[3, 5], x[4, 7] = np.nan, -np.inf
    x[5] = np.nan
    x[6, :] = np.float32(1e-45)
    got = ops.kernels(dev.be).row_absmax(dev.dev(x))
    want = CpuKernels.row_absmax(x)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
    assert got[1] > 0 and got[6] == np.float32(1e-45)


@pytest.mark.gpu
def test_float32_arithmetic_on_cupy_keeps_subnormals():
    """fp4sim._f32 on CuPy arrays gives NumPy's float32 bits where CuPy's own arithmetic flushes subnormal
    inputs and results (it compiles with -ftz=true); and the paths built on it: UE5M3 NVFP4 with blocks whose
    amax is subnormal, MXFP8 and NVFP4 GEMMs whose scale products fall below 2^-126, a delayed amax."""
    if not fs.gpu.available():
        pytest.skip("no CUDA device with CuPy: the GPU run of these tests needs pip install '.[gpu]'")
    import cupy

    from fp4sim import _f32, emulate
    from fp4sim.training import Operand
    rng = np.random.default_rng(9)
    a = (rng.standard_normal(4096) * np.exp2(rng.integers(-140, -100, 4096))).astype(np.float32)
    b = (rng.standard_normal(4096) * np.exp2(rng.integers(-30, 30, 4096))).astype(np.float32)
    ga, gb = cupy.asarray(a), cupy.asarray(b)
    for f in (_f32.mul, _f32.div, _f32.add):
        with np.errstate(all="ignore"):
            same_bits(cupy.asnumpy(f(ga, gb)), f(a, b).astype(np.float32))
            same_bits(cupy.asnumpy(f(ga, np.float32(3e-5))), f(a, np.float32(3e-5)).astype(np.float32))
    assert _f32.absmax(ga) == _f32.absmax(a) == np.abs(a).max() > 0
    same_bits(cupy.asnumpy(_f32.absmax(ga.reshape(64, 64), axis=1)), np.abs(a.reshape(64, 64)).max(1))
    x = heavy((32, 64), 11)
    x[:, :16] *= np.float32(1e-39)                               # whole blocks of subnormals
    for scheme in ("nvfp4_ue5m3", "nvfp4_ue5m3_2d"):
        for kw in ({}, {"per_tensor_scale": False}):
            want, got = fs.quantize(x, scheme, **kw), fs.quantize(cupy.asarray(x), scheme, **kw)
            assert np.array_equal(cupy.asnumpy(got.codes), want.codes) and \
                np.array_equal(cupy.asnumpy(got.scales), want.scales), (scheme, kw)
            same_bits(cupy.asnumpy(fs.dequantize(got)), fs.dequantize(want))
    x = heavy((24, 96), 12) * np.float32(2.0**-56)
    w = heavy((16, 96), 13) * np.float32(2.0**-56)
    x[:12] *= np.float32(2.0**-12)                               # rows far below the amax: outputs and MX scale
    w[:8] *= np.float32(2.0**-12)                                # products below 2^-126, many subnormal
    for scheme in ("mxfp8_e4m3", "mxfp4", "nvfp4"):
        want = fs.gemm(fs.quantize(x, scheme), fs.quantize(w, scheme))
        assert (np.abs(want[want != 0]) < 2.0**-126).mean() > 0.1, scheme
        got = fs.gemm(fs.quantize(cupy.asarray(x), scheme), fs.quantize(cupy.asarray(w), scheme))
        same_bits(cupy.asnumpy(got), want)
    op = Operand(scheme="nvfp4", amax="delayed")
    tiny = np.full((4, 16), 1e-40, np.float32)
    assert emulate.held_amax(cupy.asarray(tiny), op, 0, "x", {}) == emulate.held_amax(tiny, op, 0, "x", {}) > 0


def test_philox_bytes(dev):
    from fp4sim.rng import philox_bytes, seed_key
    for seed, stream, start in [(0, 0, 0), (2**64 - 1, 7, 2**36)]:
        out = dev.dev(np.empty(1000, np.uint8))
        k0, k1 = seed_key(seed)
        dev.be.launch("philox_bytes", 63, np.uint64(start), np.int64(1000), np.uint32(k0), np.uint32(k1),
                      np.uint32(stream), out)
        assert np.array_equal(dev.host(out), philox_bytes(seed, 1000, stream, start))


CASES = {"heavy": heavy((48, 160), 5), "odd": heavy((5, 7, 37), 6), "zeros": np.zeros((16, 32), np.float32)}
CASES["zeros"][3, 5] = -0.0
CASES["bf16"] = heavy((32, 64), 8).astype(ml_dtypes.bfloat16).astype(np.float32)
_t = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0], np.float32)
CASES["lattice"] = (np.tile(_t, (16, 4)) * (np.float32(2.0) ** np.arange(-8, 8, dtype=np.float32))[:, None])
SPECIALS = heavy((20, 64), 7)
SPECIALS[1, 3], SPECIALS[2, 9], SPECIALS[4, 40] = np.nan, -np.inf, 1e-40


@pytest.mark.parametrize("scheme,kw", [
    ("nvfp4", {}), ("nvfp4", {"flavor": "paper"}), ("nvfp4", {"flavor": "torchao"}),
    ("nvfp4", {"flavor": "modelopt"}), ("nvfp4_2d", {}), ("nvfp4_2d", {"flavor": "torchao"}),
    ("nvfp4", {"global_amax": 3e38}), ("nvfp4", {"global_amax": 1e-40}), ("nvfp4", {"scale_layout": "swizzled"}),
    ("nvfp4", {"flavor": "torchao", "global_amax": 1e-40}), ("mxfp4", {"scale_layout": "swizzled"}),
    ("mxfp4", {}), ("mxfp4", {"scale_mode": "floor"}), ("mxfp4", {"scale_mode": "ceil"}),
    ("mxfp4", {"scale_mode": "even"}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {"scale_mode": "even"}),
    ("mxfp6_e2m3", {}), ("mxfp6_e3m2", {"scale_mode": "floor"}), ("mxint8", {}), ("mxint8", {"scale_mode": "even"}),
    ("fp8_e4m3fnuz", {}), ("fp8_e5m2fnuz", {}),
    ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("fp8_blockwise", {}), ("fp8_blockwise", {"block": (128, 128)}),
    ("bf16", {}), ("nvfp4", {"row_scaled": True}), ("nvfp4", {"flavor": "paper", "row_scaled": True}),
    ("nvfp4", {"flavor": "torchao", "per_tensor_scale": False}),
    ("nvfp4", {"four_over_six": "mae"}), ("nvfp4", {"four_over_six": "mse", "four_over_six_e4m3_max": 256}),
    ("nvfp4", {"four_over_six": "mse", "four_over_six_fast_math": True}), ("nvfp4_2d", {"four_over_six": "mse"}),
    ("nvfp4_2d", {"four_over_six": "mae", "four_over_six_fast_math": True, "four_over_six_e4m3_max": 256}),
    ("nvfp4", {"four_over_six": "mae", "four_over_six_ties": "map_to_4"}),
    ("nvfp4", {"four_over_six": "mse", "row_scaled": True}),
    ("nvfp4", {"four_over_six": "mae", "four_over_six_fast_math": True, "four_over_six_e4m3_max": 256,
               "row_scaled": True}),
])
@pytest.mark.parametrize("case", list(CASES) + ["specials"])
def test_quantize_and_fake_quantize(dev, scheme, kw, case):
    x = SPECIALS if case == "specials" else CASES[case]
    axes = (-1, 0) if x.ndim == 2 and case == "heavy" else (-1,)
    for axis in axes:
        for rnd in ({}, {"rounding": "sr", "seed": 4}) if "four_over_six" not in kw else ({},):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                want = fs.quantize(x, scheme, axis=axis, **kw, **rnd)
                got = ops.quantize(dev.be, dev.dev(x), scheme, axis=axis, **kw, **rnd)
                f_want = fs.fake_quantize(x, scheme, axis=axis, **{k: v for k, v in kw.items()
                                                                    if k != "scale_layout"}, **rnd)
                f_got = ops.quantize(dev.be, dev.dev(x), scheme, axis=axis, fake=True,
                                     **{k: v for k, v in kw.items() if k != "scale_layout"}, **rnd)
            assert np.array_equal(dev.host(got.codes), want.codes), (scheme, kw, case, axis, rnd)
            if want.scales is not None:
                assert np.array_equal(dev.host(got.scales).view(np.uint8), np.asarray(want.scales).view(np.uint8))
            assert (got.global_amax is None) == (want.global_amax is None)
            if "map_to_4" in want.extras:
                assert np.array_equal(got.extras["map_to_4"], want.extras["map_to_4"])
            if want.global_amax is not None:
                assert np.array_equal(np.asarray(dev.host(got.global_amax)), np.asarray(want.global_amax))
            same_bits(dev.host(f_got), np.asarray(f_want))
            same_bits(dev.host(fs.dequantize(got)), fs.dequantize(want))  # on the device for CuPy tensors
            same_bits(dev.host(ops.dequantize(dev.be, got)), fs.dequantize(want))  # the GPU kernel, also on host


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4_2d", "mxfp4", "mxfp8_e4m3", "fp8_e4m3", "fp8_blockwise", "bf16"])
def test_midpoint_sr_in_the_block_kernels(dev, scheme):
    """rbits_mapping='midpoint' through each block kernel, Philox and given bytes, along both axes."""
    x = CASES["heavy"]
    rb = np.random.default_rng(6).integers(0, 256, x.shape, dtype=np.uint8)
    for axis in (-1, 0):
        for bits in ({"seed": 4}, {"rbits": rb}):
            kw = dict(rounding="sr", rbits_mapping="midpoint", axis=axis, **bits)
            want = fs.quantize(x, scheme, **kw)
            got = ops.quantize(dev.be, dev.dev(x), scheme, **{k: dev.dev(v) for k, v in kw.items()})
            assert np.array_equal(dev.host(got.codes), want.codes), (scheme, axis, list(bits))
            if want.scales is not None:
                assert np.array_equal(dev.host(got.scales).view(np.uint8), np.asarray(want.scales).view(np.uint8))


@pytest.mark.parametrize("d", [2, 16, 32, 128])
def test_rht(dev, d):
    x = heavy((8, 256), d)
    for signs in (["te"] if d == 16 else []) + [11, None]:
        for out in ("bf16", "fp32"):
            want = fs.rht(x, d, signs, out=out)
            got = dev.host(ops.rht(dev.be, dev.dev(x), d, signs, out=out))
            same_bits(got, want)
    want = fs.rht(x.T.copy(), d, None, axis=0)
    assert np.array_equal(dev.host(ops.rht(dev.be, dev.dev(x.T.copy()), d, None, axis=0)), want)


def test_errors_match_the_cpu(dev):
    with pytest.raises(TypeError, match="dtype int32"):
        ops.encode(dev.be, dev.dev(np.arange(4, dtype=np.int32)), fs.E2M1)
    with pytest.raises(ValueError, match="rbits="):
        ops.encode(dev.be, dev.dev(np.ones(4, np.float32)), fs.E2M1, "sr")
    with pytest.raises(ValueError, match="nothing to quantize"):
        ops.quantize(dev.be, dev.dev(np.zeros((2, 0), np.float32)), "nvfp4")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100a"])
def test_kernels_compile_to_cubin_with_nvcc(arch, tmp_path):
    """Syntax and arch guards: the source builds for Hopper and Blackwell (cubin, not just PTX)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        oracle_missing("nvcc not found: install the CUDA toolkit")
    out = tmp_path / f"k_{arch}.cubin"
    ids = write_ids_header(tmp_path)
    r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", *NVRTC_OPTIONS, "-include", str(ids), str(SOURCE), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10000


def test_lattice_ties_and_sr_thresholds_on_the_fast_paths(dev):
    """Scale factor exactly 1 (global amax 2688, a +-6 per block): the CUDA fast RNE path meets exact E2M1 ties,
    and SR meets floor(delta*256) + r == 256 exactly, on every lane."""
    j = np.arange(1, 257) % 256
    x = np.zeros((256, 32), np.float32)
    x[:, 0] = x[:, 16] = 6.0
    x[:, 1:8] = _t[1:8]
    x[:, 9:16] = (0.5 + j / 512).astype(np.float32)[:, None]
    x[:, 17:24] = -_t[1:8]
    want = fs.quantize(x, "nvfp4", global_amax=2688.0)
    got = ops.quantize(dev.be, dev.dev(x), "nvfp4", global_amax=2688.0)
    assert np.array_equal(dev.host(got.codes), want.codes)
    for shift in (0, -1):
        rb = np.zeros(x.shape, np.uint8)
        rb[:, 9:16] = ((256 - j + shift) % 256).astype(np.uint8)[:, None]
        want = fs.quantize(x, "nvfp4", rounding="sr", rbits=rb, global_amax=2688.0)
        got = ops.quantize(dev.be, dev.dev(x), "nvfp4", rounding="sr", rbits=dev.dev(rb), global_amax=2688.0)
        assert np.array_equal(dev.host(got.codes), want.codes), shift


@pytest.mark.parametrize("model,grid", [("exact_sum", None), ("k64_rtz", None), ("k64_rtz", 1024), ("k64_rne", None),
                                        ("k32_rtz", None), ("k128_rne", 1024), ("k16_rtz", None)])
def test_nvfp4_gemm_models(dev, model, grid):
    """fp4sim.gemm's NVFP4 accumulation models by the CUDA kernel (nvfp4_gemm_models: CUDA's own __fadd_rz /
    __fadd_rn and int64 -> float conversion; on the host, the CPU's IEEE additions under that rounding mode)
    against the Numba kernels, bit for bit: block amaxes over 16 binades (so the rules differ), a partial last
    group, 16x16 weights, small values for the grid."""
    rng = np.random.default_rng(7)

    def spread(R, K, scale=1.0):
        s = np.exp2(rng.uniform(-8, 8, (R, -(-K // 16)))).repeat(16, 1)[:, :K]
        return (rng.standard_normal((R, K)) * s * scale).astype(np.float32)

    for (M, N, K, wblock, scale) in ((33, 17, 208, (1, 16), 1.0), (8, 40, 256, (16, 16), 1.0),
                                     (12, 9, 320, (1, 16), 1e-3)):
        a, b = spread(M, K, scale), spread(N, K, scale)
        kw = {"global_amax": np.float32(2688.0)} if scale != 1.0 else {}
        qa, qb = fs.quantize(a, "nvfp4", **kw), fs.quantize(b, "nvfp4", block=wblock, **kw)
        want = fs.gemm(qa, qb, accumulate=model, grid=grid)
        ga = ops.quantize(dev.be, dev.dev(a), "nvfp4", **kw)
        gb = ops.quantize(dev.be, dev.dev(b), "nvfp4", block=wblock, **kw)
        got = dev.host(fs.gemm(ga, gb, accumulate=model, grid=grid, backend=dev.be))
        same_bits(got, want)


def test_tensor_core_chains(dev):
    """fp4sim.tensorcore's chains by the CUDA kernels (tc_chain, tc_group_chain) against the Numba kernels, bit
    for bit: every chip model on FP8 (E4M3 x E5M2, fast and slow, blockwise) and BF16 operands, tcgen05 on NVFP4,
    MXFP4 and MXFP8 with block scales over many binades, subnormal results and an overflowing BF16 chain."""
    import ml_dtypes

    from fp4sim import tensorcore as tc
    rng = np.random.default_rng(31)

    def spread(R, K, blk, binades):
        return (rng.standard_normal((R, K)) * np.exp2(rng.integers(-binades, binades, (R, K // blk))).repeat(blk, 1)
                ).astype(np.float32)

    x, w = spread(24, 512, 16, 10), spread(16, 512, 16, 10)
    for acc in ("hopper", "hopper_fast_accum", "ada", "ada_fast_accum", "b200", "b200_mma"):
        qa, qb = fs.quantize(x, "fp8_e4m3"), fs.quantize(w, "fp8_e5m2")
        same_bits(fs.gemm(qa, qb, accumulate=acc, backend=dev.be), fs.gemm(qa, qb, accumulate=acc))
        qa, qb = fs.quantize(x, "fp8_blockwise"), fs.quantize(w, "fp8_blockwise")
        same_bits(fs.gemm(qa, qb, accumulate=acc, backend=dev.be), fs.gemm(qa, qb, accumulate=acc))
    for acc in ("hopper", "ada", "ampere", "b200", "b200_mma"):
        qa, qb = fs.quantize(x * np.float32(1e-37), "bf16"), fs.quantize(w, "bf16")     # subnormal results
        same_bits(fs.gemm(qa, qb, accumulate=acc, backend=dev.be), fs.gemm(qa, qb, accumulate=acc))
        qa, qb = fs.quantize(x, "bf16"), fs.quantize(w, "bf16")
        same_bits(fs.gemm(qa, qb, accumulate=acc, backend=dev.be), fs.gemm(qa, qb, accumulate=acc))
    big = np.full((2, 64), np.float32(ml_dtypes.bfloat16(2.0 ** 126)), np.float32)
    step = tc.get_model("hopper").step("bf16")
    got = tc.chain(big, big * np.float32(-1e-30) + np.float32(8), "bf16", "bf16", step, backend=dev.be)
    same_bits(got, tc.chain(big, big * np.float32(-1e-30) + np.float32(8), "bf16", "bf16", step))
    assert np.isinf(got).all()
    for sch, blk in (("nvfp4", 16), ("mxfp4", 32), ("mxfp8_e4m3", 32)):
        a, b = spread(24, 320 if sch == "nvfp4" else 256, blk, 12), spread(16, 320 if sch == "nvfp4" else 256, blk, 12)
        qa, qb = fs.quantize(a, sch), fs.quantize(b, sch)
        same_bits(fs.gemm(qa, qb, accumulate="tcgen05", backend=dev.be), fs.gemm(qa, qb, accumulate="tcgen05"))
    # MXFP8 with a subnormal accumulator that meets tiny terms (its exponent read at -126)
    xa = (rng.standard_normal((8, 256)) * 4).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    xb = (rng.standard_normal((8, 256)) * 4).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.full((8, 8), 2.0 ** -82)
    s[:, :2] = 2.0 ** -68
    got = tc.tcgen05_fp8(xa, "e4m3", s, xb, "e4m3", s, backend=dev.be)
    same_bits(got, tc.tcgen05_fp8(xa, "e4m3", s, xb, "e4m3", s))
    assert ((np.abs(got) < 2.0 ** -126) & (got != 0)).mean() > 0.5


def test_tensor_constants_on_the_device_equal_the_hosts(dev):
    """nvfp4_tensor_constants (made on the device from a tensor amax left there) against the host's
    planning.nvfp4_constants_rows, for every flavour, over amaxes of every binade, subnormals, 0, Inf, FLT_MAX
    and the amaxes around 2688 / FLT_MAX where the encode scale saturates."""
    from fp4sim.planning import nvfp4_constants_rows
    k = ops.kernels(dev.be)
    edge = np.array([0.0, np.inf, 3.4028235e38, 1e-45, 1e-40, 2688 / 3.4028235e38, 7.9e-36, 7.8e-36, 448.0, 6.0],
                    np.float32)
    amaxes = np.concatenate([edge, np.abs(SWEEP[np.isfinite(SWEEP)][::97])]).astype(np.float32)
    for flavor in ("te", "paper", "torchao", "modelopt"):
        c0, c1, dq = nvfp4_constants_rows(flavor, amaxes)
        for i, a in enumerate(amaxes):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                if flavor in ("te", "paper"):   # the one-amax path the host takes for a single tensor
                    c0, c1, dq = nvfp4_constants_rows(flavor, a)
                    j = 0
                else:
                    j = i
            got = dev.host(k.nvfp4_tensor_constants(dev.dev(np.array([a], np.float32).view(np.uint32)), flavor))
            want = np.array([c0[j], c1[j], dq[j, 0], dq[j, 1]], np.float32)
            assert np.array_equal(got.astype(np.float32).view(np.uint32), want.view(np.uint32)), (flavor, a, got, want)
            assert np.array_equal(got, want.astype(np.float64), equal_nan=True)   # exact float32 values


HALF = np.concatenate([heavy((16, 64), 9).ravel(), np.float32([6e-8, -6e-8, 3e-5, 65504, -0.0, np.nan, np.inf]),
                       np.float32(2.0) ** -np.arange(14, 25, dtype=np.float32)]).astype(np.float32)
HALF = np.resize(HALF, (24, 64))
# rows of float16 subnormals only (k * 2^-24), so whole blocks have a subnormal amax
HALF[20:] = (np.random.default_rng(3).integers(-1023, 1024, (4, 64)) * 2.0 ** -24).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4_2d", "mxfp4", "mxfp8_e4m3", "fp8_e4m3", "fp8_blockwise", "bf16"])
def test_16_bit_inputs_are_read_directly(dev, dtype, scheme):
    """float16 and bfloat16 inputs go to the block kernels as they are (no widening copy) and give the CPU
    backend's bits: float16 subnormals, NaN and Inf included, along both axes, round-to-nearest and SR."""
    dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    if dtype == "bfloat16" and isinstance(dev, _Cupy):
        pytest.skip("CuPy has no bfloat16 arrays (the host build reads ml_dtypes' bfloat16)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        x = HALF.astype(dt)
        for axis in (-1, 0):
            for rnd in ({}, {"rounding": "sr", "seed": 5}):
                want = fs.quantize(x, scheme, axis=axis, **rnd)
                got = ops.quantize(dev.be, dev.dev(x), scheme, axis=axis, **rnd)
                assert np.array_equal(dev.host(got.codes), want.codes), (dtype, scheme, axis, rnd)
                if want.scales is not None:
                    assert np.array_equal(dev.host(got.scales).view(np.uint8), np.asarray(want.scales).view(np.uint8))
                same_bits(dev.host(ops.quantize(dev.be, dev.dev(x), scheme, axis=axis, fake=True, **rnd)),
                          fs.fake_quantize(x, scheme, axis=axis, **rnd))
        ops.flush_warnings()


class _Counting:
    """Counts GpuKernels.to_host, the backend's only device-to-host read."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = ops.GpuKernels.to_host

        def counted(kself, a):
            self.n += 1
            return real(kself, a)
        monkeypatch.setattr(ops.GpuKernels, "to_host", counted)


@pytest.mark.parametrize("scheme,kw", [("nvfp4", {}), ("nvfp4", {"flavor": "torchao"}), ("nvfp4", {"flavor": "modelopt"}),
                                       ("nvfp4", {"flavor": "paper"}), ("nvfp4_2d", {}), ("nvfp4", {"global_amax": 3.0}),
                                       ("nvfp4", {"flavor": "torchao", "per_tensor_scale": False}), ("mxfp4", {}),
                                       ("mxfp8_e4m3", {}), ("fp8_e4m3", {}), ("fp8_blockwise", {})])
def test_quantize_reads_nothing_back_from_the_device(dev, monkeypatch, scheme, kw):
    """Quantize, fake_quantize and dequantize of these schemes never read the device (the tensor amax, the
    constants made from it and the NaN flags stay there), with round-to-nearest and SR; their warnings arrive
    once they are flushed, not during the call. 4over6, which chooses on the host, is counted (the counter works)."""
    x = SPECIALS
    ops.flush_warnings()
    count = _Counting(monkeypatch)
    for rnd in ({}, {"rounding": "sr", "seed": 3}):
        for fake in (False, True):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                q = ops.quantize(dev.be, dev.dev(x), scheme, fake=fake, **kw, **rnd)
            assert not seen, "the warnings need the device's values: they wait for a later call or a flush"
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                ops.flush_warnings()
            if scheme.startswith("fp8"):
                assert not seen
            else:   # SPECIALS holds a NaN (E2M1 has none) and an Inf (the MX block scale comes from it)
                expect = "Inf inside an MX block" if scheme == "mxfp8_e4m3" else "NaN in the input"
                assert any(expect in str(w.message) for w in seen), [str(w.message) for w in seen]
        ops.dequantize(dev.be, q if not fake else ops.quantize(dev.be, dev.dev(x), scheme, **kw, **rnd))
        assert count.n == 0, (scheme, kw, rnd)
        ops.flush_warnings()
    ops.quantize(dev.be, dev.dev(x), "nvfp4", four_over_six="mae")
    assert count.n > 0


def test_nvfp4_with_a_given_amax_takes_its_flags_from_the_quantize_kernel(dev, monkeypatch):
    """NVFP4 with a given second-level amax (or none) makes no amax pass: the quantize kernel sets the NaN / Inf
    flags itself, of the rotated values when the RHT is fused. The warnings are the CPU's, for NaN, Inf, both and
    neither, in full and partial blocks, 1x16 and 16x16, direct and through the fused RHT."""
    launched = []
    real = type(dev.be).launch
    monkeypatch.setattr(type(dev.be), "launch", lambda be, name, *a: (launched.append(name), real(be, name, *a))[1])

    def messages(fn):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
            ops.flush_warnings()
        return sorted({str(w.message) for w in seen})
    rng = np.random.default_rng(4)
    for where in ((), (3, 5), (29, 38), (3, 5, 29, 38)):
        for i, special in enumerate((np.nan, np.inf, -np.inf)):
            x = rng.standard_normal((32, 48)).astype(np.float32)
            x[where[:2]] = special if where else 0.0
            x[where[2:]] = (np.nan if i else np.inf) if len(where) > 2 else x[where[2:]]
            for scheme, kw in (("nvfp4", {"global_amax": 2.5}), ("nvfp4_2d", {"global_amax": 2.5}),
                               ("nvfp4", {"flavor": "torchao", "per_tensor_scale": False})):
                for fn_cpu, fn_dev in (
                        (lambda: fs.quantize(x, scheme, **kw),
                         lambda: ops.quantize(dev.be, dev.dev(x), scheme, **kw)),
                        (lambda: fs.quantize(x[:, :40], scheme, **kw),                   # a partial block
                         lambda: ops.quantize(dev.be, dev.dev(x[:, :40].copy()), scheme, **kw)),
                        (lambda: fs.quantize(fs.rht(x, 16, "te", out="bf16"), scheme, **kw),
                         lambda: ops.rht_quantize(dev.be, dev.dev(x), 16, "te", "bf16", scheme, **kw))):
                    launched.clear()
                    assert messages(fn_dev) == messages(fn_cpu), (where, special, scheme, kw)
                    assert "absmax_bits" not in launched and "rht_absmax_bits" not in launched, launched


class _DeviceStandIn(np.ndarray):
    """A host array standing in for a device array: every implicit read of its values (float(), int(), bool(),
    an index, item(), tolist()) is recorded, as each would synchronise with a GPU."""
    reads: list = []

    def _read(self, what):
        _DeviceStandIn.reads.append(what)
        return np.asarray(self).item()

    def __float__(self):
        return float(self._read("float"))

    def __int__(self):
        return int(self._read("int"))

    def __bool__(self):
        return bool(self._read("bool"))

    def __index__(self):
        return int(self._read("index"))

    def item(self, *a):
        return self._read("item")

    def tolist(self):
        self._read("tolist")
        return np.asarray(self).tolist()

    def get(self, out=None, blocking=True):          # an explicit read (GpuKernels.to_host, the pinned copies)
        if out is None:
            return np.asarray(self).copy()
        out[...] = np.asarray(self)
        return out


@pytest.mark.parametrize("preset", ["nvfp4_paper", "mxfp4_paper", "fp8_blockwise"])
def test_a_training_layer_reads_nothing_from_the_device(host_lib, monkeypatch, preset):
    """One layer's Fprop, Dgrad and Wgrad with accumulate="fast" on the CUDA source, with every array the backend
    makes standing in for a device array: no device-to-host read, explicit (GpuKernels.to_host) or implicit (a
    float() of a device value, a device bool in an if), so a GPU step never waits for the device. The stand-in
    records a float() of a quantized tensor's device amax (the detector works)."""
    import types
    from fp4sim import emulate
    from fp4sim.quantize import forced_kernels
    from fp4sim.training import Recipe

    def stand_in(a):
        return a.view(_DeviceStandIn) if type(a) is np.ndarray else a

    class Xp:                                    # NumPy whose array constructors make stand-ins
        cuda = types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0))

        def __getattr__(self, name):
            f = getattr(np, name)
            if name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "asarray", "ascontiguousarray",
                        "concatenate", "stack", "arange", "where", "array"):
                return lambda *a, **k: stand_in(f(*a, **k))
            return f

    class Event:
        done = True

        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event)))
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda s, d: np.empty(s, d)))
    be = HostBackend(host_lib)
    be.xp = Xp()
    launch = HostBackend.launch
    monkeypatch.setattr(HostBackend, "launch", lambda self, name, th, *args: launch(
        self, name, th, *[np.asarray(a) if isinstance(a, _DeviceStandIn) else a for a in args]))
    count = _Counting(monkeypatch)
    x, w, dy = (stand_in(heavy(s, i)) for s, i in (((64, 96), 11), ((48, 96), 12), ((64, 48), 13)))
    rec = Recipe.preset(preset, accumulate="fast", seed=5)
    _DeviceStandIn.reads = []
    with forced_kernels(ops.kernels(be)), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = [emulate.fprop(x, w, rec, layer=2, call=3)[0], emulate.dgrad(dy, w, rec, layer=2, call=3),
               emulate.wgrad(dy, x, rec, layer=2, call=3)]
    assert _DeviceStandIn.reads == [] and count.n == 0, (_DeviceStandIn.reads, count.n)
    assert all(isinstance(o, _DeviceStandIn) for o in out)          # the results stayed on the "device"
    float(ops.quantize(be, x, "nvfp4").global_amax)
    assert _DeviceStandIn.reads == ["float"]
    ops.kernels(be).poll_warnings(wait=True)


def test_dequantize_reads_a_device_tensor_amax_on_the_device(dev):
    """A QuantizedTensor whose global_amax is a device array (what the GPU's quantize returns) dequantizes with
    the constants made on the device from it: the host's bits, for every flavour."""
    class Dev(np.ndarray):           # a host array that looks like a device one to the planning layer
        def get(self):
            return np.asarray(self)
    for flavor in ("te", "paper", "torchao", "modelopt"):
        want = fs.quantize(CASES["heavy"], "nvfp4", flavor=flavor)
        got = ops.quantize(dev.be, dev.dev(CASES["heavy"]), "nvfp4", flavor=flavor)
        if not hasattr(got.global_amax, "get"):
            got = dataclasses.replace(got, global_amax=np.asarray(got.global_amax, np.float32).view(Dev))
        assert planning.plan_dequantize(got).dq is None
        same_bits(dev.host(ops.dequantize(dev.be, got)), fs.dequantize(want))


@pytest.mark.parametrize("scheme,kw", [("nvfp4", {}), ("nvfp4", {"flavor": "torchao"}), ("nvfp4_2d", {}),
                                       ("nvfp4", {"global_amax": 2.5}), ("mxfp4", {}), ("nvfp4", {"row_scaled": True})])
def test_rht_fused_into_the_quantize(dev, scheme, kw):
    """quantize(rht(x)) with the RHT inside the NVFP4 amax and quantize kernels (d = 16; the rotated tensor never
    stored) gives the two calls' bits: along both axes, bfloat16 and float32 RHT outputs, RNE and SR, float16
    inputs too; what the fused kernels do not take (MX, row-scaled) runs as the two calls."""
    x = np.concatenate([CASES["heavy"], np.tile(SPECIALS[:16], (1, 3))[:, :160]])   # (64, 160), NaN and Inf too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for xin in (x, x.astype(np.float16)):
            for axis in (-1, 0):
                for out in ("bf16", "fp32"):
                    for rnd in ({}, {"rounding": "sr", "seed": 7}):
                        for signs in ("te", 3):
                            want = fs.quantize(fs.rht(xin, 16, signs, axis=axis, out=out, memory="axis_last"), scheme,
                                               axis=axis, **kw, **rnd)
                            got = ops.rht_quantize(dev.be, dev.dev(xin), 16, signs, out, scheme, axis=axis, **kw,
                                                   **rnd)
                            assert np.array_equal(dev.host(got.codes), want.codes), (scheme, kw, axis, out, rnd)
                            assert np.array_equal(dev.host(got.scales).view(np.uint8),
                                                  np.asarray(want.scales).view(np.uint8))
                            if want.global_amax is not None:
                                assert np.array_equal(np.asarray(dev.host(got.global_amax)),
                                                      np.asarray(want.global_amax))
                        fake = ops.rht_quantize(dev.be, dev.dev(xin), 16, "te", out, scheme, axis=axis, fake=True,
                                                **kw)
                        same_bits(dev.host(fake), fs.fake_quantize(fs.rht(xin, 16, "te", axis=axis, out=out), scheme,
                                                                   axis=axis, **kw))
        ops.flush_warnings()


@pytest.mark.parametrize("preset,kw", [("nvfp4_paper", {}), ("nvfp4_paper", {"rht_fprop": True}),
                                       ("mxfp4_paper", {}), ("fp8_blockwise", {}), ("mxfp8", {})])
def test_the_training_gemms_through_the_cuda_source(dev, preset, kw):
    """emulate.fprop / dgrad / wgrad of one layer with every quantization on the CUDA kernels (on the host build:
    fp4sim.quantize.forced_kernels) give the CPU backend's bits: the tensor amaxes and constants kept on the
    device, the operands quantized along their first axis read in place, the Wgrad RHT fused into the NVFP4
    kernels, SR on the gradients; accumulate="fast" and the exact rule."""
    from fp4sim import emulate, fastpath
    from fp4sim.quantize import forced_kernels
    from fp4sim.training import Recipe
    if isinstance(dev, _Cupy):
        pytest.skip("the CuPy run is tests/test_training.py's QuantLinear on CUDA")
    x, w, dy = heavy((64, 96), 11), heavy((48, 96), 12), heavy((64, 48), 13)
    for acc in ("fast", "exact"):
        rec = Recipe.preset(preset, accumulate=acc, seed=5, **kw)
        old = fastpath._set_enabled(False)                 # the CPU side on its general path too
        try:
            want = [emulate.fprop(x, w, rec, layer=2, call=3)[0], emulate.dgrad(dy, w, rec, layer=2, call=3),
                    emulate.wgrad(dy, x, rec, layer=2, call=3)]
        finally:
            fastpath._set_enabled(old)
        with forced_kernels(ops.kernels(dev.be)), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = [emulate.fprop(x, w, rec, layer=2, call=3)[0], emulate.dgrad(dy, w, rec, layer=2, call=3),
                   emulate.wgrad(dy, x, rec, layer=2, call=3)]
        for g, wnt, what in zip(got, want, ("fprop", "dgrad", "wgrad")):
            same_bits(np.asarray(g, np.float32), np.asarray(wnt, np.float32))
