"""paper_repro.teacher: the teacher-student task, its runs (deterministic, cached, the late switch), the figures'
verdicts recomputed from their CSVs, and the sqrt(3) gradient-SNR claim's rule on curves with a known answer."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from paper_repro import teacher as T  # noqa: E402
from paper_repro import stats  # noqa: E402
from paper_repro.ablations import verdict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = T.Run(task="mlp", preset="nvfp4_paper", steps=12, eval_points=3)


def test_the_task_is_realizable_and_fixed():
    """The teacher is an MLP of the task's form; the data are the same on every call; the targets have unit
    variance on the training set; the outlier channels are heavy-tailed (kurtosis far above a Gaussian's 3)."""
    task = T.TASKS["mlp"]
    xt, yt, xv, yv = T.data(task)
    assert xt.shape == (task.n_train, T.D_IN) and yt.shape == (task.n_train, task.d_out)
    assert xv.shape == (task.n_val, T.D_IN)
    assert float(yt.std()) == pytest.approx(1.0, rel=1e-5)
    T._DATA.clear()
    assert torch.equal(T.data(task)[0], xt)
    x = xt.double()
    kurt = ((x - x.mean(0)) ** 4).mean(0) / x.var(0) ** 2
    assert float(kurt[:T.N_OUTLIER].min()) > 10 and float(kurt[T.N_OUTLIER:].max()) < 3.3
    teacher = T.build(task, task.seed + 1, teacher=True)
    assert teacher.up.out_features == task.teacher_width and T.build(task, 0).up.out_features == task.width


def test_the_residual_task_computes_its_definition_and_keeps_the_named_blocks():
    """The residual student is inp -> 4 x (x + down(relu(up(x))) / 2) -> proj (recomputed here from its weight
    matrices); its teacher has the task's narrower hidden width; the block names let keep_last=1 keep exactly
    block 3 and the glob blocks.0.* exactly block 0; the output layer is quantized with quantize_head."""
    task = T.TASKS["resmlp"]
    xt, yt, _, _ = T.data(task)
    assert yt.shape == (task.n_train, task.d_out) and float(yt.std()) == pytest.approx(1.0, rel=1e-5)
    teacher = T.build(task, task.seed + 1, teacher=True)
    assert [b.up.out_features for b in teacher.blocks] == [task.teacher_width] * task.blocks
    m = T.build(task, 3)
    x = xt[:5].double()
    h = x @ m.inp.weight.double().T
    for b in m.blocks:
        h = h + torch.relu(h @ b.up.weight.double().T) @ b.down.weight.double().T / math.sqrt(task.blocks)
    with torch.no_grad():
        got = m(xt[:5]).double()
    assert torch.allclose(got, h @ m.proj.weight.double().T, rtol=1e-4, atol=1e-5)
    base = T.Run(task="resmlp", preset="nvfp4_paper", steps=4, batch=16, eval_points=1)
    for run, want in ((replace(base, keep_last=1), {"blocks.3.up", "blocks.3.down"}),
                      (replace(base, keep=("blocks.0.*",)), {"blocks.0.up", "blocks.0.down"}),
                      (base, set())):
        s = T.build_student(run)
        kept = {n for n, mod in s.named_modules() if getattr(mod, "_fp4sim_kept", False)}
        assert kept == want and s.proj.recipe.name == "nvfp4_paper"


def test_the_loss_spike_rule_on_series_with_a_known_answer():
    """max_jump: the largest ratio of a value to the median of the window before it (a numpy oracle over every
    position), its first step; None for a series no longer than the window; a non-finite value ends the scan. The
    instability summary divides by the reference's loss on the same steps, so a jump both runs share (a batch of
    outliers) is not a spike and one of the variant alone is; diverged runs are counted."""
    rng = np.random.default_rng(0)
    loss = list(np.exp(-np.arange(400) / 200) * (1 + 0.1 * rng.random(400)))
    loss[250] *= 5.0
    want = max((loss[i] / np.median(loss[i - 100:i]), i + 1) for i in range(100, 400))
    got = T.max_jump(loss, 100)
    assert got["step"] == 251 == want[1] and got["ratio"] == pytest.approx(want[0], rel=1e-12)
    assert T.max_jump(loss[:100], 100) == {"ratio": None, "step": None}
    assert T.max_jump(loss[:200] + [math.inf] + loss[250:], 100)["step"] < 201
    ref = {"diverged": None, "train_loss": loss}                          # the same batch spike at step 251
    alone = list(loss)
    alone[300] *= 4.0                                                     # a spike of the variant alone
    runs = [{"diverged": None, "train_loss": list(loss)}, {"diverged": None, "train_loss": alone},
            {"diverged": "training loss nan at step 9", "train_loss": loss[:8] + [math.nan]}]
    inst = T._instability(runs, [ref, ref, ref])
    assert inst["max_loss_jump"][0] == pytest.approx(want[0]) and inst["max_excess_jump"][0] == pytest.approx(1.0)
    assert inst["max_excess_jump"][1] == pytest.approx(4.0) and inst["max_excess_jump"][2] is None
    assert inst["spiked"] == 1 and inst["diverged"] == 1 and inst["runs"] == 3
    assert T._instability([ref], [ref])["max_excess_jump"] == [None]      # the reference against itself


def test_a_run_is_deterministic_cached_and_paired_by_seed(tmp_path):
    a = T.train(TINY)
    b = T.train(TINY, tmp_path)
    assert a["rows"] == b["rows"] and [r["step"] for r in a["rows"]] == TINY.eval_steps()
    assert (tmp_path / f"{TINY.key()}.json").is_file()
    c = T.train(TINY, tmp_path)                                   # read back
    assert c == json.loads((tmp_path / f"{TINY.key()}.json").read_text())
    assert T.train(replace(TINY, seed=1))["rows"] != a["rows"]
    assert all(0 < r["val_mse"] < 10 and r["snr_median"] > 0 for r in a["rows"])
    s0 = T.build_student(TINY)
    s1 = T.build_student(replace(TINY, preset="bf16"))
    assert torch.equal(s0.up.weight, s1.up.weight)              # one seed: the same initial student


def test_the_late_switch_changes_the_recipe_at_its_step(monkeypatch):
    """late=(0.5, 'forward'): from step 6 of 12 the Fprop GEMMs run BF16 and Dgrad / Wgrad keep NVFP4; the run
    equals the plain one up to the switch."""
    from fp4sim.torch import linear
    seen = []
    real = linear.set_recipe

    def spy(model, recipe, which="both", include_kept=False):
        seen.append((which, recipe.name))
        out = real(model, recipe, which, include_kept)
        seen.append({m.recipe.name + "/" + m.recipe_backward.name for m in model.modules()
                     if isinstance(m, linear.QuantLinear)})
        return out

    monkeypatch.setattr("fp4sim.torch.set_recipe", spy, raising=False)
    monkeypatch.setattr(linear, "set_recipe", spy)
    run = replace(TINY, eval_points=12, late=(0.5, "forward"))
    got = T.train(run)["rows"]
    assert seen == [("forward", "bf16"), {"bf16/nvfp4_paper"}]
    plain = T.train(replace(TINY, eval_points=12))["rows"]
    assert got[:6] == plain[:6] and got[6:] != plain[6:]


def test_the_quick_figures_verdicts_recompute_from_their_csv(tmp_path):
    """Both figures in quick mode; every variant's effect is the seed-paired mean difference of the final held-out
    MSE read from the CSV against its comparison variant, and the verdict is the ablation rule's on those
    differences."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for fig in T.FIGS:
        r = subprocess.run([sys.executable, "-m", "paper_repro", fig, "--quick", "--out", str(tmp_path), "--quiet"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        summ = json.loads((tmp_path / f"{fig}.json").read_text())
        rows = list(csv.DictReader(open(tmp_path / f"{fig}.csv")))
        last = {}
        for row in rows:
            k = (row["variant"], int(row["seed"]))
            if int(row["step"]) >= last.get(k, (-1, 0))[0]:
                last[k] = (int(row["step"]), float(row["val_mse"]))
        seeds = range(summ["seeds"])
        assert summ["seeds"] == T.QUICK_SEEDS
        _, variants = T.FIGS[fig]
        assert set(summ["variants"]) == {v.label for v in variants}
        for v in variants:
            if v.expect == "reference":
                continue
            vs = v.vs or summ["reference"]
            d = [last[(v.label, s)][1] - last[(vs, s)][1] for s in seeds]
            got = summ["variants"][v.label]
            assert got["effect"] == pytest.approx(np.mean(d), rel=1e-9, abs=1e-15) and got["vs"] == vs
            assert got["verdict"] == verdict(v.expect, d, [False] * len(d))[0]
        assert (tmp_path / f"{fig}.png").read_bytes()[:4] == b"\x89PNG"
    assert "snr_claim" in json.loads((tmp_path / "teacher_formats.json").read_text())
    depth = json.loads((tmp_path / "teacher_depth.json").read_text())
    assert "snr_claim" in depth and depth["task"]["kind"] == "resmlp"
    order = [n for n, _ in depth["final_snr_by_layer"]["NVFP4 (paper recipe)"]]   # input to output
    assert order[0] == "inp" and order[-1] == "proj" and order[1:3] == ["blocks.0.up", "blocks.0.down"]
    assert all(v["runs"] == T.QUICK_SEEDS for v in depth["instability"].values())
    fin = {}                                                    # the depth CSV's final rows
    for row in csv.DictReader(open(tmp_path / "teacher_depth.csv")):
        fin[(row["variant"], int(row["seed"]))] = float(row["val_mse"])   # rows in step order: the last stays
    nv = [fin[("NVFP4 (paper recipe)", s)] for s in range(T.QUICK_SEEDS)]
    for lab in ("NVFP4 + BF16 last block", "NVFP4 + BF16 first block"):
        d = np.array([fin[(lab, s)] for s in range(T.QUICK_SEEDS)]) - nv
        got = depth["vs_nvfp4"][lab]
        assert got["effect"] == pytest.approx(d.mean(), rel=1e-9, abs=1e-15)
        assert got["stderr"] == pytest.approx(d.std(ddof=1) / math.sqrt(len(d)), rel=1e-9, abs=1e-15)


def test_the_snr_claim_rule_on_curves_with_a_known_answer():
    """Three seeds whose median SNR falls below sqrt(3) at the 4th of 8 evaluations: an excess loss flat before and
    rising after reproduces the claim; one rising before and flat after contradicts it; SNR that never falls is
    'not tested'."""
    def rows(snr, ratio, jitter):
        return [{"step": i + 1, "val_mse": float(r) * (1 + jitter), "snr_median": float(s)}
                for i, (s, r) in enumerate(zip(snr, ratio))]
    snr = [5, 4, 3, 1.5, 1.2, 1.0, 0.9, 0.8]
    flat_then_up = [1, 1, 1, 1, 1.2, 1.44, 1.73, 2.07]
    up_then_flat = [1, 1.2, 1.44, 1.73, 1.73, 1.73, 1.73, 1.73]
    ref = {s: rows([9] * 8, [1] * 8, 0) for s in range(3)}
    for ratio, want in ((flat_then_up, "reproduces"), (up_then_flat, "contradicts")):
        q = {s: rows(snr, [r * (1 + 0.01 * s * i) for i, r in enumerate(ratio)], 0) for s in range(3)}
        got = stats.snr_claim(q, ref, range(3))
        assert got["verdict"].startswith(want), got
        assert got["crossing_step"] == {0: 4, 1: 4, 2: 4}
    q = {s: rows([9] * 8, flat_then_up, 0) for s in range(3)}
    got = stats.snr_claim(q, ref, range(3))
    assert got["verdict"].startswith("not tested") and got["lowest_snr_median"] == 9


# ------------------------------------------------------------------------------------------------ audit pins
def test_the_snr_summaries_cover_the_quantized_layers_only():
    """A run that keeps its last layer in BF16: snr_median / snr_min are over the quantized layer (up) alone;
    the kept layer's much higher SNR is logged per layer but enters neither."""
    run = replace(TINY, keep=("down",))
    rows = T.train(run)["rows"]
    for r in rows:
        assert set(r["snr_layers"]) == {"up", "down"}
        assert r["snr_median"] == r["snr_min"] == r["snr_layers"]["up"]
        assert r["snr_layers"]["down"] > r["snr_layers"]["up"]


def _fake_result(run, val, snr, diverged=None):
    """A run's result as train() stores it: evaluations with val_mse ``val`` at the end (NaN where diverged) and
    every layer's SNR ``snr`` at the last evaluation."""
    steps = run.eval_steps()
    layers = ["inp"] + [f"blocks.{b}.{p}" for b in range(4) for p in ("up", "down")] + ["proj"]
    rows = [{"step": s, "train_mse": 1.0, "val_mse": 1.0, "snr_median": 5.0, "snr_min": 4.0,
             "snr_layers": {n: 5.0 for n in layers}} for s in steps]
    rows[-1].update(val_mse=val, snr_layers={n: snr for n in layers})
    return {"run": json.loads(json.dumps(T.asdict(run), default=list)), "rows": rows, "diverged": diverged,
            "train_loss": [1.0] * run.steps}


def test_teacher_depth_summary_flags_a_diverged_nvfp4_run_and_takes_geometric_means(tmp_path):
    """teacher_depth from stored results (no training): an NVFP4 run that diverged makes the kept-block runs'
    comparison against NVFP4 'diverged', not a number; final_snr_by_layer is the geometric mean over seeds of
    the last evaluation's SNR (1, 4 and 16 give 4, not 7)."""
    seeds = 3
    cache = tmp_path / "runs" / "teacher"
    cache.mkdir(parents=True)
    for lab, run in T.runs_for("teacher_depth", True, seeds):
        nv_div = lab == "NVFP4 (paper recipe)" and run.seed == 1
        got = _fake_result(run, math.nan if nv_div else 0.01 * (1 + run.seed), 4.0 ** run.seed,
                           "training loss nan at step 20" if nv_div else None)
        (cache / f"{run.key()}.json").write_text(json.dumps(got))
    summ = T.make("teacher_depth", tmp_path, quick=True, seeds=seeds)
    for lab in ("NVFP4 + BF16 last block", "NVFP4 + BF16 first block"):
        assert summ["vs_nvfp4"][lab].get("diverged") is True and "effect" not in summ["vs_nvfp4"][lab], lab
    snr = summ["final_snr_by_layer"]["BF16"]
    assert snr[0][0] == "inp" and all(v == pytest.approx(4.0, rel=1e-12) for _, v in snr)


def test_the_snr_claim_counts_intervals_below_and_crossings_as_documented():
    """Intervals 'below sqrt(3)' start and end below it (5, 1, 5, 1, 1, 1: two of five); the held-out MSE fell in
    one of those two; a seed that first falls below at the last evaluation is no crossing inside the run (no
    slope after it)."""
    def rows(snr, mse):
        return [{"step": 10 * (i + 1), "val_mse": m, "snr_median": s} for i, (s, m) in enumerate(zip(snr, mse))]
    ref = {s: rows([9] * 6, [1.0] * 6) for s in range(3)}
    q = {0: rows([5, 1, 5, 1, 1, 1], [2.0, 1.9, 1.8, 1.7, 1.8, 1.6]),      # below: (3->4) rises, (4->5) falls
         1: rows([5, 5, 5, 5, 5, 1], [2.0] * 6),                           # first below at the last evaluation
         2: rows([5] * 6, [2.0] * 6)}                                       # never
    got = stats.snr_claim(q, ref, range(3))
    assert got["intervals_below"] == 2 and got["fell_below"] == 0.5
    assert got["mse_fall_factor_below"] == pytest.approx(math.exp(math.log(1.7 / 1.8) + math.log(1.8 / 1.6)))
    assert got["seeds_below"] == {"from the first evaluation": 0, "never": 1, "only at the last evaluation": 1}
    assert got["crossing_step"] == {0: 20} and got["verdict"].startswith("not tested")
    q[2] = rows([5, 5, 1, 1, 1, 1], [2.0, 2.0, 2.0, 1.5, 1.4, 1.3])         # three falls in three intervals below
    got = stats.snr_claim(q, ref, range(3))
    assert got["intervals_below"] == 5 and got["fell_below"] == pytest.approx(4 / 5)
    assert got["crossing_step"] == {0: 20, 2: 30} and got["n"] == 2
