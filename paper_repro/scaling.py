"""``python -m paper_repro scaling``: the FP4 gap against tokens per parameter (D/N).

Design (fixed before any result was seen): a character GPT of about 0.19 M parameters (d_model 64, 4 blocks, 4
heads, 2 key/value heads; the paper_repro architecture) trained under BF16, NVFP4 (paper recipe), MXFP4 (paper
recipe, RHT d=32) and FP8 blockwise, the last block and the head in BF16 as in the other figures, at budgets of
D/N = 0.5 ... 50 tokens per parameter (N: every parameter of the model, embedding and head included), 3 seeds.

The warmup-stable-decay schedule makes the sweep cheap: runs that differ only in their length are the same run
until the shorter one's decay starts (the same warmup and constant learning rate, batches, evaluations and
stochastic-rounding call counts), so one trunk per (recipe, seed) trains to the largest budget and leaves a
snapshot at the decay step of every smaller budget, from which that budget's 20% linear cooldown continues.
Every run evaluates on one grid of token counts (each budget's decay start and end), so a branch's numbers are
those of the independent run of its budget bit for bit (tested), not an approximation of it; what branching
changes against independent runs is only the compute (about one long run per recipe and seed, plus 20% of
every shorter budget).

Outputs: ``scaling.json`` (``points``: {format, tokens_per_param, tokens, params, effect, stderr, n,
effective_data} with effect = final validation loss minus BF16's at the same budget, paired by seed, and
effective_data the share of its tokens with which BF16 reaches the same loss, interpolated on BF16's curve),
``scaling.csv`` (every run's final loss) and ``scaling.png`` (the gap against D/N; each format's loss against
tokens beside BF16's).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import plotting, stats
from .model import GPTConfig
from .train import RunConfig, is_done

RECIPES = ("bf16", "nvfp4_paper", "mxfp4_paper", "fp8_blockwise")
LABELS = {"bf16": "BF16", "nvfp4_paper": "NVFP4 (paper recipe)", "mxfp4_paper": "MXFP4 (RHT d=32)",
          "fp8_blockwise": "FP8 blockwise"}
COLORS = {"bf16": "k", "nvfp4_paper": "tab:green", "mxfp4_paper": "tab:red", "fp8_blockwise": "tab:blue"}
RATIOS = (0.5, 1, 2, 5, 10, 20, 50)
FULL = RunConfig(model=GPTConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ctx=128), batch=32,
                 tokens=4096 * 2, lr=2e-3, warmup=10, decay_frac=0.2, eval_points=1, val_windows=96)
QUICK = RunConfig(model=GPTConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ctx=32), batch=4,
                  tokens=128 * 2, lr=3e-3, warmup=2, decay_frac=0.2, eval_points=1, val_windows=8)
QUICK_RECIPES = ("bf16", "nvfp4_paper")
QUICK_STEPS = (10, 20, 40)            # the quick trunk and its two branches, in steps
FULL_SEEDS, QUICK_SEEDS = 3, 2
COLUMNS = ("format", "seed", "tokens", "tokens_per_param", "params", "val_loss", "diverged")


def n_params(model_cfg: GPTConfig) -> int:
    from .model import GPT
    return sum(p.numel() for p in GPT(model_cfg).parameters())


def budgets(base: RunConfig, quick: bool) -> list[int]:
    """The token budgets of the sweep, in increasing order (whole steps; duplicates dropped)."""
    tps = base.batch * base.model.ctx
    if quick:
        return [s * tps for s in QUICK_STEPS]
    n = n_params(base.model)
    steps = sorted({max(int(round(r * n / tps)), 2 * base.warmup) for r in RATIOS})
    return [s * tps for s in steps]


def budget_index(quick: bool, ratio: float) -> int:
    """The index of the sweep's budget nearest ``ratio`` tokens per parameter (the largest in quick mode)."""
    if quick:
        return -1
    toks = budgets(FULL, False)
    n = n_params(FULL.model)
    return min(range(len(toks)), key=lambda i: abs(toks[i] / n - ratio))


def configs(quick: bool, seeds: int) -> dict:
    """{(format, seed): [RunConfig per budget, increasing]} with the shared evaluation grid."""
    base = QUICK if quick else FULL
    toks = budgets(base, quick)
    tps = base.batch * base.model.ctx
    grid = set()
    for t in toks:
        c = replace(base, tokens=t)
        grid |= {c.decay_step() * tps, t}
    grid = tuple(sorted(grid))
    recipes = QUICK_RECIPES if quick else RECIPES
    return {(f, s): [replace(base, preset=f, seed=s, tokens=t, keep_last=1, eval_tokens=grid) for t in toks]
            for s in range(seeds) for f in recipes}             # seed-major: an interrupted sweep has whole seeds


def run_sweep(cfgs: dict, out: Path, quiet: bool = False, scheduler: str | None = None) -> dict:
    """Train every (format, seed)'s trunk, leaving the snapshots of the shorter budgets, then its cooldowns;
    return {config key: log rows}. With ``scheduler`` (a Dask scheduler address) each (format, seed) is one
    job on that cluster, resuming from its checkpoints in the shared run folder ``out/runs``."""
    runs = Path(out) / "runs"
    jobs = list(cfgs.values())
    if scheduler:
        client = connect(scheduler)
        futs = [client.submit(_job, chain, str(runs), pure=False) for chain in jobs]
        logs = {}
        for f in futs:
            logs.update(f.result())
        return logs
    from .runner import token_bar
    todo = [c for chain in jobs for c in chain if not is_done(runs / c.key(), c)]
    bar, progress = token_bar(sum(c.steps * c.batch * c.model.ctx for c in todo), quiet)
    try:
        logs = {}
        for chain in jobs:
            logs.update(_job(chain, str(runs), progress))
    finally:
        bar.close()
    return logs


def connect(address: str):
    """A Dask client of the scheduler at ``address``; ValueError naming the address when nothing answers there
    within 5 s, or when Dask is not installed."""
    try:
        from distributed import Client
    except ImportError:
        raise ValueError("--scheduler needs Dask: pip install 'dask[distributed]' (or '.[dask]' from the "
                         "repository root)") from None
    try:
        return Client(address, timeout=5)
    except (OSError, TimeoutError) as e:
        raise ValueError(f"--scheduler {address}: no Dask scheduler answered ({type(e).__name__}: {e}); start "
                         "one with 'dask scheduler' or drop --scheduler to run here") from None


def _job(chain, runs, progress=None) -> dict:
    """One (format, seed): the trunk (the longest budget) with a snapshot at every shorter budget's decay
    step, then the shorter budgets from their snapshots."""
    from .runner import train_chain
    return train_chain(chain, Path(runs), progress)


def summarize(cfgs: dict, logs: dict, params: int) -> dict:
    """The JSON summary: per (format, budget) the paired gap to BF16 and the effective data."""
    final = {}
    for (f, s), chain in cfgs.items():
        for c in chain:
            rows = logs[c.key()]
            last = rows[-1] if rows else {"val_loss": math.nan, "step": 0}
            ok = last["step"] == c.steps and math.isfinite(last["val_loss"])
            final[(f, s, c.tokens)] = last["val_loss"] if ok else math.nan
    fmts = sorted({f for f, _ in cfgs}, key=list(RECIPES).index)
    seeds = sorted({s for _, s in cfgs})
    toks = [c.tokens for c in next(iter(cfgs.values()))]
    bf = np.array([[final[("bf16", s, t)] for t in toks] for s in seeds])          # (seeds, budgets)
    bf_mean = np.nanmean(bf, 0) if np.isfinite(bf).any() else bf[0]
    points = []
    for f in fmts:
        if f == "bf16":
            continue
        for j, t in enumerate(toks):
            d = np.array([final[(f, s, t)] - final[("bf16", s, t)] for s in seeds])
            d = d[np.isfinite(d)]
            mean_loss = float(np.nanmean([final[(f, s, t)] for s in seeds]))
            points.append({"format": f, "tokens": t, "params": params, "tokens_per_param": t / params,
                           "effect": float(d.mean()) if d.size else math.nan,
                           "stderr": float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan,
                           "n": int(d.size),
                           "effective_data": stats.effective_data(toks, bf_mean, mean_loss, t)})
    curves = {f: {"tokens": toks, "val_loss_mean": [float(np.nanmean([final[(f, s, t)] for s in seeds]))
                                                    for t in toks]} for f in fmts}
    return {"points": points, "params": params, "seeds": seeds, "tokens": toks, "curves": curves,
            "tokens_per_param": [t / params for t in toks]}


def make(out: Path, quick: bool = False, seeds: int | None = None, quiet: bool = False,
         scheduler: str | None = None) -> dict:
    seeds = seeds or (QUICK_SEEDS if quick else FULL_SEEDS)
    cfgs = configs(quick, seeds)
    params = n_params((QUICK if quick else FULL).model)
    logs = run_sweep(cfgs, out, quiet, scheduler)
    summary = summarize(cfgs, logs, params)
    rows = []
    from .train import diverged
    for (f, s), chain in cfgs.items():
        for c in chain:
            r = logs[c.key()]
            rows.append({"format": f, "seed": s, "tokens": c.tokens, "tokens_per_param": c.tokens / params,
                         "params": params, "val_loss": r[-1]["val_loss"] if r else math.nan,
                         "diverged": diverged(Path(out) / "runs" / c.key()) or ""})
    plotting.write_csv(Path(out) / "scaling.csv", COLUMNS, rows)
    plotting.write_json(Path(out) / "scaling.json", summary)
    _plot(summary, Path(out))
    return summary


def _dn_panel(ax, summary, ylabel, title, ref, value, err=None):
    """One panel against D/N: ``value(point)`` (None: left out) of each format but BF16, a line at ``ref``."""
    for f in summary["curves"]:
        if f == "bf16":
            continue
        pts = [p for p in summary["points"] if p["format"] == f and value(p) is not None]
        x, y = [p["tokens_per_param"] for p in pts], [value(p) for p in pts]
        if err:
            ax.errorbar(x, y, yerr=[err(p) for p in pts], marker="o", color=COLORS[f], label=LABELS[f], capsize=3)
        else:
            ax.plot(x, y, marker="o", color=COLORS[f], label=LABELS[f])
    ax.axhline(ref, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens per parameter (D/N)")
    ax.set_ylabel(ylabel)
    plotting.title(ax, title, width=60)
    ax.legend(fontsize=8)


def _plot(summary, out: Path):
    plt = plotting.pyplot()
    fig, (a1, a3, a2) = plt.subplots(1, 3, figsize=(17, 4.6))
    _dn_panel(a1, summary, "final val loss - BF16's (nats, paired by seed)",
              "FP4 / FP8 gap to BF16 against D/N (mean ± s.e. over seeds)", 0, lambda p: p["effect"],
              lambda p: p["stderr"] if math.isfinite(p["stderr"]) else 0)
    _dn_panel(a3, summary, "effective data (share of the tokens BF16 needs)",
              "effective data: the tokens with which BF16 reaches the same loss", 1, lambda p: p["effective_data"])
    for f, c in summary["curves"].items():
        a2.plot(c["tokens"], c["val_loss_mean"], marker="o", color=COLORS[f], label=LABELS[f])
    a2.set_xscale("log")
    a2.set_xlabel("training tokens (each a cooldown of its own budget)")
    a2.set_ylabel("final validation loss (nats/char)")
    plotting.title(a2, "loss against budget, each format beside BF16", width=60)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)


def largest(preset: str, seed: int) -> RunConfig:
    """The full sweep's run of ``preset`` and ``seed`` at its largest budget (what fig2, fig6a and fig6b train
    in full mode)."""
    if preset not in RECIPES:
        raise ValueError(f"preset {preset!r}: the sweep trains {', '.join(RECIPES)}")
    return configs(False, seed + 1)[(preset, seed)][-1]
