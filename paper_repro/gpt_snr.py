"""``python -m paper_repro gpt_snr``: the weight-gradient SNR of every layer through a language-model run, against
the sqrt(3) threshold of Chmiel et al. 2025 ("FP4 All the Way"), beside the run's excess loss over BF16.

Design (fixed before any result was seen): the scaling sweep's model and schedule (paper_repro/scaling.py) at its
D/N 10 budget, under BF16, NVFP4 (paper recipe) and MXFP4 (paper recipe, RHT d=32), 3 seeds, evaluated on the
sweep's grid; at every evaluation ``fp4sim.torch.gradient_fidelity`` on the first validation batch gives each
QuantLinear's ``snr = ||g_ref|| / ||g_q - g_ref||`` (``g_ref``: the same step in float32; the BF16 last block and
head included). Logging it does not change the run: each run's losses are those of the sweep's run of the same
format, seed and budget, bit for bit (checked where that run is in DIR/runs). The claim is tested as on the
teacher task (``stats.snr_claim``): per seed, the first evaluation at which the median SNR of the FP4 layers
falls below sqrt(3), and whether log(L_q / L_bf16) grows faster per evaluation after it than before.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import plotting, scaling
from .train import RunConfig

FORMATS = ("bf16", "nvfp4_paper", "mxfp4_paper")
RATIO = 10                                 # D/N of the runs (a budget of the sweep)
FULL_SEEDS, QUICK_SEEDS = 3, 2
COLUMNS = ("format", "seed", "step", "tokens", "val_loss", "layer", "kept", "snr", "cosine")


def configs(quick: bool, seeds: int) -> dict:
    """{(format, seed): RunConfig}: the sweep's run of that budget with the fidelity logged."""
    sweep = scaling.configs(quick, seeds)
    i = scaling.budget_index(quick, RATIO)
    fmts = scaling.QUICK_RECIPES if quick else FORMATS
    out = {}
    for s in range(seeds):
        for f in fmts:
            base = sweep[(f, s)][i] if (f, s) in sweep else replace(sweep[("bf16", s)][i], preset=f)
            out[(f, s)] = replace(base, log_fidelity=True)
    return out


def kept_layers(cfg: RunConfig) -> set:
    from .model import build
    model = build(cfg.model, cfg.recipe(), cfg.seed)
    return {n for n, m in model.named_modules() if getattr(m, "_fp4sim_kept", False)}


def make(out: Path, quick: bool = False, seeds: int | None = None, quiet: bool = False) -> dict:
    from .runner import run_all
    from .stats import snr_claim
    from .train import is_done, read_log
    from fp4sim.torch.stats import SNR_THRESHOLD
    out = Path(out)
    seeds = seeds or (QUICK_SEEDS if quick else FULL_SEEDS)
    cfgs = configs(quick, seeds)
    logs = run_all(list(cfgs.values()), out, quiet=quiet)
    kept = kept_layers(next(iter(cfgs.values())))
    rows, same = [], {}
    for (f, s), c in cfgs.items():
        for r in logs[c.key()]:
            for layer, (snr, cos) in r.get("fidelity", {}).items():
                rows.append({"format": f, "seed": s, "step": r["step"], "tokens": r["tokens"],
                             "val_loss": r["val_loss"], "layer": layer, "kept": int(layer in kept), "snr": snr,
                             "cosine": cos})
        twin = replace(c, log_fidelity=False)                 # the sweep's own run of this format and budget
        d = out / "runs" / twin.key()
        if is_done(d, twin):
            same[f"{f} s{s}"] = [x["val_loss"] for x in read_log(d)] == [x["val_loss"] for x in logs[c.key()]]
    plotting.write_csv(out / "gpt_snr.csv", COLUMNS, rows)

    def series(f, s):
        return [{"step": r["step"], "val_mse": r["val_loss"],
                 "snr_median": float(np.median([v[0] for n, v in r["fidelity"].items() if n not in kept]))}
                for r in logs[cfgs[(f, s)].key()]]
    series = functools.lru_cache(maxsize=None)(series)     # each (format, seed) computed once
    ss = list(range(seeds))
    quant = [f for f in dict.fromkeys(f for f, _ in cfgs) if f != "bf16"]
    ref = {s: series("bf16", s) for s in ss}
    claims = {f: snr_claim({s: series(f, s) for s in ss}, ref, ss) for f in quant}
    params = scaling.n_params(next(iter(cfgs.values())).model)
    c0 = next(iter(cfgs.values()))
    summary = {"params": params, "tokens": c0.tokens, "tokens_per_param": c0.tokens / params, "seeds": seeds,
               "threshold": SNR_THRESHOLD, "kept_layers": sorted(kept), "snr_claim": claims,
               "losses_equal_the_sweep_runs": same,
               "final_snr_median_fp4_layers": {f: float(np.median([series(f, s)[-1]["snr_median"] for s in ss]))
                                               for f in quant},
               "final_excess_loss": {f: _mean_se([series(f, s)[-1]["val_mse"] - ref[s][-1]["val_mse"] for s in ss])
                                     for f in quant}}
    plotting.write_json(out / "gpt_snr.json", summary)
    _plot(cfgs, logs, kept, quant, ss, out, summary)
    return summary


def _mean_se(v):
    v = np.asarray(v, float)
    return {"mean": float(v.mean()), "stderr": float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan}


def _plot(cfgs, logs, kept, quant, ss, out, summary):
    from .scaling import COLORS, LABELS
    plt = plotting.pyplot()
    f, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.6))
    for fmt in quant:
        per = {}
        for s in ss:
            for r in logs[cfgs[(fmt, s)].key()]:
                for n, (snr, _) in r["fidelity"].items():
                    per.setdefault(n, {}).setdefault(r["tokens"], []).append(snr)
        for n, by in per.items():
            t = sorted(by)
            a0.plot(t, [np.median(by[x]) for x in t], color=COLORS[fmt], alpha=0.25 if n in kept else 0.6,
                    lw=0.8, ls=":" if n in kept else "-")
        a0.plot([], [], color=COLORS[fmt], label=f"{LABELS[fmt]}: each layer (dotted: BF16 kept)")
    a0.axhline(summary["threshold"], color="k", ls="--", lw=1, label="sqrt(3)")
    a0.set(xscale="log", yscale="log", xlabel="training tokens", ylabel="weight-gradient SNR ||g_ref|| / ||g_q - g_ref||")
    plotting.title(a0, f"gradient SNR per layer (median over {len(ss)} seeds), D/N {summary['tokens_per_param']:.3g}",
                   width=60)
    a0.legend(fontsize=7)
    for fmt in quant:
        t = [r["tokens"] for r in logs[cfgs[(fmt, ss[0])].key()]]
        ex = np.array([[a["val_loss"] - b["val_loss"] for a, b in zip(logs[cfgs[(fmt, s)].key()],
                                                                      logs[cfgs[("bf16", s)].key()])] for s in ss])
        m = ex.mean(0)
        se = ex.std(0, ddof=1) / math.sqrt(len(ss)) if len(ss) > 1 else np.zeros_like(m)
        a1.errorbar(t, m, yerr=se, color=COLORS[fmt], marker="o", ms=3, capsize=2, label=LABELS[fmt])
    a1.axhline(0, color="k", lw=0.8)
    a1.set(xscale="log", xlabel="training tokens", ylabel="validation loss - BF16's (nats, paired by seed)")
    plotting.title(a1, "excess loss over BF16 (mean ± s.e.)", width=60)
    a1.legend(fontsize=8)
    f.tight_layout()
    f.savefig(out / "gpt_snr.png", dpi=120)
    plt.close(f)
