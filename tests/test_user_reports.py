"""What a new user hit on a fresh clone, each pinned by a test that failed before its fix: analyze on Inf and NaN
tensors, a closed pipe, Hugging Face files, the reports' ranking and figures, paper_repro's list, the validators'
diagnoses, and the calls that were accepted silently."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import fp4sim as fs

ROOT = Path(__file__).resolve().parents[1]


def _analyze(*args, **kw):
    return subprocess.run([sys.executable, "-m", "fp4sim.analyze", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, **kw)


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    """An activation with ~1% +Inf and a gradient with a few NaN, as files."""
    d = tmp_path_factory.mktemp("nonfinite")
    rng = np.random.default_rng(43)
    x = rng.standard_normal((256, 256)).astype(np.float32)
    x[rng.random(x.shape) < 0.01] = np.inf
    g = (rng.standard_normal((256, 256)) * 1e-3).astype(np.float32)
    g[[3, 70, 200], [5, 9, 250]] = np.nan
    np.save(d / "inf_act.npy", x)
    np.save(d / "nan_grad.npy", g)
    return d, x, g


def test_analyze_reports_inf_as_lost_values_and_counts_them(nonfinite):
    """NVFP4 with an Inf tensor amax dequantizes every finite value to Inf/NaN (TE's kernels do too): analyze says
    'lost' with the share of finite values lost (counted here from fs.fake_quantize's output), an unbounded error
    instead of 'degen.' and 0.0, and the count of Inf elements; MXFP4 beside it keeps its numbers."""
    from fp4sim.analyze.core import analyze
    from fp4sim.analyze.report import summary, table
    d, x, _ = nonfinite
    ds = analyze([str(d / "inf_act.npy")], hadamard=False, quiet=True)
    t = "inf_act"
    assert int(ds.n_inf.sel(tensor=t)) == int(np.isinf(x).sum()) > 0 and int(ds.n_nan.sel(tensor=t)) == 0
    fin = np.isfinite(x)
    for s in ("nvfp4", "fp8_blockwise", "mxfp4_rceil", "bf16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            kw = {"scale_mode": "rceil"} if s.startswith("mxfp4") else {}
            y = fs.fake_quantize(x, s.split("_rceil")[0], **kw)
        want = (fin & ~np.isfinite(y)).sum() / fin.sum()
        got = ds.sel(tensor=t, scheme=s)
        assert float(got.lost_frac) == pytest.approx(want, abs=1e-12), s
        assert (str(got.status.values) == "lost") == (want > 0), s
    nv = ds.sel(tensor=t, scheme="nvfp4")
    assert float(nv.lost_frac) == 1.0 and np.isinf(float(nv.max_abs_err)) and float(nv.sqnr_db) == -np.inf
    assert str(ds.status.sel(tensor=t, scheme="mxfp4_rceil").values) == "ok"
    text = table(ds)
    row = next(line for line in text.splitlines() if line.startswith("inf_act") and "activation" in line)
    assert row.split()[2] == "lost" and "degen." not in row
    assert f"inf_act {int(np.isinf(x).sum())} Inf, 0 NaN of 65536; finite values lost" in text
    js = summary(ds)["tensors"][t]
    assert js["n_inf"] == int(np.isinf(x).sum()) and js["schemes"]["nvfp4"]["status"] == "lost"
    assert js["schemes"]["nvfp4"]["lost_frac"] == 1.0 and js["schemes"]["nvfp4"]["max_abs_err"] is None


def test_nan_is_announced_by_quantize_and_counted_by_analyze(nonfinite):
    """fs.quantize warns of NaN where E2M1 turns it into +6 (NVFP4, MXFP4), not where the format keeps it (MXFP8);
    analyze counts a tensor's NaN elements."""
    from fp4sim.analyze.core import analyze
    d, _, g = nonfinite
    for s, warns in (("nvfp4", True), ("mxfp4", True), ("nvfp4_2d", True), ("mxfp8_e4m3", False)):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            q = fs.quantize(g, s)
        msgs = [str(w.message) for w in got if "NaN in the input" in str(w.message)]
        assert bool(msgs) == warns, (s, msgs)
        if warns:
            assert "+6" in msgs[0]
            assert (fs.dequantize(q)[np.isnan(g)] > 0).all()          # the +6 the warning speaks of
    ds = analyze([str(d / "nan_grad.npy")], hadamard=False, quiet=True)
    assert int(ds.n_nan.values[0]) == 3 and int(ds.n_inf.values[0]) == 0


@pytest.mark.parametrize("quiet", [False, True])
def test_a_closed_pipe_loses_no_output(nonfinite, tmp_path, quiet):
    """analyze ... --json F --figures D | head: the reader is gone before the table is printed; the JSON and the
    figures are written all the same, no traceback, exit status as without the pipe."""
    d, _, _ = nonfinite
    js, figs = tmp_path / "s.json", tmp_path / "figs"
    p = subprocess.Popen([sys.executable, "-m", "fp4sim.analyze", str(d / "nan_grad.npy"), "--no-hadamard",
                          "--json", str(js), "--figures", str(figs), *(["--quiet"] if quiet else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()                                     # as head does after its lines
    err = p.stderr.read().decode()
    assert p.wait(timeout=600) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err, err
    assert json.loads(js.read_text())["tensors"]["nan_grad"]["n_nan"] == 3
    assert sorted(f.suffix for f in figs.iterdir()) and all(f.stat().st_size > 0 for f in figs.iterdir())


def test_paper_repro_list_says_no_training_only_where_none_is_done():
    import os
    r = subprocess.run([sys.executable, "-m", "paper_repro", "list"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    for fig in ("fig1", "appB4"):
        assert lines[fig].endswith("(no training)"), lines[fig]
    for fig in ("scaling", "gpt_snr", "accumulation", "fp8_hopper", "teacher_formats", "teacher_recipe",
                "teacher_depth", "fig2"):
        assert "no training" not in lines[fig], lines[fig]


def test_a_hugging_face_file_analyses_its_matrices_and_lists_the_rest(tmp_path):
    """A model.safetensors as Hugging Face writes it (__metadata__, an int64 position_ids buffer, biases and
    LayerNorm weights beside the projection matrices): the matrices are analysed, the buffer and the 1-D
    vectors are listed as no quantization target and the exit status is 0; --include-vectors analyses the
    vectors too. A .txt file is an unsupported type, not a torch.load error; --help names .npy."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(1)
    t = {"embeddings.position_ids": np.arange(512, dtype=np.int64)[None],
         "embeddings.LayerNorm.weight": np.ones(64, np.float32), "embeddings.LayerNorm.bias": np.zeros(64, np.float32),
         "encoder.layer.0.attention.self.query.weight": rng.standard_normal((64, 64)).astype(np.float32),
         "encoder.layer.0.attention.self.query.bias": rng.standard_normal(64).astype(np.float32),
         "encoder.layer.0.output.dense.weight": rng.standard_normal((64, 128)).astype(np.float32)}
    f = tmp_path / "model.safetensors"
    save_file(t, str(f), metadata={"format": "pt"})
    r = _analyze(f, "--no-hadamard", "--quiet", "--json", tmp_path / "s.json")
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert set(s["tensors"]) == {"encoder.layer.0.attention.self.query.weight", "encoder.layer.0.output.dense.weight"}
    assert all(v["role"] == "weight" for v in s["tensors"].values())
    why = {k["tensor"]: k["reason"] for k in s["skipped"]}
    assert all(k.get("ignored") for k in s["skipped"]) and set(why) == set(t) - set(s["tensors"])
    assert "int64: an integer or boolean buffer" in why["embeddings.position_ids"]
    assert "1-D bias or normalization weight" in why["embeddings.LayerNorm.weight"]
    assert "not analysed, no quantization target (4):" in r.stdout and "\nskipped" not in r.stdout
    r = _analyze(f, "--no-hadamard", "--quiet", "--include-vectors", "--json", tmp_path / "v.json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads((tmp_path / "v.json").read_text())["tensors"]) == 5
    (tmp_path / "notes.txt").write_text("not a tensor")
    r = _analyze(tmp_path / "notes.txt", "--quiet")
    assert r.returncode == 2 and "unsupported file type '.txt'" in r.stderr and "torch" not in r.stderr
    assert ".npy" in _analyze("--help").stdout


def test_a_quick_figure_says_it_is_a_smoke_test(tmp_path):
    """--quick outputs carry the mark in their JSON and a red line above the picture (none without --quick)."""
    import os
    import matplotlib.pyplot as plt
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "paper_repro", "fig1", "--quick", "--out", str(tmp_path), "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "smoke test" in json.loads((tmp_path / "fig1.json").read_text())["quick"]
    img = plt.imread(str(tmp_path / "fig1.png"))
    top = img[:30, :, :3]
    assert ((top[..., 0] > 0.6) & (top[..., 1] < 0.3) & (top[..., 2] < 0.3)).sum() > 50      # red text
    full = tmp_path / "full"
    r = subprocess.run([sys.executable, "-m", "paper_repro", "fig1", "--out", str(full), "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0 and "quick" not in json.loads((full / "fig1.json").read_text())


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A dump of 14 tensors in which every gradient (stochastically rounded) has a lower NVFP4 SQNR than every
    weight and activation: 8 gradients, 3 weights, 3 activations (two of them paired with a gradient)."""
    from fp4sim.analyze.core import analyze
    d = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(6)
    t = {f"l{i}.grad_output": (rng.standard_normal((64, 64)) * 1e-3).astype(np.float32) for i in range(8)}
    t.update({f"w{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(3)})
    t.update({f"l{i}.input": rng.standard_normal((64, 64)).astype(np.float32) for i in range(3)})
    np.savez(d / "dump.npz", **t)
    return analyze([str(d / "dump.npz")], hadamard=False, quiet=True)


def test_the_report_opens_with_a_summary_by_role_and_the_worst_of_each(many):
    from fp4sim.analyze.report import table
    ds = many
    text = table(ds)
    head = text.split("\n\nSQNR (dB) by tensor")[0].splitlines()
    assert head[0].startswith("Summary by role")
    schemes = [str(s) for s in ds.scheme.values]
    for r in ("weight", "activation", "gradient"):
        idx = [i for i, x in enumerate(ds.role.values) if x == r]
        row = next(ln for ln in head if ln.startswith(r)).split()
        assert int(row[1]) == len(idx)
        for j, s in enumerate(schemes):
            st = [str(ds.status.values[i, j]) for i in idx]
            want = "n/a" if all(x == "not applied" for x in st) else f"{np.median(ds.sqnr_db.values[idx, j]):.1f}"
            assert row[2 + j] == want, (r, s)
        sq = {str(ds.tensor.values[i]): float(ds.sqnr_db.values[i, schemes.index("nvfp4")]) for i in idx}
        worst = sorted(sq, key=sq.get)[:5]
        line = next(ln for ln in head if ln.startswith(f"  {r}: "))
        assert [p.split(" (")[0] for p in line[len(f"  {r}: "):].split(", ")] == worst
    assert max(ds.sqnr_db.sel(scheme="nvfp4").values[ds.role.values == "gradient"]) < \
        min(ds.sqnr_db.sel(scheme="nvfp4").values[ds.role.values != "gradient"])


def test_the_heat_map_ranks_within_each_role(many, tmp_path):
    """With room for 6 of 14 tensors, the heat map shows the two worst of each role (not the 6 worst gradients,
    which are worse than every weight and activation here)."""
    from fp4sim.analyze.figures import _worst_per_role, write_figures
    ds = many
    j4 = [str(s) for s in ds.scheme.values].index("nvfp4")
    idx, groups = _worst_per_role(ds, j4, 6)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert [str(ds.role.values[g[0]]) for g in groups] == ["weight", "activation", "gradient"]
    for g in groups:
        r = ds.role.values[g[0]]
        others = [i for i, x in enumerate(ds.role.values) if x == r and i not in g]
        assert max(ds.sqnr_db.values[g, j4]) <= min(ds.sqnr_db.values[others, j4])
    assert _worst_per_role(ds, j4, 40)[0] and len(_worst_per_role(ds, j4, 40)[0]) == 14
    files = write_figures(ds, tmp_path, top=6)
    assert (tmp_path / "error_by_scheme.png") in files


def test_the_wgrad_rows_give_both_sr_errors(many):
    """The table's weight-gradient rows carry the one-seed SR error (what a step sees) and the error of the
    seed-averaged output, as the figure does, each equal to the Dataset's value."""
    from fp4sim.analyze.report import table
    ds = many
    lines = [ln for ln in table(ds).splitlines() if ln.startswith("l0 ")]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0][3:].split("|")]
    assert cells[3] == f"{float(ds.wgrad_rel_err_sr_one_seed.sel(pair='l0')):.4f}"
    assert cells[4] == f"{float(ds.wgrad_rel_err_sr_mean.sel(pair='l0')):.4f}"


# ------------------------------------------------------------------------------------------------ validate gemm
def _gemm_pair(M, N, K, seed):
    g = np.random.default_rng(seed)
    mk = lambda R: (g.standard_normal((R, K)) * np.exp2(g.uniform(-8, 8, (R, K // 16))).repeat(16, 1))  # noqa: E731
    return fs.quantize(mk(M).astype(np.float32), "nvfp4"), fs.quantize(mk(N).astype(np.float32), "nvfp4")


def test_compare_gemm_names_a_transposed_output_and_truncated_bfloat16():
    import ml_dtypes
    from fp4sim.validate import compare_gemm
    from fp4sim.validate.gemm import model_outputs
    qa, qb = _gemm_pair(12, 12, 512, 1)
    ys = model_outputs(qa, qb)
    y = ys["k64_rtz"]
    rep = compare_gemm(qa, qb, np.ascontiguousarray(y.T), expected=ys)
    assert rep.best is None and rep.faults and rep.faults[0].startswith("transposed: out.T reproduces k64_rtz")
    assert "fault: transposed" in rep.summary()
    qa2, _ = _gemm_pair(7, 12, 512, 2)
    with pytest.raises(ValueError, match=r"out has shape \(12, 7\).*transposed output, B \. A\^T — out\.T "
                                         r"reproduces k64_rne"):
        compare_gemm(qa2, qb, np.ascontiguousarray(fs.gemm(qa2, qb, accumulate="k64_rne").T))
    trunc = (y.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    rne = y.astype(ml_dtypes.bfloat16)
    assert (trunc.view(np.uint16) != rne.view(np.uint16)).any()
    rep = compare_gemm(qa, qb, trunc, expected=ys)
    got = [f for f in rep.faults if f.startswith("bfloat16 truncated: the output is the float32 result of ")]
    assert rep.best is None and got and "k64_rtz" in got[0].split(" with ")[0]
    assert not compare_gemm(qa, qb, rne, expected=ys).faults


def test_compare_gemm_says_when_the_operands_cannot_tell_the_models_apart():
    """K = 16: one block, one product sum, every model without the 1/1024 grid gives the same outputs; an output
    off in one cell matches every such model in the same share, which the report says."""
    from fp4sim.validate import compare_gemm
    from fp4sim.validate.gemm import CANDIDATES
    qa, qb = _gemm_pair(6, 5, 16, 3)
    y = fs.gemm(qa, qb).copy()
    y[2, 3] = np.nextafter(y[2, 3], np.float32(np.inf))
    rep = compare_gemm(qa, qb, y, models=[m for m in CANDIDATES if m != "k64_rtz_grid1024"])
    assert rep.best is None and len(set(rep.match_fraction.values())) == 1
    assert any("cannot tell the models apart" in n for n in rep.notes)
    qa, qb = _gemm_pair(6, 5, 512, 3)
    y = fs.gemm(qa, qb, accumulate="k64_rtz").copy()
    y[2, 3] = -y[2, 3]
    assert not any("cannot tell" in n for n in compare_gemm(qa, qb, y).notes)


def test_a_witness_that_all_models_match_is_listed_as_consistent_with_all(tmp_path):
    from fp4sim.validate.gemm import model_outputs
    qa, qb = _gemm_pair(4, 3, 16, 4)
    w = tmp_path / "w" / "tiny"
    (w / "expected").mkdir(parents=True)
    for side, q in (("a", qa), ("b", qb)):
        np.save(w / f"{side}_codes.npy", q.codes)
        np.save(w / f"{side}_scales.npy", q.linear_scales())
        np.save(w / f"{side}_amax.npy", np.asarray(q.global_amax, np.float32))
    ys = model_outputs(qa, qb)
    for m, y in ys.items():
        np.save(w / "expected" / f"{m}.npy", y)
    (tmp_path / "w" / "manifest.json").write_text(json.dumps({"witnesses": {"tiny": {}}}))
    (tmp_path / "dev").mkdir()
    np.save(tmp_path / "dev" / "tiny.npy", ys["te_reference"])
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm", "--witnesses", str(tmp_path / "w"),
                        "--outputs", str(tmp_path / "dev")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"tiny: consistent with all {len(ys)} models (this witness does not separate " \
                                       "them)"


def test_swizzled_scales_given_as_linear_are_named_with_the_flag_to_pass(tmp_path):
    from fp4sim.validate import compare
    x = np.random.default_rng(8).standard_normal((128, 64)).astype(np.float32)
    q = fs.quantize(x, "nvfp4", scale_layout="swizzled")
    r = compare(x, q.codes, q.scales, "nvfp4", global_amax=q.global_amax)
    assert r.verdict == "mismatch"
    assert r.diagnosis["layout"][0] == ("the scale bytes are in the swizzled layout, not the linear one given: pass "
                                        "scale_layout='swizzled'")
    for name, a in (("x", x), ("c", q.codes), ("s", q.scales)):
        np.save(tmp_path / f"{name}.npy", a)
    cli = subprocess.run([sys.executable, "-m", "fp4sim.validate", "--scheme", "nvfp4", "--input", str(tmp_path / "x.npy"),
                          "--codes", str(tmp_path / "c.npy"), "--scales", str(tmp_path / "s.npy")], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert cli.returncode == 1 and "pass --scale-layout swizzled" in cli.stdout, cli.stdout + cli.stderr
    lin = fs.quantize(x, "nvfp4")
    r = compare(x, lin.codes, lin.scales, "nvfp4", global_amax=lin.global_amax, scale_layout="swizzled")
    assert r.diagnosis["layout"][0].endswith("pass scale_layout='linear'")


# ------------------------------------------------------------------------------------------------ silent calls
def test_four_over_six_on_a_preset_without_nvfp4_operands_is_refused():
    from fp4sim.training import Recipe
    for preset in ("mxfp4_paper", "bf16", "fp8_blockwise"):
        with pytest.raises(ValueError, match=rf"four_over_six='mse': .*preset '{preset}' has none"):
            Recipe.preset(preset, four_over_six="mse")
    assert Recipe.preset("nvfp4_paper", four_over_six="mae").fprop_w.four_over_six == "mae"


def test_gemm_witnesses_refuse_a_folder_that_holds_files(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    (d / "old.npy").write_bytes(b"x")
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "gemm-witnesses", "--out", str(d)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "exists and is not an empty folder" in r.stderr
    assert sorted(p.name for p in d.iterdir()) == ["old.npy"]


# ------------------------------------------------------------------------------------------------ the bridge
def test_a_wrong_input_width_names_the_layer_as_torch_would():
    torch = pytest.importorskip("torch")
    from fp4sim.torch import convert
    m = convert(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), "nvfp4_paper")
    with pytest.raises(RuntimeError, match=r"layer '0': mat1 and mat2 shapes cannot be multiplied \(6x48 and 64x32\)"):
        m(torch.randn(2, 3, 48))
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(6x48 and 64x32\)"):
        torch.nn.Linear(64, 32)(torch.randn(2, 3, 48))                 # torch's own words, for comparison


def test_suggest_high_precision_orders_its_errors_worst_first():
    torch = pytest.importorskip("torch")
    from fp4sim.torch import convert, suggest_high_precision
    torch.manual_seed(2)
    m = convert(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(5)]), "nvfp4_paper", quantize_head=True,
                keep_high_precision=("0",))           # the first layer in BF16: the smallest error, in front
    x = torch.randn(64, 32)
    keep, err = suggest_high_precision(m, lambda: m(x).pow(2).mean().backward(), fraction=0.4)
    vals = list(err.values())
    assert vals == sorted(vals, reverse=True) and list(err)[:2] == keep and len(err) == 5
    assert list(err)[-1] == "0" and list(err) != [str(i) for i in range(5)]      # not the module order


def test_suggest_high_precision_keeps_the_nearest_count_of_layers():
    """The count kept is fraction x layers rounded to the nearest whole number (halves to even, as Python's
    round), at least one: 5 layers x 0.35 = 1.75 keeps 2 and x 0.7 = 3.5 keeps 4, where rounding down would keep 1
    and 3; x 0.5 = 2.5 keeps 2, where rounding up would keep 3; x 0.05 keeps 1."""
    torch = pytest.importorskip("torch")
    from fp4sim.torch import convert, suggest_high_precision
    torch.manual_seed(2)
    m = convert(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(5)]), "nvfp4_paper", quantize_head=True)
    x = torch.randn(64, 32)
    for fraction, n in ((0.35, 2), (0.7, 4), (0.5, 2), (0.05, 1), (1.0, 5)):
        keep, err = suggest_high_precision(m, lambda: m(x).pow(2).mean().backward(), fraction=fraction)
        assert len(keep) == n and keep == list(err)[:n], (fraction, keep)


def test_dump_linear_tensors_saves_a_shared_input_once(tmp_path):
    """q / k / v take the same tensor: it is saved once (as q's input), and the dump's __meta__ pairs k and v
    with it, so analyze still runs the weight-gradient study of all three."""
    torch = pytest.importorskip("torch")
    from fp4sim.analyze.core import analyze
    from fp4sim.torch import dump_linear_tensors

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))

        def forward(self, h):
            return self.o(self.q(h) * self.k(h) + self.v(h))

    torch.manual_seed(0)
    model = Attn()
    h = torch.randn(64, 32)
    out = dump_linear_tensors(model, lambda: model(h).pow(2).mean().backward(), tmp_path / "d.npz")
    assert [k for k in out if k.endswith(".input")] == ["q.input", "o.input"]
    meta = json.loads(bytes(np.load(tmp_path / "d.npz")["__meta__"]).decode())
    assert meta["shared_inputs"] == {"k.input": "q.input", "v.input": "q.input"}
    np.testing.assert_array_equal(out["q.input"], h.numpy())
    ds = analyze([str(tmp_path / "d.npz")], schemes=["nvfp4"], hadamard=False, quiet=True)
    assert set(ds.pair.values) == {"q", "k", "v", "o"}
    g = out["k.grad_output"].astype(np.float64).T @ out["q.input"].astype(np.float64)
    np.testing.assert_allclose(g, model.k.weight.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_messages_name_the_option_and_what_the_file_is(tmp_path):
    """What a user typed gets named back: a text file under a .npy name is no NumPy file (not 'pickled objects'),
    `analyze .` reads the current folder, `--threads 0` and `--schemes ""` name their flag, `--global-amax nan`
    shows nan (not NumPy's repr), `fp4sim spec --help` and `fp4sim recipes --help` describe themselves, and a
    library warning reaches a command's user as one line, without a source line."""
    import numpy as np
    (tmp_path / "notes.npy").write_text("hello\n")
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)

    def run(*args):
        return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=tmp_path,
                              timeout=600)
    r = run("fp4sim.analyze", "notes.npy", "--quiet")
    assert r.returncode == 2 and "is not a NumPy .npy file" in r.stdout + r.stderr and "pickled" not in r.stdout, \
        r.stdout + r.stderr
    r = run("fp4sim.analyze", ".", "--quiet", "--schemes", "nvfp4", "--no-hadamard")
    assert r.returncode == 1 and "empty name" not in r.stderr and "x " in r.stdout, r.stdout + r.stderr
    r = run("fp4sim.analyze", "x.npy", "--threads", "0")
    assert r.returncode == 2 and "bad input: --threads 0" in r.stderr, r.stderr
    r = run("fp4sim.analyze", "x.npy", "--schemes", "")
    assert r.returncode == 2 and "--schemes '': names no scheme" in r.stderr, r.stderr
    import fp4sim as fs
    q = fs.quantize(x, "nvfp4")
    np.save(tmp_path / "c.npy", np.asarray(q.codes))
    np.save(tmp_path / "s.npy", np.asarray(q.scales))
    r = run("fp4sim.validate", "--scheme", "nvfp4", "--input", "x.npy", "--codes", "c.npy", "--scales", "s.npy",
            "--global-amax", "nan")
    assert r.returncode == 2 and "--global-amax nan: give the tensor" in r.stderr and "np.float32" not in \
        r.stderr, r.stderr
    xn = x.copy()
    xn[0, 0] = np.nan
    np.save(tmp_path / "xn.npy", xn)
    r = run("fp4sim.validate", "--scheme", "nvfp4", "--input", "xn.npy", "--codes", "c.npy", "--scales", "s.npy")
    warn = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert warn and all(ln.startswith("fp4sim.validate: warning: NaN in the input") for ln in warn), r.stderr
    pages = {}
    for cmd in ("spec", "recipes"):
        r = subprocess.run([str(Path(sys.executable).parent / "fp4sim"), cmd, "--help"], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: fp4sim {cmd}"), r.stdout
        pages[cmd] = r.stdout
    assert pages["spec"] != pages["recipes"]


def test_a_folder_that_cannot_be_listed_is_reported_not_a_traceback(tmp_path, monkeypatch):
    """`analyze DIR` where a folder under DIR cannot be listed (permission denied; `analyze /` meets /proc): that
    folder is reported among the problems and the readable files are found."""
    import os
    import numpy as np
    from fp4sim.analyze.inputs import discover
    (tmp_path / "locked").mkdir()
    (tmp_path / "ok").mkdir()
    np.save(tmp_path / "ok" / "x.npy", np.ones((4, 32), np.float32))
    real = os.scandir

    def scandir(path="."):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    sources, problems, _ = discover([str(tmp_path)])
    assert [s.name for s in sources] == ["x"]
    assert problems == [(str(tmp_path / "locked"), "a folder that cannot be listed (permission denied): its files "
                                                   "were not read")], problems
