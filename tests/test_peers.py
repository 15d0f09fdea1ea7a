"""fp4sim's flavours against the peer libraries themselves, bit for bit (CI installs them: '.[test]').

  peer                          what is compared                          fp4sim setting
  TransformerEngine 2.20.2 ref  packed codes + E4M3 scales, 1x16 & 16x16  flavor="te"
                                RHT (_apply_rht) on bf16 inputs           rht(d=16, signs="te")
  torchao 0.18 nvfp4_quantize   packed codes + scales, all-zero tensor    flavor="torchao"
  nvidia-modelopt 0.47          packed codes + scales, all-zero tensor    flavor="modelopt"
  torchao to_mx                 MX scale bytes + codes, 4 modes            mxfp4 / mxfp8_e4m3 / mxfp6_e2m3 / _e3m2
  torchao to_blocked            swizzled scale layout                      layout.swizzle_scales
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from peers import import_or_missing, load_te_reference, torch_or_skip

pytestmark = pytest.mark.peer


def _inputs():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((32, 64)).astype(np.float32)
    z[:16, :16] = 0.0                      # a zero tile next to nonzero ones
    z[16:, 48:] *= 1e-6                    # scales that underflow to E4M3 subnormals / zero
    z[20, 50] = 3e-9
    return {
        "randn": rng.standard_normal((32, 128)).astype(np.float32),
        "heavy": heavy((48, 96), 3),
        "bf16_valued": rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16).astype(np.float32),
        "te_vs_paper": _te_vs_paper(),
        "lattice": _lattice(),
        "zero_and_underflow": z,
        "all_zero": np.zeros((16, 32), np.float32),
        "ties_at_six": np.tile(np.array([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2, np.float32), (16, 2)),
    }


def _te_vs_paper():
    """A block whose scale byte is 82 in TE's order and 81 in the paper's (tensor amax 95.09591)."""
    z = np.zeros((16, 32), np.float32)
    z[0, 0], z[1, 0], z[1, 1] = np.float32(95.09591), np.float32(2.0165424), 1.0
    return z


def _lattice():
    """E2M1 ties and grid values times powers of two, each block with a +-6 element: exact ties everywhere."""
    vals = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0],
                    np.float32)
    scale = (np.float32(2.0) ** np.arange(-8, 8, dtype=np.float32))[:, None]
    return (np.tile(vals, (16, 2)) * scale).astype(np.float32)


INPUTS = _inputs()


@pytest.fixture(scope="module")
def te_ref(tmp_path_factory):
    return load_te_reference(tmp_path_factory.mktemp("te"))


@pytest.mark.parametrize("name", list(INPUTS))
@pytest.mark.parametrize("tile", [1, 16])
@pytest.mark.parametrize("global_amax", [None, 3e38, 1e-40])
def test_te_flavour_matches_transformer_engine_reference(te_ref, name, tile, global_amax):
    torch = torch_or_skip()
    x = INPUTS[name]
    g = np.float32(np.abs(x).max()) if global_amax is None else np.float32(global_amax)
    codes, scales = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
        torch.from_numpy(x), torch.tensor(g), 16, tile, pow_2_scales=False, eps=0.0)
    q = fs.quantize(x, "nvfp4", block=(tile, 16), global_amax=None if global_amax is None else g)
    np.testing.assert_array_equal(q.codes, codes.numpy())
    np.testing.assert_array_equal(q.scales_per_row(), scales.view(torch.uint8).numpy())


def test_te_reference_maps_negative_zero_to_code_zero_and_the_kernels_do_not(te_ref):
    """TE's Python reference differs from its CUDA kernels (and from fp4sim's te flavour) on -0 only."""
    torch = torch_or_skip()
    x = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    x[0, 0], x[3, 7] = -0.0, -0.0
    codes, _ = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
        torch.from_numpy(x), torch.tensor(np.float32(np.abs(x).max())), 16, 1, pow_2_scales=False, eps=0.0)
    theirs = fs.layout.unpack_fp4(codes.numpy())
    ours = fs.layout.unpack_fp4(fs.quantize(x, "nvfp4").codes)
    diff = np.argwhere(theirs != ours)
    assert diff.tolist() == [[0, 0], [3, 7]]
    assert (ours[0, 0], theirs[0, 0]) == (8, 0)


def test_rht_matches_transformer_engine_apply_rht(te_ref):
    torch = torch_or_skip()
    import ml_dtypes
    from types import SimpleNamespace
    x = np.random.default_rng(2).standard_normal((64, 128)).astype(ml_dtypes.bfloat16).astype(np.float32)
    Q = te_ref.NVFP4QuantizerRef
    self = SimpleNamespace(with_rht=True, quant_tile_shape=(1, 16), with_random_sign_mask=True,
                           _build_hadamard_matrix=Q._build_hadamard_matrix)
    theirs = Q._apply_rht(self, torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    np.testing.assert_array_equal(fs.rht(x, 16, "te"), theirs)


@pytest.mark.parametrize("name", list(INPUTS))
def test_torchao_flavour_matches_torchao(name):
    torch = torch_or_skip()
    nv = import_or_missing("torchao.prototype.mx_formats.nvfp4_tensor")
    x = INPUTS[name]
    amax = torch.tensor(np.float32(np.abs(x).max()))
    scales, packed = nv.nvfp4_quantize(torch.from_numpy(x), 16, nv.per_tensor_amax_to_scale(amax))
    with pytest.warns(RuntimeWarning) if name == "all_zero" else _nullcontext():
        q = fs.quantize(x, "nvfp4", flavor="torchao")
    np.testing.assert_array_equal(q.scales, scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(q.codes, packed.numpy())
    if name == "all_zero":
        assert np.all(q.scales == 0xFF) and np.all(q.codes == 0xCC)


@pytest.mark.parametrize("name", list(INPUTS))
def test_modelopt_flavour_matches_modelopt(name):
    torch = torch_or_skip()
    qt = import_or_missing("modelopt.torch.quantization.qtensor")
    x = INPUTS[name]
    xx = x.copy()
    xx[0, 1] = -0.0 if name != "all_zero" else xx[0, 1]
    qobj, scales, _ = qt.NVFP4QTensor.quantize(torch.from_numpy(xx.copy()), 16)
    with pytest.warns(RuntimeWarning) if name == "all_zero" else _nullcontext():
        q = fs.quantize(xx, "nvfp4", flavor="modelopt")
    np.testing.assert_array_equal(q.scales, scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(q.codes, qobj._quantized_data.numpy())
    if name == "all_zero":
        assert np.all(q.scales == 0xFF) and np.all(q.codes == 0x77)


@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
@pytest.mark.parametrize("elem", ["e2m1", "e4m3", "e2m3", "e3m2"])
def test_mx_scale_modes_against_torchao_to_mx(mode, elem):
    torch = torch_or_skip()
    mx = import_or_missing("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from fp4sim.reference.blocks import mx_scale_ref
    rng = np.random.default_rng(5)
    x = heavy((64, 256), 6)
    # blocks whose amax sits exactly on / just above a power of two (times 6 or 448): log2's weak spot
    fmt = fs.get_format(elem)
    for i in range(16):
        x[i, 0] = np.float32(fmt.max * 2.0 ** rng.integers(-8, 8)) * (np.float32(1) + np.float32(2.0**-23) * (i % 3))
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    tdt = {"e2m1": torch.float4_e2m1fn_x2, "e4m3": torch.float8_e4m3fn, "e2m3": DTYPE_FP6_E2M3,
           "e3m2": DTYPE_FP6_E3M2}[elem]
    ts, td = mx.to_mx(torch.from_numpy(x), tdt, 32, ScaleCalculationMode[mode.upper()])
    theirs_s = ts.view(torch.uint8).numpy()
    theirs_d = td.view(torch.uint8).numpy()                 # (FP6: one unpacked code per byte, as fp4sim's)
    q = fs.quantize(x, fs.schemes.MX_ELEMS[fmt], scale_mode=mode)
    ours_s = q.scales
    bad = ours_s != theirs_s
    if mode != "rceil":
        assert not bad.any()
        np.testing.assert_array_equal(q.codes, theirs_d)
        return
    # rceil: torchao computes it with float32 log2, which is off by one binade just above powers of two
    amax = np.abs(x.reshape(64, 8, 32)).max(-1)
    for r, j in np.argwhere(bad):
        assert ours_s[r, j] == mx_scale_ref(amax[r, j], "rceil", fmt) == theirs_s[r, j] + 1
    assert bad.sum() >= 1, "the power-of-two blocks above should expose torchao's log2 rceil"
    rows = ~bad.any(axis=1)
    np.testing.assert_array_equal(q.codes[rows], theirs_d[rows])


def test_swizzle_matches_torchao_to_blocked():
    torch = torch_or_skip()
    ut = import_or_missing("torchao.prototype.mx_formats.utils")
    for shape in [(128, 4), (130, 7), (256, 12), (5, 3)]:
        s = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
        theirs = ut.to_blocked(torch.from_numpy(s)).numpy().reshape(-1)
        np.testing.assert_array_equal(fs.layout.swizzle_scales(s), theirs)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------------------------ kernel validation
def _peer_outputs(te_ref, x):
    """(flavour, packed codes, scale bytes) from each peer quantizer for x."""
    torch = torch_or_skip()
    nv = import_or_missing("torchao.prototype.mx_formats.nvfp4_tensor")
    qt = import_or_missing("modelopt.torch.quantization.qtensor")
    xt = torch.from_numpy(x)
    amax = xt.abs().amax()
    c, s = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(xt, amax, 16, 1, pow_2_scales=False, eps=0.0)
    yield "te", c.numpy(), s.view(torch.uint8).numpy()
    s, c = nv.nvfp4_quantize(xt, 16, nv.per_tensor_amax_to_scale(amax))
    yield "torchao", c.numpy(), s.view(torch.uint8).numpy()
    qo, s, _ = qt.NVFP4QTensor.quantize(xt.clone(), 16)
    yield "modelopt", qo._quantized_data.numpy(), s.view(torch.uint8).numpy()


def test_peer_outputs_validate_exact_under_their_flavour_and_are_named(te_ref):
    from fp4sim.validate import compare
    x = heavy((128, 256), 3)
    for flavor, codes, scales in _peer_outputs(te_ref, x):
        assert compare(x, codes, scales, "nvfp4", flavor=flavor).exact, flavor
        other = "modelopt" if flavor != "modelopt" else "te"
        r = compare(x, codes, scales, "nvfp4", flavor=other)
        assert r.verdict == "mismatch" and r.diagnosis["exact_match"], flavor
        named = r.diagnosis["best"]["label"]
        assert named.startswith(f"flavor={flavor!r}") or (flavor == "te" and named.startswith("flavor='paper'"))


def test_te_pow2_scales_path_is_mxfp4_rceil(te_ref):
    """TE's pow_2_scales NVFP4 path (1x32 blocks, E8M0 round-up of amax/6, no tensor scale) is fp4sim's MXFP4
    with rceil scales: the same codes and scales, except where TE's reference takes the float32 log2 of
    amax/6 just above a power of two (one binade low there; fp4sim follows the exact bit rule)."""
    torch = torch_or_skip()
    rng = np.random.default_rng(3)
    x = heavy((64, 128), 5)
    near = (np.float32(6.0) * np.float32(2.0) ** rng.integers(-20, 20, 64).astype(np.float32))
    x[:, 0] = (near.view(np.uint32) + rng.integers(0, 4, 64).astype(np.uint32)).view(np.float32)  # just above 6*2^k
    codes, dec = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
        torch.from_numpy(x), torch.tensor(0.0), 32, 1, pow_2_scales=True, eps=0.0)
    q = fs.quantize(x, "mxfp4", scale_mode="rceil")
    ours = 2.0 ** (q.scales.astype(np.float64) - 127)
    te = dec.numpy().astype(np.float64)
    same = ours == te
    assert same.mean() > 0.9
    amax = np.abs(x.reshape(64, -1, 32)).max(-1)
    v = (amax / np.float32(6)).astype(np.float32)
    for r, b in np.argwhere(~same):
        assert te[r, b] == ours[r, b] / 2                              # TE one binade low ...
        assert np.log2(np.float32(v[r, b])) == np.floor(np.log2(float(v[r, b])))  # ... where float32 log2 is exact-looking
        assert v[r, b] > ours[r, b] / 2                                # although amax/6 exceeds that power of two
    rows = np.flatnonzero(same.all(1))
    np.testing.assert_array_equal(codes.numpy()[rows], q.codes[rows])


ROW_INPUTS = {**INPUTS, "rows_over_many_binades": heavy((32, 64), 9) * np.float32(2.0) ** np.arange(-16, 16,
                                                                                            dtype=np.float32)[:, None]}


@pytest.mark.parametrize("name", list(ROW_INPUTS))
@pytest.mark.parametrize("flavor", ["te", "paper"])
def test_row_scaled_nvfp4_matches_transformer_engine_reference(te_ref, name, flavor):
    """TE 2.20.2's row_scaled_nvfp4: one FP32 second-level scale per row from that row's amax (te's fused
    multiplier; the paper flavour is the same with TE <= 2.13's order, compared against its formula here)."""
    torch = torch_or_skip()
    x = ROW_INPUTS[name].astype(np.float32)
    rows = np.abs(np.nan_to_num(x)).max(1).astype(np.float32)
    q = fs.quantize(x, "nvfp4", flavor=flavor, row_scaled=True)
    assert q.global_amax.dtype == np.float32 and np.array_equal(q.global_amax, rows)
    if flavor == "te":
        codes, scales = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
            torch.from_numpy(x), torch.from_numpy(rows), 16, 1, pow_2_scales=False, row_scaled_nvfp4=True, eps=0.0)
        np.testing.assert_array_equal(q.scales, scales.view(torch.uint8).numpy())
        np.testing.assert_array_equal(q.codes, codes.numpy())
    for r in range(x.shape[0]):          # each row equals that row quantized alone as its own tensor
        one = fs.quantize(x[r:r + 1], "nvfp4", flavor=flavor, global_amax=rows[r])
        assert np.array_equal(one.codes[0], q.codes[r]) and np.array_equal(one.scales[0], q.scales[r])
    y = fs.dequantize(q)
    for r in range(x.shape[0]):
        one = fs.dequantize(fs.quantize(x[r:r + 1], "nvfp4", flavor=flavor, global_amax=rows[r]))
        assert np.array_equal(one[0].view(np.uint32), y[r].view(np.uint32))


@pytest.mark.parametrize("name", [n for n in INPUTS if n != "all_zero"] + ["all_zero"])
def test_torchao_without_a_tensor_scale_matches_torchao(name):
    torch = torch_or_skip()
    nv = import_or_missing("torchao.prototype.mx_formats.nvfp4_tensor")
    x = INPUTS[name]
    big = x * np.float32(1e4)                                  # block scales above 448 clamp there
    for a in (x, big):
        scales, packed = nv.nvfp4_quantize(torch.from_numpy(np.ascontiguousarray(a)), 16, None)
        q = fs.quantize(a, "nvfp4", flavor="torchao", per_tensor_scale=False)
        assert q.global_amax is None
        np.testing.assert_array_equal(q.scales, scales.view(torch.uint8).numpy())
        np.testing.assert_array_equal(q.codes, packed.numpy())
        want = fs.E2M1.values[fs.layout.unpack_fp4(q.codes)] * np.repeat(fs.E4M3.values[q.scales], 16, axis=1)
        np.testing.assert_array_equal(fs.dequantize(q), want.astype(np.float32)[:, : a.shape[1]])


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_gemm_with_row_scaled_operands_equals_te_qgemm(te_ref, ta, tb):
    """TE's qgemm applies alpha per output row (column) for a row-scaled first (second) operand."""
    import types
    torch = torch_or_skip()
    A = heavy((32, 128), 11) * np.float32(2.0) ** np.arange(-8, 8, 0.5, dtype=np.float32)[:, None]
    B = heavy((24, 128), 12)
    qa, qb = fs.quantize(A, "nvfp4", row_scaled=ta), fs.quantize(B, "nvfp4", row_scaled=tb)
    ref = object.__new__(te_ref.NVFP4QuantizerRef)
    ref.pow_2_scales, ref.nvfp4_use_4over6, ref.nvfp4_e4m3_max = False, False, 448
    amax = lambda q: torch.from_numpy(np.asarray(q.global_amax, np.float32).reshape(-1).copy())  # noqa: E731
    rx = types.SimpleNamespace(global_amax_row=amax(qa), global_amax_col=amax(qa))
    rw = types.SimpleNamespace(global_amax_row=amax(qb), global_amax_col=amax(qb))
    sx = torch.from_numpy(fs.E4M3.values[qa.scales].astype(np.float32))
    sw = torch.from_numpy(fs.E4M3.values[qb.scales].astype(np.float32))
    got = fs.gemm(qa, qb)
    if tb:  # TE's Fprop qgemm multiplies the two global_amax_row vectors elementwise: it has no form for this
        for m, n in ((0, 0), (5, 17), (31, 23)):      # each output element = its two rows as their own tensors
            one = fs.gemm(fs.quantize(A[m:m + 1], "nvfp4", global_amax=np.asarray(qa.global_amax).reshape(-1)[
                m if ta else 0]), fs.quantize(B[n:n + 1], "nvfp4", global_amax=qb.global_amax[n]))
            assert one.view(np.uint32)[0, 0] == got.view(np.uint32)[m, n]
        return
    y = ref.qgemm(torch.from_numpy(qa.codes.copy()), torch.from_numpy(qb.codes.copy()), None, torch.float32, sx, sw,
                  qresult_x=rx, qresult_w=rw).numpy()
    assert np.array_equal(got.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("name", list(INPUTS))
@pytest.mark.parametrize("tile", [1, 16])
@pytest.mark.parametrize("mode,fast,emax", [("mae", False, 448), ("mse", False, 448), ("mae", False, 256),
                                             ("mse", True, 448), ("mae", True, 256)])
def test_four_over_six_matches_transformer_engine_reference(te_ref, name, tile, mode, fast, emax):
    torch = torch_or_skip()
    x = INPUTS[name]
    g = np.float32(np.abs(x).max())
    codes, scales = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
        torch.from_numpy(x), torch.tensor(g), 16, tile, pow_2_scales=False, nvfp4_use_4over6=True,
        nvfp4_e4m3_max=emax, nvfp4_4over6_err_mode=mode.upper(), nvfp4_4over6_err_use_fast_math=fast, eps=0.0)
    q = fs.quantize(x, "nvfp4", block=(tile, 16), four_over_six=mode, four_over_six_fast_math=fast,
                    four_over_six_e4m3_max=emax)
    np.testing.assert_array_equal(q.scales_per_row(), scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(q.codes, codes.numpy())


@pytest.mark.parametrize("name", list(ROW_INPUTS))
@pytest.mark.parametrize("mode,fast,emax", [("mae", False, 448), ("mse", False, 256), ("mse", True, 448),
                                             ("mae", True, 256)])
def test_row_scaled_four_over_six_matches_transformer_engine_reference(te_ref, name, mode, fast, emax):
    """TE 2.20.2's row_scaled_nvfp4 together with nvfp4_use_4over6: per-row S_enc = 6 * e4m3_max / amax_row, and
    the error of each candidate measured with that row's amax."""
    torch = torch_or_skip()
    x = ROW_INPUTS[name].astype(np.float32)
    rows = np.abs(np.nan_to_num(x)).max(1).astype(np.float32)
    codes, scales = te_ref.NVFP4QuantizerRef._quantize_blockwise_reference(
        torch.from_numpy(x), torch.from_numpy(rows), 16, 1, pow_2_scales=False, row_scaled_nvfp4=True,
        nvfp4_use_4over6=True, nvfp4_e4m3_max=emax, nvfp4_4over6_err_mode=mode.upper(),
        nvfp4_4over6_err_use_fast_math=fast, eps=0.0)
    q = fs.quantize(x, "nvfp4", row_scaled=True, four_over_six=mode, four_over_six_fast_math=fast,
                    four_over_six_e4m3_max=emax)
    assert np.array_equal(q.global_amax, rows)
    np.testing.assert_array_equal(q.scales, scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(q.codes, codes.numpy())


@pytest.mark.parametrize("emax", [448, 256])
def test_gemm_of_row_scaled_four_over_six_operands_equals_te_qgemm(te_ref, emax):
    """A row-scaled 4over6 first operand (alpha per output row, divided by 36 * e4m3_max_a * e4m3_max_b) against
    a 4over6 weight with one tensor scale, as TE's qgemm forms it."""
    import types
    torch = torch_or_skip()
    A = heavy((32, 128), 15) * np.float32(2.0) ** np.arange(-8, 8, 0.5, dtype=np.float32)[:, None]
    B = heavy((24, 128), 16)
    qa = fs.quantize(A, "nvfp4", row_scaled=True, four_over_six="mse", four_over_six_e4m3_max=emax)
    qb = fs.quantize(B, "nvfp4", four_over_six="mae", four_over_six_e4m3_max=448)
    ref = object.__new__(te_ref.NVFP4QuantizerRef)
    ref.pow_2_scales, ref.nvfp4_use_4over6, ref.nvfp4_e4m3_max = False, True, 448
    ga = torch.from_numpy(qa.global_amax.copy())
    gb = torch.tensor([float(qb.global_amax)])
    rx = types.SimpleNamespace(global_amax_row=ga, global_amax_col=ga, nvfp4_use_4over6=True, nvfp4_e4m3_max=emax)
    rw = types.SimpleNamespace(global_amax_row=gb, global_amax_col=gb, nvfp4_use_4over6=True, nvfp4_e4m3_max=448)
    sx = torch.from_numpy(fs.E4M3.values[qa.scales].astype(np.float32))
    sw = torch.from_numpy(fs.E4M3.values[qb.scales].astype(np.float32))
    y = ref.qgemm(torch.from_numpy(qa.codes.copy()), torch.from_numpy(qb.codes.copy()), None, torch.float32, sx, sw,
                  qresult_x=rx, qresult_w=rw).numpy()
    assert np.array_equal(fs.gemm(qa, qb).view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("ea,eb", [(448, 448), (256, 448), (256, 256)])
def test_gemm_of_four_over_six_operands_equals_te_qgemm(te_ref, ea, eb):
    import types
    torch = torch_or_skip()
    A, B = heavy((32, 128), 13), heavy((16, 128), 14)
    qa = fs.quantize(A, "nvfp4", four_over_six="mae", four_over_six_e4m3_max=ea)
    qb = fs.quantize(B, "nvfp4", block=(16, 16), four_over_six="mse", four_over_six_e4m3_max=eb)
    ref = object.__new__(te_ref.NVFP4QuantizerRef)
    ref.pow_2_scales, ref.nvfp4_use_4over6, ref.nvfp4_e4m3_max = False, True, 448
    res = lambda q, e: types.SimpleNamespace(  # noqa: E731
        global_amax_row=torch.tensor([float(q.global_amax)]), global_amax_col=torch.tensor([float(q.global_amax)]),
        nvfp4_use_4over6=True, nvfp4_e4m3_max=e)
    sx = torch.from_numpy(fs.E4M3.values[qa.scales_per_row()].astype(np.float32))
    sw = torch.from_numpy(fs.E4M3.values[qb.scales_per_row()].astype(np.float32))
    y = ref.qgemm(torch.from_numpy(qa.codes.copy()), torch.from_numpy(qb.codes.copy()), None, torch.float32, sx, sw,
                  qresult_x=res(qa, ea), qresult_w=res(qb, eb)).numpy()
    assert np.array_equal(fs.gemm(qa, qb).view(np.uint32), y.view(np.uint32))


@pytest.mark.peer
def test_validate_takes_torchaos_per_tensor_scale_as_it_is(tmp_path):
    """torchao's nvfp4_quantize takes per_tensor_scale = amax / 2688. Given as the tensor scale (here from a delayed
    amax 1.37x the tensor's own, so it is no float32 neighbour of max|x| / 2688) the torchao flavour reproduces
    the kernel exactly; given where the amax belongs, the report says what it is and names the CLI flag."""
    import subprocess
    import sys
    torch = torch_or_skip()
    nv = import_or_missing("torchao.prototype.mx_formats.nvfp4_tensor")
    from fp4sim.validate import compare
    x = heavy((64, 128), 5)
    pts = nv.per_tensor_amax_to_scale(torch.tensor(np.float32(np.abs(x).max() * 1.37)))
    scales, codes = nv.nvfp4_quantize(torch.from_numpy(x), 16, pts)
    s, c, p = scales.view(torch.uint8).numpy(), codes.numpy(), np.float32(pts.item())
    r = compare(x, c, s, "nvfp4", flavor="torchao", tensor_scale=p, expect_tensor_amax=False)
    assert r.verdict == "exact", r.summary()
    r = compare(x, c, s, "nvfp4", flavor="torchao", tensor_scale=p)          # not the tensor's own: noted
    assert r.global_amax_mismatch and any("tensor_scale" in n and "fl(max|x| / 2688)" in n for n in r.notes)
    pts0 = nv.per_tensor_amax_to_scale(torch.tensor(np.float32(np.abs(x).max())))
    scales0, codes0 = nv.nvfp4_quantize(torch.from_numpy(x), 16, pts0)
    for k, v in (("x", x), ("c", codes0.numpy()), ("s", scales0.view(torch.uint8).numpy())):
        np.save(tmp_path / f"{k}.npy", v)
    base = [sys.executable, "-m", "fp4sim.validate", "--scheme", "nvfp4", "--flavor", "torchao", "--input",
            tmp_path / "x.npy", "--codes", tmp_path / "c.npy", "--scales", tmp_path / "s.npy"]
    ok = subprocess.run([*map(str, base), "--tensor-scale", repr(float(pts0.item()))], capture_output=True, text=True)
    assert ok.returncode == 0 and "EXACT" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([*map(str, base), "--global-amax", repr(float(pts0.item()))], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "--global-amax" in bad.stdout and "--tensor-scale" in bad.stdout and "amax = scale x 2688" in bad.stdout
    assert "global_amax" not in bad.stdout.replace("--global-amax", "") and "--delayed-scaling" in bad.stdout
