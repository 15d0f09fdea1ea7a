"""fp4sim.tensorcore against three independent oracles: the hardware test vectors of the Khattak-Mikaitis
toolbox (5,000 recorded instruction outputs per chip and format), mmaemu's ``scaled_mm`` (cuBLAS FP8 GEMMs as
recorded on an H100 and an RTX 4060) and the rational model in ``fp4sim.reference.tensorcore``."""
from __future__ import annotations

import warnings
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import fp4sim as fs
from fp4sim import tensorcore as tc
from fp4sim.reference import tensorcore as ref
from fp4sim.tensorcore.accumulate import EMIN

VEC = Path(__file__).parent / "data" / "tensorcore_vectors"
CHIP_MODEL = {"A100": "ampere", "H100": "hopper", "H200": "hopper", "Ada": "ada", "B200": "b200_mma"}
CODE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2}
FAMILY = {"e4m3": "fp8", "e5m2": "fp8"}
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _vector_sets():
    for chip in CHIP_MODEL:
        z = np.load(VEC / f"{chip}.npz")
        for f in sorted({k.rsplit("_", 1)[0] for k in z.files}):
            yield chip, f


def _values(codes, f):
    return codes.view(np.float32) if f == "tf32" else codes.view(CODE[f]).astype(np.float32)


@pytest.mark.parametrize("chip,fmt", list(_vector_sets()))
def test_hardware_vectors(chip, fmt):
    """Every recorded instruction output of the toolbox, bit for bit, through the chip's model."""
    z = np.load(VEC / f"{chip}.npz")
    a, b = _values(z[f"{fmt}_a"], fmt), _values(z[f"{fmt}_b"], fmt)
    c, d = z[f"{fmt}_c"].view(np.float32), z[f"{fmt}_d"]
    step = tc.get_model(CHIP_MODEL[chip]).step(FAMILY.get(fmt, fmt))
    got = np.array([tc.chain(a[i:i + 1], b[i:i + 1], fmt, fmt, step, C=c[i:i + 1].reshape(1, 1))[0, 0]
                    for i in range(len(c))], np.float32)
    assert len(c) == 5000
    assert (got.view(np.uint32) == d).sum() == 5000


# ---------------------------------------------------------------------------------------------------------
# mmaemu: torch._scaled_mm as recorded
def _mmaemu(*args, **kw):
    import mmaemu
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mmaemu.scaled_mm(*args, **kw)


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _fp8(x, dt):
    return torch.from_numpy(np.asarray(x, np.float32)).to(dt)


def _operands(rng, M, K, N, kind, dta=E4, dtb=E4):
    if kind == "random":
        a = rng.standard_normal((M, K)) * np.exp2(rng.integers(-8, 6, (M, K)))
        w = rng.standard_normal((N, K)) * np.exp2(rng.integers(-8, 6, (N, K)))
    elif kind == "subnormal":                                   # E4M3 subnormals are below 2^-6, E5M2's 2^-14
        a = rng.integers(-7, 8, (M, K)) * 2.0 ** -9
        w = rng.integers(-3, 4, (N, K)) * 2.0 ** -16 * (1 + (rng.random((N, K)) < 0.3) * 2 ** 10)
    elif kind == "cancel":                                      # large terms cancelling, small ones surviving
        a = rng.choice([-448.0, 448.0, -0.0625, 0.0625, 2.0 ** -6], (M, K))
        w = np.repeat(rng.choice([-1.0, 1.0, 0.0078125], (N, K // 2)), 2, axis=1)
        a[:, 1::2] = -a[:, ::2]
        a[:, 5::16] = 0.001
    elif kind == "spread":                                      # exponents over the whole range of both formats
        a = rng.choice([-1, 1], (M, K)) * np.exp2(rng.integers(-9, 9, (M, K)).astype(float))
        w = rng.choice([-1, 1], (N, K)) * np.exp2(rng.integers(-9, 9, (N, K)).astype(float))
    else:
        raise AssertionError(kind)
    return _fp8(a, dta), _fp8(w, dtb)


SA, SB = torch.tensor(0.37, dtype=torch.float32), torch.tensor(1.9, dtype=torch.float32)


@pytest.mark.parametrize("model", ["hopper", "ada"])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("dts", [(E4, E4), (E4, E5), (E5, E4)], ids=["e4m3", "e4m3_e5m2", "e5m2_e4m3"])
def test_scaled_mm_equals_mmaemu(model, fast, dts):
    rng = np.random.default_rng(hash((model, fast, str(dts))) % 2 ** 32)
    outs = [torch.float32, torch.bfloat16, torch.float16, E4] + ([E5] if dts != (E4, E4) else [])
    for kind in ("random", "subnormal", "cancel", "spread"):
        for M, K, N in ((8, 400, 16), (5, 1024, 32)):
            a, w = _operands(rng, M, K, N, kind, *dts)
            for od in outs:
                want = _mmaemu(a, w.t(), SA, SB, out_dtype=od, use_fast_accum=fast, profile=model, splitk=1)
                got = tc.scaled_mm(a, w.t(), SA, SB, out_dtype=od, use_fast_accum=fast, model=model)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(_bits(got), _bits(want)), (kind, M, K, N, od)


@pytest.mark.parametrize("model", ["hopper", "ada"])
def test_scaled_mm_nonfinite_and_fp8_outputs_equal_mmaemu(model):
    """NaN and Inf codes (E5M2 infinities, Inf x 0, +Inf and -Inf together), a saturating FP8 output with
    scale_result, and zero rows."""
    rng = np.random.default_rng(7)
    M, K, N = 8, 256, 32
    a, w = _operands(rng, M, K, N, "random", E5, E4)
    av, wv = a.float(), w.float()
    av[0, 3] = float("nan")
    av[1, 10] = float("inf")
    av[2, 11], av[2, 12] = float("inf"), float("-inf")
    av[3, 20] = float("-inf")
    wv[5, 20] = 0.0
    wv[7, 40] = float("nan")
    av[4] = 0.0
    a, w = av.to(E5), wv.to(E4)
    for fast in (True, False):
        for od, sr in ((torch.float32, None), (torch.bfloat16, None), (E4, torch.tensor(8.0)), (E5, None)):
            kw = {} if sr is None else {"scale_result": sr}
            want = _mmaemu(a, w.t(), SA, SB, out_dtype=od, use_fast_accum=fast, profile=model, splitk=1, **kw)
            got = tc.scaled_mm(a, w.t(), SA, SB, out_dtype=od, use_fast_accum=fast, model=model, **kw)
            assert torch.equal(_bits(got), _bits(want)), (fast, od)


@pytest.mark.parametrize("model,split", [("hopper", (2, "contiguous")), ("hopper", (3, "contiguous")),
                                         ("ada", (2, "serial")), ("ada", (3, "pairwise")), ("ada", (4, "serial"))])
@pytest.mark.parametrize("fast", [True, False])
def test_split_k_equals_mmaemu(model, split, fast):
    rng = np.random.default_rng(3)
    a, w = _operands(rng, 6, 1168, 16, "random")               # 1168: ragged last k-tile for both tile widths
    want = _mmaemu(a, w.t(), SA, SB, out_dtype=torch.float32, use_fast_accum=fast, profile=model, splitk=split)
    got = tc.scaled_mm(a, w.t(), SA, SB, out_dtype=torch.float32, use_fast_accum=fast, model=model, split_k=split)
    assert torch.equal(_bits(got), _bits(want))


def test_b200_mma_instruction_equals_mmaemu_dot():
    """The late addend of the B200 mma.sync fit, from nonzero float32 addends."""
    from mmaemu.model.chain import dot
    rng = np.random.default_rng(11)
    a, w = _operands(rng, 64, 96, 1, "spread", E4, E5)
    w = w.t().expand(-1, 64).t().contiguous()                  # one B column per row of A: 64 instruction chains
    w = _fp8(rng.standard_normal((64, 96)) * np.exp2(rng.integers(-10, 10, (64, 96))), E5)
    c = torch.from_numpy((rng.standard_normal(64) * np.exp2(rng.integers(-20, 20, 64))).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = dot(a, w, c, preset="b200_mma_sync")
    step = tc.get_model("b200_mma").step("fp8")
    got = np.array([tc.chain(a[i:i + 1].float().numpy(), w[i:i + 1].float().numpy(), "e4m3", "e5m2", step,
                             C=c[i:i + 1].numpy().reshape(1, 1))[0, 0] for i in range(64)], np.float32)
    assert (got.view(np.uint32) == want.numpy().view(np.uint32)).all()


# ---------------------------------------------------------------------------------------------------------
# the rational oracle, for the BF16 / FP16 / TF32 models mmaemu does not cover
def _adversarial(rng, fmt, n, K):
    """Values of ``fmt`` over its whole range: subnormals, large exponent gaps, exact cancellations."""
    lo, hi = {"bf16": (-133, 127), "fp16": (-24, 15), "tf32": (-133, 127)}[fmt]
    e = rng.integers(lo, hi, (n, K))
    e = np.where(rng.random((n, K)) < 0.5, rng.integers(-3, 3, (n, K)), e)     # half near 1: cancellations
    x = rng.choice([-1, 1], (n, K)) * (1 + rng.integers(0, 1024, (n, K)) / 1024) * np.exp2(e.astype(float))
    x = np.where(rng.random((n, K)) < 0.1, 0.0, x)
    if fmt == "tf32":
        v = x.astype(np.float32)
        return (v.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return x.astype(CODE[fmt]).astype(np.float32)


@pytest.mark.parametrize("model", ["hopper", "ampere", "ada", "b200_mma"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "tf32"])
def test_chain_equals_rational_model(model, fmt):
    rng = np.random.default_rng(hash((model, fmt)) % 2 ** 32)
    step = tc.get_model(model).step(fmt)
    n, K = 40, 3 * step.nfma + 5
    a, b = _adversarial(rng, fmt, n, K), _adversarial(rng, fmt, n, K)
    b[::4] = -a[::4]                                         # whole rows cancelling exactly
    b[1::4, :-1] = a[1::4, 1:]
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 120, n))).astype(np.float32)
    c[::5] = 0
    for i in range(n):
        got = tc.chain(a[i:i + 1], b[i:i + 1], fmt, fmt, step, C=c[i:i + 1].reshape(1, 1))[0, 0]
        want = ref.dot([Fraction(float(x)) for x in a[i]], [Fraction(float(x)) for x in b[i]], step,
                       EMIN[fmt], EMIN[fmt], c=Fraction(float(c[i])))
        want = np.float32(float(want))
        assert got.tobytes() == want.tobytes(), (i, got, want)


@pytest.mark.parametrize("model", ["hopper", "ampere", "b200_mma"])
def test_subnormal_results_truncate_on_the_float32_grid(model):
    """Sums below 2^-126: the result is truncated to float32's subnormal grid, not rounded to it."""
    rng = np.random.default_rng(8)
    step = tc.get_model(model).step("bf16")
    e = rng.integers(-73, -66, (30, 2 * step.nfma)).astype(float)
    a = (rng.choice([-1, 1], e.shape) * (1 + rng.integers(0, 128, e.shape) / 128) * np.exp2(e)).astype(
        ml_dtypes.bfloat16).astype(np.float32)
    b = ((1 + rng.integers(0, 128, e.shape) / 128) * np.exp2(e[:, ::-1])).astype(ml_dtypes.bfloat16).astype(
        np.float32)
    n_sub = 0
    for i in range(30):
        got = tc.chain(a[i:i + 1], b[i:i + 1], "bf16", "bf16", step)[0, 0]
        want = np.float32(float(ref.dot([Fraction(float(x)) for x in a[i]], [Fraction(float(x)) for x in b[i]],
                                        step, -126, -126)))
        assert got.tobytes() == want.tobytes(), (i, got, want)
        n_sub += 0 < abs(want) < 2.0 ** -126
    assert n_sub >= 20


def test_scaled_fp8_chain_truncates_below_float32_normals():
    """chain_exp on FP8 values carrying a power-of-two scale (as block-scaled operands do): the 13-bit FP8 step's
    sums fall below 2^-126, where they keep the bits down to 2^-139 and truncate to a signed zero below that; the
    row blocks and lane tiles of the kernel (M > 16, N > 64) are walked with per-output addends."""
    from fp4sim.tensorcore.accumulate import chain_exp, exponents
    rng = np.random.default_rng(21)
    M, N, K, shift = 19, 70, 40, 70
    step = tc.get_model("hopper").step("fp8")
    e4 = ml_dtypes.float8_e4m3fn
    a = (rng.standard_normal((M, K)) * np.exp2(rng.integers(-8, 3, (M, K)))).astype(e4).astype(np.float32)
    b = (rng.standard_normal((N, K)) * np.exp2(rng.integers(-8, 3, (N, K)))).astype(e4).astype(np.float32)
    b[::3, :] = -b[::3, ::-1]                            # cancelling terms: results near 0 of either sign
    a[0, :] = 0                                          # a row of zeros: +0
    s = np.exp2(-shift)
    A, B = a.astype(np.float64) * s, b.astype(np.float64) * s
    EA, EB = exponents(a, "e4m3") - shift, exponents(b, "e4m3") - shift
    c = (rng.standard_normal((M, N)) * np.exp2(rng.integers(-152, -124, (M, N)))).astype(np.float32)
    c[::2] = 0
    got = chain_exp(A, EA, B, EB, step, C=c)           # (zeros' exponents stay far below every maximum)
    n_tiny = n_zero = 0
    for i in range(M):
        for j in range(N):
            want = ref.dot([Fraction(float(x)) for x in A[i]], [Fraction(float(x)) for x in B[j]], step,
                           -6 - shift, -6 - shift, c=Fraction(float(c[i, j])))
            want = np.float32(float(want))
            assert got[i, j].tobytes() == want.tobytes(), (i, j, got[i, j], want)
            n_tiny += 0 < abs(want) < 2.0 ** -126
            n_zero += want == 0
    assert n_tiny > 200 and n_zero > 50, (n_tiny, n_zero)


def test_slow_accumulation_equals_rational_model():
    """128-element restarts added in float32 (the reference adds them with exact nearest-even roundings)."""
    rng = np.random.default_rng(5)
    step = tc.get_model("hopper").step("fp8")
    a = _operands(rng, 6, 400, 1, "random")[0].float().numpy()
    b = _operands(rng, 6, 400, 1, "spread")[0].float().numpy()
    got = tc.accumulate(a, b, "e4m3", "e4m3", "hopper", "fp8", fast=False)
    for i in range(6):
        for j in range(6):
            want = ref.gemm_entry([Fraction(float(x)) for x in a[i]], [Fraction(float(x)) for x in b[j]], step,
                                  -6, -6, chunk=128)
            assert got[i, j].tobytes() == np.float32(float(want)).tobytes()


def test_overflowing_bf16_accumulator_is_infinite():
    step = tc.get_model("hopper").step("bf16")
    big = np.float32(ml_dtypes.bfloat16(2.0 ** 126))
    a = np.full((1, 32), big, np.float32)
    b = np.full((1, 32), np.float32(8.0), np.float32)
    assert tc.chain(a, b, "bf16", "bf16", step)[0, 0] == np.inf
    assert tc.chain(a, -b, "bf16", "bf16", step)[0, 0] == -np.inf


# ---------------------------------------------------------------------------------------------------------
# the exact rule, NumPy operands, and what is refused
def test_exact_model_equals_float64_blocks():
    rng = np.random.default_rng(2)
    a, w = _operands(rng, 4, 512, 16, "random")
    got = tc.scaled_mm(a, w.t(), SA, SB, out_dtype=torch.float32, model="exact").numpy()
    av, wv = a.double().numpy(), w.double().numpy()
    acc = np.zeros((4, 16), np.float32)
    for k0 in range(0, 512, 128):
        acc = acc + (av[:, k0:k0 + 128] @ wv[:, k0:k0 + 128].T).astype(np.float32)
    alpha = np.float32(np.float64(np.float32(0.37)) * np.float64(np.float32(1.9)))
    assert got.tobytes() == (acc * alpha).tobytes()


def test_numpy_operands_give_numpy_results():
    rng = np.random.default_rng(4)
    a, w = _operands(rng, 4, 256, 16, "random")
    an = a.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    wn = w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    got = tc.scaled_mm(an, wn.T, np.float32(0.37), np.float32(1.9), out_dtype="bfloat16", use_fast_accum=True)
    want = tc.scaled_mm(a, w.t(), SA, SB, out_dtype=torch.bfloat16, use_fast_accum=True)
    assert isinstance(got, np.ndarray) and got.dtype == ml_dtypes.bfloat16
    assert got.view(np.int16).tobytes() == _bits(want).numpy().tobytes()
    d = tc.scaled_mm(an, wn.T, np.float32(1), np.float32(1))
    assert d.dtype == ml_dtypes.float8_e4m3fn                 # torch's default: a's dtype


@pytest.mark.parametrize("kw,msg", [
    (dict(model="tpu"), "model='tpu': use one of"),
    (dict(model="ampere"), "no FP8 inner-product model"),
    (dict(model="b200_mma", use_fast_accum=False), "slow accumulation is not characterised"),
    (dict(split_k=(2, "serial")), "splits K as 'contiguous'"),
    (dict(split_k=2), "use 1 (unsplit) or (S, scheme)"),
    (dict(model="ada", split_k=(2, "serial"), use_fast_accum=True, out_dtype="float64"), "out_dtype='float64'"),
    (dict(scale_a=torch.ones(4, 1)), "scale_a must be a one-element float32"),
    (dict(scale_b=0.1), "scale_b=0.1 is not a float32 value"),
])
def test_refusals(kw, msg):
    rng = np.random.default_rng(0)
    a, w = _operands(rng, 4, 64, 16, "random")
    args = dict(scale_a=SA, scale_b=SB)
    args.update({k: kw.pop(k) for k in ("scale_a", "scale_b") if k in kw})
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        tc.scaled_mm(a, w.t(), args["scale_a"], args["scale_b"], **kw)


def test_shape_and_format_refusals():
    rng = np.random.default_rng(0)
    a, w = _operands(rng, 4, 64, 16, "random")
    with pytest.raises(ValueError, match="K = 56 and N = 16 must be multiples of 16"):
        tc.scaled_mm(a[:, :56], w[:, :56].t(), SA, SB)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        tc.scaled_mm(a, w, SA, SB)
    with pytest.raises(ValueError, match="both float8_e5m2"):
        tc.scaled_mm(a.float().to(E5), w.t().float().to(E5), SA, SB)
    with pytest.raises(ValueError, match="cuBLASLt refuses"):
        tc.scaled_mm(a, w.t(), SA, SB, out_dtype=E5)
    with pytest.raises(TypeError, match="scaled_mm takes FP8 operands"):
        tc.scaled_mm(a.float(), w.t(), SA, SB)


# ---------------------------------------------------------------------------------------------------------
# MMA-Sim: the instructions (tcgen05 block-scaled, wgmma, mma)
def _mmasim(cls, arch, shape_and_type):
    from mmasim.nv_ptx import sim
    return getattr(sim, cls)(arch, shape_and_type)


def _spread_nvfp4(rng, rows, K):
    """An NVFP4 operand whose block scales spread over many binades (codes and the scale bytes)."""
    import fp4sim as fs
    x = rng.standard_normal((rows, K)) * np.exp2(rng.integers(-10, 6, (rows, K // 16))).repeat(16, 1)
    return fs.quantize(x.astype(np.float32), "nvfp4")


def _sim_fp4_chain(op, va, vb, sa_codes, sb_codes, dt):
    t = torch.from_numpy
    return op(t(va).half(), t(np.ascontiguousarray(vb.T)).half(), torch.zeros(va.shape[0], vb.shape[0]),
              t(np.ascontiguousarray(sa_codes)).view(dt), t(np.ascontiguousarray(sb_codes.T)).view(dt)).numpy()


def test_tcgen05_nvfp4_equals_mmasim():
    import fp4sim as fs
    from fp4sim.gemm import _nvfp4_alpha, _values
    rng = np.random.default_rng(12)
    qa, qb = _spread_nvfp4(rng, 24, 320), _spread_nvfp4(rng, 16, 320)       # 320: a ragged last instruction
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3")
    va, vb = _values(qa, np), _values(qb, np)
    pad = lambda v, n: np.pad(v, ((0, 0), (0, n - v.shape[1])))             # noqa: E731
    acc = _sim_fp4_chain(op, pad(va, 384), pad(vb, 384), pad(qa.scales_per_row(), 24),
                         pad(qb.scales_per_row(), 24), torch.float8_e4m3fn)
    want = (_nvfp4_alpha(qa, qb, np) * acc).astype(np.float32)
    got = fs.gemm(qa, qb, accumulate="tcgen05")
    assert got.tobytes() == want.tobytes()
    # the two published models of the one chip are told apart by these operands
    assert (got != fs.gemm(qa, qb, accumulate="k64_rtz")).any()


def test_tcgen05_mxfp4_and_mxfp8_equal_mmasim():
    import fp4sim as fs
    from fp4sim.gemm import _values
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((16, 256)) * np.exp2(rng.integers(-20, 20, (16, 8))).repeat(32, 1)).astype(np.float32)
    y = (rng.standard_normal((8, 256)) * np.exp2(rng.integers(-20, 20, (8, 8))).repeat(32, 1)).astype(np.float32)
    qa, qb = fs.quantize(x, "mxfp4"), fs.quantize(y, "mxfp4")
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", "m128n8k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0")
    want = _sim_fp4_chain(op, _values(qa, np), _values(qb, np), qa.linear_scales(), qb.linear_scales(),
                          torch.float8_e8m0fnu)
    assert fs.gemm(qa, qb, accumulate="tcgen05").tobytes() == want.tobytes()
    for sch_a, sch_b in (("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e4m3")):
        qa, qb = fs.quantize(x, sch_a), fs.quantize(y, sch_b)
        fa, fb = qa.scheme.elem.name, qb.scheme.elem.name
        op = _mmasim("TCGen05MMABlockScale", "Blackwell", f"m128n8k32.kind::mxf8f6f4.block32.f32.{fa}.{fb}.ue8m0")
        A = torch.from_numpy(qa.codes.reshape(16, 256)).view(getattr(torch, f"float8_{fa}" + ("fn" if fa == "e4m3" else "")))
        B = torch.from_numpy(np.ascontiguousarray(qb.codes.reshape(8, 256).T)).view(
            getattr(torch, f"float8_{fb}" + ("fn" if fb == "e4m3" else "")))
        sa, sb = qa.linear_scales(), qb.linear_scales()
        C = torch.zeros(16, 8)
        for k in range(8):                                  # one K32 instruction per scale block
            C = op(A[:, 32 * k:32 * k + 32], B[32 * k:32 * k + 32], C,
                   torch.from_numpy(np.ascontiguousarray(sa[:, k:k + 1])).view(torch.float8_e8m0fnu),
                   torch.from_numpy(np.ascontiguousarray(sb[:, k:k + 1].T)).view(torch.float8_e8m0fnu))
        assert fs.gemm(qa, qb, accumulate="tcgen05").tobytes() == C.numpy().tobytes(), (sch_a, sch_b)


def _mx_codes(q, rows, K):
    """An MX operand's codes as MMA-Sim takes them: FP8 as torch float8, FP6 one per uint8 (bits 5:0)."""
    c = torch.from_numpy(np.ascontiguousarray(q.codes.reshape(rows, K)))
    return {"e4m3": lambda: c.view(E4), "e5m2": lambda: c.view(E5)}.get(q.scheme.elem.name, lambda: c)()


def _mmasim_mxf8f6f4(qa, qb, M, N, K, C=None):
    """MMA-Sim's tcgen05 kind::mxf8f6f4 chain over K, one K32 instruction per scale block."""
    fa, fb = qa.scheme.elem.name, qb.scheme.elem.name
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", f"m128n8k32.kind::mxf8f6f4.block32.f32.{fa}.{fb}.ue8m0")
    A, B = _mx_codes(qa, M, K), _mx_codes(qb, N, K).T.contiguous()
    sa, sb = qa.linear_scales(), qb.linear_scales()
    C = torch.zeros(M, N) if C is None else C
    for k in range(K // 32):
        C = op(A[:, 32 * k:32 * k + 32], B[32 * k:32 * k + 32], C,
               torch.from_numpy(np.ascontiguousarray(sa[:, k:k + 1])).view(torch.float8_e8m0fnu),
               torch.from_numpy(np.ascontiguousarray(sb[:, k:k + 1].T)).view(torch.float8_e8m0fnu))
    return C.numpy()


@pytest.mark.parametrize("pair", [("mxfp6_e2m3", "mxfp6_e2m3"), ("mxfp6_e3m2", "mxfp6_e3m2"),
                                  ("mxfp6_e3m2", "mxfp6_e2m3"), ("mxfp6_e2m3", "mxfp8_e4m3"),
                                  ("mxfp8_e5m2", "mxfp6_e3m2")])
def test_tcgen05_mxfp6_equals_mmasim(pair):
    """fs.gemm(accumulate='tcgen05') on MXFP6 operands, alone and mixed with MXFP8 (kind::mxf8f6f4 takes any pair),
    equals MMA-Sim's Blackwell model over random blocks with spread scales, blocks holding mostly FP6 subnormals,
    groups that cancel exactly and all-zero groups under large scales."""
    import fp4sim as fs
    rng = np.random.default_rng(31)
    M, N, K = 16, 8, 320
    x = rng.standard_normal((M, K)) * np.exp2(rng.integers(-20, 20, (M, K // 32))).repeat(32, 1)
    y = rng.standard_normal((N, K)) * np.exp2(rng.integers(-20, 20, (N, K // 32))).repeat(32, 1)
    x[:, 32:64] = rng.standard_normal((M, 32)) * 1e-3      # one large element per block: the rest are
    x[:, 32] = 100.0                                         # FP6 subnormals after scaling
    y[:, 32:64] = rng.standard_normal((N, 32)) * 1e-2
    y[:, 33] = 50.0
    x[:, 64:96], y[:, 64:96] = 1.0, np.tile([1.0, -1.0], 16)  # products cancelling exactly
    x[:, 96:128] = 0.0                                       # an all-zero block ...
    y[:, 96:128] = 3e30                                      # ... against a large scale
    qa, qb = fs.quantize(x.astype(np.float32), pair[0]), fs.quantize(y.astype(np.float32), pair[1])
    want = _mmasim_mxf8f6f4(qa, qb, M, N, K)
    got = fs.gemm(qa, qb, accumulate="tcgen05")
    assert got.tobytes() == want.tobytes(), np.abs(got - want).max()


@pytest.mark.parametrize("fmt", ["e2m3", "e3m2"])
def test_tcgen05_fp6_subnormal_blocks_equal_mmasim(fmt, monkeypatch):
    """Blocks of FP6 subnormals only (their products' exponents clamp at the element's smallest normal exponent,
    0 for E2M3 and -2 for E3M2, which sets the step's alignment) after blocks that leave a full-precision
    accumulator: tc.tcgen05_fp8 equals MMA-Sim, and moving either clamp by one breaks the equality."""
    import importlib
    import fp4sim as fs
    acc_mod = importlib.import_module("fp4sim.tensorcore.accumulate")
    rng = np.random.default_rng(5)
    F, M, N, K = fs.get_format(fmt), 8, 8, 256
    ca, cb = rng.integers(0, 64, (M, K)).astype(np.uint8), rng.integers(0, 64, (N, K)).astype(np.uint8)
    for c in (ca, cb):
        for k in range(1, K // 32, 2):                   # odd blocks: exponent field 0, nonzero, either sign
            c[:, 32 * k:32 * k + 32] = rng.integers(1, 1 << F.mbits, (c.shape[0], 32)) | (
                rng.integers(0, 2, (c.shape[0], 32)) << 5)
    ea = rng.integers(100, 140, (M, K // 32)).astype(np.uint8)
    eb = rng.integers(100, 140, (N, K // 32)).astype(np.uint8)
    ea[:, 1::2] += 12                                   # the subnormal blocks' products above the accumulator
    eb[:, 1::2] += 12
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", f"m128n8k32.kind::mxf8f6f4.block32.f32.{fmt}.{fmt}.ue8m0")
    A, B = torch.from_numpy(ca), torch.from_numpy(np.ascontiguousarray(cb.T))
    C = torch.zeros(M, N)
    for k in range(K // 32):
        C = op(A[:, 32 * k:32 * k + 32], B[32 * k:32 * k + 32], C,
               torch.from_numpy(np.ascontiguousarray(ea[:, k:k + 1])).view(torch.float8_e8m0fnu),
               torch.from_numpy(np.ascontiguousarray(eb[:, k:k + 1].T)).view(torch.float8_e8m0fnu))

    def ours():
        return tc.tcgen05_fp8(fs.decode(ca, F), fmt, np.exp2(ea - 127.0), fs.decode(cb, F), fmt, np.exp2(eb - 127.0))

    assert ours().tobytes() == C.numpy().tobytes()
    for d in (-1, 1):
        monkeypatch.setitem(acc_mod.EMIN, fmt, {"e2m3": 0, "e3m2": -2}[fmt] + d)
        assert ours().tobytes() != C.numpy().tobytes(), d


@pytest.mark.parametrize("model,cls,arch,shapes", [
    ("hopper", "WGMMA", "Hopper", {"bf16": "m64n8k16.f32.bf16.bf16", "fp16": "m64n8k16.f32.f16.f16",
                                   "tf32": "m64n8k8.f32.tf32.tf32", "e4m3": "m64n8k32.f32.e4m3.e5m2"}),
    ("ampere", "MMA", "Ampere", {"bf16": "m16n8k16.f32.bf16.bf16.f32", "fp16": "m16n8k16.f32.f16.f16.f32",
                                 "tf32": "m16n8k8.f32.tf32.tf32.f32"}),
    ("ada", "MMA", "Ada Lovelace", {"bf16": "m16n8k16.f32.bf16.bf16.f32", "tf32": "m16n8k8.f32.tf32.tf32.f32",
                                    "e4m3": "m16n8k32.f32.e4m3.e5m2.f32"}),
    ("b200", "TCGen05MMA", "Blackwell", {"bf16": "m64n8k16.kind::f16.f32.bf16.bf16",
                                         "fp16": "m64n8k16.kind::f16.f32.f16.f16",
                                         "tf32": "m64n8k8.kind::tf32.f32.tf32.tf32",
                                         "e4m3": "m64n8k32.kind::f8f6f4.f32.e4m3.e5m2"}),
])
def test_chip_models_equal_mmasim_instructions(model, cls, arch, shapes):
    """fp4sim's chip models, fed the same operands, equal MMA-Sim's wgmma / mma models (chains over K = 256)."""
    rng = np.random.default_rng(14)
    for fmt, st in shapes.items():
        op = _mmasim(cls, arch, st)
        fb = "e5m2" if fmt == "e4m3" else fmt
        x = rng.standard_normal((8, 256)) * np.exp2(rng.integers(-12, 12, (8, 256)))
        w = rng.standard_normal((8, 256)) * np.exp2(rng.integers(-12, 12, (8, 256)))
        tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "e4m3": E4, "e5m2": E5}
        A, B = torch.from_numpy(x.astype(np.float32)).to(tdt[fmt]), torch.from_numpy(w.astype(np.float32)).to(tdt[fb])
        if fmt == "tf32":
            A = (A.view(torch.int32) >> 13 << 13).view(torch.float32)
            B = (B.view(torch.int32) >> 13 << 13).view(torch.float32)
        c = torch.from_numpy((rng.standard_normal((8, 8)) * 4).astype(np.float32))
        want = op(A, B.t().contiguous(), c).numpy()
        step = tc.get_model(model).step(FAMILY.get(fmt, fmt))
        got = tc.chain(A.float().numpy(), B.float().numpy(), fmt, fb, step, C=c.numpy())
        assert got.tobytes() == want.tobytes(), (model, fmt)


@pytest.mark.parametrize("fa,fb", [("e2m3", "e2m3"), ("e3m2", "e2m3"), ("e4m3", "e3m2"), ("e2m3", "e5m2")])
def test_scaled_mm_takes_fp6_on_b200(fa, fb):
    """fs.scaled_mm(model='b200') on OCP FP6 operands (ml_dtypes float6 arrays, alone or mixed with FP8): MMA-Sim's
    tcgen05 kind::f8f6f4 chain over K, then the per-tensor epilogue; 'exact' takes them too, the other chips
    refuse them naming the models that do."""
    fp6 = {"e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}
    ml = {**fp6, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
    rng = np.random.default_rng(45)
    M, N, K = 64, 16, 256

    def operand(f, rows):
        F = fs.get_format(f)
        x = np.clip(rng.standard_normal((rows, K)) * np.exp2(rng.integers(-8, 4, (rows, K))), -F.max, F.max)
        x[:, :32] = np.tile([F.max, -F.max], 16)             # large products that cancel in pairs
        return fs.encode(x.astype(np.float32), F)

    ca, cb = operand(fa, M), operand(fb, N)
    a, b = ca.view(ml[fa]), cb.view(ml[fb])
    sa, sb = np.float32(0.75), np.float32(2.0 ** -5)
    y = fs.scaled_mm(a, b.T, sa, sb, model="b200", out_dtype="float32", use_fast_accum=True)

    def sim_operand(c, f):
        t = torch.from_numpy(np.ascontiguousarray(c))
        return t if f in fp6 else t.view(E4 if f == "e4m3" else E5)
    op = _mmasim("TCGen05MMA", "Blackwell", f"m{M}n{N}k32.kind::f8f6f4.f32.{fa}.{fb}")
    acc = op(sim_operand(ca, fa), sim_operand(cb, fb).T.contiguous(), torch.zeros(M, N)).numpy()
    want = (acc.astype(np.float64) * np.float64(np.float32(sa * sb)) + 0.0).astype(np.float32)
    assert y.tobytes() == want.tobytes()
    # MMA-Sim models RTX Blackwell's (sm_120) mma.sync kind::f8f6f4 with the same step: one chain from C
    C = torch.from_numpy(rng.standard_normal((16, 8)).astype(np.float32))
    mma = _mmasim("MMA", "RTX Blackwell", f"m16n8k32.kind::f8f6f4.f32.{fa}.{fb}.f32")
    got = tc.chain(fs.decode(ca[:16], fs.get_format(fa)), fs.decode(cb[:8], fs.get_format(fb)), fa, fb,
                   tc.get_model("b200").step("fp8"), C=C.numpy())
    assert got.tobytes() == mma(sim_operand(ca[:16], fa), sim_operand(cb[:8], fb).T.contiguous(), C).numpy().tobytes()
    ex = fs.scaled_mm(a, b.T, sa, sb, model="exact", out_dtype="float32")
    ref = (a.astype(np.float64) @ b.astype(np.float64).T) * float(sa) * float(sb)
    assert np.abs(ex - ref).max() <= 1e-6 * np.abs(ref).max()
    with pytest.raises(TypeError, match="model='b200' or 'exact'"):
        fs.scaled_mm(a, b.T, sa, sb, model="hopper", out_dtype="float32")
    if fa in fp6:
        with pytest.raises(ValueError, match="no FP6 output"):
            fs.scaled_mm(a, b.T, sa, sb, model="b200", use_fast_accum=True)


# ---------------------------------------------------------------------------------------------------------
# AMD CDNA3 (MI300) matrix cores against MMA-Sim's MFMA models
_FNUZ = {"e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz, "bf16": torch.bfloat16,
         "fp16": torch.float16}
_MFMA = {("e4m3fnuz", "e4m3fnuz"): "f32_16x16x32_fp8_fp8", ("e4m3fnuz", "e5m2fnuz"): "f32_16x16x32_fp8_bf8",
         ("e5m2fnuz", "e4m3fnuz"): "f32_32x32x16_bf8_fp8", ("e5m2fnuz", "e5m2fnuz"): "f32_32x32x16_bf8_bf8",
         ("bf16", "bf16"): "f32_16x16x16_bf16", ("fp16", "fp16"): "f32_32x32x8_f16"}


def _cdna3_operands(rng, fmt, rows, K):
    """Values of ``fmt`` as a torch tensor: exponents spread over the format's range (FNUZ subnormals included),
    a pair-cancelling stretch, zeros, and the format's largest value."""
    lim = {"e4m3fnuz": 240.0, "e5m2fnuz": 57344.0, "bf16": 3e38, "fp16": 65504.0}[fmt]
    lo = {"e4m3fnuz": -12, "e5m2fnuz": -20, "bf16": -40, "fp16": -26}[fmt]
    x = rng.standard_normal((rows, K)) * np.exp2(rng.integers(lo, 8, (rows, K)))
    x[:, :16] = np.tile([1.0, -1.0], 8) * 3.0
    x[:, 16:24] = 0.0
    x[0, 30] = lim
    return torch.from_numpy(np.clip(x, -lim, lim).astype(np.float32)).to(_FNUZ[fmt])


@pytest.mark.parametrize("fa,fb", list(_MFMA))
def test_cdna3_mfma_equals_mmasim(fa, fb):
    """tc.mfma (the CDNA3 instruction model chained over K) equals MMA-Sim's MFMA instruction on the same operands
    and accumulators: spread exponents, FNUZ subnormals, cancelling products, zero groups, accumulators far above
    and far below the products (FP8's drop rule) and in float32's subnormal range; a NaN gives 0x7FFFFFFF."""
    from mmasim.amd.sim import MFMA
    rng = np.random.default_rng(41)
    M, N, K = 16, 16, 96
    A, B = _cdna3_operands(rng, fa, M, K), _cdna3_operands(rng, fb, N, K)
    c = rng.standard_normal((M, N)) * np.exp2(rng.integers(-60, 40, (M, N)))
    c[0, :4] = [1e-40, -3e-39, 0.0, -0.0]
    C = torch.from_numpy(c.astype(np.float32))
    want = MFMA("CDNA3", _MFMA[fa, fb])(A, B.t().contiguous(), C).numpy()
    got = tc.mfma(A.float().numpy(), B.float().numpy(), fa, fb, C=C.numpy())
    assert got.tobytes() == want.tobytes(), np.abs(got.astype(np.float64) - want).max()
    A2 = A.float().clone()
    A2[3, 40] = float("nan")
    got = tc.mfma(A2.numpy(), B.float().numpy(), fa, fb, C=C.numpy())
    assert np.all(got.view(np.uint32)[3] == 0x7FFFFFFF) and not np.isnan(np.delete(got, 3, 0)).any()


def test_cdna3_is_not_a_nvidia_model():
    """The witness for the two vendors: the same E4M3-valued operands (every value is both an E4M3 and an
    E4M3FNUZ value) give different float32 sums under CDNA3's model and Hopper's, whose steps align 32 products
    to 13 fraction bits."""
    rng = np.random.default_rng(42)
    a = np.abs(rng.standard_normal((16, 1024))) * 4
    b = np.abs(rng.standard_normal((16, 1024))) * 4
    A = fs.decode(fs.encode(a.astype(np.float32), fs.E4M3FNUZ), fs.E4M3FNUZ)
    B = fs.decode(fs.encode(b.astype(np.float32), fs.E4M3FNUZ), fs.E4M3FNUZ)
    amd = tc.mfma(A, B, "e4m3fnuz", "e4m3fnuz")
    nv = tc.chain(A, B, "e4m3", "e4m3", tc.get_model("hopper").step("fp8"))
    assert (amd != nv).mean() > 0.5
    exact = A.astype(np.float64) @ B.astype(np.float64).T
    assert np.abs(amd - exact).max() < np.abs(nv - exact).max()


def test_gemm_and_scaled_mm_take_fnuz_fp8_on_cdna3():
    """fp8_e4m3fnuz / fp8_e5m2fnuz per-tensor schemes: fs.gemm(accumulate='cdna3') is MMA-Sim's chain times
    RN32(s_a · s_b); fs.scaled_mm(model='cdna3') the same on torch's FNUZ tensors; BF16 operands chain alone; the
    other vendor's operands and models are refused with the fix named."""
    from mmasim.amd.sim import MFMA
    rng = np.random.default_rng(43)
    x = (rng.standard_normal((16, 256)) * 3).astype(np.float32)
    w = (rng.standard_normal((32, 256)) * 0.02).astype(np.float32)
    qa, qb = fs.quantize(x, "fp8_e4m3fnuz"), fs.quantize(w, "fp8_e5m2fnuz")
    A = torch.from_numpy(qa.codes.reshape(16, 256)).view(torch.float8_e4m3fnuz)
    B = torch.from_numpy(qb.codes.reshape(32, 256)).view(torch.float8_e5m2fnuz)
    acc = MFMA("CDNA3", "f32_16x16x32_fp8_bf8")(A, B.t().contiguous(), torch.zeros(16, 32)).numpy()
    sa, sb = np.float32(qa.scales.reshape(-1)[0]), np.float32(qb.scales.reshape(-1)[0])
    want = (acc.astype(np.float64) * np.float64(np.float32(sa * sb)) + 0.0).astype(np.float32)
    assert fs.gemm(qa, qb, accumulate="cdna3").tobytes() == want.tobytes()
    y = fs.scaled_mm(A, B.t(), torch.tensor(sa), torch.tensor(sb), model="cdna3", out_dtype=torch.float32)
    assert y.numpy().tobytes() == want.tobytes()
    qa16, qb16 = fs.quantize(x, "bf16"), fs.quantize(w, "bf16")
    want16 = MFMA("CDNA3", "f32_16x16x16_bf16")(torch.from_numpy(x).bfloat16(),
                                                 torch.from_numpy(w).bfloat16().t().contiguous(),
                                                 torch.zeros(16, 32)).numpy()
    assert fs.gemm(qa16, qb16, accumulate="cdna3").tobytes() == want16.tobytes()
    assert np.abs(fs.gemm(qa, fs.quantize(w, "fp8_e4m3fnuz")) - x @ w.T).max() < 0.05 * np.abs(x @ w.T).max()
    with pytest.raises(ValueError, match="accumulate='cdna3' models AMD"):
        fs.gemm(fs.quantize(x, "fp8_e4m3"), fs.quantize(w, "fp8_e4m3"), accumulate="cdna3")
    with pytest.raises(TypeError, match="model='cdna3'"):
        fs.scaled_mm(A, B.t(), torch.tensor(sa), torch.tensor(sb))
    with pytest.raises(TypeError, match="NVIDIA's models"):
        fs.scaled_mm(A.float().to(E4), B.t().float().to(E4), torch.tensor(sa), torch.tensor(sb), model="cdna3",
                     out_dtype=torch.float32)
    with pytest.raises(ValueError, match="pass out_dtype"):
        fs.scaled_mm(A, B.t(), torch.tensor(sa), torch.tensor(sb), model="cdna3")
    with pytest.raises(ValueError, match="takes two FP8"):
        tc.mfma(x, w, "e4m3fnuz", "bf16")


# ---------------------------------------------------------------------------------------------------------
# fs.gemm and training with the hardware models
def test_gemm_fp8_per_tensor_equals_scaled_mm_and_mmaemu():
    import fp4sim as fs
    rng = np.random.default_rng(15)
    x = (rng.standard_normal((16, 512)) * 3).astype(np.float32)
    w = (rng.standard_normal((32, 512)) * 0.02).astype(np.float32)
    qa, qb = fs.quantize(x, "fp8_e4m3"), fs.quantize(w, "fp8_e5m2")
    A = torch.from_numpy(qa.codes.reshape(16, 512)).view(E4)
    B = torch.from_numpy(qb.codes.reshape(32, 512)).view(E5)
    sa = torch.tensor(np.float32(qa.scales.reshape(-1)[0]))
    sb = torch.tensor(np.float32(qb.scales.reshape(-1)[0]))
    for acc, fast in (("hopper", False), ("hopper_fast_accum", True), ("ada", False), ("ada_fast_accum", True)):
        want = _mmaemu(A, B.t(), sa, sb, out_dtype=torch.float32, use_fast_accum=fast, profile=acc.split("_")[0],
                       splitk=1).numpy()
        assert fs.gemm(qa, qb, accumulate=acc).tobytes() == want.tobytes(), acc


def test_gemm_fp8_blockwise_promotes_each_block():
    """DeepSeek-V3's promotion: each 128-element block's chain from +0, scaled and added in float32."""
    import fp4sim as fs
    from fp4sim.gemm import _block_scales
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((8, 384)) * np.exp2(rng.integers(-4, 4, (8, 3))).repeat(128, 1)).astype(np.float32)
    w = rng.standard_normal((16, 384)).astype(np.float32)
    qa, qb = fs.quantize(x, "fp8_blockwise"), fs.quantize(w, fs.get_scheme("fp8_blockwise", block=(128, 128)))
    A = torch.from_numpy(qa.codes.reshape(8, 384)).view(E4)
    B = torch.from_numpy(qb.codes.reshape(16, 384)).view(E4)
    sa, sb = _block_scales(qa, np), _block_scales(qb, np)
    one = torch.tensor(1.0)
    want = np.zeros((8, 16), np.float32)
    for j in range(3):
        part = _mmaemu(A[:, 128 * j:128 * j + 128].contiguous(), B[:, 128 * j:128 * j + 128].contiguous().t(), one,
                       one, out_dtype=torch.float32, use_fast_accum=True, profile="hopper", splitk=1).numpy()
        want += (sa[:, j, None] * sb[None, :, j]) * part
    assert fs.gemm(qa, qb, accumulate="hopper").tobytes() == want.tobytes()


def test_training_step_under_hopper_accumulation():
    """Recipe(accumulate='hopper'): the FP8 GEMMs of fp8_blockwise and the BF16 kept layers run Hopper's models."""
    from fp4sim.emulate import fprop
    from fp4sim.training import Recipe
    rng = np.random.default_rng(17)
    x = rng.standard_normal((32, 256)).astype(np.float32)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    import fp4sim as fs
    for preset in ("fp8_blockwise", "bf16"):
        y_hw, qw, qx = fprop(x, w, Recipe.preset(preset, accumulate="hopper"), return_qx=True)
        y_ex, _ = fprop(x, w, Recipe.preset(preset))
        assert y_hw.tobytes() == fs.gemm(qx, qw, accumulate="hopper").tobytes()
        assert y_ex.tobytes() == fs.gemm(qx, qw).tobytes()
        assert not np.array_equal(y_hw, y_ex)


def test_gemm_refuses_models_of_other_formats():
    import fp4sim as fs
    x = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="accumulate='hopper' models H100 / H200"):
        fs.gemm(fs.quantize(x, "nvfp4"), fs.quantize(x, "nvfp4"), accumulate="hopper")
    with pytest.raises(ValueError, match="accumulate='tcgen05' models Blackwell's block-scaled"):
        fs.gemm(fs.quantize(x, "bf16"), fs.quantize(x, "bf16"), accumulate="tcgen05")
    with pytest.raises(ValueError, match="fast accumulation is an FP8 setting"):
        fs.gemm(fs.quantize(x, "bf16"), fs.quantize(x, "bf16"), accumulate="hopper_fast_accum")


def test_tcgen05_corner_cases_equal_mmasim():
    """All-zero groups under a large scale (exponent -139, not the scale's), groups whose products cancel (they
    keep their scales' exponent), and accumulators in float32's subnormal range (their exponent read as -126),
    from tiny UE8M0 scales."""
    rng = np.random.default_rng(18)
    E2 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    M, N, K = 8, 8, 256
    va, vb = E2[rng.integers(0, 16, (M, K))], E2[rng.integers(0, 16, (N, K))]
    va[:, 0:16] = 0                                           # group 0: all products zero ...
    va[:, 16:32] = 1.0                                        # group 1: products that cancel exactly
    vb[:, 16:32] = np.tile([1.0, -1.0], 8)
    # NVFP4: the zero and the cancelling groups carry the largest scales
    ca = rng.integers(0x01, 0x10, (M, K // 16)).astype(np.uint8)        # subnormal and small scales ...
    cb = rng.integers(0x01, 0x10, (N, K // 16)).astype(np.uint8)
    ca[:, 0] = cb[:, 0] = 0x7E                                             # ... under 448 (zero group)
    ca[:, 1] = cb[:, 1] = 0x60                                             # ... and 32 (cancelling group)
    dec = lambda c: c.view(ml_dtypes.float8_e4m3fn).astype(np.float32)      # noqa: E731
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3")
    want = _sim_fp4_chain(op, va, vb, ca, cb, torch.float8_e4m3fn)
    assert tc.tcgen05_fp4(va, dec(ca), vb, dec(cb), 16, "ue4m3").tobytes() == want.tobytes()
    # MXFP4: the first blocks' scales (2^-68 each side) leave a subnormal accumulator near 2^-132, the later
    # blocks' (2^-82) add terms near 2^-164 that only an accumulator read at exponent -126 truncates away
    ea = np.full((M, K // 32), 127 - 82, np.uint8)
    eb = np.full((N, K // 32), 127 - 82, np.uint8)
    ea[:, :2] = eb[:, :2] = 127 - 68
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", "m128n8k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0")
    want = _sim_fp4_chain(op, va, vb, ea, eb, torch.float8_e8m0fnu)
    got = tc.tcgen05_fp4(va, np.exp2(ea - 127.0), vb, np.exp2(eb - 127.0), 32, "ue8m0")
    assert got.tobytes() == want.tobytes()
    assert ((np.abs(got) < 2.0 ** -126) & (got != 0)).mean() > 0.5
    ea = rng.integers(50, 62, (M, K // 32)).astype(np.uint8)
    eb = rng.integers(50, 62, (N, K // 32)).astype(np.uint8)
    # MXFP8 the same way
    xa = (rng.standard_normal((M, K)) * 4).astype(ml_dtypes.float8_e4m3fn)
    xb = (rng.standard_normal((N, K)) * 4).astype(ml_dtypes.float8_e4m3fn)
    ea[:, 0] = eb[:, 0] = 55
    op = _mmasim("TCGen05MMABlockScale", "Blackwell", "m128n8k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0")
    A = torch.from_numpy(xa.view(np.uint8)).view(E4)
    B = torch.from_numpy(np.ascontiguousarray(xb.view(np.uint8).T)).view(E4)
    C = torch.zeros(M, N)
    for k in range(K // 32):
        C = op(A[:, 32 * k:32 * k + 32], B[32 * k:32 * k + 32], C,
               torch.from_numpy(np.ascontiguousarray(ea[:, k:k + 1])).view(torch.float8_e8m0fnu),
               torch.from_numpy(np.ascontiguousarray(eb[:, k:k + 1].T)).view(torch.float8_e8m0fnu))
    got = tc.tcgen05_fp8(xa.astype(np.float32), "e4m3", np.exp2(ea - 127.0), xb.astype(np.float32), "e4m3",
                         np.exp2(eb - 127.0))
    assert got.tobytes() == C.numpy().tobytes()
    assert (np.abs(got) < 2.0 ** -126).mean() > 0.5


# ---------------------------------------------------------------------------------------------------------
# validate: which model a kernel's FP8 GEMM output is
@pytest.mark.parametrize("profile,fast,label", [("hopper", False, "hopper"), ("hopper", True, "hopper_fast_accum"),
                                                 ("ada", False, "ada"), ("ada", True, "ada_fast_accum")])
@pytest.mark.parametrize("od", [torch.float32, torch.bfloat16])
def test_compare_scaled_mm_names_mmaemus_configuration(profile, fast, label, od):
    from fp4sim.validate import compare_scaled_mm
    rng = np.random.default_rng(19)
    a, w = _operands(rng, 16, 1024, 32, "random")
    out = _mmaemu(a, w.t(), SA, SB, out_dtype=od, use_fast_accum=fast, profile=profile, splitk=1)
    rep = compare_scaled_mm(a, w.t(), SA, SB, out)
    assert rep.best == label and rep.matches == [label], rep.summary()
    assert rep.dtype == str(od).replace("torch.", "")


def test_compare_scaled_mm_recognises_emulating_kernels():
    from fp4sim.validate import compare_scaled_mm
    rng = np.random.default_rng(20)
    a, w = _operands(rng, 8, 512, 16, "random")
    af, wf = a.float() * SA, w.float() * SB                     # the torchao-style route: decode, then matmul
    seq = torch.zeros(8, 16)
    for k in range(512):
        seq = seq + af[:, k, None] * wf[None, :, k]
    rep = compare_scaled_mm(a, w.t(), SA, SB, seq)
    assert rep.best == "dequant_f32"
    rep = compare_scaled_mm(a, w.t(), SA, SB, af @ wf.t())      # a BLAS: another summation order
    assert rep.best is None and any("summation-order" in n for n in rep.notes), rep.summary()
    exact = tc.scaled_mm(a, w.t(), SA, SB, out_dtype=torch.float32, model="exact")
    assert compare_scaled_mm(a, w.t(), SA, SB, exact).best == "exact"
    bad = exact.clone()
    bad[3, 4] = bad[3, 4] * 1.5
    rep = compare_scaled_mm(a, w.t(), SA, SB, bad)
    assert rep.best is None and rep.closest == "exact" and rep.mismatches[0]["row"] == 3
    assert not any("summation-order" in n for n in rep.notes)
    with pytest.raises(ValueError, match=r"out has shape \(16, 8\)"):
        compare_scaled_mm(a, w.t(), SA, SB, exact.t())
    with pytest.raises(ValueError, match="candidates \\['tpu'\\]"):
        compare_scaled_mm(a, w.t(), SA, SB, exact, candidates=["tpu"])


def test_validate_gemm_cli_takes_fp8_operands(tmp_path):
    import subprocess
    import sys
    rng = np.random.default_rng(21)
    a, w = _operands(rng, 8, 512, 16, "random", E4, E5)
    out = _mmaemu(a, w.t(), SA, SB, out_dtype=torch.bfloat16, use_fast_accum=True, profile="hopper", splitk=1)
    np.save(tmp_path / "a.npy", a.view(torch.uint8).numpy())
    np.save(tmp_path / "w.npy", w.view(torch.uint8).numpy())
    np.save(tmp_path / "out.npy", out.view(torch.int16).numpy().view(np.uint16))
    args = [sys.executable, "-m", "fp4sim.validate", "gemm", "--a-fp8", str(tmp_path / "a.npy"), "--a-format", "e4m3",
            "--b-fp8", str(tmp_path / "w.npy"), "--b-format", "e5m2", "--a-scale", repr(float(SA)),
            "--b-scale", repr(float(SB)),
            "--out", str(tmp_path / "out.npy"), "--out-dtype", "bfloat16", "--json", str(tmp_path / "r.json")]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MATCHES hopper_fast_accum" in r.stdout
    r = subprocess.run(args + ["--expect", "hopper"], capture_output=True, text=True)
    assert r.returncode == 1
    r = subprocess.run(args[:8] + args[10:], capture_output=True, text=True)        # no --b-fp8
    assert r.returncode == 2 and "needs both --a-fp8 and --b-fp8" in r.stderr
    r = subprocess.run([a_ for a_ in args if a_ not in ("--a-format", "e4m3")], capture_output=True, text=True)
    assert r.returncode == 2 and "name their format with --a-format" in r.stderr


def test_device_check_script_runs_without_a_device(tmp_path):
    """benchmarks/tensorcore_check.py --emulate: mmaemu's H100 stands in for the device, and the script must name
    the configuration it ran (slow accumulation: hopper; fast: hopper_fast_accum)."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "tensorcore_check.py"), "--out", str(tmp_path),
                        "--emulate", "--quick", "--limit", "4"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "tensorcore_check.json").read_text())
    assert [c["best"] for c in res["fp8"]] == ["hopper", "hopper", "hopper_fast_accum", "hopper_fast_accum"]
    assert len(res["16bit"]) == 4 and all("exact" in c["match_fraction"] for c in res["16bit"])
    assert len(list((tmp_path / "outputs").glob("*.npy"))) == 8


def test_fp8_witnesses_separate_every_pair_and_name_the_device(tmp_path):
    """gemm-witnesses --format fp8: every pair of the eight candidates differs somewhere (each pair's first
    separating cell recomputed by an independent oracle: mmaemu for hopper / ada, the rational model for
    b200, b200_mma and exact, a float32 loop for dequant_f32); a device that computes mmaemu's Hopper is named, fast and
    slow accumulation apart."""
    import json
    import subprocess
    import sys
    from fp4sim.validate.scaled_mm import SCALED_MM_CANDIDATES, read_fp8_witness
    wd = tmp_path / "w"
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm-witnesses", "--format", "fp8", "--out",
                        str(wd)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    man = json.loads((wd / "manifest.json").read_text())
    labels = list(SCALED_MM_CANDIDATES)
    pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]]
    assert min(man["separating_cells"][f"{a} | {b}"] for a, b in pairs) > 0

    def oracle(label, a, b, sa, sb, r, c):
        model, fast = SCALED_MM_CANDIDATES[label]
        ta = torch.from_numpy(a[r:r + 1].view(np.uint8).copy()).view(E4 if a.dtype == ml_dtypes.float8_e4m3fn else E5)
        tb = torch.from_numpy(b[c:c + 1].view(np.uint8).copy()).view(E4 if b.dtype == ml_dtypes.float8_e4m3fn else E5)
        tb16 = torch.cat([tb] * 16)                                      # N a multiple of 16 for mmaemu
        if model in ("hopper", "ada"):
            return float(_mmaemu(ta, tb16.t(), torch.tensor(sa), torch.tensor(sb), out_dtype=torch.float32,
                                 use_fast_accum=fast, profile=model, splitk=1)[0, 0])
        av, bv = [Fraction(float(x)) for x in a[r].astype(np.float64)], [Fraction(float(x)) for x in b[c].astype(np.float64)]
        alpha = ref.rne32(Fraction(float(sa)) * Fraction(float(sb)))
        if model in ("b200_mma", "b200"):
            acc = ref.dot(av, bv, tc.get_model(model).step("fp8"), EMIN[_f(a)], EMIN[_f(b)])
        elif model == "exact":
            acc = Fraction(0)
            for k0 in range(0, len(av), 128):
                acc = ref.rne32(acc + ref.rne32(sum((x * y for x, y in zip(av[k0:k0 + 128], bv[k0:k0 + 128])),
                                                    Fraction(0))))
        else:                                                            # dequant_f32
            s = np.float32(0)
            for x, y in zip(a[r].astype(np.float32) * np.float32(sa), b[c].astype(np.float32) * np.float32(sb)):
                s = np.float32(s + np.float32(x * y))
            return float(s)
        return float(ref.rne32(Fraction(acc) * alpha))

    def _f(x):
        return "e4m3" if x.dtype == ml_dtypes.float8_e4m3fn else "e5m2"

    found = set()
    for name, entry in man["witnesses"].items():
        a, b, sa, sb, exp = read_fp8_witness(wd / name, entry)
        for p, q in pairs:
            if (p, q) in found:
                continue
            diff = np.argwhere(exp[p].view(np.uint32) != exp[q].view(np.uint32))
            if len(diff):
                r, c = diff[0]
                for lab in (p, q):
                    assert np.float32(oracle(lab, a, b, sa, sb, r, c)) == exp[lab][r, c], (name, lab, r, c)
                found.add((p, q))
    assert found == set(pairs)
    for fast, label in ((False, "hopper"), (True, "hopper_fast_accum")):
        od = tmp_path / f"out_{label}"
        od.mkdir()
        for name, entry in man["witnesses"].items():
            a, b, sa, sb, _ = read_fp8_witness(wd / name, entry)
            ta = torch.from_numpy(a.view(np.uint8)).view(E4 if entry["a_format"] == "e4m3" else E5)
            tb = torch.from_numpy(b.view(np.uint8)).view(E4 if entry["b_format"] == "e4m3" else E5)
            y = _mmaemu(ta, tb.t(), torch.tensor(sa), torch.tensor(sb), out_dtype=torch.float32,
                        use_fast_accum=fast, profile="hopper", splitk=1)
            np.save(od / f"{name}.npy", y.numpy())
        r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm", "--witnesses", str(wd), "--outputs",
                            str(od)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.splitlines()[-1] == f"consistent with every witness: {label}"


# ------------------------------------------------------------------------ an H200's own outputs
H200 = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200-2026-12-04"


def _check_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tensorcore_check", H200.parents[1] / "tensorcore_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_h200_recordings_are_the_hopper_model():
    """The outputs an NVIDIA H200 gave in benchmarks/gpu_check.sh (torch 2.11 + cuBLAS, CUDA 13.0: 72
    ``torch._scaled_mm`` FP8 GEMMs, E4M3 / E5M2 operand pairs, slow and fast accumulation, float32 and bfloat16
    outputs, K = 1024 and 4096; 8 BF16 / FP16 matmuls; a 96 x 96 corner of each, stored as bits) are recomputed from
    the recorded seeds, bit for bit: by fs.scaled_mm(model="hopper") for FP8 and by the hopper chain for the 16-bit
    matmuls. The exact rule and Ada's chain differ from the device on the random operands, so the recordings do
    tell those models apart (not every parameter: a 16-bit step one fraction bit shorter gives the same outputs on
    these operands; the toolbox's vectors above pin that down)."""
    chk = _check_script()
    rec = np.load(H200 / "tensorcore_outputs.npz")
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)            # the check's scales
    C = chk.CORNER
    bits = {4: torch.int32, 2: torch.int16}
    for i, (M, K, N, kind, dta, dtb, fast, od) in enumerate(chk.fp8_cases(False)):
        a, w = chk._operands(torch, kind, M, K, N, dta, dtb, 1000 + i, "cpu")
        a, w = a[:C], w[:C]
        y = fs.scaled_mm(a, w.t(), sa, sb, out_dtype=od, use_fast_accum=fast, model="hopper")
        want = rec[f"fp8_{i:02d}"]
        assert np.array_equal(y.view(bits[y.element_size()]).numpy(), want), (i, kind, dta, dtb, fast, od)
        if kind == "random" and K == 1024 and not fast and od == torch.float32:
            for other in ("exact", "ada"):
                z = fs.scaled_mm(a, w.t(), sa, sb, out_dtype=od, model=other)
                assert (z.view(torch.int32).numpy() != want).mean() > 0.5, other
    i = 0
    for K in (1024, 4096):
        for dt, fam, npdt in ((torch.bfloat16, "bf16", ml_dtypes.bfloat16), (torch.float16, "fp16", np.float16)):
            for kind in ("random", "positive"):
                g = torch.Generator().manual_seed(2000 + i)
                a, w = torch.randn(2048, K, generator=g), torch.randn(2048, K, generator=g)
                if kind == "positive":
                    a, w = a.abs(), w.abs()
                A, W = (t[:C].to(dt).float().numpy() for t in (a, w))
                acc = tc.accumulate(A, W, fam, fam, "hopper", fam, fast=True)
                want = rec[f"{fam}_{i:02d}"]
                assert np.array_equal(acc.astype(npdt).view(np.int16), want), (i, fam, kind)
                if kind == "random":                      # Ada's and the A100's 8-product steps differ
                    ada = tc.accumulate(A, W, fam, fam, "ada", fam, fast=True)
                    assert (ada.astype(npdt).view(np.int16) != want).any(), (i, fam)
                i += 1


def test_training_step_under_cdna3():
    """A recipe of FNUZ FP8 operands (E4M3FNUZ forward, E5M2FNUZ gradients, as FP8 training on an MI300 scales
    them) with accumulate='cdna3': its Fprop is fs.gemm's CDNA3 model on the operands it quantized."""
    from fp4sim.emulate import fprop
    from fp4sim.training import Operand, Recipe
    rng = np.random.default_rng(44)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w = (rng.standard_normal((48, 64)) * 0.05).astype(np.float32)
    f, g = Operand("fp8_e4m3fnuz"), Operand("fp8_e5m2fnuz")
    r = Recipe(fprop_x=f, fprop_w=f, dgrad_dy=g, dgrad_w=f, wgrad_x=f, wgrad_dy=g, accumulate="cdna3", name="mi300")
    y, qw, qx = fprop(x, w, r, return_qx=True)
    assert qx.scheme.name == "fp8_e4m3fnuz" and y.tobytes() == fs.gemm(qx, qw, accumulate="cdna3").tobytes()
    assert not np.array_equal(y, fs.gemm(qx, qw))


def test_compare_scaled_mm_names_amd_and_fp6_models():
    """validate.compare_scaled_mm on an MI300 kernel's output (MMA-Sim's MFMA chain, then the epilogue) names cdna3;
    on a B200 kind::f8f6f4 FP6 output (MMA-Sim's tcgen05) names b200; an exact product names exact; each family
    is offered its own candidates and a candidate of another family is refused."""
    from mmasim.amd.sim import MFMA
    from fp4sim.validate import compare_scaled_mm
    rng = np.random.default_rng(46)
    a = torch.from_numpy(np.abs(rng.standard_normal((16, 512)) * 3).astype(np.float32)).to(torch.float8_e4m3fnuz)
    w = torch.from_numpy(np.abs(rng.standard_normal((32, 512))).astype(np.float32)).to(torch.float8_e5m2fnuz)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    acc = MFMA("CDNA3", "f32_16x16x32_fp8_bf8")(a, w.t().contiguous(), torch.zeros(16, 32)).numpy()
    rep = compare_scaled_mm(a, w.t(), sa, sb, torch.from_numpy((acc.astype(np.float64) * 0.125).astype(np.float32)))
    assert rep.best == "cdna3" and "exact" not in rep.matches
    A64, W64 = a.float().numpy().astype(np.float64), w.float().numpy().astype(np.float64)
    exact = np.zeros((16, 32), np.float32)              # the exact rule: 128-element blocks, added in float32
    for k0 in range(0, 512, 128):
        exact = exact + (A64[:, k0:k0 + 128] @ W64[:, k0:k0 + 128].T).astype(np.float32)
    exact = exact.astype(np.float64) * 0.125
    rep = compare_scaled_mm(a, w.t(), sa, sb, torch.from_numpy(exact.astype(np.float32)))
    assert rep.best == "exact" and "cdna3" not in rep.matches
    with pytest.raises(ValueError, match="for AMD FNUZ operands choose from cdna3"):
        compare_scaled_mm(a, w.t(), sa, sb, torch.from_numpy(acc), candidates=["hopper"])
    # E4M3 x E2M3 (kind::f8f6f4 mixes them): products from 2^-12 to 3360, so the chain's truncations show
    c8 = fs.encode((np.abs(rng.standard_normal((64, 256))) * np.exp2(rng.integers(-8, 8, (64, 256)))
                    ).astype(np.float32), fs.E4M3)
    d6 = fs.encode(np.abs(rng.standard_normal((16, 256))).astype(np.float32) * 4, fs.E2M3)
    op = _mmasim("TCGen05MMA", "Blackwell", "m64n16k32.kind::f8f6f4.f32.e4m3.e2m3")
    acc = op(torch.from_numpy(c8).view(E4), torch.from_numpy(np.ascontiguousarray(d6.T)), torch.zeros(64, 16)).numpy()
    A6, B6 = c8.view(ml_dtypes.float8_e4m3fn), d6.view(ml_dtypes.float6_e2m3fn)
    rep = compare_scaled_mm(A6, B6.T, np.float32(1.0), np.float32(1.0), acc)
    assert rep.best == "b200" and "exact" not in rep.matches


@pytest.mark.parametrize("fmt,family,label", [("fp8-fnuz", "fnuz", "cdna3"), ("fp6", "fp6", "b200")])
def test_fnuz_and_fp6_witnesses_separate_their_models_and_name_the_device(tmp_path, fmt, family, label):
    """gemm-witnesses --format fp8-fnuz / fp6: every pair of the family's candidates differs somewhere; outputs
    made by MMA-Sim's own model of the chip (mmasim.amd.MFMA on CDNA3; tcgen05 kind::f8f6f4 on Blackwell), then
    the per-tensor epilogue, are named as that model by the check."""
    import json
    import subprocess
    import sys
    from fp4sim.validate.scaled_mm import FAMILY_CANDIDATES, read_fp8_witness
    wd = tmp_path / "w"
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm-witnesses", "--format", fmt, "--out", str(wd)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    man = json.loads((wd / "manifest.json").read_text())
    assert man["models"] == list(FAMILY_CANDIDATES[family])
    assert min(man["separating_cells"].values()) > 0
    od = tmp_path / "out"
    od.mkdir()
    for name, entry in man["witnesses"].items():
        a, b, sa, sb, _ = read_fp8_witness(wd / name, entry)
        M, N, K = a.shape[0], b.shape[0], a.shape[1]
        ca, cb = torch.from_numpy(a.view(np.uint8).copy()), torch.from_numpy(b.view(np.uint8).copy())
        if family == "fnuz":
            from mmasim.amd.sim import MFMA
            dt = {"e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz}
            A, B = ca.view(dt[entry["a_format"]]), cb.view(dt[entry["b_format"]])
            suffix = {"e4m3fnuz": "fp8", "e5m2fnuz": "bf8"}
            op = MFMA("CDNA3", f"f32_16x16x32_{suffix[entry['a_format']]}_{suffix[entry['b_format']]}")
            acc = op(A, B.t().contiguous(), torch.zeros(M, N)).numpy()
        else:
            op = _mmasim("TCGen05MMA", "Blackwell", f"m64n{N}k32.kind::f8f6f4.f32.e4m3.e2m3")   # (any M)
            acc = op(ca.view(E4), cb.T.contiguous(), torch.zeros(M, N)).numpy()
        y = (acc.astype(np.float64) * np.float64(np.float32(sa * sb)) + 0.0).astype(np.float32)
        np.save(od / f"{name}.npy", y)
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm", "--witnesses", str(wd), "--outputs", str(od),
                        "--expect", label], capture_output=True, text=True)
    assert r.returncode == 0 and label in r.stdout, r.stdout + r.stderr
