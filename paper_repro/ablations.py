"""The paper's recipe ablations (part 2): each figure is a set of variants of the NVFP4 recipe, trained over seeds,
compared with the full recipe at the end of training and given a verdict against the paper's claim.

Verdicts compare the final validation loss of a variant with the reference (the full recipe; or the variant
named by ``Variant.vs``, where the paper's claim is about that pair) paired by seed
(same initial weights, data order and SR key): d = loss_variant - loss_reference, its mean m and standard error
se over seeds. Where the paper says the variant is worse: "reproduces" if m > 2 se, "contradicts" if
m < -2 se, else "not distinguishable from seed noise at this scale (spread X, effect Y)". Where the paper says
it makes no difference: "reproduces" if |m| <= 2 se. A variant that diverged (train.divergence) reproduces a
claim of divergence and contradicts any other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import plotting, stats
from .stats import verdict  # noqa: F401  (the rule lives in stats; imported from here by its users)
from .train import RunConfig, diverged

BRANCH = 0.34          # fig4 / fig12: branch from the full recipe at 34% of the run, as the paper does
LATE = 0.82            # fig7: just after the learning-rate decay starts at 80% (the paper's 8.2T of 10T)


@dataclass(frozen=True)
class Variant:
    label: str
    make: object            # RunConfig (the figure's base, seed set) -> RunConfig
    paper: str              # what the paper reports for it
    expect: str             # "worse", "same", "diverges" or "reference"
    vs: str = ""            # the variant it is compared with, where the paper compares it with another than the
    #                         figure's reference (fig14: reusing the Fprop copy of activations vs re-quantizing)


def _sw(cfg, **sw):
    return replace(cfg, switches=tuple(sorted({**dict(cfg.switches), **sw}.items())))


def _branch(at, preset=None, switches=None, keep_last=None, which="both"):
    """A phase appended to the run: from ``at`` on, ``preset`` (default: the run's own, with its switches plus
    ``switches``), the kept blocks ``keep_last`` and the GEMMs ``which``."""
    def make(cfg):
        sw = tuple(sorted((({} if preset else dict(cfg.switches)) | (switches or {})).items()))
        ph = (at, preset or cfg.preset, sw, cfg.keep_last if keep_last is None else keep_last, which)
        return replace(cfg, phases=cfg.phases + (ph,))
    return make


def _ref(cfg):
    return cfg


_W16 = (("fprop_w", "nvfp4", (16, 16), "rne"), ("dgrad_w", "nvfp4", (16, 16), "rne"))
_W1 = (("fprop_w", "nvfp4", (1, 16), "rne"), ("dgrad_w", "nvfp4", (1, 16), "rne"))
_A1 = (("fprop_x", "nvfp4", (1, 16), "rne"), ("wgrad_x", "nvfp4", (1, 16), "rne"))
BASE_1D_RNE = dict(disable_2d_quantization=True, disable_rht=True, disable_stochastic_rounding=True)

ABLATIONS = {
    "fig4": ("Branches of the full recipe at 34% of the run", [
        Variant("full recipe", _ref, "reference", "reference"),
        Variant("no SR", _branch(BRANCH, switches={"disable_stochastic_rounding": True}),
                "higher loss without SR on gradients", "worse"),
        Variant("no RHT", _branch(BRANCH, switches={"disable_rht": True}), "higher loss without RHT on Wgrad",
                "worse"),
        Variant("no 2D weights", _branch(BRANCH, switches={"disable_2d_quantization": True}),
                "higher loss with 1x16 weights", "worse"),
        Variant("no BF16 blocks", _branch(BRANCH, keep_last=0), "higher loss with every block in NVFP4", "worse"),
    ]),
    "fig7": ("Switching to BF16 late in the run", [
        Variant("NVFP4 throughout", _ref, "reference", "reference"),
        Variant("BF16 forward at 82%", _branch(LATE, preset="bf16", which="forward"),
                "most of the gap to BF16 closes when the forward switches", "better"),
        Variant("BF16 backward at 82%", lambda c: _branch(LATE, preset="bf16", which="backward")(
            _branch(LATE, switches={"disable_2d_quantization": True}, which="forward")(c)),
                "little of the gap closes when only the backward switches (forward keeps NVFP4, 1x16 weights)",
                "same"),
        Variant("BF16 both at 82%", _branch(LATE, preset="bf16", which="both"), "the gap closes", "better"),
        Variant("BF16 both at 99%", _branch(0.99, preset="bf16", which="both"),
                "a switch in the last 1% of the run closes little", "same"),
    ]),
    "fig8": ("Adding the recipe's parts one at a time", [
        Variant("base: 1x16 RNE", lambda c: _sw(c, **BASE_1D_RNE), "highest loss", "worse"),
        Variant("+ 2D weights", lambda c: _sw(c, disable_rht=True, disable_stochastic_rounding=True),
                "each part lowers the loss", "worse"),
        Variant("+ 2D weights + RHT", lambda c: _sw(c, disable_stochastic_rounding=True),
                "each part lowers the loss", "worse"),
        Variant("full recipe (+ SR)", _ref, "reference", "reference"),
        Variant("base + SR", lambda c: _sw(c, disable_2d_quantization=True, disable_rht=True),
                "SR gives the largest single gain", "worse"),
        Variant("base + SR + RHT", lambda c: _sw(c, disable_2d_quantization=True), "each part lowers the loss",
                "worse"),
    ]),
    "fig10": ("Where stochastic rounding is applied", [
        Variant("SR on gradients", _ref, "reference (the recipe)", "reference"),
        Variant("SR on all backward operands", lambda c: _sw(c, sr_backward=True),
                "no better than gradients only (weights and activations rounded stochastically in Dgrad/Wgrad)",
                "same"),
        Variant("SR on gradients and activations", lambda c: _sw(c, sr_activations=True),
                "worse: SR on forward activations diverges or raises the loss", "worse"),
        Variant("SR on gradients and weights", lambda c: _sw(c, sr_weights=True),
                "worse: SR on weights raises the loss", "worse"),
    ]),
    "fig11": ("Which GEMM gets the RHT", [
        Variant("RHT on Wgrad", _ref, "reference (the recipe)", "reference"),
        Variant("RHT on Wgrad + Fprop", lambda c: _sw(c, rht_fprop=True),
                "no gain at this size, and the forward pays the cost", "same"),
        Variant("RHT on Wgrad + Dgrad", lambda c: _sw(c, rht_dgrad=True), "no gain", "same"),
        Variant("no RHT", lambda c: _sw(c, disable_rht=True), "higher loss (more at larger scale)", "worse"),
    ]),
    "fig12": ("RHT size, branched from d=16 at 34%", [
        Variant("d=16", _ref, "reference (the recipe)", "reference"),
        Variant("d=2", _branch(BRANCH, switches={"rht_size": 2}), "too small to spread outliers: higher loss",
                "worse"),
        Variant("d=4", _branch(BRANCH, switches={"rht_size": 4}), "higher loss than d=16", "worse"),
        Variant("d=128", _branch(BRANCH, switches={"rht_size": 128}), "no better than d=16", "same"),
    ]),
    "fig13": ("Random sign vectors of the RHT", [
        Variant("TE's fixed vector", _ref, "reference (the recipe)", "reference"),
        Variant("one vector from the seed", lambda c: _sw(c, rht_signs="fixed"), "the same as any fixed vector",
                "same"),
        Variant("a new vector per transform", lambda c: _sw(c, rht_signs="per_transform"),
                "no better than one fixed vector", "same"),
        Variant("no random signs", lambda c: _sw(c, rht_signs="none"), "higher loss without random signs",
                "worse"),
    ]),
    "fig9": ("Which blocks stay in BF16 (of 4; the head always does)", [
        Variant("last 1 block", lambda c: replace(c, log_wgrad_error=True), "reference (the recipe)", "reference"),
        Variant("none", lambda c: replace(c, keep_last=0, log_wgrad_error=True),
                "higher loss (at 12B: divergence) with every block in NVFP4", "worse"),
        Variant("last 2 blocks", lambda c: replace(c, keep_last=2, log_wgrad_error=True),
                "lower loss than fewer BF16 blocks", "better"),
        Variant("first 1 block", lambda c: replace(c, keep_last=0, keep_first=1, log_wgrad_error=True),
                "the last blocks matter more than the first", "worse"),
        Variant("first 1 + last 1", lambda c: replace(c, keep_first=1, log_wgrad_error=True),
                "little gain over the last block alone", "same"),
    ]),
    "fig14": ("NVFP4 on weights only or activations only (everything else BF16)", [
        Variant("weights 16x16", lambda c: replace(c, preset="bf16", operands=_W16), "reference", "reference"),
        Variant("weights 1x16, re-quantized along N for Dgrad",
                lambda c: replace(c, preset="bf16", operands=_W1), "forward and backward see different weights: "
                "higher loss than 16x16", "worse"),
        Variant("weights 1x16, Dgrad reuses the Fprop copy",
                lambda c: replace(c, preset="bf16", operands=_W1, switches=(("dgrad_w_reuse_fprop", True),)),
                "the same weights in both directions: as good as 16x16", "same"),
        Variant("activations 1x16", lambda c: replace(c, preset="bf16", operands=_A1),
                "activations tolerate 1x16 blocks: close to weights-only", "same"),
        Variant("activations 1x16, Wgrad reuses the Fprop copy",
                lambda c: replace(c, preset="bf16", operands=_A1, switches=(("wgrad_x_reuse_fprop", True),)),
                "the inconsistency matters little for activations: about the same as re-quantizing them", "same",
                vs="activations 1x16"),
    ]),
}


def runs_for(fig: str, base: RunConfig, seeds: int) -> list[tuple[str, float, RunConfig]]:
    """(label, 1.0, config) of every run of an ablation figure, plus the BF16 baseline, for each seed."""
    _, variants = ABLATIONS[fig]
    out = []
    for s in range(seeds):
        b = replace(base, preset="nvfp4_paper", seed=s)
        out.append(("bf16", 1.0, replace(b, preset="bf16")))
        for v in variants:
            out.append((v.label, 1.0, v.make(b)))
    return out


def paired_verdict(v, final, seeds, ref, metric) -> dict:
    """A variant's summary: its final ``metric`` paired by seed with the reference's (or ``v.vs``'s) and the
    verdict on those differences. ``final``: {label: {seed: (final value, diverged)}}; ``v``: label, expect, paper,
    vs."""
    vs = v.vs or ref
    diffs = [final[v.label][s][0] - final[vs][s][0] for s in seeds]
    flags = [final[v.label][s][1] or final[vs][s][1] for s in seeds]
    word, info = verdict(v.expect, diffs, flags)
    m, sd = stats.mean_std([final[v.label][s][0] for s in seeds])
    return {"paper": v.paper, "expect": v.expect, "verdict": word, "vs": vs, f"final_{metric}_mean": float(m),
            f"final_{metric}_std": float(sd), **info}


def wgrad_error_at_branch(runs, run_dirs, fig="fig12") -> list[dict]:
    """The Wgrad GEMM error of every RHT size on the same tensors: for each seed, the d=16 run's snapshot at the
    branch point (the weights all of fig12's branches start from), one forward and backward pass on the first
    validation windows under each variant's recipe, each NVFP4 layer's relative Wgrad error against the float64
    product of the same operands (fp4sim.torch.suggest_high_precision). Rows: seed, variant, layer, rel_error."""
    import warnings

    import torch

    from fp4sim.torch import RecipeMismatchWarning

    from . import data
    from .model import build
    from .train import Phase, _quant_layers, apply_phase, wgrad_errors
    _, variants = ABLATIONS[fig]
    ref = next(v.label for v in variants if v.expect == "reference")
    out = []
    _, val_ids = data.splits()
    for seed in sorted({c.seed for _, _, c in runs}):
        base = next(c for lab, _, c in runs if lab == ref and c.seed == seed)
        step = Phase(BRANCH, base.preset).step(base.steps)
        snap = Path(run_dirs[base.key()]) / f"snap-{step}.pt"
        if not snap.is_file():
            raise FileNotFoundError(f"{fig}: {snap} is missing (a branch trains it); remove the branch runs' folders "
                                    "under runs/ to train them again")
        st = torch.load(snap, weights_only=False)
        val = torch.from_numpy(data.val_windows(val_ids, base.val_windows, base.model.ctx))[:base.batch]
        for v in variants:
            cfg = next(c for lab, _, c in runs if lab == v.label and c.seed == seed)
            model = build(cfg.model, cfg.recipe(), seed)
            with warnings.catch_warnings():         # the variant starts from the base run's snapshot, on purpose
                warnings.simplefilter("ignore", RecipeMismatchWarning)
                model.load_state_dict(st["model"])
            if cfg.phases:
                apply_phase(model, cfg, cfg.phases[-1])
            q = _quant_layers(model)
            for n, c in st["calls"].items():
                q[n]._calls = c
            out += [{"seed": seed, "variant": v.label, "layer": n, "rel_error": e}
                    for n, e in wgrad_errors(model, val, cfg.model.vocab).items()]
    return out


def make(fig: str, runs, logs, out: Path, run_dirs, wgrad_at_branch=None) -> dict:
    """Write fig.png / fig.csv / fig.json of an ablation figure from its finished runs (fig12's Wgrad errors at
    the branch point computed from the runs' snapshots, or taken as given in ``wgrad_at_branch``: rows of
    fig12_wgrad_error.csv)."""
    title, variants = ABLATIONS[fig]
    out = Path(out)
    rows = plotting.training_rows(fig, runs, logs)
    plotting.write_csv(out / f"{fig}.csv", plotting.TRAIN_COLUMNS + ("wgrad_rel_error_mean",), rows)
    logged = any("wgrad_error" in r for rr in logs.values() for r in rr)
    at_branch = None
    if fig == "fig12":
        at_branch = wgrad_at_branch if wgrad_at_branch is not None else wgrad_error_at_branch(runs, run_dirs, fig)
    if at_branch is not None:
        plotting.write_csv(out / f"{fig}_wgrad_error.csv", ("seed", "variant", "layer", "rel_error"), at_branch)
    seeds = sorted({c.seed for _, _, c in runs})
    final = {}
    for lab, _, c in runs:
        r = logs[c.key()]
        final.setdefault(lab, {})[c.seed] = (r[-1]["val_loss"], bool(diverged(run_dirs[c.key()])))
    ref = next(v.label for v in variants if v.expect == "reference")
    summary = {"title": title, "seeds": len(seeds), "reference": ref, "variants": {}}
    plt = plotting.pyplot()
    panel3 = logged or at_branch is not None
    f, axes = plt.subplots(1, 3 if panel3 else 2, figsize=(17 if panel3 else 12, 4.4))
    a0, a1 = axes[0], axes[1]
    cmap = plt.get_cmap("tab10")
    if at_branch is not None:   # every RHT size on the same weights and batch: the snapshot at the branch point
        by = {}
        for r in at_branch:
            by.setdefault(r["variant"], {}).setdefault(r["seed"], []).append(r["rel_error"])
        summary["wgrad_error_at_branch"] = {}
        for i, v in enumerate(variants):
            per_seed = [float(np.mean(e)) for e in by.get(v.label, {}).values()]
            m, sd = stats.mean_std(per_seed)
            summary["wgrad_error_at_branch"][v.label] = {"mean": float(m), "std": float(sd), "seeds": len(per_seed)}
            axes[2].bar([i], [m], yerr=[sd], color=cmap(i), capsize=4)
        axes[2].set_xticks(range(len(variants)), [v.label for v in variants], fontsize=8)
        axes[2].set(ylabel="relative Wgrad GEMM error (mean over NVFP4 layers)")
        plotting.title(axes[2], f"Wgrad error of each d on the same tensors (step at {BRANCH:.0%}), mean ± std over seeds")
        axes[2].grid(alpha=0.3, axis="y")
    if logged:                  # the paper's diagnostic: each run's mean relative Wgrad GEMM error over its layers
        for i, v in enumerate(variants):
            for s in seeds:
                c = next(c for lab, _, c in runs if lab == v.label and c.seed == s)
                pts = [(r["tokens"], np.mean(list(r["wgrad_error"].values()))) for r in logs[c.key()]
                       if r.get("wgrad_error")]
                if pts:
                    axes[2].plot(*zip(*pts), color=cmap(i), lw=1, alpha=0.8, label=v.label if s == seeds[0] else None)
        axes[2].set(xlabel="training tokens", ylabel="relative Wgrad GEMM error (mean over NVFP4 layers)")
        plotting.title(axes[2], "Wgrad quantization error during training")
        axes[2].legend(fontsize=7)
        axes[2].grid(alpha=0.3)
    for i, v in enumerate(variants):
        t, R, ok = None, [], True
        for s in seeds:
            c = next(c for lab, _, c in runs if lab == v.label and c.seed == s)
            b = next(c for lab, _, c in runs if lab == "bf16" and c.seed == s)
            rv, rb = logs[c.key()], {r["step"]: r["val_loss"] for r in logs[b.key()]}
            ok &= len(rv) == len(logs[b.key()])
            if ok:
                t = np.array([r["tokens"] for r in rv])
                R.append(stats.rel_diff_pct([rb[r["step"]] for r in rv], [r["val_loss"] for r in rv]))
        if ok and R:
            plotting.lines(a0, t, np.array(R), cmap(i), v.label, i, len(variants))
        summary["variants"][v.label] = info = paired_verdict(v, final, seeds, ref, "val_loss")
        if v.label != ref:
            a1.errorbar([i], [info.get("effect", math.nan)], yerr=[2 * info.get("stderr", math.nan)], fmt="o",
                        color=cmap(i), capsize=4)
        else:                   # the reference: 0 by definition, marked so that its tick is not empty
            a1.plot([i], [0.0], marker="D", ms=7, mfc="white", mec=cmap(i), mew=1.5, ls="none",
                    label="reference (0 by definition)")
    a0.axhline(0, color="k", lw=0.8)
    a0.set(xlabel="training tokens", ylabel="relative difference from BF16 (%)")
    plotting.title(a0, f"{title}: relative difference from BF16, mean ± 1 s.e. over {len(seeds)} seeds")
    a0.legend(fontsize=7)
    a1.legend(fontsize=7, loc="best")
    a1.axhline(0, color="k", lw=0.8)
    a1.set_xticks(range(len(variants)), [v.label + (f"\n(vs {v.vs})" if v.vs else "") for v in variants], rotation=25,
                  ha="right", fontsize=7)
    against = ref if not any(v.vs for v in variants) else f"{ref} (or the run named)"
    a1.set(ylabel=f"final loss - {against} (nats), ± 2 s.e.")
    plotting.title(a1, "effect at the end of training, paired by seed")
    for a in (a0, a1):
        a.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(out / f"{fig}.png", dpi=130)
    plt.close(f)
    plotting.write_json(out / f"{fig}.json", summary)
    return summary


def verdict_table(out: Path) -> str:
    """The verdicts of every ablation figure whose JSON is in ``out``, as a Markdown table (figures/README.md
    and the closing notes quote it): the paper's claim, the paired effect on the final validation loss (mean
    ± standard error over seeds, nats; positive = worse than the reference), the seed spread of that difference,
    and the verdict."""
    import json
    lines = ["| figure | variant (vs reference) | the paper | effect on the final loss (nats) | seed spread | "
             "verdict |", "|---|---|---|---|---|---|"]
    for fig in ABLATIONS:
        p = Path(out) / f"{fig}.json"
        if not p.is_file():
            continue
        j = json.loads(p.read_text())
        for var in ABLATIONS[fig][1]:                   # in the figure's order
            lab, v = var.label, j["variants"].get(var.label)
            if v is None or v["expect"] == "reference":
                continue
            if v.get("diverged"):
                eff, spread = "diverged", ""
            elif math.isfinite(v.get("stderr", math.nan)):
                eff, spread = f"{v['effect']:+.4f} ± {v['stderr']:.4f}", f"{v['spread']:.4f}"
            else:
                eff, spread = f"{v.get('effect', math.nan):+.4f}", ""
            lines.append(f"| {fig} | {lab} (vs {v.get('vs', j['reference'])}) | {v['paper']} | {eff} | {spread} | "
                         f"{v['verdict']} |")
    return "\n".join(lines) + "\n"
