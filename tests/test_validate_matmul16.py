"""fp4sim.validate.compare_matmul and the BF16 witness sets: the 16-bit tensor-core models named from a kernel's
output, checked against an H200's recorded outputs and against outputs computed independently (the rational
model of fp4sim.reference.tensorcore, exact rationals, a float32 loop)."""
from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from fp4sim import tensorcore as tc
from fp4sim.reference import tensorcore as ref
from fp4sim.validate.matmul16 import (MATMUL_CANDIDATES, check_bf16_witnesses, compare_matmul, read_bf16_witness,
                                      write_bf16_witnesses)

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "benchmarks" / "results" / "h200-2026-12-04"
CORNER = 96


@pytest.mark.parametrize("case", range(8))
def test_compare_matmul_names_what_an_h200_computed(case):
    """The 16-bit matmuls an H200 ran in benchmarks/gpu_check.sh (torch.matmul, bfloat16 / float16 outputs): the
    device's bits are named "hopper", and on random operands the A100 / Ada chain does not reproduce them."""
    rec = np.load(H200 / "tensorcore_outputs.npz")
    K = (1024, 4096)[case // 4]
    dt, fam = ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))[(case // 2) % 2]
    kind = ("random", "positive")[case % 2]
    g = torch.Generator().manual_seed(2000 + case)              # the check's operands, rebuilt from its seeds
    a, w = torch.randn(2048, K, generator=g), torch.randn(2048, K, generator=g)
    if kind == "positive":
        a, w = a.abs(), w.abs()
    a, w = a[:CORNER].to(dt), w[:CORNER].to(dt)
    bits = rec[f"{fam}_{case:02d}"]
    out = torch.from_numpy(bits).view(dt)
    rep = compare_matmul(a, w.t(), out)
    assert rep.best == "hopper" and rep.dtype == ("bfloat16" if fam == "bf16" else "float16"), rep.summary()
    if kind == "random":
        assert "ampere" not in rep.matches, rep.summary()
    # the same with ml_dtypes / NumPy arrays and the bits given with out_dtype
    npdt = ml_dtypes.bfloat16 if fam == "bf16" else np.float16
    rep2 = compare_matmul(a.float().numpy().astype(npdt), w.float().numpy().astype(npdt).T, bits,
                          out_dtype=rep.dtype)
    assert rep2.matches == rep.matches and rep2.match_fraction == rep.match_fraction


def _oracle(A, B, label):
    """float32 (M, N) from exact rationals: the rational chain for the chips, the exactly rounded sum, or the
    float32 additions in K order done one NumPy scalar at a time."""
    M, N = A.shape[0], B.shape[0]
    y = np.empty((M, N), np.float32)
    for i in range(M):
        for j in range(N):
            a = [Fraction(float(x)) for x in A[i]]
            b = [Fraction(float(x)) for x in B[j]]
            if label in ("hopper", "ampere"):
                v = ref.dot(a, b, tc.get_model(label).step("bf16"), -126, -126)
                y[i, j] = np.float32(float(v))
            elif label == "exact":
                y[i, j] = np.float32(float(ref.rne32(sum((x * z for x, z in zip(a, b)), Fraction(0)))))
            else:
                acc = np.float32(0)
                for x, z in zip(A[i], B[j]):
                    acc = np.float32(acc + np.float32(x) * np.float32(z))
                y[i, j] = acc
    return y


def test_bf16_witnesses_separate_every_pair_and_name_each_model(tmp_path):
    """Every pair of candidates differs on the witnesses, in float32 and after rounding to bfloat16 (rechecked from
    the oracle's outputs, not the manifest's counts); outputs computed by the oracle as a device running model M
    would give them are consistent with M alone, in both dtypes; the expected outputs on disk are the oracle's."""
    man = write_bf16_witnesses(tmp_path / "w")
    assert man["format"] == "bf16" and list(man["models"]) == list(MATMUL_CANDIDATES)
    small = ["bf16_midpoints", "spread_cancellation"]
    oracle = {}
    for name in small:
        a, b, exp = read_bf16_witness(tmp_path / "w" / name)
        A, B = a.astype(np.float32), b.astype(np.float32)
        if name == "spread_cancellation":
            A, B = A[:6], B[:6]                        # a corner: the oracle is slow
        oracle[name] = {m: _oracle(A, B, m) for m in MATMUL_CANDIDATES}
        for m, y in oracle[name].items():
            assert exp[m][:A.shape[0], :B.shape[0]].tobytes() == y.tobytes(), (name, m)
    names = list(MATMUL_CANDIDATES)
    for i, m1 in enumerate(names):
        for m2 in names[i + 1:]:
            y1, y2 = oracle["bf16_midpoints"][m1], oracle["bf16_midpoints"][m2]
            assert (y1.astype(ml_dtypes.bfloat16).view(np.uint16) != y2.astype(ml_dtypes.bfloat16).view(np.uint16)
                    ).sum() >= 4, (m1, m2)
    for m in names:
        for dtype in ("float32", "bfloat16"):
            outs = tmp_path / f"out_{m}_{dtype}"
            outs.mkdir()
            y = oracle["bf16_midpoints"][m]
            np.save(outs / "bf16_midpoints.npy", y if dtype == "float32" else
                    y.astype(ml_dtypes.bfloat16).view(np.uint16))
            res = check_bf16_witnesses(tmp_path / "w", outs, dtype)
            assert res["consistent"] == [m], (m, dtype, res["consistent"])
            assert set(res["missing"]) == {"positive_k1024", "spread_cancellation"}


def test_witness_cli_round_trip(tmp_path):
    """gemm-witnesses --format bf16, a device's outputs (here the stored hopper outputs, as bfloat16 bits), then
    gemm --witnesses: exit 0 and the consistent model named; --expect another model: exit 1."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "fp4sim.validate", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT, timeout=300)
    r = run("gemm-witnesses", "--format", "bf16", "--out", str(tmp_path / "w"))
    assert r.returncode == 0 and "wrote 3 BF16 witnesses" in r.stdout, r.stderr
    man = json.loads((tmp_path / "w" / "manifest.json").read_text())
    outs = tmp_path / "dev"
    outs.mkdir()
    for n in man["witnesses"]:
        y = np.load(tmp_path / "w" / n / "expected" / "hopper.npy")
        np.save(outs / f"{n}.npy", y.astype(ml_dtypes.bfloat16).view(np.uint16))
    r = run("gemm", "--witnesses", str(tmp_path / "w"), "--outputs", str(outs), "--out-dtype", "bfloat16")
    assert r.returncode == 0 and "consistent with every witness: hopper" in r.stdout, r.stdout + r.stderr
    r = run("gemm", "--witnesses", str(tmp_path / "w"), "--outputs", str(outs), "--out-dtype", "bfloat16",
            "--expect", "ampere")
    assert r.returncode == 1, r.stdout + r.stderr
    r = run("gemm-witnesses", "--format", "bf16", "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and "not an empty folder" in r.stderr


def test_compare_matmul_refuses_bad_input():
    x = np.ones((4, 8), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 .ml_dtypes. or float16"):
        compare_matmul(np.ones((4, 8), np.float32), x.T, np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="a is bfloat16 and b float16"):
        compare_matmul(x, np.ones((8, 4), np.float16), np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="b is \\(K, N\\)"):
        compare_matmul(x, x, np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match="out has shape \\(3, 4\\)"):
        compare_matmul(x, x.T, np.zeros((3, 4), np.float32))
    with pytest.raises(TypeError, match="out is int16: a 16-bit GEMM.s output is float32, bfloat16 or float16"):
        compare_matmul(x, x.T, np.zeros((4, 4), np.int16))
    with pytest.raises(ValueError, match="candidates \\['volta'\\]"):
        compare_matmul(x, x.T, np.zeros((4, 4), np.float32), candidates=["volta"])
    y = x.copy()
    y[0, 0] = np.inf
    with pytest.raises(ValueError, match="Inf or NaN"):
        compare_matmul(y, x.T, np.zeros((4, 4), np.float32))
