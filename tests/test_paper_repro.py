"""paper_repro: the training harness (determinism, resume after a kill), the figures' quick modes, the data
pipeline and the numbers the figures report (sign convention, token-multiplier interpolation)."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp4sim as fs  # noqa: E402
from paper_repro import ablations, build_data, data, figures, plotting, stats  # noqa: E402
from paper_repro.model import GPT, GPTConfig, build  # noqa: E402
from paper_repro.train import RunConfig, train, wsd_lr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = replace(figures.QUICK, preset="nvfp4_paper", tokens=4 * 32 * 8, eval_points=4)


def _run(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "paper_repro", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, **kw)


# ------------------------------------------------------------------------------------------- quick modes
@pytest.mark.parametrize("fig", [f for f in figures.FIGURES if f not in figures.TEACHER])   # teacher: test_teacher
def test_quick_mode_writes_and_checks_its_outputs(tmp_path, fig):
    r = _run([fig, "--quick", "--out", str(tmp_path), "--quiet"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for ext in ("png", "csv", "json"):
        assert (tmp_path / f"{fig}.{ext}").stat().st_size > 0
    assert (tmp_path / f"{fig}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(tmp_path / f"{fig}.csv")))
    if figures.FIGURES[fig].generic:
        runs = figures.runs_for(fig, True, figures.QUICK_SEEDS)
        assert len(rows) == sum(len(c.eval_steps()) for _, _, c in runs)
        extra = ("wgrad_rel_error_mean",) if fig in ablations.ABLATIONS else ()
        assert set(rows[0]) == set(plotting.TRAIN_COLUMNS + extra)
        assert {r["run"] for r in rows} == {lab for lab, _, _ in runs}
        assert {int(r["seed"]) for r in rows} == set(range(figures.QUICK_SEEDS))
    if fig in ablations.ABLATIONS:  # the verdict table lists every variant but the reference, in order
        t = _run(["table", "--out", str(tmp_path)], timeout=60)
        assert t.returncode == 0, t.stderr
        summ = json.load(open(tmp_path / f"{fig}.json"))
        got = [ln for ln in t.stdout.splitlines() if ln.startswith(f"| {fig} |")]
        want = [v for v in ablations.ABLATIONS[fig][1] if v.expect != "reference"]
        assert len(got) == len(want)
        last = {}                                   # the final validation loss of every (run, seed), from the CSV
        for r in rows:
            k = (r["run"], int(r["seed"]))
            if int(r["step"]) >= last.get(k, (-1, 0))[0]:
                last[k] = (int(r["step"]), float(r["val_loss"]))
        for ln, v in zip(got, want):
            vs = v.vs or summ["reference"]
            assert ln.startswith(f"| {fig} | {v.label} (vs {vs}) | {v.paper} |")
            assert ln.endswith(f"| {summ['variants'][v.label]['verdict']} |")
            d = [last[(v.label, s)][1] - last[(vs, s)][1] for s in range(figures.QUICK_SEEDS)]
            assert summ["variants"][v.label]["effect"] == pytest.approx(np.mean(d), rel=1e-9, abs=1e-12)
    if fig in figures.SCALED:   # the scale the figure was trained at
        summ = json.load(open(tmp_path / f"{fig}.json"))
        cfg = figures.QUICK
        n = sum(p.numel() for p in GPT(cfg.model).parameters())
        assert (summ["params"], summ["tokens"]) == (n, cfg.tokens)
        assert summ["tokens_per_param"] == pytest.approx(cfg.tokens / n, rel=1e-12)
    if fig == "fig12":          # every RHT size's Wgrad error on the branch point's tensors
        w = list(csv.DictReader(open(tmp_path / "fig12_wgrad_error.csv")))
        per = {(r["variant"], int(r["seed"]), r["layer"]): float(r["rel_error"]) for r in w}
        labels = [v.label for v in ablations.ABLATIONS["fig12"][1]]
        layers = {lay for _, _, lay in per}
        assert layers and all(lay.startswith("layers.0.") for lay in layers)   # the last block and head are BF16
        assert set(per) == {(v, s, lay) for v in labels for s in range(figures.QUICK_SEEDS) for lay in layers}
        assert all(0 < e < 1 for e in per.values())
        for s in range(figures.QUICK_SEEDS):     # the same tensors under another d quantize differently
            assert all(per[("d=2", s, lay)] != per[("d=16", s, lay)] for lay in layers)
        summ = json.load(open(tmp_path / "fig12.json"))["wgrad_error_at_branch"]
        for v in labels:
            want = np.mean([np.mean([per[(v, s, lay)] for lay in layers]) for s in range(figures.QUICK_SEEDS)])
            assert summ[v]["mean"] == pytest.approx(want, rel=1e-12)


def test_cli_lists_and_refuses_bad_arguments(tmp_path):
    r = _run(["list"])
    assert r.returncode == 0 and all(f in r.stdout for f in figures.FIGURES)
    r = _run(["fig99", "--quick", "--out", str(tmp_path)])
    assert r.returncode == 2 and "unknown figure 'fig99'" in r.stderr
    r = _run(["fig2", "--quick", "--seeds", "0", "--out", str(tmp_path)])
    assert r.returncode == 2 and "--seeds" in r.stderr
    r = _run(["table", "--out", str(tmp_path)])                # nothing made there yet
    assert r.returncode == 2 and "no ablation figure" in r.stderr and not r.stdout


# ------------------------------------------------------------------------------------------- harness
def test_same_seed_gives_the_same_csv_bytes_and_another_seed_does_not(tmp_path):
    a = train(TINY, tmp_path / "a")
    b = train(TINY, tmp_path / "b")
    assert (tmp_path / "a" / "log.csv").read_bytes() == (tmp_path / "b" / "log.csv").read_bytes()
    assert a == b and len(a) == len(TINY.eval_steps())
    train(replace(TINY, seed=1), tmp_path / "c")
    assert (tmp_path / "c" / "log.csv").read_bytes() != (tmp_path / "a" / "log.csv").read_bytes()
    assert not (tmp_path / "a" / "ckpt.pt").exists()          # a finished run keeps its log, not its checkpoint
    assert train(TINY, tmp_path / "a") == a                   # and is read back, not retrained


def test_logging_the_wgrad_error_changes_no_training_bits(tmp_path):
    """The diagnostic runs an extra forward/backward pass between steps; the SR counters and the gradients it
    touches are restored, so the run's log equals the unlogged run's byte for byte."""
    from paper_repro.train import _quant_layers, wgrad_errors
    train(TINY, tmp_path / "plain")
    logged = train(replace(TINY, log_wgrad_error=True), tmp_path / "logged")
    assert (tmp_path / "plain" / "log.csv").read_bytes() == (tmp_path / "logged" / "log.csv").read_bytes()
    assert all(r["wgrad_error"] and all(0 < e < 1 for e in r["wgrad_error"].values()) for r in logged)
    model = build(TINY.model, TINY.recipe(), 0)
    ids = torch.randint(0, TINY.model.vocab, (2, TINY.model.ctx + 1))
    q = _quant_layers(model)
    for m in q.values():
        m._calls = 7
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    errs = wgrad_errors(model, ids, TINY.model.vocab)
    assert errs and set(errs) <= set(q) and not any(getattr(q[n], "_fp4sim_kept", False) for n in errs)
    assert all(m._calls == 7 for m in q.values())
    assert all(bool((p.grad == 0.25).all()) for p in model.parameters())


def test_interrupted_run_resumes_to_the_same_curve(tmp_path):
    want = train(TINY, tmp_path / "whole")
    part = train(TINY, tmp_path / "cut", ckpt_every=3, stop_after=5)       # stops after step 5; ckpt at step 3
    assert len(part) < len(want) and (tmp_path / "cut" / "ckpt.pt").exists()
    calls = []
    assert train(TINY, tmp_path / "cut", ckpt_every=3, progress=lambda n, loss: calls.append((n, loss))) == want
    tps = TINY.batch * TINY.model.ctx                   # the progress bar learns the 3 steps it does not train
    assert calls[0] == (3 * tps, None) and [n for n, _ in calls[1:]] == [tps] * (TINY.steps - 3)
    assert all(loss is not None for _, loss in calls[1:])
    assert (tmp_path / "cut" / "log.csv").read_bytes() == (tmp_path / "whole" / "log.csv").read_bytes()


def test_resume_after_a_kill_gives_the_same_curve(tmp_path):
    """SIGKILL a training process after its first checkpoint, start it again: the finished log equals an
    uninterrupted run's byte for byte (stochastic-rounding counters, optimizer state and data order restored).
    All three runs are fresh processes with the same environment, so only the resume logic is compared (the
    bits of a run also depend on its process's thread settings, which earlier tests in this process change)."""
    cfg = replace(TINY, tokens=4 * 32 * 120, eval_points=6)     # long enough to be killed mid-run on a fast path
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cmd(run_dir, every):
        code = ("import sys, fp4sim; from paper_repro.train import RunConfig, train; "
                f"train(RunConfig.from_json(sys.argv[1]), {str(run_dir)!r}, ckpt_every={every})")
        return [sys.executable, "-c", code, cfg.to_json()]

    want_dir, run_dir = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(cmd(want_dir, None), cwd=ROOT, env=env, check=True, timeout=600)
    p = subprocess.Popen(cmd(run_dir, 2), cwd=ROOT, env=env)
    t0 = time.time()
    while not (run_dir / "ckpt.pt").exists() and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    time.sleep(0.3)
    assert p.poll() is None, "the run finished before it could be killed; make it longer"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (run_dir / "done.json").exists() and (run_dir / "ckpt.pt").exists()
    step = torch.load(run_dir / "ckpt.pt", weights_only=False)["step"]
    assert 0 < step < cfg.steps
    subprocess.run(cmd(run_dir, None), cwd=ROOT, env=env, check=True, timeout=600)
    assert (run_dir / "log.csv").read_bytes() == (want_dir / "log.csv").read_bytes()


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path):
    train(TINY, tmp_path / "r", ckpt_every=2, stop_after=3)
    with pytest.raises(ValueError, match="another configuration"):
        train(replace(TINY, lr=1e-3), tmp_path / "r")


def test_run_config_checks_and_round_trips():
    assert RunConfig.from_json(TINY.to_json()) == TINY
    assert RunConfig.from_json(TINY.to_json()).key() == TINY.key()
    with pytest.raises(ValueError, match="steps"):
        replace(TINY, tokens=10)
    with pytest.raises(ValueError, match="eval_points"):
        replace(TINY, eval_points=10_000)
    sw = replace(TINY, switches=(("disable_rht", True),))
    assert RunConfig.from_json(sw.to_json()) == sw and "disable_rht" in sw.key()
    assert sw.recipe().wgrad_x.rht is None and TINY.recipe().wgrad_x.rht == 16


def test_wsd_schedule():
    steps, lr = 100, 1e-3
    v = [wsd_lr(s, steps, lr, 10, 0.2) for s in range(steps)]
    assert v[0] == pytest.approx(lr / 10) and v[9] == pytest.approx(lr)
    assert all(x == lr for x in v[10:80])                          # constant until the last 20%
    assert all(a > b for a, b in zip(v[80:], v[81:])) and 0 < v[-1] < lr / 15   # then linear decay towards 0


def test_model_is_the_papers_style_and_keeps_the_last_block_in_bf16():
    c = GPTConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ctx=16)
    m = GPT(c)
    assert not [n for n, p in m.named_parameters() if n.endswith("bias")]
    assert m.layers[0].k.weight.shape == (32, 64) and m.layers[0].q.weight.shape == (64, 64)   # GQA: 2 kv heads
    assert m.embed.weight.data_ptr() != m.head.weight.data_ptr()                               # untied
    assert isinstance(m.layers[0].attn_norm, torch.nn.RMSNorm)
    qm = build(c, replace(TINY, model=c, keep_last=1).recipe(), 0)
    from fp4sim.torch import QuantLinear
    names = {n: mm.recipe.name for n, mm in qm.named_modules() if isinstance(mm, QuantLinear)}
    assert len(names) == 3 * 6 + 1
    assert {n for n, r in names.items() if r == "bf16"} == {f"layers.2.{p}" for p in ("q", "k", "v", "o", "up", "down")} \
        | {"head"}
    x = torch.randint(0, 96, (2, 16))
    # causal: changing a later token leaves earlier logits unchanged (plain float32 model)
    y1 = m(x)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 96
    assert torch.equal(m(x2)[:, :-1], y1[:, :-1])


# ------------------------------------------------------------------------------------------- data
def test_vocabulary_split_and_batches():
    text = "Call me Ishmael.\n~ {x}"
    assert data.decode(data.encode(text)) == text and len(data.VOCAB) == 96
    with pytest.raises(ValueError):
        data.encode("caf\u00e9")
    tr, va = data.splits()
    assert 0.015 < len(va) / (len(tr) + len(va)) < 0.025 and tr.max() < 96
    b1, b2 = data.train_batch(tr, 3, 7, 4, 32), data.train_batch(tr, 3, 7, 4, 32)
    assert np.array_equal(b1, b2) and b1.shape == (4, 33)
    assert not np.array_equal(b1, data.train_batch(tr, 3, 8, 4, 32))
    assert not np.array_equal(b1, data.train_batch(tr, 4, 7, 4, 32))
    assert np.array_equal(data.val_windows(va, 8, 32), data.val_windows(va, 8, 32))


def test_build_data_from_tarballs(tmp_path):
    def tgz(name, files):
        with tarfile.open(tmp_path / name, "w:gz") as t:
            for fn, body in files.items():
                b = body.encode()
                info = tarfile.TarInfo(fn)
                info.size = len(b)
                t.addfile(info, io.BytesIO(b))
    tgz(build_data.TARBALLS["sotu"], {f"package/data/{1790 + i}_x.txt": f"Address {i} \u2014 \u201cyes\u201d.\n"
                                      for i in range(210)} | {"package/data/1790_x.json": "{}"})
    tgz(build_data.TARBALLS["moby"], {"package/data/data.txt": "Call me Ishmael. Caf\u00e9\ttime\r\n",
                                      "package/data/chapter_1.txt": "not used"})
    out = tmp_path / "c.txt.xz"
    assert build_data.main(["--from", str(tmp_path), "--out", str(out)]) == 0
    import lzma
    text = lzma.open(out).read().decode("ascii")
    assert text.startswith('Address 0 -- "yes".\n\nAddress 1') and text.endswith("Call me Ishmael. Cafe time\n")
    assert text.count("Address") == 210 and "not used" not in text
    assert set(text) <= set(data.VOCAB)


# ------------------------------------------------------------------------------------------- numbers
def test_relative_difference_sign_convention():
    # (baseline - run) / baseline: a run with a higher (worse) loss than BF16 is negative, as in the paper
    assert stats.rel_diff_pct(2.0, 2.1) == pytest.approx(-5.0)
    assert stats.rel_diff_pct(2.0, 1.9) == pytest.approx(5.0)
    runs = [("bf16", 1.0, replace(TINY, preset="bf16")), ("nvfp4_paper", 1.0, TINY)]
    logs = {runs[0][2].key(): [{"step": 1, "tokens": 9, "lr": 0.1, "train_loss": 3.0, "val_loss": 2.0}],
            runs[1][2].key(): [{"step": 1, "tokens": 9, "lr": 0.1, "train_loss": 3.0, "val_loss": 2.05}]}
    rows = plotting.training_rows("fig2", runs, logs)
    assert rows[0]["rel_diff_pct"] is None and rows[1]["rel_diff_pct"] == pytest.approx(-2.5)


def test_token_multiplier_interpolation_on_known_curves():
    m = (1.0, 1.25, 1.36, 1.5)
    line = lambda x: 3.0 - 0.4 * x  # noqa: E731
    r = stats.token_multiplier(m, [line(x) for x in m], line(1.3))
    assert r["status"] == "interpolated" and r["value"] == pytest.approx(1.3, abs=1e-12)
    r = stats.token_multiplier(m, [line(x) for x in m], line(1.36))
    assert r["value"] == pytest.approx(1.36, abs=1e-12)
    r = stats.token_multiplier(m, [line(x) for x in m], line(0.9))          # MXFP4 already better at 1x
    assert r["status"] == "at_or_below_min" and r["value"] == 1.0
    r = stats.token_multiplier(m, [line(x) for x in m], line(1.8))          # never reached: extrapolation only
    assert r["status"] == "above_max" and np.isnan(r["value"]) and r["extrapolated"] == pytest.approx(1.8)
    # a curve of the paper's kind, L = a + b / m: piecewise-linear between the bracketing points
    curve = [2.0 + 0.3 / x for x in m]
    t = 2.0 + 0.3 / 1.3
    r = stats.token_multiplier(m, curve, t)
    f = (curve[1] - t) / (curve[1] - curve[2])
    assert r["value"] == pytest.approx(1.25 + f * 0.11) and abs(r["value"] - 1.3) < 0.005
    # over seeds: paired per-seed answers 1.2, 1.3, 1.4 -> mean curve answer 1.3, stderr 0.1 / sqrt(3)
    L = np.array([[line(x) + 0.4 * d for x in m] for d in (-0.1, 0.0, 0.1)])
    T = np.full(3, line(1.3))
    res = stats.token_multiplier_over_seeds(m, L, T)
    assert res["per_seed"] == pytest.approx([1.2, 1.3, 1.4]) and res["value"] == pytest.approx(1.3)
    assert res["stderr"] == pytest.approx(0.1 / np.sqrt(3))
    with pytest.raises(ValueError):
        stats.token_multiplier((1.0, 0.9), (2.0, 1.0), 1.5)


def test_fig1_block_decodes_as_the_format_defines(tmp_path):
    s = figures.fig1(tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "fig1.csv")))
    W = figures._sample(s["tensor"])
    amax = np.float32(np.abs(W).max())
    assert float(rows[0]["tensor_amax"]) == float(amax)
    sval = fs.E4M3.values[int(rows[0]["scale_byte"])]
    for r in rows:   # decoded = E2M1 value x E4M3 scale x amax / 2688, from the codes (independent of the CSV's own)
        v = fs.E2M1.values[int(r["code"])]
        want = np.float32(v) * np.float32(np.float32(sval) * amax * np.float32(1 / 2688.0))
        assert abs(float(r["dequantized"]) - float(want)) <= 1e-6 * abs(float(want)) + 1e-12
        assert abs(float(r["x"]) - float(W[0, int(r["element"])])) == 0
    k = [int(r["element"]) for r in rows if r["is_block_amax"] == "1"]
    assert k == [int(np.argmax(np.abs(W[0, :16])))]
    assert max(int(r["code"]) & 7 for r in rows) == 7           # the block amax maps to the top code (6)


def test_appb4_the_lost_binade(tmp_path):
    s = figures.appb4(tmp_path)
    assert s["block"]["mxfp4_rceil"]["amax_decoded"] == 3.0 and s["block"]["mxfp4_floor"]["amax_decoded"] == 3.0
    assert abs(s["block"]["nvfp4"]["amax_decoded"] - 3.01) < 1e-6        # the tensor amax maps to 6 * 448 exactly
    assert s["block"]["mxfp4_rceil"]["max_code"] == 5 and s["block"]["nvfp4"]["max_code"] == 7   # 3.0 vs 6.0
    h = s["histogram"]
    assert all(abs(sum(v) - 1) < 1e-9 for v in h.values())
    assert h["nvfp4"][7] > h["mxfp4_rceil"][7]             # NVFP4 uses the top code more often than MXFP4
    j = json.loads((tmp_path / "appB4.json").read_text())
    assert j["block"]["nvfp4"]["scales"] == s["block"]["nvfp4"]["scales"]


# ------------------------------------------------------------------------------------------- phases (part 2)
def test_runs_without_phases_keep_their_keys():
    # the configuration JSON of a run without phases has no "phases" entry, so runs trained before phases
    # existed are still found (their key is a hash of that JSON)
    assert "phases" not in json.loads(TINY.to_json())
    ph = replace(TINY, phases=((0.5, "nvfp4_paper", (("disable_rht", True),), 1, "both"),))
    assert json.loads(ph.to_json())["phases"] == [[0.5, "nvfp4_paper", [["disable_rht", True]], 1, "both"]]
    assert RunConfig.from_json(ph.to_json()) == ph and ph.key() != TINY.key() and ph.parent() == TINY
    assert replace(TINY, phases=((0.01, "bf16", (), 1, "both"),)).phases[0].step(TINY.steps) == 1
    assert replace(TINY, phases=((0.99, "bf16", (), 1, "both"),)).phases[0].step(TINY.steps) == TINY.steps - 1
    with pytest.raises(ValueError, match="non-decreasing"):
        replace(TINY, phases=((0.6, "bf16", (), 1, "both"), (0.3, "bf16", (), 1, "both")))
    two = replace(TINY, phases=((0.5, "bf16", (), 1, "backward"), (0.5, "nvfp4_paper",
                                                                    (("disable_2d_quantization", True),), 1, "forward")))
    assert len(two.phases) == 2
    with pytest.raises(ValueError, match="which"):
        replace(TINY, phases=((0.5, "bf16", (), 1, "sideways"),))


def test_a_branch_follows_its_parent_up_to_the_branch_point_and_siblings_share_it(tmp_path):
    cfg = replace(TINY, tokens=4 * 32 * 12, eval_points=6)
    parent = train(cfg, tmp_path / "runs" / cfg.key())
    no_sr = replace(cfg, phases=((0.5, "nvfp4_paper", (("disable_stochastic_rounding", True),), 1, "both"),))
    at = no_sr.phases[0].step(cfg.steps)
    a = train(no_sr, tmp_path / "runs" / no_sr.key())
    snap = tmp_path / "runs" / cfg.key() / f"snap-{at}.pt"
    assert snap.is_file()                                     # the shared prefix, saved for the siblings
    n = sum(r["step"] <= at for r in parent)
    assert a[:n] == parent[:n] and a[n:] != parent[n:]       # the same run up to the branch, different after
    # a sibling starts from the snapshot (not from step 0) and still agrees with the parent before the branch
    bf = replace(cfg, phases=((0.5, "bf16", (), 1, "backward"),))
    assert torch.load(snap, weights_only=False)["step"] == at
    b = train(bf, tmp_path / "runs" / bf.key())
    assert b[:n] == parent[:n] and b[n:] != a[n:]
    # interrupted after the branch and resumed: the same curve as uninterrupted
    train(no_sr, tmp_path / "cut", ckpt_every=1, stop_after=at + 2)
    assert train(no_sr, tmp_path / "cut") == a


def test_divergence_is_detected_and_reported_not_crashed_on(tmp_path):
    from paper_repro.train import divergence, diverged
    assert divergence([3.0, 2.5, 2.2, 2.0, 1.9, 1.8, 1.9, 1.85]) is None
    assert "nan" in divergence([3.0, 2.0, float("nan")])
    boom = [3.0, 2.0, 1.8, 1.7, 1.6, 1.5, 1.5, 1.5, 1.5, 1.5] + [1.5 + 0.5 * k for k in range(1, 8)]
    why = divergence(boom)
    assert why is not None and "nats above" in why
    assert divergence(boom[:12]) is None                      # a small bump is not a divergence
    cfg = replace(TINY, preset="bf16", lr=30.0, warmup=1, tokens=4 * 32 * 30, eval_points=3)   # explodes
    rows = train(cfg, tmp_path / "x")
    reason = diverged(tmp_path / "x")
    assert reason and rows[-1]["step"] < cfg.steps and np.isnan(rows[-1]["val_loss"])


def test_ablation_verdicts():
    from paper_repro.ablations import verdict
    assert verdict("worse", [0.03, 0.04, 0.05], [False] * 3)[0] == "reproduces"
    w, info = verdict("worse", [0.01, -0.012, 0.004], [False] * 3)
    assert w.startswith("not distinguishable from seed noise at this scale (spread") and abs(info["effect"]) < 0.01
    assert verdict("worse", [-0.03, -0.04, -0.05], [False] * 3)[0].startswith("contradicts")
    assert verdict("better", [-0.03, -0.04, -0.05], [False] * 3)[0] == "reproduces"
    assert verdict("same", [0.001, -0.002, 0.0005], [False] * 3)[0] == "reproduces (no difference)"
    assert verdict("same", [0.03, 0.04, 0.05], [False] * 3)[0].startswith("contradicts")
    assert verdict("diverges", [math.nan] * 3, [True, False, False])[0] == "reproduces (diverged)"
    assert verdict("worse", [math.nan] * 3, [True, False, False])[0] == "contradicts: diverged"
    assert verdict("worse", [0.1], [False])[0] == "one seed: no verdict"
    # the standard error: m = 0.02, sd = 0.01, se = 0.01 / sqrt(3); 2 se = 0.0115 < 0.02 -> reproduces
    w, info = verdict("worse", [0.01, 0.02, 0.03], [False] * 3)
    assert w == "reproduces" and info["stderr"] == pytest.approx(0.01 / np.sqrt(3))


def test_fp8_hopper_reuses_the_sweeps_runs_and_changes_only_the_accumulation():
    """fp8_hopper's fast and BF16 runs are the scaling sweep's own (their logs are read back, not retrained), its
    exact and hopper runs differ from them only in ``accumulate``, and each seed's D/N 20 run is a cooldown of
    its D/N 50 trunk."""
    from paper_repro import fp8_hopper, runner, scaling
    sweep = scaling.configs(False, 3)
    got = fp8_hopper.configs(False, 3)
    n = scaling.n_params(scaling.FULL.model)
    for (m, s, i), c in got.items():
        want = sweep[("bf16" if m == "bf16" else "fp8_blockwise", s)][i]
        assert round(c.tokens / n) in (20, 50)
        if m in ("fast", "bf16"):
            assert c.key() == want.key()
        else:
            assert c.key() != want.key() and c == replace(want, accumulate=m)
    ch = runner.chains([c for (m, _, _), c in got.items() if m in ("exact", "hopper")])
    assert len(ch) == 6 and all([round(c.tokens / n) for c in x] == [20, 50] for x in ch)


def test_fp8_hopper_summary_pairs_by_seed():
    from paper_repro import fp8_hopper
    final = {}
    for s, (e, h, f, b) in enumerate([(3.0, 3.1, 3.0, 2.9), (3.2, 3.25, 3.3, 3.0), (3.1, 3.12, 3.05, 3.0)]):
        final.update({("exact", s, 0): e, ("hopper", s, 0): h, ("fast", s, 0): f, ("bf16", s, 0): b})
    p = fp8_hopper.summarize(final, [0, 1, 2], [0], {0: 1000}, 100)["points"][0]
    d = [0.1, 0.05, 0.02]
    assert p["models"]["hopper"]["effect"] == pytest.approx(np.mean(d), rel=1e-12)
    assert p["models"]["hopper"]["stderr"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(3), rel=1e-12)
    assert p["fp8_gap_to_bf16"] == pytest.approx(np.mean([0.1, 0.2, 0.1]), rel=1e-12)
    assert p["models"]["hopper"]["effect_over_gap"] == pytest.approx(np.mean(d) / np.mean([0.1, 0.2, 0.1]))
    assert p["models"]["hopper"]["verdict"].startswith("contradicts")      # 0.057 ± 0.023: beyond 2 s.e.
    assert p["models"]["fast"]["verdict"] == "reproduces (no difference)"  # 0.017 ± 0.044
    assert p["tokens_per_param"] == 10


def test_ablation_runs_share_the_reference_and_branch_where_the_paper_does():
    from paper_repro import ablations
    runs = figures.runs_for("fig4", False, 3)
    ref = [c for lab, _, c in runs if lab == "full recipe"]
    assert [c.key() for c in ref] == [replace(figures.FULL, preset="nvfp4_paper", seed=s).key() for s in range(3)]
    nosr = next(c for lab, _, c in runs if lab == "no SR" and c.seed == 0)
    assert nosr.parent() == ref[0] and nosr.phases[0].at == ablations.BRANCH
    assert dict(nosr.phases[0].switches) == {"disable_stochastic_rounding": True}
    late = next(c for lab, _, c in figures.runs_for("fig7", False, 1) if lab == "BF16 backward at 82%")
    assert [(p.which, p.preset) for p in late.phases] == [("forward", "nvfp4_paper"), ("backward", "bf16")]
    base = next(c for lab, _, c in figures.runs_for("fig8", False, 1) if lab == "base: 1x16 RNE")
    r = base.recipe()
    assert r.fprop_w.block in (None, (1, 16)) and r.wgrad_x.rht is None and r.dgrad_dy.rounding == "rne"


def test_a_branch_keeps_the_runs_own_switches_and_adds_its_own():
    from paper_repro import ablations
    c = replace(TINY, switches=(("rht_size", 4),))
    b = ablations._branch(0.5, switches={"disable_rht": True})(c)
    assert b.phases[0].switches == (("disable_rht", True), ("rht_size", 4))
    assert ablations._branch(0.5, preset="bf16")(c).phases[0].switches == ()


# ------------------------------------------------------------------------------- verdict and statistics rules
def test_verdict_rule_sits_at_two_standard_errors():
    """Paired differences m + (-k, 0, k): sample std k, standard error k / sqrt(3), so m = t * k / sqrt(3) sits at
    t standard errors. 1.5 se is seed noise for 'worse' / 'better' and no difference for 'same'; 2.5 se
    reproduces 'worse' / 'better' and contradicts 'same'."""
    from paper_repro.ablations import verdict
    k = 0.01
    se = k / math.sqrt(3)
    at = lambda t, s=1: [s * t * se - k, s * t * se, s * t * se + k]  # noqa: E731
    for t, worse, same in ((1.5, "not distinguishable", "reproduces (no difference)"),
                           (2.5, "reproduces", "contradicts")):
        w, info = verdict("worse", at(t), [False] * 3)
        assert w.startswith(worse) and info["stderr"] == pytest.approx(se) and info["effect"] == pytest.approx(t * se)
        assert verdict("better", at(t, -1), [False] * 3)[0].startswith(worse), t
        assert verdict("worse", at(t, -1), [False] * 3)[0].startswith("contradicts" if t > 2 else "not distinguish")
        assert verdict("same", at(t), [False] * 3)[0].startswith(same), t
        assert verdict("same", at(t, -1), [False] * 3)[0].startswith(same), t


def _synthetic_ablation(tmp_path, fig, seeds, diverged_runs=()):
    """Finished runs of an ablation figure written by hand: every run's log falls linearly, each label offset by
    its index (so every variant has a finite paired difference), and done.json marks the runs named in
    diverged_runs ((label, seed) pairs) as diverged."""
    runs = ablations.runs_for(fig, figures.QUICK, seeds)
    logs, dirs = {}, {}
    labels = list(dict.fromkeys(lab for lab, _, _ in runs))
    for lab, _, c in runs:
        steps = c.eval_steps()
        off = 0.01 * labels.index(lab) + 0.001 * c.seed
        logs[c.key()] = [dict(step=s, tokens=s * c.batch * c.model.ctx, lr=1e-3, train_loss=3.0 - 0.1 * i + off,
                              val_loss=3.0 - 0.1 * i + off) for i, s in enumerate(steps)]
        d = tmp_path / "runs" / c.key()
        d.mkdir(parents=True, exist_ok=True)
        reason = "val loss 2 nats above its best" if (lab, c.seed) in diverged_runs else None
        (d / "done.json").write_text(json.dumps({"diverged": reason}))
        dirs[c.key()] = d
    return runs, logs, dirs


def test_a_diverged_reference_run_gives_no_paired_difference(tmp_path):
    """fig4's reference (the full recipe) diverged on seed 1 (at a finite loss): every variant compared against it
    is marked diverged instead of being judged on a paired difference against that run; with no divergence the same
    runs give ordinary verdicts from their differences."""
    ref = next(v.label for v in ablations.ABLATIONS["fig4"][1] if v.expect == "reference")
    runs, logs, dirs = _synthetic_ablation(tmp_path, "fig4", 3, diverged_runs={(ref, 1)})
    out = tmp_path / "bad"
    out.mkdir()
    s = ablations.make("fig4", runs, logs, out, dirs)
    others = [v for v in ablations.ABLATIONS["fig4"][1] if v.expect != "reference" and (v.vs or ref) == ref]
    assert others
    for v in others:
        got = s["variants"][v.label]
        assert got.get("diverged") is True and "diverged" in got["verdict"], (v.label, got)
    runs, logs, dirs = _synthetic_ablation(tmp_path / "ok", "fig4", 3)
    out = tmp_path / "good"
    out.mkdir()
    s = ablations.make("fig4", runs, logs, out, dirs)
    for v in others:
        got = s["variants"][v.label]
        assert "diverged" not in got and got["verdict"] == "reproduces", (v.label, got)   # +0.01 * index, worse


def test_mean_std_is_the_sample_standard_deviation():
    """Hand-computed: [1, 2, 3, 4] has mean 2.5 and sample std sqrt(5/3) (population: sqrt(5/4)); columns along
    axis 0; one value has std 0."""
    m, s = stats.mean_std([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and s == pytest.approx(math.sqrt(5 / 3), rel=1e-15)
    m, s = stats.mean_std([[1.0, 10.0], [3.0, 10.0]])
    assert list(m) == [2.0, 10.0] and s == pytest.approx([math.sqrt(2), 0.0], rel=1e-15)
    m, s = stats.mean_std([7.0])
    assert m == 7.0 and s == 0.0


def test_token_multiplier_stderr_counts_only_the_interpolated_seeds():
    """Four seeds, one of which never reaches its target (above the largest multiplier): the standard error is
    over the three interpolated answers 1.2, 1.3, 1.4 (sample std 0.1, / sqrt(3)), not over all four seeds."""
    m = (1.0, 1.25, 1.36, 1.5)
    line = lambda x: 3.0 - 0.4 * x  # noqa: E731
    L = np.array([[line(x) + 0.4 * d for x in m] for d in (-0.1, 0.0, 0.1, 0.0)])
    T = np.array([line(1.3)] * 3 + [line(1.9)])
    res = stats.token_multiplier_over_seeds(m, L, T)
    assert res["per_seed_status"] == ["interpolated"] * 3 + ["above_max"]
    assert res["per_seed"][:3] == pytest.approx([1.2, 1.3, 1.4]) and math.isnan(res["per_seed"][3])
    assert res["stderr"] == pytest.approx(0.1 / math.sqrt(3), rel=1e-9)


def test_replot_redraws_a_figure_from_its_csv_with_the_same_numbers(tmp_path):
    """fig6b and fig12 made in quick mode, then redrawn from their CSVs alone (the runs folder removed): the CSV is
    written back byte for byte and the JSON summary with the same numbers; the PNG is drawn again. A figure without
    training, or without a CSV, is refused."""
    import shutil
    for fig in ("fig6b", "fig12"):
        r = _run([fig, "--quick", "--out", str(tmp_path), "--quiet"], timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix in (".csv", ".json")}
    shutil.rmtree(tmp_path / "runs")
    for p in tmp_path.glob("*.png"):
        p.unlink()
    r = _run(["replot", "--quick", "--out", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fig6b: redrew" in r.stdout and "fig12: redrew" in r.stdout
    for name, b in before.items():
        assert (tmp_path / name).read_bytes() == b, name
    assert all((tmp_path / f"{f}.png").read_bytes()[:4] == b"\x89PNG" for f in ("fig6b", "fig12"))
    r = _run(["replot", "fig1", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "only training figures" in r.stderr
    r = _run(["replot", "fig2", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _run(["fig2", "extra", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "only replot takes figure names" in r.stderr


def test_loss_panels_include_every_evaluation():
    """The y limits of a loss panel hold every evaluation of every curve, the first one included (it used to be cut
    off), with NaN of a diverged run left out."""
    plt = plotting.pyplot()
    f, ax = plt.subplots()
    Y1 = np.array([[3.5, 2.4, 2.0], [3.6, 2.5, 2.1]])
    Y2 = np.array([[3.4, 2.3, np.nan]])
    plotting.ylim_all(ax, Y1, Y2)
    lo, hi = ax.get_ylim()
    assert lo < 2.0 and hi > 3.6
    plt.close(f)


# ------------------------------------------------------------------------------------------- scaling sweep
def _grid_cfgs(budgets_steps, preset="nvfp4_paper"):
    """Tiny runs of several lengths on one evaluation grid (each budget's decay start and end)."""
    tps = TINY.batch * TINY.model.ctx
    cs = [replace(TINY, preset=preset, tokens=s * tps, eval_points=1) for s in budgets_steps]
    grid = sorted({t for c in cs for t in (c.decay_step() * tps, c.tokens)})
    return [replace(c, eval_tokens=tuple(grid)) for c in cs], tps


def test_a_cooldown_branched_from_a_trunk_is_the_independent_run_bit_for_bit(tmp_path):
    """A 10-step budget continued from the snapshot a 25-step trunk left at its decay step writes the same log,
    byte for byte, as the 10-step run trained from the start (the SR call counts, the evaluations on the shared
    grid and the optimizer state included); it trains only its cooldown; its learning rates are WSD's."""
    (short, trunk), tps = _grid_cfgs([10, 25])
    assert short.prefix_key() == trunk.prefix_key() and short.key() != trunk.key()
    train(trunk, tmp_path / "runs" / trunk.key(), snapshot_steps=[short.decay_step()])
    assert (tmp_path / "runs" / short.prefix_key() / f"snap-{short.decay_step()}.pt").is_file()
    calls = []
    branched = train(short, tmp_path / "runs" / short.key(), progress=lambda n, loss: calls.append((n, loss)))
    assert calls[0] == (short.decay_step() * tps, None)
    assert len(calls) == 1 + short.steps - short.decay_step()       # the cooldown's steps only
    alone = train(short, tmp_path / "alone" / short.key())
    assert branched == alone
    assert (tmp_path / "runs" / short.key() / "log.csv").read_bytes() == \
        (tmp_path / "alone" / short.key() / "log.csv").read_bytes()
    for r in branched:                                               # rows at the grid's steps: WSD's rate
        assert r["lr"] == wsd_lr(r["step"] - 1, short.steps, short.lr, short.warmup, short.decay_frac)
    assert [r["step"] for r in branched] == short.eval_steps()
    assert [r["lr"] for r in branched][-1] < short.lr and short.decay_step() == 8


def test_prefix_sharing_needs_a_shared_grid_and_no_phases():
    (short, _), _ = _grid_cfgs([10, 25])
    assert replace(short, eval_tokens=()).prefix_key() is None
    assert replace(short, phases=((0.5, "bf16"),)).prefix_key() is None
    assert replace(short, seed=1).prefix_key() != short.prefix_key()
    assert RunConfig.from_json(short.to_json()) == short
    assert "eval_tokens" not in json.loads(TINY.to_json())          # older runs keep their keys
    with pytest.raises(ValueError, match="eval_tokens"):
        replace(short, eval_tokens=(0,))


def test_effective_data_on_a_synthetic_curve():
    """BF16's loss falls linearly in log tokens; a format whose loss at T is BF16's at T/2 has effective data
    0.5 (exactly, the interpolation is linear in log tokens); outside BF16's range there is no answer."""
    T = np.array([1e3, 2e3, 4e3, 8e3, 16e3])
    bf = 3.0 - 0.2 * np.log(T)
    for t in (2e3, 4e3, 8e3, 16e3):
        assert stats.effective_data(T, bf, 3.0 - 0.2 * math.log(t / 2), t) == pytest.approx(0.5, rel=1e-12)
    assert stats.effective_data(T, bf, 3.0 - 0.2 * math.log(6e3), 8e3) == pytest.approx(0.75, rel=1e-12)
    assert stats.effective_data(T, bf, bf[-1] - 0.01, 16e3) is None           # better than BF16's best
    assert stats.effective_data(T, bf, bf[0] + 0.01, 1e3) is None             # worse than BF16's smallest
    assert stats.effective_data(T, bf, math.nan, 1e3) is None
    with pytest.raises(ValueError, match="increasing"):
        stats.effective_data(T[::-1], bf, 2.0, 1e3)


def test_scaling_quick_summary_is_recomputed_from_its_csv(tmp_path):
    """scaling --quick: a tiny trunk and two branches per format and seed; scaling.json's points (the paired
    gap to BF16 and its standard error, n, D/N, effective data) recomputed from scaling.csv."""
    from paper_repro import scaling
    r = _run(["scaling", "--quick", "--out", str(tmp_path), "--quiet"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summ = json.load(open(tmp_path / "scaling.json"))
    rows = list(csv.DictReader(open(tmp_path / "scaling.csv")))
    assert set(rows[0]) == set(scaling.COLUMNS)
    loss = {(r["format"], int(r["seed"]), int(r["tokens"])): float(r["val_loss"]) for r in rows}
    toks = sorted({t for _, _, t in loss})
    assert toks == summ["tokens"] and len(toks) == len(scaling.QUICK_STEPS)
    params = summ["params"]
    assert params == sum(p.numel() for p in GPT(scaling.QUICK.model).parameters())
    assert len(summ["points"]) == len(toks) * (len(scaling.QUICK_RECIPES) - 1)
    for p in summ["points"]:
        assert set(p) == {"format", "tokens_per_param", "tokens", "params", "effect", "stderr", "n",
                          "effective_data"}
        d = np.array([loss[(p["format"], s, p["tokens"])] - loss[("bf16", s, p["tokens"])]
                      for s in range(scaling.QUICK_SEEDS)])
        assert p["n"] == scaling.QUICK_SEEDS and p["effect"] == pytest.approx(d.mean(), abs=1e-12)
        assert p["stderr"] == pytest.approx(d.std(ddof=1) / math.sqrt(len(d)), abs=1e-12)
        assert p["tokens_per_param"] == pytest.approx(p["tokens"] / params)
        bf = [np.mean([loss[("bf16", s, t)] for s in range(scaling.QUICK_SEEDS)]) for t in toks]
        mean = np.mean([loss[(p["format"], s, p["tokens"])] for s in range(scaling.QUICK_SEEDS)])
        want = stats.effective_data(toks, bf, mean, p["tokens"])
        assert (p["effective_data"] is None) == (want is None)
        if want is not None:
            assert p["effective_data"] == pytest.approx(want, rel=1e-9)
    assert any(d.name.startswith("prefix-") for d in (tmp_path / "runs").iterdir())   # the branches branched


def test_scaling_scheduler_that_does_not_answer_is_a_clear_error(tmp_path):
    r = _run(["scaling", "--quick", "--out", str(tmp_path), "--scheduler", "tcp://127.0.0.1:9", "--quiet"],
             timeout=120)
    assert r.returncode == 2 and "no Dask scheduler answered" in r.stderr
    r = _run(["fig2", "--quick", "--out", str(tmp_path), "--scheduler", "tcp://127.0.0.1:9"], timeout=60)
    assert r.returncode == 2 and "scaling only" in r.stderr


def test_a_longer_trunk_starts_from_the_latest_snapshot_and_is_the_independent_run(tmp_path):
    """Extending a sweep: a 40-step run of the same prefix as a finished 25-step trunk starts from the latest
    snapshot that trunk left (at the 10-step budget's decay step, not its own), trains only the rest, and writes
    the log of the 40-step run trained from the start, byte for byte."""
    (short, trunk, longer), tps = _grid_cfgs([10, 25, 40])
    train(trunk, tmp_path / "runs" / trunk.key(), snapshot_steps=[short.decay_step()])
    calls = []
    got = train(longer, tmp_path / "runs" / longer.key(), progress=lambda n, loss: calls.append((n, loss)))
    assert calls[0] == (short.decay_step() * tps, None)
    assert len(calls) == 1 + longer.steps - short.decay_step()
    alone = train(longer, tmp_path / "alone" / longer.key())
    assert got == alone
    assert (tmp_path / "runs" / longer.key() / "log.csv").read_bytes() == \
        (tmp_path / "alone" / longer.key() / "log.csv").read_bytes()


def test_run_all_trains_a_shared_prefix_as_one_trunk_and_its_cooldowns(tmp_path):
    """run_all on runs of one prefix (given shortest first) trains the longest as the trunk and the others as
    cooldowns from its snapshots, with the numbers of independent runs; chains keep runs without a prefix apart."""
    from paper_repro.runner import chains, run_all
    cs, tps = _grid_cfgs([10, 16])
    other = replace(TINY, seed=1)
    assert [[c.key() for c in ch] for ch in chains([cs[1], other, cs[0], cs[1]])] == \
        [[cs[0].key(), cs[1].key()], [other.key()]]
    logs = run_all(cs, tmp_path, quiet=True)
    assert list(logs) == [c.key() for c in cs]
    assert (tmp_path / "runs" / cs[0].prefix_key() / f"snap-{cs[0].decay_step()}.pt").is_file()
    assert logs[cs[0].key()] == train(cs[0], tmp_path / "alone" / cs[0].key())


def test_the_scaled_figures_are_the_sweeps_runs_at_its_largest_budget():
    """fig2 / fig6a / fig6b in full mode train the scaling sweep's D/N-50 runs (the same keys, so the sweep's
    finished runs are reused) and fig6b's MXFP4 multiples share that trunk's prefix; --short gives the earlier
    0.75M-parameter runs; quick mode is unchanged."""
    from paper_repro import scaling
    sweep = scaling.configs(False, 3)
    for fig, presets in (("fig2", ("bf16", "nvfp4_paper", "fp8_blockwise")),
                         ("fig6a", ("bf16", "nvfp4_paper", "mxfp4_paper"))):
        runs = figures.runs_for(fig, False, 3)
        assert [c.key() for _, _, c in runs] == [sweep[(p, s)][-1].key() for s in range(3) for p in presets]
        n = sum(p.numel() for p in GPT(runs[0][2].model).parameters())
        assert runs[0][2].tokens / n >= 50 - 1e-3
    runs = figures.runs_for("fig6b", False, 3)
    mx = {(m, c.seed): c for lab, m, c in runs if lab.startswith("mxfp4_paper_x")}
    assert sorted({m for m, _ in mx}) == list(figures.SCALED_MULTS)
    tok = {c.tokens for c in sweep[("mxfp4_paper", 0)]}
    for s in range(3):
        assert mx[(1.0, s)].key() == sweep[("mxfp4_paper", s)][-1].key()
        assert mx[(0.4, s)].key() in {c.key() for c in sweep[("mxfp4_paper", s)]}     # the D/N 20 run
        assert len({c.prefix_key() for (m, ss), c in mx.items() if ss == s}) == 1
    assert {mx[(m, 0)].tokens for m in (1.25, 1.36, 1.5)}.isdisjoint(tok)
    short = figures.runs_for("fig2", False, 3, short=True)
    assert [c.key() for _, _, c in short][:3] == [replace(figures.FULL, preset=p, seed=0).key()
                                                   for p in ("bf16", "nvfp4_paper", "fp8_blockwise")]
    assert figures.runs_for("fig2", True, 2) == figures.runs_for("fig2", True, 2, short=True)
    assert _run(["fig2", "--quick", "--short"], timeout=60).returncode == 2


def test_logging_the_gradient_fidelity_does_not_change_the_run(tmp_path):
    """log_fidelity logs every QuantLinear's weight-gradient SNR and cosine at each evaluation (kept layers
    included, fidelity.csv read back with the log), and the run's rows are those of the same run without it."""
    cfg = replace(TINY, log_fidelity=True)
    assert cfg.key() != TINY.key() and "log_fidelity" not in TINY.to_json()
    rows = train(cfg, tmp_path / cfg.key())
    plain = train(TINY, tmp_path / TINY.key())
    assert [{k: r[k] for k in ("step", "train_loss", "val_loss")} for r in rows] == \
        [{k: r[k] for k in ("step", "train_loss", "val_loss")} for r in plain]
    from paper_repro.train import read_log
    back = read_log(tmp_path / cfg.key())
    assert [r["fidelity"] for r in back] == [r["fidelity"] for r in rows]
    layers = set(rows[0]["fidelity"])
    model = build(TINY.model, TINY.recipe(), TINY.seed)
    from fp4sim.torch import QuantLinear
    assert layers == {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert any(n.startswith("layers.1.") for n in layers)                   # the kept (BF16) block too
    for r in rows:
        for snr, cos in r["fidelity"].values():
            assert snr > 0 and -1 <= cos <= 1


def test_gpt_snr_quick_logs_every_layer_and_matches_the_sweeps_runs(tmp_path):
    """gpt_snr --quick beside scaling --quick: the fidelity-logging runs give the sweep's losses bit for bit; the
    CSV has every QuantLinear at every evaluation; the JSON's SNR medians and excess losses recomputed from it."""
    from paper_repro import gpt_snr
    for fig in ("scaling", "gpt_snr"):
        r = _run([fig, "--quick", "--out", str(tmp_path), "--quiet"], timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    summ = json.load(open(tmp_path / "gpt_snr.json"))
    assert summ["losses_equal_the_sweep_runs"] and all(summ["losses_equal_the_sweep_runs"].values())
    rows = list(csv.DictReader(open(tmp_path / "gpt_snr.csv")))
    cfgs = gpt_snr.configs(True, gpt_snr.QUICK_SEEDS)
    model = build(next(iter(cfgs.values())).model, next(iter(cfgs.values())).recipe(), 0)
    from fp4sim.torch import QuantLinear
    layers = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for (f, s), c in cfgs.items():
        got = [r for r in rows if r["format"] == f and int(r["seed"]) == s]
        assert len(got) == len(layers) * len(c.eval_steps()) and {r["layer"] for r in got} == layers
    kept = set(summ["kept_layers"])
    last = max(int(r["step"]) for r in rows)
    q = [float(r["snr"]) for r in rows if r["format"] == "nvfp4_paper" and int(r["step"]) == last
         and r["layer"] not in kept]
    per_seed = [np.median([float(r["snr"]) for r in rows if r["format"] == "nvfp4_paper" and int(r["seed"]) == s
                           and int(r["step"]) == last and r["layer"] not in kept]) for s in range(2)]
    assert q and summ["final_snr_median_fp4_layers"]["nvfp4_paper"] == pytest.approx(np.median(per_seed))
    loss = {(r["format"], int(r["seed"])): float(r["val_loss"]) for r in rows if int(r["step"]) == last}
    ex = [loss[("nvfp4_paper", s)] - loss[("bf16", s)] for s in range(2)]
    assert summ["final_excess_loss"]["nvfp4_paper"]["mean"] == pytest.approx(np.mean(ex), abs=1e-12)


def test_a_run_that_stopped_early_does_not_enter_the_scaling_gap():
    """scaling.summarize on stored logs: an NVFP4 run that stopped before its last step (unfinished, with a
    finite and flattering last loss) and one whose last loss is NaN (diverged) are left out of their budget's
    paired gap and mean curve; the other seeds' differences make the point."""
    from paper_repro import scaling
    seeds = 3
    cfgs = scaling.configs(True, seeds)
    logs, loss = {}, {}
    for (f, s), chain in cfgs.items():
        for j, c in enumerate(chain):
            v = 3.0 - 0.2 * j + (0.1 if f == "nvfp4_paper" else 0.0) + 0.01 * s * (j + 1)
            loss[(f, s, c.tokens)] = v
            logs[c.key()] = [{"step": c.steps // 2, "val_loss": v + 1}, {"step": c.steps, "val_loss": v}]
    big = cfgs[("nvfp4_paper", 1)][-1]
    logs[big.key()] = logs[big.key()][:1]                        # stopped at half its steps: loss v + 1
    logs[big.key()][0]["val_loss"] = 0.5                          # ... and flattering
    mid = cfgs[("nvfp4_paper", 2)][1]
    logs[mid.key()][-1]["val_loss"] = math.nan                   # diverged at its last evaluation
    summ = scaling.summarize(cfgs, logs, 1000)
    pts = {p["tokens"]: p for p in summ["points"]}
    for c, gone in ((big, 1), (mid, 2)):
        keep = [s for s in range(seeds) if s != gone]
        d = [loss[("nvfp4_paper", s, c.tokens)] - loss[("bf16", s, c.tokens)] for s in keep]
        assert pts[c.tokens]["n"] == 2 and pts[c.tokens]["effect"] == pytest.approx(np.mean(d), abs=1e-12)
        j = summ["tokens"].index(c.tokens)
        assert summ["curves"]["nvfp4_paper"]["val_loss_mean"][j] == pytest.approx(
            np.mean([loss[("nvfp4_paper", s, c.tokens)] for s in keep]), abs=1e-12)
    first = cfgs[("nvfp4_paper", 0)][0].tokens
    assert pts[first]["n"] == seeds


def test_a_data_parallel_run_trains_resumes_and_keeps_its_own_key(tmp_path):
    """--nproc 2: the run trains as two DDP processes under torchrun (each half of the batch, its own SR bits):
    its key differs from the single-process run's (whose key is what it was), its losses follow that run's
    closely, the progress reaches the caller, and interrupted and resumed it gives the same rows, bit for bit."""
    two = replace(TINY, nproc=2)
    assert two.key() != TINY.key() and "nproc" not in TINY.to_json()
    ticks = []
    rows = train(two, tmp_path / "two", progress=lambda tok, loss: ticks.append(tok))
    assert sum(ticks) == two.steps * two.batch * two.model.ctx
    one = train(TINY, tmp_path / "one")
    assert [r["step"] for r in rows] == [r["step"] for r in one] and rows != one
    assert all(abs(a["train_loss"] - b["train_loss"]) < 0.02 for a, b in zip(rows, one)), (rows, one)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    train(two, tmp_path / "cut", ckpt_every=1, stop_after=3)
    assert train(two, tmp_path / "cut") == rows
    with pytest.raises(ValueError, match="nproc=3"):
        replace(TINY, nproc=3)
    r = _run(["fig2", "--quick", "--nproc", "0", "--out", str(tmp_path / "o")])
    assert r.returncode == 2 and "--nproc 0" in r.stderr
    r = _run(["gpt_snr", "--quick", "--nproc", "2", "--out", str(tmp_path / "o")])
    assert r.returncode == 2 and "--nproc applies to the training figures" in r.stderr


def test_a_refused_nproc_leaves_no_output_folder(tmp_path):
    """--nproc 3 does not divide the quick runs' batch of 4: refused (exit 2, one line) before --out is made."""
    out = tmp_path / "o3"
    r = _run(["fig2", "--quick", "--nproc", "3", "--out", str(out)])
    assert r.returncode == 2 and "divides the batch" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
