"""``python -m paper_repro fp8_hopper``: the FP8 curve of the scaling sweep when its GEMMs accumulate as a Hopper
tensor core does, against the exact rule.

Design (fixed before any result was seen): the scaling sweep's model and schedule (paper_repro/scaling.py) under
its FP8 blockwise recipe (1x128 activations and gradients, 128x128 weights, E4M3, the last block and the head in
BF16) at its D/N 20 and 50 budgets (one trunk per seed to D/N 50 and the D/N 20 cooldown branched from it), once
with ``accumulate="hopper"`` (every 128-element block's block-FMA chain from +0 as an H100 / H200 computes it:
32 products per step aligned to the largest exponent, 13 fraction bits; the block results scaled and added in
float32 as DeepSeek-V3's promotion does; BF16 layers through Hopper's 16-bit chain over the whole K) and once
with ``accumulate="exact"`` (exact products, each block rounded once to float32), 3 seeds. The sweep's own FP8
runs (``fast``: a float32 BLAS matmul of the dequantized operands) and its BF16 runs are read back, not trained
again. Final validation losses are paired by seed with ``exact``'s; the hypothesis is "no difference" (the
verdict rule of the ablations: within two standard errors), set against FP8's gap to BF16 at the same budget.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import plotting, scaling, stats

MODELS = ("exact", "hopper", "fast")
RATIOS = (20, 50)
REFERENCE = "exact"
FULL_SEEDS, QUICK_SEEDS = 3, 2
COLUMNS = ("model", "seed", "tokens", "tokens_per_param", "val_loss")
COLORS = {"exact": "0.35", "hopper": "tab:blue", "fast": "tab:orange", "bf16": "k"}
LABELS = {"exact": "FP8, exact rule", "hopper": "FP8, Hopper tensor core", "fast": "FP8, float32 BLAS (fast)",
          "bf16": "BF16"}


def _budgets(quick: bool) -> list[int]:
    """The sweep's budget indices of the runs: D/N 20 and 50 (quick: the sweep's two longest budgets)."""
    if quick:
        return [-2, -1]
    return [scaling.budget_index(False, r) for r in RATIOS]


def configs(quick: bool, seeds: int) -> dict:
    """{(model, seed, budget index): RunConfig}: FP8 blockwise under each accumulation model and BF16, the sweep's
    configurations with only ``accumulate`` changed (quick mode: the quick sweep's BF16 configurations with the
    FP8 preset, as the quick sweep trains no FP8). Seed-major, so that an interrupted run leaves whole seeds."""
    sweep = scaling.configs(quick, seeds)
    out = {}
    for s in range(seeds):
        for i in _budgets(quick):
            base = sweep[("bf16", s)][i]
            for m in MODELS:
                out[(m, s, i)] = replace(base, preset="fp8_blockwise", accumulate=m)
            out[("bf16", s, i)] = base
    return out


def summarize(final: dict, seeds: list, budgets: list, tokens: dict, params: int) -> dict:
    """``final``: {(model or "bf16", seed, budget): final validation loss}. Per budget and model: the seed-mean
    loss, and for hopper and fast the paired difference to exact with stats.verdict's "same" rule and that
    difference over FP8's gap to BF16 (exact's loss minus BF16's, seed mean)."""
    points = []
    for b in budgets:
        gap = float(np.mean([final[(REFERENCE, s, b)] - final[("bf16", s, b)] for s in seeds]))
        row = {"tokens": tokens[b], "tokens_per_param": tokens[b] / params, "fp8_gap_to_bf16": gap,
               "bf16_final_val_loss_mean": float(np.mean([final[("bf16", s, b)] for s in seeds])), "models": {}}
        for m in MODELS:
            v = [final[(m, s, b)] for s in seeds]
            mean, sd = stats.mean_std(v)
            r = {"final_val_loss_mean": float(mean), "final_val_loss_std": float(sd), "per_seed": v}
            if m != REFERENCE:
                d = [final[(m, s, b)] - final[(REFERENCE, s, b)] for s in seeds]
                word, info = stats.verdict("same", d, [not math.isfinite(x) for x in d])
                r.update(vs=REFERENCE, verdict=word, diffs=d, **info)
                if "effect" in info and gap:
                    r["effect_over_gap"] = info["effect"] / gap
            row["models"][m] = r
        points.append(row)
    return {"params": params, "seeds": len(seeds), "reference": REFERENCE, "points": points}


def make(out: Path, quick: bool = False, seeds: int | None = None, quiet: bool = False) -> dict:
    from .runner import final_val_loss, run_all
    out = Path(out)
    seeds = seeds or (QUICK_SEEDS if quick else FULL_SEEDS)
    cfgs = configs(quick, seeds)
    logs = run_all(list(dict.fromkeys(cfgs.values())), out, quiet=quiet)
    params = scaling.n_params(next(iter(cfgs.values())).model)
    final, rows, tokens = {}, [], {}
    for (m, s, b), c in cfgs.items():
        final[(m, s, b)] = final_val_loss(logs[c.key()], c)
        tokens[b] = c.tokens
        rows.append({"model": m, "seed": s, "tokens": c.tokens, "tokens_per_param": c.tokens / params,
                     "val_loss": final[(m, s, b)]})
    plotting.write_csv(out / "fp8_hopper.csv", COLUMNS, rows)
    summary = summarize(final, list(range(seeds)), _budgets(quick), tokens, params)
    plotting.write_json(out / "fp8_hopper.json", summary)
    _plot(summary, out)
    return summary


def _plot(summary, out: Path):
    plt = plotting.pyplot()
    f, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.6))
    pts = summary["points"]
    x = [p["tokens_per_param"] for p in pts]
    for m in ("bf16",) + MODELS:
        if m == "bf16":
            y, e = [p["bf16_final_val_loss_mean"] for p in pts], None
        else:
            ms = [p["models"][m] for p in pts]
            y = [r["final_val_loss_mean"] for r in ms]
            e = [r["final_val_loss_std"] / math.sqrt(len(r["per_seed"])) if len(r["per_seed"]) > 1 else 0.0
                 for r in ms]
        a0.errorbar(x, y, yerr=e, marker="o", color=COLORS[m], label=LABELS[m], capsize=3)
    a0.set_xscale("log")
    a0.set(xlabel="tokens per parameter (D/N)", ylabel="final validation loss (nats/char)")
    a0.legend(fontsize=8)
    plotting.title(a0, "final loss, seed mean ± s.e.: FP8 blockwise under three accumulations, and BF16", width=62)
    for k, m in enumerate(("hopper", "fast")):
        for j, p in enumerate(pts):
            r = p["models"][m]
            xs = p["tokens_per_param"] * (1.06 if k else 0.94)
            a1.plot([xs] * len(r["diffs"]), r["diffs"], "o", color=COLORS[m], alpha=0.45, ms=5)
            se = r.get("stderr", math.nan)
            a1.errorbar([xs], [r.get("effect", math.nan)], yerr=[0 if not math.isfinite(se) else se], fmt="s",
                        color=COLORS[m], capsize=3, label=f"{LABELS[m]} - exact" if j == 0 else None)
    for j, p in enumerate(pts):
        g = p["fp8_gap_to_bf16"]
        if g and math.isfinite(g):
            a1.hlines([0.1 * g, -0.1 * g], p["tokens_per_param"] * 0.85, p["tokens_per_param"] * 1.15,
                      color="0.5", ls=":", lw=1, label="± 10% of FP8's gap to BF16" if j == 0 else None)
    a1.axhline(0, color="k", lw=0.8)
    a1.set_xscale("log")
    a1.set(xlabel="tokens per parameter (D/N)", ylabel="final loss - exact rule's (nats, paired by seed)")
    a1.legend(fontsize=8)
    plotting.title(a1, "difference to the exact rule per seed (dots), mean ± s.e. (squares)", width=62)
    f.tight_layout()
    f.savefig(out / "fp8_hopper.png", dpi=120)
    plt.close(f)
