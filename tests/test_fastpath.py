"""The training fast path (fp4sim.fastpath, taken by fp4sim.emulate with accumulate="fast"): its kernels against the
general quantize / dequantize path bit for bit, and whole training steps with the fast path on and off giving the
same gradients bit for bit, for every preset and switch; plan-cache bugs (a stale plan, a stale Philox key) are
injected and must be caught."""
from __future__ import annotations

import contextlib
import copy
import pickle

import numba as nb
import numpy as np
import pytest

import fp4sim as fs
import fp4sim.ids
from fp4sim import emulate, fastpath
from fp4sim.cpu.elements import e2m1_rne, e2m1_value
from fp4sim.cpu.fast import e2m1_rne_value, e4m3_rne_value
from fp4sim.training import Operand, Recipe

torch = pytest.importorskip("torch")


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


@contextlib.contextmanager
def _fast(on: bool):
    old = fastpath._set_enabled(on)
    try:
        yield
    finally:
        fastpath._set_enabled(old)


def _operand(rng, shape, spread=True):
    """Gaussian values whose rows and 16-element blocks span many binades, some all-zero blocks."""
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x *= np.exp2(rng.integers(-12, 12, size=(shape[0], 1))).astype(np.float32)
        x *= np.exp2(rng.integers(-6, 6, size=(1, shape[1]))).astype(np.float32)
    x.reshape(-1)[: x.size // 16 * 16].reshape(-1, 16)[::7] = 0.0
    return x


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("flavor", ["te", "paper"])
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("rounding", ["rne", "sr"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(64, 96), (37, 53), (16, 7), (130, 48)])
def test_nvfp4_values_equal_dequantize_of_quantize(flavor, block, rounding, axis, shape):
    """The fused kernel's values are dequantize(quantize(x)) bit for bit: both flavours, 1x16 and 16x16, RNE
    and SR (the same Philox bits per element), along either axis, lengths that are not multiples of 16."""
    rng = np.random.default_rng(hash((flavor, block, rounding, axis, shape)) % 2**32)
    x = _operand(rng, shape)
    op = Operand("nvfp4", block, rounding)
    plan = fastpath.operand_plan(op, shape, axis)
    if rounding == "sr" and plan.kind == "general":
        assert shape[1] % 16 and axis == 0          # the Philox layout the kernel cannot generate row by row
        return
    assert plan.kind == "nvfp4"
    kw = dict(seed=12345, stream=77) if rounding == "sr" else {}
    q = fs.quantize(x, fs.get_scheme("nvfp4", flavor=flavor, block=block), axis=axis, rounding=rounding, **kw)
    want = fs.dequantize(q)
    want = want if axis == 1 else want.T
    plan = fastpath.OperandPlan("nvfp4", 0 if flavor == "te" else 1, plan.tile, plan.mode, plan.ph, plan.pstride)
    got = fastpath.nvfp4_values(fastpath.a_form(x, axis), plan, 12345, 77)
    assert got.flags.c_contiguous and _same(got, want)


def test_nvfp4_values_refuses_what_it_does_not_take():
    """NaN in the operand, an infinite amax and an amax past FLT_MAX/448 go to the general path (None)."""
    plan = fastpath.operand_plan(Operand("nvfp4"), (16, 32), 1)
    for bad in (np.nan, np.inf, np.float32(3e38)):
        x = np.ones((16, 32), np.float32)
        x[3, 5] = bad
        assert fastpath.nvfp4_values(x, plan) is None
    assert fastpath.nvfp4_values(np.ones((16, 32), np.float32), plan) is not None


@nb.njit(cache=True)
def _e2m1_rne_mismatches(bits):
    """How many of the float32 bit patterns ``bits`` (uint32; each with both signs) e2m1_rne_value rounds
    otherwise than the encoder, e2m1_value(e2m1_rne(v))."""
    bad = 0
    v = bits.view(np.float32)
    nv = (bits ^ np.uint32(0x80000000)).view(np.float32)
    for i in range(bits.shape[0]):
        for x in (v[i], nv[i]):
            a = np.float32(e2m1_rne_value(x))
            b = np.float32(e2m1_value(e2m1_rne(x)))
            if a != b or np.signbit(a) != np.signbit(b):
                bad += 1
    return bad


def test_e2m1_rne_value_every_float32_near_the_grid():
    """The float-magic E2M1 rounding against the encoder for every float32 from 2^-3 up to 16 (the grid's
    quanta, ties and saturation; both signs), every 1009th bit pattern elsewhere (subnormals to Inf)."""
    near = np.arange(0x3E000000, 0x41800000, dtype=np.uint32)             # 0.125 .. 16
    assert _e2m1_rne_mismatches(near) == 0
    rest = np.arange(0, 0x7F800001, 1009, dtype=np.uint32)
    assert _e2m1_rne_mismatches(np.concatenate([rest, np.array([0, 1, 0x7F7FFFFF, 0x7F800000], np.uint32)])) == 0


@nb.njit(cache=True)
def _e4m3_values(bits):
    v = bits.view(np.float32)
    out = np.empty(2 * bits.shape[0], np.float32)
    for i in range(bits.shape[0]):
        out[2 * i] = e4m3_rne_value(v[i])
        out[2 * i + 1] = e4m3_rne_value(-v[i])
    return out


def test_e4m3_rne_value_every_float32_in_its_range():
    """The register E4M3 rounding (RNE, satfinite) against fp4sim's E4M3 encoder and decoder for every float32
    from 2^-12 (below half the smallest subnormal) up to 1024 (past the saturation at 448), both signs, every
    997th bit pattern elsewhere, 0, the smallest subnormal, FLT_MAX and Inf."""
    for lo, hi in ((0x39800000, 0x3F000000), (0x3F000000, 0x44800000)):
        bits = np.arange(lo, hi, dtype=np.uint32)
        both = np.stack([bits, bits | np.uint32(0x80000000)], 1).reshape(-1).view(np.float32)
        want = fs.decode(fs.encode(both, "e4m3", saturate=True), "e4m3")
        assert np.array_equal(_e4m3_values(bits).view(np.uint32), want.view(np.uint32))
    bits = np.concatenate([np.arange(0, 0x7F800001, 997, dtype=np.uint32),
                           np.array([0, 1, 0x7F7FFFFF, 0x7F800000], np.uint32)])
    both = np.stack([bits, bits | np.uint32(0x80000000)], 1).reshape(-1).view(np.float32)
    want = fs.decode(fs.encode(both, "e4m3", saturate=True), "e4m3")
    assert np.array_equal(_e4m3_values(bits).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(300, 200), (129, 130), (64, 256)])
def test_fp8_blockwise_values_equal_dequantize_of_quantize(block, axis, shape):
    """FP8 blockwise (E4M3, RNE) values of the fast path are dequantize(quantize(x)) bit for bit: blocks whose
    amaxes span 60 binades, all-zero blocks, subnormal and -0 elements, partial blocks and tiles."""
    rng = np.random.default_rng(hash((block, axis, shape)) % 2**32)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, (shape[0], 1)))).astype(np.float32)
    x[::7, :128] = 0.0
    x[3, 5], x[4, 7] = 1e-42, -0.0
    plan = fastpath.operand_plan(Operand("fp8_blockwise", block), shape, axis)
    assert plan.kind == "fp8_blockwise"
    want = fs.dequantize(fs.quantize(x, "fp8_blockwise", axis=axis, block=block))
    got = fastpath.fp8_blockwise_values(fastpath.a_form(x, axis), plan)
    assert _same(got, want if axis == 1 else want.T)
    x[1, 1] = np.inf
    assert fastpath.fp8_blockwise_values(fastpath.a_form(x, axis), plan) is None


@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("scale_mode", ["rceil", "floor", "even"])
@pytest.mark.parametrize("rounding", ["rne", "sr"])
@pytest.mark.parametrize("axis", [0, 1])
def test_mx_values_equal_dequantize_of_quantize(scheme, scale_mode, rounding, axis):
    """The MX kernel called directly (no planning layer) gives dequantize(quantize(x)): every element format,
    scale modes, SR with the same Philox bits, along either axis, a blocked length that is not a multiple of
    32; NaN or Inf goes to the general path."""
    rng = np.random.default_rng(hash((scheme, scale_mode, rounding, axis)) % 2**32)
    x = _operand(rng, (64, 80))
    op = Operand(scheme, None, rounding)
    plan = fastpath.operand_plan(op, x.shape, axis)
    assert plan.kind == "mx"
    sch = fs.get_scheme(scheme, scale_mode=scale_mode)
    kw = dict(seed=99, stream=5) if rounding == "sr" else {}
    want = fs.dequantize(fs.quantize(x, sch, axis=axis, rounding=rounding, **kw))
    plan = fastpath.OperandPlan("mx", fp4sim.ids.SCALE_MODE_IDS[scale_mode], 1, plan.mode, plan.ph,
                                plan.pstride, plan.elem)
    got = fastpath.mx_values(fastpath.a_form(x, axis), plan, 99, 5)
    assert _same(got, want if axis == 1 else want.T)
    x[2, 3] = np.nan
    assert fastpath.mx_values(fastpath.a_form(x, axis), plan, 99, 5) is None


def test_bf16_values_equal_the_bf16_encoder():
    """float32 -> bfloat16 RNE against fp4sim's BF16 scheme (codes << 16): random bit patterns of every class,
    ties, the values that round up into Inf, NaN payloads (the format's NaN 0x7FFF), -0."""
    rng = np.random.default_rng(3)
    u = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x00000000, 0x80000000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x7F800000,
                        0xFF800000, 0x7FC00000, 0xFF800001, 0x7F800001, 0x3F808000, 0x3F818000, 0x00008000,
                        0x00018000, 0x0000FFFF], np.uint32)
    u = np.concatenate([u, special, (u[:4096] & 0xFFFF0000) | 0x8000]).reshape(-1, 16)
    x = u.view(np.float32)
    got = fastpath.bf16_values(x)
    q = fs.quantize(x, "bf16")
    want = (q.codes.astype(np.uint32) << 16).view(np.float32)
    assert _same(got, want)


# ------------------------------------------------------------------------------------------------ emulate
_PRESETS = ["bf16", "nvfp4_paper", "mxfp4_paper", "mxfp8", "fp8_blockwise"]
_SWITCHES = [{}, {"disable_stochastic_rounding": True}, {"disable_rht": True}, {"disable_2d_quantization": True},
             {"sr_activations": True}, {"sr_weights": True}, {"rht_fprop": True, "rht_dgrad": True},
             {"rht_signs": "fixed"}, {"rht_signs": "per_transform"}, {"rht_signs": "none"}, {"rht_size": 32},
             {"weights_1d_reuse": True}, {"four_over_six": "mae"}, {"wgrad_x_reuse_fprop": True,
                                                                   "disable_rht": True}]


def _three_gemms(x, w, dy, rec, layer=2, call=3):
    y, qw, qx = emulate.fprop(x, w, rec, layer, call, return_qx=True)
    keep_w = qw if rec.dgrad_w_reuse_fprop or emulate.serves(qw, rec.dgrad_w) else None
    keep_x = qx if rec.wgrad_x_reuse_fprop or emulate.serves(qx, rec.wgrad_x) else None
    cache = {}
    dx = emulate.dgrad(dy, w, rec, layer, call, keep_w, cache=cache)
    dw = emulate.wgrad(dy, x, rec, layer, call, None, keep_x, cache=cache)
    return y, dx, dw


def _emulate_equal(rec, shapes, seed=0) -> bool:
    rng = np.random.default_rng(seed)
    for M, N, K in shapes:
        x, w, dy = _operand(rng, (M, K)), _operand(rng, (N, K), False), _operand(rng, (M, N))
        with _fast(True):
            fast = _three_gemms(x, w, dy, rec)
        with _fast(False):
            general = _three_gemms(x, w, dy, rec)
        if not all(_same(a, b) for a, b in zip(fast, general)):
            return False
    return True


@pytest.mark.parametrize("preset", _PRESETS)
def test_emulate_fast_equals_general_every_preset(preset):
    """Fprop, Dgrad and Wgrad outputs bit for bit equal with the fast path on and off, on shapes whose M, N
    and K are and are not multiples of 16 (padding, partial tiles, partial Philox groups)."""
    rec = Recipe.preset(preset, accumulate="fast", seed=9)
    assert _emulate_equal(rec, [(64, 48, 32), (50, 33, 40), (128, 96, 80)])


@pytest.mark.parametrize("sw", _SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "paper")
def test_emulate_fast_equals_general_every_switch(sw):
    rec = Recipe.preset("nvfp4_paper", accumulate="fast", seed=4, **sw)
    assert _emulate_equal(rec, [(64, 48, 32), (50, 33, 40)])
    if sw.get("rht_signs") or sw.get("rht_size"):
        assert _emulate_equal(Recipe.preset("mxfp4_paper", accumulate="fast", seed=4, **sw), [(64, 64, 64)])


def test_emulate_fast_path_reuses_shared_values():
    """Quantize once, use twice: 16x16 weights reach Dgrad from Fprop's values (the weight is never quantized
    along N), and BF16's activations and output gradients likewise; the values are those of quantizing again."""
    rng = np.random.default_rng(1)
    x, w, dy = _operand(rng, (64, 32)), _operand(rng, (48, 32)), _operand(rng, (64, 48))
    rec = Recipe.preset("nvfp4_paper", accumulate="fast")
    calls = []
    real = emulate._operand_values

    def spy(a, op, axis, *args, **kw):
        calls.append(args[3])
        return real(a, op, axis, *args, **kw)
    with _fast(True), pytest.MonkeyPatch.context() as mp:
        mp.setattr(emulate, "_operand_values", spy)
        _three_gemms(x, w, dy, rec)
        assert "dgrad_w" not in calls and "fprop_w" in calls
        calls.clear()
        _three_gemms(x, w, dy, Recipe.preset("bf16", accumulate="fast"))
        assert sorted(calls) == ["dgrad_dy", "fprop_w", "fprop_x"]
        calls.clear()
        _three_gemms(x, w, dy, Recipe.preset("mxfp4_paper", accumulate="fast"))
        assert len(calls) == 6                          # 1x32 blocks depend on the axis: nothing shared
    assert _emulate_equal(rec, [(64, 48, 32)])


def _wgrad_shape_change_equal() -> bool:
    """Wgrad's output gradient (SR along the tokens, Philox bits laid out by the tensor's width) for widths
    that change between calls of one operand: 48 (in-kernel Philox), 40 (not a multiple of 16), 64."""
    rec = Recipe.preset("nvfp4_paper", accumulate="fast", disable_rht=True)
    rng = np.random.default_rng(5)
    for N in (48, 40, 64, 40):
        x, dy = _operand(rng, (32, 32)), _operand(rng, (32, N))
        with _fast(True):
            a = emulate.wgrad(dy, x, rec, 0, 1)
        with _fast(False):
            b = emulate.wgrad(dy, x, rec, 0, 1)
        if not _same(a, b):
            return False
    return True


def test_plan_rebuilt_when_the_shape_changes():
    assert _wgrad_shape_change_equal()


def test_stale_plan_is_caught(monkeypatch):
    """Injected bug: the plan cache keyed without the shape (the first width's Philox layout reused)."""
    real = fastpath.operand_plan.__wrapped__
    stale = {}
    monkeypatch.setattr(fastpath, "operand_plan", lambda op, shape, axis: stale.setdefault((op, axis),
                                                                                          real(op, shape, axis)))
    assert not _wgrad_shape_change_equal()


# ------------------------------------------------------------------------------------------------ torch bridge
def _model(seed=0, d=32, blocks=2):
    from test_training import TinyGPT
    torch.manual_seed(seed)
    return TinyGPT(vocab=32, d=d, heads=2, blocks=blocks)


def _grads(model, steps=3, T=(24, 24, 17), lr=1e-2, between=None):
    """Gradients of ``steps`` SGD steps (sequence lengths ``T`` per step, so shapes change between calls)."""
    from fp4sim.torch import QuantLinear
    g = torch.Generator().manual_seed(1)
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        idx = torch.randint(0, 32, (3, T[s % len(T)] + 1), generator=g)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if between is not None:
            between(model, s)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    return out


def _bridge_equal(make, **kw) -> bool:
    with _fast(True):
        a = _grads(make(), **kw)
    with _fast(False):
        b = _grads(make(), **kw)
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


@pytest.mark.parametrize("preset,sw", [(p, {}) for p in _PRESETS] + [
    ("nvfp4_paper", {"rht_signs": "per_transform"}), ("nvfp4_paper", {"rht_signs": "fixed"}),
    ("nvfp4_paper", {"rht_signs": "none"}), ("nvfp4_paper", {"weights_1d_reuse": True}),
    ("nvfp4_paper", {"sr_weights": True, "sr_activations": True}), ("nvfp4_paper", {"four_over_six": "mse"})],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()) or "-")
def test_training_steps_fast_equals_general(preset, sw):
    """Gradients of whole training steps bit for bit equal with the fast path on and off: the SR streams
    (the call counter advances), the RHT sign strategies, the first and last blocks and the head kept in BF16,
    sequence lengths that change between steps."""
    from fp4sim.torch import convert
    rec = Recipe.preset(preset, accumulate="fast", seed=3, keep=("head",), keep_first=1, **sw)
    assert _bridge_equal(lambda: convert(_model(blocks=3), rec))


def test_training_fast_equals_general_across_set_recipe():
    """set_recipe mid-run (backward only to BF16, then both to nvfp4 without SR, then forward to mxfp4): the
    operands each pass shares are those the recipe of that pass quantizes."""
    from fp4sim.torch import convert, set_recipe

    def between(model, s):
        if s == 0:
            set_recipe(model, Recipe.preset("bf16", accumulate="fast"), "backward")
        elif s == 1:
            set_recipe(model, Recipe.preset("nvfp4_paper", accumulate="fast", disable_stochastic_rounding=True))
        elif s == 2:
            set_recipe(model, Recipe.preset("mxfp4_paper", accumulate="fast"), "forward")
    rec = Recipe.preset("nvfp4_paper", accumulate="fast", seed=1)
    assert _bridge_equal(lambda: convert(_model(), rec), steps=5, between=between)


def test_models_copy_pickle_and_reload_on_the_fast_path():
    """A model that ran fast-path steps deep-copies, pickles and reloads its state_dict; each copy then trains on
    exactly as the original does (same gradients bit for bit), the SR call counters included."""
    from fp4sim.torch import convert
    rec = Recipe.preset("nvfp4_paper", accumulate="fast", seed=2)
    with _fast(True):
        m = convert(_model(), rec)
        _grads(m, steps=2)
        copies = [copy.deepcopy(m), pickle.loads(pickle.dumps(m))]
        fresh = convert(_model(seed=7), rec)
        fresh.load_state_dict(m.state_dict())
        copies.append(fresh)
        ref = _grads(m, steps=2)
        for c in copies:
            got = _grads(c, steps=2)
            assert all(torch.equal(x, y) for sa, sb in zip(ref, got) for x, y in zip(sa, sb))


def test_stale_philox_key_is_caught(monkeypatch):
    """Injected bug: the fused kernel's Philox key and stream kept from the first call (a cached plan that held
    them), so every later call draws the first call's bits."""
    from fp4sim.torch import convert
    real = fastpath.nvfp4_values
    first = {}

    def stale(A, plan, seed=None, stream=0):
        seed, stream = first.setdefault((plan, A.shape), (seed, stream))
        return real(A, plan, seed, stream)
    monkeypatch.setattr(fastpath, "nvfp4_values", stale)
    rec = Recipe.preset("nvfp4_paper", accumulate="fast", seed=3)
    assert not _bridge_equal(lambda: convert(_model(), rec), T=(24,))
