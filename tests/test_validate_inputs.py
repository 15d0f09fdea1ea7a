"""The GEMM checks on what a new user gives them: FP8 outputs (1-byte words), the model named best when several
match, and bad arguments, which are answered as bad input (exit 2, the flag named), never as a kernel that
matches no model (exit 1)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim.validate.matmul16 import compare_matmul
from fp4sim.validate.scaled_mm import compare_scaled_mm

ROOT = Path(__file__).resolve().parents[1]
E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
ONE = np.float32(1.0)


def _ops(seed=0, M=16, N=32, K=256, fb=E4):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((M, K)) * 0.5).astype(E4)
    b = (rng.standard_normal((N, K)) * 0.5).astype(fb)
    return a, b


@pytest.mark.parametrize("out", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_outputs_are_compared_code_by_code(out):
    """compare_scaled_mm on an FP8 output (it broadcast 1-byte outputs against 4-byte words): the hopper model's
    own output matches it; ml_dtypes's rounding of the hopper float32 result (finite, far from saturation) is the
    same output, an independent check of the epilogue; one code moved by one step is one mismatch of one ulp."""
    a, b = _ops(fb=E5 if out == "float8_e5m2" else E4)
    y32 = np.asarray(fs.scaled_mm(a, b.T, ONE, ONE, out_dtype="float32", model="hopper"))
    assert np.abs(y32).max() < 200
    y = np.asarray(fs.scaled_mm(a, b.T, ONE, ONE, out_dtype=out, model="hopper"))
    assert y.dtype == np.dtype(getattr(ml_dtypes, out))
    assert np.array_equal(y.view(np.uint8), y32.astype(y.dtype).view(np.uint8))
    rep = compare_scaled_mm(a, b.T, ONE, ONE, y)
    assert rep.best == "hopper" and rep.match_fraction["hopper"] == 1.0, rep.summary()
    bits = y.view(np.uint8).copy()
    i = int(np.argmax(np.abs(y32).ravel() > 1))              # a positive or negative normal: the next code is 1 ulp
    bits.ravel()[i] += 1
    rep = compare_scaled_mm(a, b.T, ONE, ONE, bits, out_dtype=out, candidates=["hopper"])
    assert rep.best is None and rep.match_fraction["hopper"] == 1 - 1 / y.size, rep.summary()
    assert [(m["row"], m["col"], m["ulps"]) for m in rep.mismatches] == [(i // y.shape[1], i % y.shape[1], 1)]
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(y.view(np.uint8).copy()).view(getattr(torch, out))
    assert compare_scaled_mm(torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn),
                             torch.from_numpy(b.view(np.uint8).T.copy()).view(getattr(torch, str(b.dtype))),
                             torch.tensor([1.0]), torch.tensor([1.0]), t).best == "hopper"


def test_best_is_the_first_match_in_candidate_order():
    """Operands every model computes alike (small integers, exact sums): ``best`` follows the candidates' order,
    and the report says the operands cannot separate them."""
    a = np.tile(np.arange(-2, 2, dtype=np.float32), (16, 8)).astype(E4)          # (16, 32)
    b = np.ones((16, 32), np.float32).astype(E4)
    y = np.asarray(fs.scaled_mm(a, b.T, ONE, ONE, out_dtype="float32", model="exact"))
    for order in (["exact", "hopper", "ada"], ["ada", "exact", "hopper"], ["hopper", "ada", "exact"]):
        rep = compare_scaled_mm(a, b.T, ONE, ONE, y, candidates=order)
        assert rep.matches == order and rep.best == order[0], rep.summary()
    assert "cannot separate the 3 models" in rep.summary()
    a16 = a.astype(np.float32).astype(ml_dtypes.bfloat16)
    b16 = b.astype(np.float32).astype(ml_dtypes.bfloat16)
    o = (a16.astype(np.float32) @ b16.astype(np.float32).T).astype(np.float32)
    for order in (["exact", "hopper"], ["hopper", "exact"], ["float32_seq", "ampere", "hopper"]):
        rep = compare_matmul(a16, b16.T, o, candidates=order)
        assert rep.matches == order and rep.best == order[0], rep.summary()


def test_a_split_k_mismatch_names_the_split_assumed():
    """A kernel that split K (ada's library, serial) against the unsplit models: no match, and the report says
    which split was assumed and how to give another."""
    a, b = _ops(seed=3, K=1024)
    y = np.asarray(fs.scaled_mm(a, b.T, ONE, ONE, out_dtype="float32", model="ada", split_k=(4, "serial")))
    rep = compare_scaled_mm(a, b.T, ONE, ONE, y, candidates=["ada", "hopper"])
    assert rep.best is None, rep.summary()
    assert any("assumed no split" in n and "--split-k S,scheme" in n for n in rep.notes), rep.summary()
    rep = compare_scaled_mm(a, b.T, ONE, ONE, y, candidates=["ada"], split_k=(4, "serial"))
    assert rep.best == "ada", rep.summary()


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm", *map(str, args)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemm_in")
    a, b = _ops()
    np.save(d / "a.npy", a.view(np.uint8))
    np.save(d / "b.npy", b.view(np.uint8))
    np.save(d / "a_ml.npy", a)                                  # np.save records an ml_dtypes array as |V1
    assert np.load(d / "a_ml.npy").dtype.kind == "V"
    np.save(d / "a250.npy", a[:, :250].view(np.uint8))
    np.save(d / "b250.npy", b[:, :250].view(np.uint8))
    np.save(d / "a5.npy", a.astype(np.float32).astype(E5).view(np.uint8))
    np.save(d / "b5.npy", b.astype(np.float32).astype(E5).view(np.uint8))
    y = np.asarray(fs.scaled_mm(a, b.T, ONE, ONE, out_dtype="float32", model="hopper"))
    np.save(d / "y.npy", y)
    y8 = np.asarray(fs.scaled_mm(a, b.T, ONE, ONE, out_dtype="float8_e4m3fn", model="hopper"))
    np.save(d / "y8.npy", y8.view(np.uint8))
    np.save(d / "y8_ml.npy", y8)
    q = fs.quantize(np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32), "nvfp4")
    np.save(d / "codes.npy", np.asarray(q.codes))
    np.save(d / "scales.npy", np.asarray(q.scales))
    return d


FP8 = ["--a-fp8", "a.npy", "--a-format", "e4m3", "--b-fp8", "b.npy", "--b-format", "e4m3", "--a-scale", "1",
       "--b-scale", "1"]


@pytest.mark.parametrize("out", ["y8.npy", "y8_ml.npy"])
def test_cli_fp8_output(files, out):
    r = _cli(files, *FP8, "--out", out, "--out-dtype", "float8_e4m3fn", "--expect", "hopper")
    assert r.returncode == 0 and "float8_e4m3fn outputs: MATCHES hopper" in r.stdout, r.stdout + r.stderr


BAD = {   # arguments -> a phrase of the message
    "amax nan": (["--a-codes", "codes.npy", "--a-scales", "scales.npy", "--a-amax", "nan", "--b-codes", "codes.npy",
                  "--b-scales", "scales.npy", "--b-amax", "1", "--out", "y.npy"], "A amax nan"),
    "amax -3": (["--a-codes", "codes.npy", "--a-scales", "scales.npy", "--a-amax", "-3", "--b-codes", "codes.npy",
                 "--b-scales", "scales.npy", "--b-amax", "1", "--out", "y.npy"], "A amax -3.0"),
    "amax 0": (["--a-codes", "codes.npy", "--a-scales", "scales.npy", "--a-amax", "1", "--b-codes", "codes.npy",
                "--b-scales", "scales.npy", "--b-amax", "0", "--out", "y.npy"], "B amax 0.0"),
    "K 250": (["--a-fp8", "a250.npy", "--a-format", "e4m3", "--b-fp8", "b250.npy", "--b-format", "e4m3",
               "--a-scale", "1", "--b-scale", "1", "--out", "y.npy"], "K = 250"),
    "split zigzag": (FP8 + ["--out", "y.npy", "--split-k", "3,zigzag"], "--split-k '3,zigzag'"),
    "e5m2 x e5m2": (["--a-fp8", "a5.npy", "--a-format", "e5m2", "--b-fp8", "b5.npy", "--b-format", "e5m2",
                     "--a-scale", "1", "--b-scale", "1", "--out", "y.npy"], "E5M2 x E5M2"),
    "scale nan": (FP8[:-3] + ["nan", "--b-scale", "1", "--out", "y.npy"], "--a-scale nan"),
    "scale inf": (FP8[:-1] + ["inf", "--out", "y.npy"], "--b-scale inf"),
    "float8 npy without format": (["--a-fp8", "a_ml.npy"] + FP8[4:] + ["--out", "y.npy"],
                                  "name the format with --a-format"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_cli_bad_input_is_exit_2_naming_it(files, case):
    args, phrase = BAD[case]
    r = _cli(files, *args)
    assert r.returncode == 2 and phrase in r.stderr and not r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


def test_cli_float8_npy_with_its_format_named(files):
    r = _cli(files, "--a-fp8", "a_ml.npy", "--a-format", "e4m3", *FP8[4:], "--out", "y.npy")
    assert r.returncode == 0 and "MATCHES hopper" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "fp8_blockwise"])
def test_an_fp8_quantize_mismatch_reports_plain_indices_blocks_and_reciprocal_scales(tmp_path, scheme):
    """An FP8 kernel output with one code off at (37, 229) and its scales written as 1 / scale: the text shows the
    index as plain integers, the block and the element within it where the scheme has blocks (128 wide: block 1,
    element 101) and nothing of the kind per tensor; the JSON index is integers; each scale shown with the expected
    and the found value, named as the reciprocal it is."""
    import json
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    q = fs.quantize(x, scheme)
    codes = np.asarray(q.codes).copy()
    codes[37, 229] ^= 1
    s = np.asarray(q.scales, np.float32)
    inv = (np.float32(1) / s).astype(np.float32)
    for name, a in (("x", x), ("c", codes), ("inv", inv)):
        np.save(tmp_path / f"{name}.npy", a)
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "--scheme", scheme, "--input", "x.npy", "--codes",
                        "c.npy", "--scales", "inv.npy", "--json", "r.json"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 1, r.stderr
    if scheme == "fp8_blockwise":
        assert "(37, 229) blk 1 el 101: x=" in r.stdout, r.stdout
    else:
        assert "(37, 229): x=" in r.stdout and "blk" not in r.stdout, r.stdout
    want = f"[0, 0]: {float(s.reshape(-1)[0]):.9g} -> {float(inv.reshape(-1)[0]):.9g} (its reciprocal)"
    assert want in r.stdout and "the kernel wrote 1 / scale where the scale belongs" in r.stdout, r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    m = rep["mismatches"][0]
    assert m["index"] == [37, 229] and all(type(i) is int for i in m["index"]), m
    assert rep["scale_mismatch_examples"][0]["reciprocal"] is True
