"""fp4sim.validate.compare_gemm and the gemm / gemm-witnesses command lines: each accumulation model named from
its own output (float32 and bfloat16), a perturbed output matched by none, the witness set separating every
pair of models (each separating cell recomputed by the rational oracle of test_gemm_models), the device
round trip through files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim.validate import compare_gemm
from fp4sim.validate.gemm import CANDIDATES, gemm_operand, model_outputs, read_witness
from test_gemm_models import alpha, cell, decoded, parts, spread

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fp4sim.validate", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def witnesses(tmp_path_factory):
    d = tmp_path_factory.mktemp("witnesses")
    r = _cli("gemm-witnesses", "--out", d)
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def operands():
    # B small against its tensor amax: small block scales, accumulators with bits below 1/1024 (the grid shows)
    qa = fs.quantize(spread(20, 512), "nvfp4")
    qb = fs.quantize(spread(16, 512, binades=4) * np.float32(1e-3), "nvfp4", block=(16, 16),
                     global_amax=np.float32(300.0))
    return qa, qb, model_outputs(qa, qb)


def test_each_model_is_named_from_its_own_output(operands):
    qa, qb, ys = operands
    for m, y in ys.items():
        rep = compare_gemm(qa, qb, y, expected=ys)
        assert rep.best == m and rep.matches == [m] and rep.ok and rep.match_fraction[m] == 1.0
        assert compare_gemm(qa, qb, y, models=[m]).best == m          # recomputed, not the stored outputs


def test_a_perturbed_output_matches_no_model_and_the_mismatch_is_located(operands):
    qa, qb, ys = operands
    y = ys["k64_rtz"].copy()
    y[7, 3] = np.nextafter(y[7, 3], np.float32(np.inf))
    y[2, 11] = -y[2, 11]
    rep = compare_gemm(qa, qb, y, expected=ys)
    assert rep.best is None and not rep.ok and rep.closest == "k64_rtz"
    assert rep.match_fraction["k64_rtz"] == pytest.approx(1 - 2 / y.size)
    assert [(e["row"], e["col"]) for e in rep.mismatches] == [(2, 11), (7, 3)]   # the worst first
    assert rep.mismatches[1]["ulps"] == 1 and rep.mismatches[1]["kernel"] == float(y[7, 3])
    assert "NO MODEL MATCHES" in rep.summary() and json.loads(rep.to_json())["best"] is None


def test_bfloat16_outputs_compare_after_rounding(operands):
    qa, qb, ys = operands
    rep = compare_gemm(qa, qb, ys["k64_rne"].astype(ml_dtypes.bfloat16), expected=ys)
    assert rep.dtype == "bfloat16" and "k64_rne" in rep.matches
    assert len(rep.matches) < len(CANDIDATES)                          # these operands still separate some
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(ys["te_reference"]).to(torch.bfloat16)
    assert "te_reference" in compare_gemm(qa, qb, t, expected=ys).matches


def test_bad_outputs_are_refused(operands):
    qa, qb, ys = operands
    with pytest.raises(ValueError, match=r"out has shape \(16, 20\).*\(20, 16\)"):
        compare_gemm(qa, qb, ys["k64_rtz"].T.copy())
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        compare_gemm(qa, qb, ys["k64_rtz"].astype(np.float64))
    with pytest.raises(ValueError, match="choose from"):
        compare_gemm(qa, qb, ys["k64_rtz"], models=["k64"])
    q0 = gemm_operand(np.zeros((0, 256), np.uint8), np.zeros((0, 32), np.uint8), np.float32(2688))
    with pytest.raises(ValueError, match="empty output matches every model"):
        compare_gemm(q0, qb, np.zeros((0, 16), np.float32))


def test_the_witnesses_separate_every_pair_of_models_checked_with_the_oracle(witnesses):
    """Every pair of models differs somewhere on the witness set, in float32 and after rounding to bfloat16; for
    every pair one separating cell is recomputed by the rational oracle under both models, and the stored
    expected outputs are fp4sim's own (recomputed from the files)."""
    man = json.loads((witnesses / "manifest.json").read_text())
    assert man["models"] == list(CANDIDATES)
    pairs = [(a, b) for i, a in enumerate(CANDIDATES) for b in list(CANDIDATES)[i + 1:]]
    assert set(man["separating_cells"]) == {f"{a} | {b}" for a, b in pairs}
    assert min(man["separating_cells"].values()) > 0 and min(man["separating_cells_bf16"].values()) > 0
    found = {}
    for name in man["witnesses"]:
        qa, qb, exp = read_witness(witnesses / name)
        fresh = model_outputs(qa, qb)
        for m in CANDIDATES:
            np.testing.assert_array_equal(fresh[m].view(np.uint32), exp[m].view(np.uint32))
        al = alpha(qa, qb)
        assert np.all(al == 1)                                          # the witnesses' alpha is 1: y = c
        for a, b in pairs:
            if (a, b) not in found:
                diff = np.argwhere(exp[a].view(np.uint32) != exp[b].view(np.uint32))
                if len(diff):
                    found[(a, b)] = (name, qa, qb, tuple(diff[0]), exp)
    assert set(found) == set(pairs)
    rows = {}
    for (a, b), (name, qa, qb, (r, c), exp) in found.items():
        if name not in rows:
            rows[name] = (decoded(qa)[0], decoded(qb)[0], parts(qa), parts(qb))
        A, B, PA, PB = rows[name]
        for m in (a, b):
            acc, grid = CANDIDATES[m]
            x, y = (PA[r], PB[c]) if m == "tcgen05" else (A[r], B[c])
            assert np.float32(cell(x, y, acc, grid)) == exp[m][r, c], (name, m, r, c)


@pytest.mark.parametrize("model", ["k64_rtz", "te_reference", "k32_rne"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_device_round_trip_names_the_model(witnesses, tmp_path, model, dtype):
    """A device that computes ``model``: its outputs (the stored expected ones, as files) are consistent with that
    model alone, in float32 and in bfloat16; one changed cell makes the set inconsistent with it."""
    out = tmp_path / "out"
    out.mkdir()
    names = json.loads((witnesses / "manifest.json").read_text())["witnesses"]
    for n in names:
        y = np.load(witnesses / n / "expected" / f"{model}.npy")
        np.save(out / f"{n}.npy", y.astype(ml_dtypes.bfloat16).view(np.uint16) if dtype == "bfloat16" else y)
    r = _cli("gemm", "--witnesses", witnesses, "--outputs", out, "--json", tmp_path / "r.json",
             *(["--expect", model] if dtype == "float32" else ["--out-dtype", "bfloat16"]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"consistent with every witness: {model}\n" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["consistent"] == [model]
    n0 = next(iter(names))
    y = np.load(out / f"{n0}.npy")
    y.view(np.uint32 if y.dtype == np.float32 else np.uint16).reshape(-1)[0] ^= 1
    np.save(out / f"{n0}.npy", y)
    r = _cli("gemm", "--witnesses", witnesses, "--outputs", out, "--out-dtype", dtype)
    assert r.returncode == 1 and "consistent with every witness: no model" in r.stdout


def test_the_gemm_command_on_codes_and_on_high_precision_inputs(tmp_path):
    a, b = spread(6, 128), spread(5, 128)
    qa, qb = fs.quantize(a, "nvfp4"), fs.quantize(b, "nvfp4")
    y = fs.gemm(qa, qb, accumulate="k64_rtz", grid=1024)
    for side, q in (("a", qa), ("b", qb)):
        np.save(tmp_path / f"{side}_codes.npy", q.codes)
        np.save(tmp_path / f"{side}_scales.npy", q.scales)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.save(tmp_path / "y.npy", y)
    common = ["--out", tmp_path / "y.npy", "--json", tmp_path / "rep.json"]
    r = _cli("gemm", "--a-codes", tmp_path / "a_codes.npy", "--a-scales", tmp_path / "a_scales.npy", "--a-amax",
             float(qa.global_amax), "--b-codes", tmp_path / "b_codes.npy", "--b-scales", tmp_path / "b_scales.npy",
             "--b-amax", float(qb.global_amax), *common)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["best"] == "k64_rtz_grid1024" and rep["shape"] == [6, 5]
    r = _cli("gemm", "--a", tmp_path / "a.npy", "--b", tmp_path / "b.npy", *common, "--expect", "te_reference")
    assert r.returncode == 1 and "MATCHES k64_rtz_grid1024" in r.stdout
    np.save(tmp_path / "y16.npy", y.astype(ml_dtypes.bfloat16))          # read back as 2-byte void: bfloat16
    r = _cli("gemm", "--a", tmp_path / "a.npy", "--b", tmp_path / "b.npy", "--out", tmp_path / "y16.npy", "--json",
             tmp_path / "rep16.json")
    assert r.returncode == 0 and json.loads((tmp_path / "rep16.json").read_text())["dtype"] == "bfloat16"
    r = _cli("gemm", "--a-codes", tmp_path / "a_codes.npy", "--out", tmp_path / "y.npy")
    assert r.returncode == 2 and "missing --a-scales, --a-amax" in r.stderr
    r = _cli("gemm", "--a", tmp_path / "a.npy", "--b", tmp_path / "b.npy", "--out", tmp_path / "y.npy",
             "--expect", "k65")
    assert r.returncode == 2 and "--expect 'k65'" in r.stderr
    r = _cli("gemm", "--a", tmp_path / "a.npy", "--b", tmp_path / "b.npy", "--out", tmp_path / "y.npy", "--k", "64")
    assert r.returncode == 2 and "--k describe(s) kernel codes" in r.stderr        # not silently ignored
    r = _cli("gemm", "--a-codes", tmp_path / "a_codes.npy", "--a-scales", tmp_path / "a_scales.npy", "--a-amax",
             "big", "--b-codes", tmp_path / "b_codes.npy", "--b-scales", tmp_path / "b_scales.npy", "--b-amax", "1",
             "--out", tmp_path / "y.npy")
    assert r.returncode == 2 and "--a-amax 'big': neither a file nor a number" in r.stderr


def test_gemm_operand_checks_the_kernel_files():
    q = fs.quantize(spread(4, 64), "nvfp4")
    op = gemm_operand(q.codes, q.scales, q.global_amax)
    np.testing.assert_array_equal(fs.gemm(op, op, accumulate="k64_rtz").view(np.uint32),
                                  fs.gemm(q, q, accumulate="k64_rtz").view(np.uint32))
    with pytest.raises(ValueError, match="K=80 needs 40"):
        gemm_operand(q.codes, q.scales, q.global_amax, K=80)
    with pytest.raises(ValueError, match="scales hold 16 bytes; 4 scale rows x 5 blocks"):
        gemm_operand(np.zeros((4, 40), np.uint8), q.scales, q.global_amax)
    with pytest.raises(ValueError, match="one per row"):
        gemm_operand(q.codes, q.scales, np.ones(3, np.float32))


def test_best_is_the_first_matching_model_in_candidates_order_whatever_the_expected_order(tmp_path):
    """Two models reproduce the output: .best is the one earlier in CANDIDATES, also when the expected outputs
    come alphabetically (as read_witness lists a witness folder's files: k128_rne before te_reference)."""
    qa, qb = fs.quantize(spread(6, 256), "nvfp4"), fs.quantize(spread(5, 256), "nvfp4")
    ys = model_outputs(qa, qb)
    y = ys["te_reference"]
    exp = {m: (y if m in ("te_reference", "k128_rne") else ys[m]) for m in sorted(ys)}
    assert list(exp).index("k128_rne") < list(exp).index("te_reference")
    rep = compare_gemm(qa, qb, y, expected=exp)
    assert rep.best == "te_reference" and rep.matches == ["te_reference", "k128_rne"]
    d = tmp_path / "w"
    (d / "expected").mkdir(parents=True)
    for side, q in (("a", qa), ("b", qb)):
        np.save(d / f"{side}_codes.npy", q.codes)
        np.save(d / f"{side}_scales.npy", q.linear_scales())
        np.save(d / f"{side}_amax.npy", np.asarray(q.global_amax, np.float32))
    for m, v in exp.items():
        np.save(d / "expected" / f"{m}.npy", v)
    _, _, read = read_witness(d)
    assert list(read) == sorted(read)
    assert compare_gemm(qa, qb, y, expected=read).best == "te_reference"


def test_ulp_distances_of_negative_bfloat16_outputs():
    """Distances in bfloat16 ulps across and below zero: the sign is bit 15 of a bfloat16, so -1 against +1 is
    2 x 0x3F80 ulps, -0 against the smallest positive subnormal 1, -tiny against +tiny 2, -1 against the next
    bfloat16 below it 1."""
    bf = ml_dtypes.bfloat16
    tiny = float(np.uint16(1).view(bf))
    below = float(np.uint16(0xBF81).view(bf))                 # -1.0078125
    model = np.array([[-1.0, -0.0, -tiny, -1.0]], np.float32)
    kernel = np.array([[1.0, tiny, tiny, below]], np.float32).astype(bf)
    q = gemm_operand(np.zeros((1, 8), np.uint8), np.zeros((1, 1), np.uint8), np.float32(2688.0))
    q4 = gemm_operand(np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8), np.float32(2688.0))
    rep = compare_gemm(q, q4, kernel, expected={"te_reference": model})
    got = {(e["row"], e["col"]): e["ulps"] for e in rep.mismatches}
    assert got == {(0, 0): 2 * 0x3F80, (0, 1): 1, (0, 2): 2, (0, 3): 1}
    f32 = compare_gemm(q, q4, np.array([[1.0, 2 ** -149, 2 ** -149, -1.0]], np.float32),
                       expected={"te_reference": np.array([[-1.0, -0.0, -2 ** -149, -1.0]], np.float32)})
    assert {(e["row"], e["col"]): e["ulps"] for e in f32.mismatches} == {(0, 0): 2 * 0x3F800000, (0, 1): 1,
                                                                          (0, 2): 2}


def test_the_manifests_bfloat16_separation_counts_are_counted_after_rounding(witnesses):
    """Each witness's bfloat16 counts recounted here from its expected outputs rounded to bfloat16 (by
    ml_dtypes), float32 counts from the float32 bits; the totals are the sums over the witnesses."""
    man = json.loads((witnesses / "manifest.json").read_text())
    total = {}
    for name, w in man["witnesses"].items():
        exp = {p.stem: np.load(p) for p in (witnesses / name / "expected").glob("*.npy")}
        for key in w["separating_cells"]:
            m1, m2 = key.split(" | ")
            a, b = exp[m1], exp[m2]
            n32 = int((a.view(np.uint32) != b.view(np.uint32)).sum())
            n16 = int((a.astype(ml_dtypes.bfloat16).view(np.uint16) != b.astype(ml_dtypes.bfloat16).view(np.uint16))
                      .sum())
            assert (w["separating_cells"][key], w["separating_cells_bf16"][key]) == (n32, n16), (name, key)
            t = total.setdefault(key, [0, 0])
            t[0] += n32
            t[1] += n16
    assert any(v[1] < v[0] for v in total.values())            # rounding to bfloat16 merges some cells
    assert {k: v[0] for k, v in total.items()} == man["separating_cells"]
    assert {k: v[1] for k, v in total.items()} == man["separating_cells_bf16"]


def test_the_gemm_command_refuses_a_scale_layout_it_cannot_apply_and_honours_it_with_codes(tmp_path):
    """--scale-layout swizzled describes kernel scale bytes: with --a / --b (fp4sim quantizes the inputs itself)
    it is refused, naming the flag; with --a-scales / --b-scales in cuBLAS's swizzled layout it is read as such
    (the same verdict as the linear bytes)."""
    from fp4sim.layout import swizzle_scales
    a, b = spread(6, 128), spread(5, 128)
    qa, qb = fs.quantize(a, "nvfp4"), fs.quantize(b, "nvfp4")
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.save(tmp_path / "y.npy", fs.gemm(qa, qb, accumulate="k64_rne"))
    r = _cli("gemm", "--a", tmp_path / "a.npy", "--b", tmp_path / "b.npy", "--out", tmp_path / "y.npy",
             "--scale-layout", "swizzled")
    assert r.returncode == 2 and "--scale-layout describe(s) kernel codes" in r.stderr
    args = []
    for side, q in (("a", qa), ("b", qb)):
        np.save(tmp_path / f"{side}_codes.npy", q.codes)
        np.save(tmp_path / f"{side}_sw.npy", np.asarray(swizzle_scales(q.linear_scales())))
        args += [f"--{side}-codes", tmp_path / f"{side}_codes.npy", f"--{side}-scales", tmp_path / f"{side}_sw.npy",
                 f"--{side}-amax", float(q.global_amax)]
    assert np.load(tmp_path / "a_sw.npy").size != qa.linear_scales().size          # padded to 128 x 4 tiles
    r = _cli("gemm", *args, "--scale-layout", "swizzled", "--out", tmp_path / "y.npy", "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "r.json").read_text())["best"] == "k64_rne"
    r = _cli("gemm", *args, "--out", tmp_path / "y.npy")                          # the same bytes read as linear
    assert r.returncode == 2 and "linear layout" in r.stderr


def test_expect_passes_for_a_model_that_matches_after_an_earlier_candidate(tmp_path):
    """K = 64: one group of 64 products, so exact_sum, k64_* and k128_* all round the exact dot product once and
    agree on every cell; --expect k128_rne exits 0 though .best is exact_sum, --expect of a model that does not
    reproduce the output exits 1."""
    g = np.random.default_rng(64)
    a, b = [(g.standard_normal((R, 64)) * np.exp2(g.uniform(-8, 8, (R, 4))).repeat(16, 1)).astype(np.float32)
            for R in (24, 20)]
    qa, qb = fs.quantize(a, "nvfp4"), fs.quantize(b, "nvfp4")
    ys = model_outputs(qa, qb)
    y = ys["exact_sum"]
    assert all(np.array_equal(ys[m].view(np.uint32), y.view(np.uint32)) for m in ("k64_rtz", "k64_rne", "k128_rne"))
    assert not np.array_equal(ys["te_reference"].view(np.uint32), y.view(np.uint32))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.save(tmp_path / "y.npy", y)
    base = ["gemm", "--a", tmp_path / "a.npy", "--b", tmp_path / "b.npy", "--out", tmp_path / "y.npy"]
    r = _cli(*base, "--expect", "k128_rne")
    assert r.returncode == 0 and "MATCHES exact_sum" in r.stdout and "k128_rne" in r.stdout, r.stdout + r.stderr
    r = _cli(*base, "--expect", "te_reference")
    assert r.returncode == 1


def test_outputs_for_some_witnesses_give_a_verdict_over_those(witnesses, tmp_path):
    """A device run that saved only some witnesses' outputs: the verdict over those present, the others named;
    an output folder with none of them is refused."""
    out = tmp_path / "out"
    out.mkdir()
    names = list(json.loads((witnesses / "manifest.json").read_text())["witnesses"])
    for n in names[:2]:
        np.save(out / f"{n}.npy", np.load(witnesses / n / "expected" / "tcgen05.npy"))
    r = _cli("gemm", "--witnesses", witnesses, "--outputs", out, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"no output for {', '.join(names[2:])}: the verdict below is over the other 2 witnesses" in r.stdout
    assert "consistent with every witness present: " in r.stdout and "tcgen05" in r.stdout.splitlines()[-1]
    assert json.loads((tmp_path / "r.json").read_text())["missing"] == names[2:]
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _cli("gemm", "--witnesses", witnesses, "--outputs", empty)
    assert r.returncode == 2 and "no device output for any witness" in r.stderr
