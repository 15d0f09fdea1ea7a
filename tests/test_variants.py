"""The NVFP4 variants beyond the paper's: TransformerEngine's row-scaled NVFP4 and torchao's NVFP4 without a
tensor scale, through quantize, dequantize, gemm, validate (API, CLI, diagnosis) and analyze."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import fp4sim as fs
from blockcases import heavy
from fp4sim.validate import compare

X = heavy((32, 64), 21) * np.float32(2.0) ** np.arange(-16, 16, dtype=np.float32)[:, None]
ROW = dict(row_scaled=True)
NOTS = dict(flavor="torchao", per_tensor_scale=False)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="1x16 blocks"):
        fs.quantize(X, "nvfp4_2d", row_scaled=True)
    with pytest.raises(ValueError, match="flavor='torchao'"):
        fs.quantize(X, "nvfp4", per_tensor_scale=False)
    with pytest.raises(ValueError, match="32 values, not 1"):
        fs.quantize(X, "nvfp4", row_scaled=True, global_amax=3.0)
    with pytest.raises(ValueError, match="per_tensor_scale=False does not have"):
        fs.quantize(X, "nvfp4", global_amax=3.0, **NOTS)
    with pytest.raises(ValueError, match="does not apply"):
        fs.quantize(X, "mxfp4", row_scaled=True)


def test_row_scaled_global_amax_override_and_axis():
    q = fs.quantize(X, "nvfp4", **ROW)
    g = np.asarray(q.global_amax) * np.float32(2)
    q2 = fs.quantize(X, "nvfp4", global_amax=g, **ROW)
    assert np.array_equal(q2.global_amax, g) and not np.array_equal(q2.scales, q.scales)
    qt = fs.quantize(X.T.copy(), "nvfp4", axis=0, **ROW)             # rows = the other axis, as always
    assert np.array_equal(qt.codes, q.codes) and np.array_equal(qt.global_amax, q.global_amax)
    assert np.array_equal(fs.dequantize(qt), fs.dequantize(q).T)


def test_gemm_of_torchao_operands_without_tensor_scale():
    A, B = heavy((16, 64), 1), heavy((8, 64), 2)
    qa, qb = fs.quantize(A, "nvfp4", **NOTS), fs.quantize(B, "nvfp4", **NOTS)
    y = fs.gemm(qa, qb)
    ref = fs.dequantize(qa).astype(np.float64) @ fs.dequantize(qb).astype(np.float64).T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    qa2, qb2 = fs.quantize(A, "nvfp4", flavor="torchao"), fs.quantize(B, "nvfp4", flavor="torchao")
    ref2 = fs.dequantize(qa2).astype(np.float64) @ fs.dequantize(qb2).astype(np.float64).T
    assert np.abs(fs.gemm(qa2, qb2) - ref2).max() <= 1e-5 * np.abs(ref2).max()   # alpha = fl(pts_a * pts_b)


@pytest.mark.parametrize("variant", [ROW, NOTS])
def test_validate_exact_and_diagnosis_names_the_variant(variant):
    q = fs.quantize(X, "nvfp4", **variant)
    sch = fs.get_scheme("nvfp4", **variant)
    assert compare(X, q.codes, q.scales, sch, global_amax=q.global_amax).exact
    r = compare(X, q.codes, q.scales, "nvfp4")                       # validated as plain te NVFP4
    assert r.verdict == "mismatch" and r.diagnosis["exact_match"]
    want = "one tensor scale per row" if variant is ROW else "no tensor scale"
    assert want in r.diagnosis["best"]["label"], r.diagnosis["best"]["label"]
    wrong = np.asarray(q.global_amax) * 2 if variant is ROW else None
    if wrong is not None:
        r = compare(X, q.codes, q.scales, sch, global_amax=wrong)
        assert not r.ok and r.global_amax_mismatch


def test_validate_cli_with_the_variants(tmp_path):
    for variant, flags in ((ROW, ["--row-scaled"]), (NOTS, ["--no-tensor-scale"])):
        q = fs.quantize(X, "nvfp4", **variant)
        for n, a in (("x", X), ("c", q.codes), ("s", q.scales)):
            np.save(tmp_path / f"{n}.npy", a)
        args = [sys.executable, "-m", "fp4sim.validate", "--scheme", "nvfp4", "--input", str(tmp_path / "x.npy"),
                "--codes", str(tmp_path / "c.npy"), "--scales", str(tmp_path / "s.npy"), *flags]
        if variant is ROW:
            np.save(tmp_path / "g.npy", q.global_amax)
            args += ["--global-amax", str(tmp_path / "g.npy")]
        r = subprocess.run(args, capture_output=True, text=True)
        assert r.returncode == 0 and "EXACT" in r.stdout, (flags, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "--scheme", "nvfp4_2d", "--input",
                        str(tmp_path / "x.npy"), "--codes", str(tmp_path / "c.npy"), "--scales",
                        str(tmp_path / "s.npy"), "--row-scaled"], capture_output=True, text=True)
    assert r.returncode == 2 and "bad input" in r.stderr and "1x16" in r.stderr


def test_analyze_takes_the_variants_as_schemes(tmp_path):
    np.savez(tmp_path / "d.npz", **{"big_rows.input": X})
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(tmp_path / "d.npz"), "--quiet", "--no-hadamard",
                        "--schemes", "nvfp4,nvfp4_row_scaled,nvfp4_torchao_no_tensor_scale,nvfp4_4over6_row_scaled",
                        "--role", "big_rows*=activation", "--json",
                        str(tmp_path / "s.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "s.json").read_text())["tensors"]["big_rows.input"]["schemes"]
    y = fs.fake_quantize(X, "nvfp4", **ROW).astype(np.float64)
    want = 10 * np.log10(np.mean(X.astype(np.float64) ** 2) / np.mean((y - X) ** 2))
    assert m["nvfp4_row_scaled"]["sqnr_db"] == pytest.approx(want, rel=1e-9)
    # rows spanning 2^32: one tensor scale underflows the small rows' block scales, one per row does not
    assert m["nvfp4_row_scaled"]["underflow_frac"] < m["nvfp4"]["underflow_frac"]
    q = fs.quantize(X, "nvfp4", row_scaled=True, four_over_six="mse")
    y = fs.dequantize(q).astype(np.float64)
    want = 10 * np.log10(np.mean(X.astype(np.float64) ** 2) / np.mean((y - X) ** 2))
    assert m["nvfp4_4over6_row_scaled"]["sqnr_db"] == pytest.approx(want, rel=1e-9)
    assert m["nvfp4_4over6_row_scaled"]["map_to_4_frac"] == pytest.approx(q.extras["map_to_4_frac"], rel=1e-12)


def test_four_over_six_validate_diagnosis_names_the_error_rule(tmp_path):
    x = heavy((32, 64), 23)
    q = fs.quantize(x, "nvfp4", four_over_six="mse", four_over_six_e4m3_max=256)
    sch = fs.get_scheme("nvfp4", four_over_six="mse", four_over_six_e4m3_max=256)
    assert compare(x, q.codes, q.scales, sch).exact
    wrong = fs.get_scheme("nvfp4", four_over_six="mae", four_over_six_e4m3_max=256)
    r = compare(x, q.codes, q.scales, wrong)
    assert r.verdict == "mismatch" and r.diagnosis["exact_match"], r.summary()
    assert r.diagnosis["best"]["label"].startswith("flavor='te', 4over6 MSE, E4M3 max 256")
    for n, a in (("x", x), ("c", q.codes), ("s", q.scales)):
        np.save(tmp_path / f"{n}.npy", a)
    base = [sys.executable, "-m", "fp4sim.validate", "--scheme", "nvfp4", "--input", str(tmp_path / "x.npy"),
            "--codes", str(tmp_path / "c.npy"), "--scales", str(tmp_path / "s.npy"), "--four-over-six-e4m3-max", "256"]
    assert subprocess.run(base + ["--four-over-six", "mse"], capture_output=True, text=True).returncode == 0
    r = subprocess.run(base + ["--four-over-six", "mae"], capture_output=True, text=True)
    assert r.returncode == 1 and "4over6 MSE" in r.stdout


def test_four_over_six_lowers_the_error_and_dequantizes_with_its_own_constants():
    x = heavy((64, 128), 24)
    base = fs.fake_quantize(x, "nvfp4").astype(np.float64)
    for emax in (448, 256):
        q = fs.quantize(x, "nvfp4", four_over_six="mse", four_over_six_e4m3_max=emax)
        y = fs.dequantize(q).astype(np.float64)
        assert np.mean((y - x) ** 2) < np.mean((base - x) ** 2)
        inv = np.float32(1) / np.float32(6 * emax)                       # fl(v * fl(fl(s * amax) * fl(1/(6 emax))))
        fac = (fs.E4M3.values[q.scales] * q.global_amax).astype(np.float32) * inv
        want = fs.E2M1.values[fs.layout.unpack_fp4(q.codes)] * np.repeat(fac.astype(np.float32), 16, axis=1)
        assert np.array_equal(y.astype(np.float32), want.astype(np.float32))
        assert 0 < q.extras["map_to_4_frac"] < 1
    with pytest.raises(ValueError, match="round-to-nearest"):
        fs.quantize(x, "nvfp4", four_over_six="mae", rounding="sr", seed=1)


def test_four_over_six_ties_resolved_the_other_way_are_named():
    """With S_enc = 1 (tensor amax 2688), blocks of {6, 3, 1.5, 0} are exact under both candidates (scales 1 and
    1.5): equal errors. TE keeps map-to-6; a kernel that picks map-to-4 there is named by the diagnosis."""
    x = heavy((32, 64), 25)
    x[31, 63] = 2688.0
    x[4:8] = np.tile(np.array([6, 3, 1.5, 0] * 4, np.float32), (4, 4))
    te = fs.quantize(x, "nvfp4", four_over_six="mae")
    other = fs.quantize(x, "nvfp4", four_over_six="mae", four_over_six_ties="map_to_4")
    assert np.all(te.scales[4:8] == fs.encode(np.array([1.0], np.float32), fs.E4M3)[0])
    assert np.all(other.scales[4:8] == fs.encode(np.array([1.5], np.float32), fs.E4M3)[0])
    assert np.array_equal(fs.dequantize(te)[4:8], fs.dequantize(other)[4:8])      # both exact
    r = compare(x, other.codes, other.scales, fs.get_scheme("nvfp4", four_over_six="mae"))
    assert r.verdict == "mismatch" and r.diagnosis["exact_match"]
    assert "equal errors choose map-to-4" in r.diagnosis["best"]["label"], r.diagnosis["best"]["label"]


def test_row_scaled_four_over_six_validates_and_is_named_by_the_diagnosis(tmp_path):
    kw = dict(row_scaled=True, four_over_six="mse", four_over_six_e4m3_max=256)
    q = fs.quantize(X, "nvfp4", **kw)
    sch = fs.get_scheme("nvfp4", **kw)
    assert compare(X, q.codes, q.scales, sch, global_amax=q.global_amax).exact
    r = compare(X, q.codes, q.scales, fs.get_scheme("nvfp4", four_over_six="mse", four_over_six_e4m3_max=256))
    assert r.verdict == "mismatch" and r.diagnosis["exact_match"], r.summary()
    assert r.diagnosis["best"]["label"].startswith("flavor='te', 4over6 MSE, E4M3 max 256, one tensor scale per row,")
    y = fs.dequantize(q).astype(np.float64)          # rows over 2^32: the per-row second level keeps every row
    one = fs.fake_quantize(X, "nvfp4", four_over_six="mse", four_over_six_e4m3_max=256).astype(np.float64)
    assert np.mean((y - X) ** 2 / np.mean(X ** 2, 1, keepdims=True)) < np.mean((one - X) ** 2 /
                                                                               np.mean(X ** 2, 1, keepdims=True))
    for n, a in (("x", X), ("c", q.codes), ("s", q.scales), ("g", q.global_amax)):
        np.save(tmp_path / f"{n}.npy", a)
    args = [sys.executable, "-m", "fp4sim.validate", "--scheme", "nvfp4", "--input", str(tmp_path / "x.npy"),
            "--codes", str(tmp_path / "c.npy"), "--scales", str(tmp_path / "s.npy"), "--row-scaled",
            "--global-amax", str(tmp_path / "g.npy"), "--four-over-six", "mse", "--four-over-six-e4m3-max", "256"]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0 and "EXACT" in r.stdout, (r.stdout, r.stderr)
    r = subprocess.run(args[:-3] + ["mae"], capture_output=True, text=True)
    assert r.returncode == 1 and "4over6 MSE, E4M3 max 256, one tensor scale per row" in r.stdout, r.stdout


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_four_over_six_fake_quantize_equals_dequantize_along_every_axis(block, axis):
    """fake_quantize with 4over6 is dequantize(quantize) bit for bit along any axis (along axis 0 it once
    reshaped the dequantized tensor, in the input's shape, as if it were the (R, K) rows: scrambled values)."""
    x = X[:, :40] * np.float32(1.5)                   # 32 x 40: the blocked axis not a multiple of 16 either way
    for err in ("mae", "mse"):
        a = fs.fake_quantize(x, "nvfp4", axis=axis, block=block, four_over_six=err)
        b = fs.dequantize(fs.quantize(x, "nvfp4", axis=axis, block=block, four_over_six=err))
        assert a.shape == x.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
