"""``python -m paper_repro accumulation``: how much the final loss of an NVFP4 run depends on the GEMM accumulation
model that emulates the tensor core.

Design (fixed before any result was seen): the scaling sweep's model and schedule (paper_repro/scaling.py) at its
D/N 10 budget under the paper's NVFP4 recipe, once per accumulation model of ``fs.gemm`` — ``exact`` (TE's
reference rule: exact per 16-element block, float32 additions in block order), ``exact_sum`` (the whole dot
product rounded once), ``k64_rtz`` (the native Blackwell model: 64-product groups, additions toward zero) and
``fast`` (one float32 BLAS matmul of the dequantized operands, the rule every other training figure uses) — with
3 seeds; the ``fast`` and BF16 runs are the sweep's own. The final validation loss of each model is paired by seed
with ``exact``'s, and the spread is set against NVFP4's gap to BF16 at the same budget: the accumulation model
matters for the figures made with ``fast`` where that spread is a visible share of the gap they report.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import plotting, scaling, stats

MODELS = ("exact", "exact_sum", "k64_rtz", "fast")
RATIO = 10                                 # D/N of the runs (a budget of the sweep)
REFERENCE = "exact"
FULL_SEEDS, QUICK_SEEDS = 3, 2
COLUMNS = ("model", "seed", "tokens", "val_loss")
COLORS = {"exact": "C0", "exact_sum": "C2", "k64_rtz": "C3", "fast": "C1"}


def configs(quick: bool, seeds: int) -> dict:
    """{(model, seed): RunConfig}: the sweep's NVFP4 run of the D/N 10 budget under each accumulation model, and
    {("bf16", seed)}: the sweep's BF16 run of that budget."""
    sweep = scaling.configs(quick, seeds)
    i = scaling.budget_index(quick, RATIO)
    out = {}
    for s in range(seeds):
        for m in MODELS:
            out[(m, s)] = replace(sweep[("nvfp4_paper", s)][i], accumulate=m)
        out[("bf16", s)] = sweep[("bf16", s)][i]
    return out


def summarize(final: dict, seeds: list, params: int, tokens: int) -> dict:
    """``final``: {(model or "bf16", seed): final validation loss}. Per model: the seed-mean loss, the paired
    difference to ``exact`` (stats.verdict's rule: "reproduces (no difference)" within two standard errors) and
    that difference in units of NVFP4's gap to BF16 (``exact``'s loss minus BF16's, seed mean)."""
    gap = float(np.mean([final[(REFERENCE, s)] - final[("bf16", s)] for s in seeds]))
    models = {}
    for m in MODELS:
        v = [final[(m, s)] for s in seeds]
        mean, sd = stats.mean_std(v)
        row = {"final_val_loss_mean": float(mean), "final_val_loss_std": float(sd), "per_seed": v}
        if m != REFERENCE:
            d = [final[(m, s)] - final[(REFERENCE, s)] for s in seeds]
            word, info = stats.verdict("same", d, [not math.isfinite(x) for x in d])
            row.update(vs=REFERENCE, verdict=word, **info)
            if "effect" in info and gap:
                row["effect_over_gap"] = info["effect"] / gap
        models[m] = row
    means = [models[m]["final_val_loss_mean"] for m in MODELS]
    return {"params": params, "tokens": tokens, "tokens_per_param": tokens / params, "seeds": len(seeds),
            "reference": REFERENCE, "bf16_final_val_loss_mean": float(np.mean([final[("bf16", s)] for s in seeds])),
            "nvfp4_gap_to_bf16": gap, "spread_of_means": float(max(means) - min(means)),
            "spread_over_gap": float((max(means) - min(means)) / gap) if gap else None, "models": models}


def make(out: Path, quick: bool = False, seeds: int | None = None, quiet: bool = False) -> dict:
    from .runner import final_val_loss, run_all
    out = Path(out)
    seeds = seeds or (QUICK_SEEDS if quick else FULL_SEEDS)
    cfgs = configs(quick, seeds)
    logs = run_all(list(dict.fromkeys(cfgs.values())), out, quiet=quiet)
    final, rows = {}, []
    for (m, s), c in cfgs.items():
        final[(m, s)] = final_val_loss(logs[c.key()], c)
        rows.append({"model": m, "seed": s, "tokens": c.tokens, "val_loss": final[(m, s)]})
    plotting.write_csv(out / "accumulation.csv", COLUMNS, rows)
    c0 = cfgs[(REFERENCE, 0)]
    summary = summarize(final, list(range(seeds)), scaling.n_params(c0.model), c0.tokens)
    plotting.write_json(out / "accumulation.json", summary)
    _plot(summary, out)
    return summary


def _plot(summary, out: Path):
    plt = plotting.pyplot()
    f, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.6))
    ms = summary["models"]
    for i, m in enumerate(MODELS):
        v = ms[m]["per_seed"]
        a0.plot([i] * len(v), v, "o", color=COLORS[m], alpha=0.5, ms=5)
        se = ms[m]["final_val_loss_std"] / math.sqrt(len(v)) if len(v) > 1 else 0.0
        a0.errorbar([i + 0.15], [ms[m]["final_val_loss_mean"]], yerr=[se], fmt="s", color=COLORS[m], capsize=3)
    a0.axhline(summary["bf16_final_val_loss_mean"], color="k", ls="--", lw=1, label="BF16 (seed mean)")
    a0.set_xticks(range(len(MODELS)), MODELS)
    a0.set(xlabel="accumulation model (NVFP4, paper recipe)", ylabel="final validation loss (nats/char)")
    a0.margins(y=0.1)
    a0.legend(fontsize=8, loc="upper right")
    plotting.title(a0, f"final loss per seed (dots) and mean ± s.e., D/N {summary['tokens_per_param']:.3g}",
                   width=62)
    others = [m for m in MODELS if m != REFERENCE]
    for i, m in enumerate(others):
        eff, se = ms[m].get("effect", math.nan), ms[m].get("stderr", math.nan)
        d = [a - b for a, b in zip(ms[m]["per_seed"], ms[REFERENCE]["per_seed"])]
        a1.plot([i - 0.12] * len(d), d, "o", color=COLORS[m], alpha=0.45, ms=5,
                label="one seed's difference" if i == 0 else None)
        a1.errorbar([i + 0.05], [eff], yerr=[0 if not math.isfinite(se) else se], fmt="s", color=COLORS[m], capsize=3,
                    label="mean ± s.e." if i == 0 else None)
    a1.axhline(0, color="k", lw=0.8)
    gap = summary["nvfp4_gap_to_bf16"]
    if gap and math.isfinite(gap):
        for sgn in (1, -1):
            a1.axhline(sgn * 0.1 * gap, color="0.5", ls=":", lw=1,
                       label="± 10% of NVFP4's gap to BF16" if sgn > 0 else None)
    a1.margins(y=0.15)
    a1.legend(fontsize=8, loc="upper left")
    a1.set_xticks(range(len(others)), others)
    a1.set(xlabel="accumulation model", ylabel=f"final loss - {REFERENCE}'s (nats, paired by seed)")
    plotting.title(a1, f"difference to TE's reference rule (mean ± s.e.); NVFP4 - BF16 = {gap:+.4f} nats",
                   width=62)
    f.tight_layout()
    f.savefig(out / "accumulation.png", dpi=120)
    plt.close(f)
