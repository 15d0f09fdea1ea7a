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
