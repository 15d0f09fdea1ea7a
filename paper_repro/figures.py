"""The figures: what each trains (or quantizes), and how it is drawn and written.

Each figure writes DIR/FIG.png, DIR/FIG.csv and DIR/FIG.json (the numbers figures/README.md quotes). Training
figures share runs: a configuration trained for one figure (e.g. the BF16 baseline of Fig. 2) is reused by the
next (Fig. 6a) from DIR/runs/.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import plotting, stats
from .model import GPTConfig
from .train import RunConfig

# Full mode: sized so that `python -m paper_repro all` (every run of every figure) takes about 90 minutes on two
# cores; the measured times are in figures/README.md.
FULL = RunConfig(model=GPTConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ctx=128), batch=16,
                 tokens=358_400, lr=2e-3, warmup=10, eval_points=12, val_windows=96)
QUICK = RunConfig(model=GPTConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ctx=32), batch=4,
                  tokens=4 * 32 * 12, lr=3e-3, warmup=2, eval_points=3, val_windows=8)
FULL_SEEDS, QUICK_SEEDS = 3, 2
MULTS = (1.0, 1.25, 1.36, 1.5)
LABELS = {"bf16": "BF16", "nvfp4_paper": "NVFP4 (paper recipe)", "fp8_blockwise": "FP8 blockwise",
          "mxfp4_paper": "MXFP4 (RHT d=32)"}
COLORS = {"bf16": "k", "nvfp4_paper": "tab:green", "fp8_blockwise": "tab:blue", "mxfp4_paper": "tab:red"}



SCALED = ("fig2", "fig6a", "fig6b")      # full mode: at the scaling sweep's largest D/N (``short``: FULL above)
SCALED_MULTS = (0.4, 1.0, 1.25, 1.36, 1.5)   # 0.4x and 1.0x are the sweep's D/N 20 and 50 runs


def base(quick: bool) -> RunConfig:
    return QUICK if quick else FULL


def at_scale(fig: str, quick: bool, short: bool) -> bool:
    """Whether ``fig`` trains at the scaling sweep's largest D/N (fig2, fig6a, fig6b in full mode unless
    ``short``: the earlier 0.75M-parameter runs at D/N 0.5)."""
    return fig in SCALED and not quick and not short


def mults(fig: str, quick: bool, short: bool) -> tuple:
    return SCALED_MULTS if at_scale(fig, quick, short) else MULTS


def _tok(cfg: RunConfig, mult: float) -> int:
    per = cfg.batch * cfg.model.ctx
    return int(round(cfg.tokens * mult / per)) * per


# ------------------------------------------------------------------------------------------- run sets
def runs_for(fig: str, quick: bool, seeds: int, short: bool = False) -> list[tuple[str, float, RunConfig]]:
    """(run label, token multiplier, config) of every training run a figure needs. fig2 / fig6a / fig6b in full
    mode are the scaling sweep's runs at its largest budget (:func:`at_scale`), and fig6b's MXFP4 runs at other
    multiples of that budget share the sweep's trunk (the same prefix: cooldowns of one longer run)."""
    from . import ablations
    b = base(quick)
    if fig in ablations.ABLATIONS:
        return ablations.runs_for(fig, b, seeds)
    scaled = at_scale(fig, quick, short)
    if scaled:
        from . import scaling

        def cfg(p, s):
            return scaling.largest(p, s)
    else:
        def cfg(p, s):
            return replace(b, preset=p, seed=s)
    out = []
    presets = {"fig2": ("bf16", "nvfp4_paper", "fp8_blockwise"), "fig6a": ("bf16", "nvfp4_paper", "mxfp4_paper"),
               "fig6b": ("nvfp4_paper",)}.get(fig, ())
    for s in range(seeds):
        for p in presets:
            out.append((p, 1.0, cfg(p, s)))
        if fig == "fig6b":
            m0 = cfg("mxfp4_paper", s)
            for m in mults(fig, quick, short):
                out.append((f"mxfp4_paper_x{m:g}", m, replace(m0, tokens=_tok(m0, m))))
    return out


def _loss_and_rel(fig, runs, logs, labels, out: Path, title):
    plt = plotting.pyplot()
    f, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4.4))
    summary = {"runs": {}, "seeds": len({c.seed for _, _, c in runs})}
    tb, Yb = plotting.curves(runs, logs, "bf16")
    shown, rels = [], []
    others = [lab for lab in labels if lab != "bf16"]
    for lab in labels:
        t, Y = plotting.curves(runs, logs, lab)
        plotting.lines(a0, t, Y, COLORS[lab], LABELS[lab], err=False)
        shown.append(Y)
        m, s = stats.mean_std(Y[:, -1])
        summary["runs"][lab] = {"final_val_loss_mean": float(m), "final_val_loss_std": float(s),
                                "final_val_loss_per_seed": [float(v) for v in Y[:, -1]]}
        if lab != "bf16":
            R = stats.rel_diff_pct(Yb, Y)
            plotting.lines(a1, t, R, COLORS[lab], LABELS[lab], others.index(lab), len(others))
            rels.append(R)
            rm, rs = stats.mean_std(R[:, -1])
            dm, ds = stats.mean_std(Y[:, -1] - Yb[:, -1])
            summary["runs"][lab].update(final_rel_diff_pct_mean=float(rm), final_rel_diff_pct_std=float(rs),
                                        final_loss_gap_vs_bf16_mean=float(dm), final_loss_gap_vs_bf16_std=float(ds))
    a0.set(xlabel="training tokens", ylabel="validation loss (nats/char)")
    if tb[-1] > 20 * tb[0]:                 # an evaluation grid over decades (the sweep's runs)
        a0.set_xscale("log")
        a1.set_xscale("log")
    plotting.title(a0, f"{title} (mean over {summary['seeds']} seeds)")
    plotting.ylim_all(a0, *shown)
    a1.axhline(0, color="k", lw=0.8)
    a1.set(xlabel="training tokens", ylabel="relative difference from BF16 (%)\n(BF16 - run) / BF16")
    plotting.title(a1, "relative difference, paired by seed (mean ± 1 s.e.)")
    plotting.ylim_all(a1, *rels, np.zeros(1))
    for a in (a0, a1):
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(out / f"{fig}.png", dpi=130)
    plt.close(f)
    return summary


def scale_of(runs) -> dict:
    """params, tokens and tokens_per_param of a figure's reference runs (multiplier 1.0; N counts every
    parameter, embedding and head included)."""
    from .model import GPT
    ref = [c for _, m, c in runs if m == 1.0]
    params = sum(p.numel() for p in GPT(ref[0].model).parameters())
    tokens = ref[0].tokens
    return {"params": params, "tokens": tokens, "tokens_per_param": tokens / params}


def make_training_figure(fig, runs, logs, out: Path) -> dict:
    out = Path(out)
    rows = plotting.training_rows(fig, runs, logs)
    plotting.write_csv(out / f"{fig}.csv", plotting.TRAIN_COLUMNS, rows)
    sc = scale_of(runs)
    tag = f"D/N {sc['tokens_per_param']:.3g}"
    if fig == "fig2":
        summary = _loss_and_rel(fig, runs, logs, ("bf16", "nvfp4_paper", "fp8_blockwise"), out,
                                f"NVFP4 vs BF16 and FP8, {tag}")
    elif fig == "fig6a":
        summary = _loss_and_rel(fig, runs, logs, ("bf16", "nvfp4_paper", "mxfp4_paper"), out,
                                f"NVFP4 vs MXFP4, same BF16 layers, {tag}")
        r = summary["runs"]
        gap = np.array(r["mxfp4_paper"]["final_val_loss_per_seed"]) - np.array(r["nvfp4_paper"]["final_val_loss_per_seed"])
        gm, gs = stats.mean_std(gap)
        summary["mxfp4_minus_nvfp4_final"] = {"mean": float(gm), "std": float(gs), "per_seed": [float(g) for g in gap]}
    else:
        summary = _fig6b(runs, logs, out, tag)
    summary = {**sc, **summary}
    plotting.write_json(out / f"{fig}.json", summary)
    return summary


def _fig6b(runs, logs, out: Path, tag: str = "") -> dict:
    plt = plotting.pyplot()
    seeds = sorted({c.seed for _, _, c in runs})
    ms = sorted({m for lab, m, c in runs if lab.startswith("mxfp4_paper_x")})
    tn, Yn = plotting.curves(runs, logs, "nvfp4_paper")
    finals = np.array([[logs[c.key()][-1]["val_loss"] for s in seeds for lab, m, c in runs
                        if lab == f"mxfp4_paper_x{mm:g}" and c.seed == s] for mm in ms]).T   # (seeds, mults)
    n_tok = next(c.tokens for lab, _, c in runs if lab == "nvfp4_paper")
    ratio = [next(c.tokens for lab, m, c in runs if lab == f"mxfp4_paper_x{mm:g}") / n_tok for mm in ms]
    res = stats.token_multiplier_over_seeds(ratio, finals, Yn[:, -1])     # the exact token ratios (whole steps)
    f, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4.6))
    plotting.lines(a0, tn, Yn, COLORS["nvfp4_paper"], f"NVFP4, {1.0:.2f}x tokens", err=False)
    cmap = plt.get_cmap("Reds")
    shown = [Yn]
    for i, m in enumerate(ms):
        t, Y = plotting.curves(runs, logs, f"mxfp4_paper_x{m:g}")
        plotting.lines(a0, t, Y, cmap(0.4 + 0.6 * i / (len(ms) - 1)), f"MXFP4, {m:.2f}x tokens", err=False)
        shown.append(Y)
    a0.set(xlabel="training tokens", ylabel="validation loss (nats/char)")
    plotting.title(a0, f"MXFP4 with more tokens, NVFP4 at {tag} (mean over {len(seeds)} seeds)")
    if tn[-1] > 20 * tn[0]:
        a0.set_xscale("log")
    plotting.ylim_all(a0, *shown)
    fm, fs = stats.mean_std(finals)
    se = fs / math.sqrt(len(seeds))
    a1.errorbar(ratio, fm, yerr=se, color="tab:red", marker="o", capsize=3, label="MXFP4 final loss (± 1 s.e.)")
    nm, ns = stats.mean_std(Yn[:, -1])
    nse = ns / math.sqrt(len(seeds))
    a1.axhline(nm, color="tab:green", label=f"NVFP4 final loss at {1.0:.2f}x (± 1 s.e.)")
    a1.axhspan(nm - nse, nm + nse, color="tab:green", alpha=0.15, lw=0)
    if res["status"] == "interpolated":
        a1.axvline(res["value"], color="0.4", ls="--",
                   label=f"match at {res['value']:.2f}x ± {res['stderr']:.2f} (paper: 1.36x)")
        plotting.title(a1, "the token multiplier at which MXFP4 matches NVFP4's final loss")
    elif res["status"] == "at_or_below_min":
        plotting.title(a1, f"MXFP4 reaches NVFP4's final loss already at {ms[0]:.2f}x (paper: 1.36x)")
    else:
        ext = res["extrapolated"]
        plotting.title(a1, f"MXFP4 does not reach NVFP4's final loss by {ms[-1]:.2f}x"
               + (f" (straight-line extrapolation: {ext:.2f}x)" if math.isfinite(ext) else "") + " (paper: 1.36x)")
    a1.set(xlabel="MXFP4 tokens / NVFP4 tokens", ylabel="final validation loss")
    a1.set_xticks(ratio, [f"{m:.2f}x" for m in ms])
    for a in (a0, a1):
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(out / "fig6b.png", dpi=130)
    plt.close(f)
    return {"seeds": len(seeds), "mults": list(ms), "token_ratios": ratio, "mxfp4_final_mean": [float(v) for v in fm],
            "mxfp4_final_std": [float(v) for v in fs], "nvfp4_final_mean": float(nm), "nvfp4_final_std": float(ns),
            "token_multiplier": res}


# ------------------------------------------------------------------------------------------- fig1, appB4
def _sample(name):
    import fp4sim
    return np.load(Path(fp4sim.__file__).parent / "data" / "sample_dump.npz")[name].astype(np.float32)


def fig1(out: Path, quick: bool = False) -> dict:
    """One real NVFP4 block: the 16 values of a MiniLM weight row, their E2M1 codes, the block's E4M3 scale, the
    tensor's FP32 scale and what they decode to; the block amax marked."""
    import fp4sim as fs
    plt = plotting.pyplot()
    name = "minilm.encoder.layer.0.attention.self.query.weight"
    W = _sample(name)
    q = fs.quantize(W, "nvfp4")
    y = fs.dequantize(q)
    r, j = 0, 0
    x = W[r, 16 * j:16 * j + 16]
    codes = fs.layout.unpack_fp4(q.codes[r:r + 1])[0, 16 * j:16 * j + 16]
    e2m1 = fs.E2M1.values[codes]
    sbyte = int(q.scales[r, j])
    sval = float(fs.E4M3.values[sbyte])
    amax = float(q.global_amax)
    s_enc = float(np.float32(2688.0) / np.float32(amax))
    k_amax = int(np.argmax(np.abs(x)))
    rows = [{"figure": "fig1", "tensor": name, "row": r, "block": j, "element": k, "x": float(x[k]),
             "code": int(codes[k]), "e2m1_value": float(e2m1[k]), "scale_byte": sbyte, "scale_e4m3": sval,
             "tensor_amax": amax, "tensor_scale_s_enc": s_enc, "dequantized": float(y[r, 16 * j + k]),
             "is_block_amax": int(k == k_amax)} for k in range(16)]
    plotting.write_csv(out / "fig1.csv", list(rows[0]), rows)
    f, ax = plt.subplots(figsize=(10, 4.2))
    ks = np.arange(16)
    ax.bar(ks - 0.2, x, 0.4, color="0.6", label="float32 weight")
    ax.bar(ks + 0.2, y[r, :16], 0.4, color="tab:green", label="NVFP4 decoded")
    ax.bar([k_amax - 0.2], [x[k_amax]], 0.4, color="none", edgecolor="tab:red", lw=2, label="block amax")
    top = float(np.abs(x).max()) * 1.25
    for k in ks:
        ax.text(k, top * (1 if x[k] >= 0 else -1) * 0.92, f"{codes[k]:X}\n{e2m1[k]:g}", ha="center", va="center",
                fontsize=7, family="monospace")
    ax.set_ylim(-top, top)
    ax.axhline(0, color="k", lw=0.6)
    ax.set(xlabel="element of the 16-element block (row 0, columns 0-15)", ylabel="value",
           title=f"NVFP4 block of {name.split('.', 1)[0]} (labels: E2M1 code, value); E4M3 scale 0x{sbyte:02X} = "
                 f"{sval:g}; FP32 tensor scale 2688/amax = {s_enc:.6g} (amax {amax:.4g})")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    f.tight_layout()
    f.savefig(out / "fig1.png", dpi=130)
    plt.close(f)
    summary = {"tensor": name, "scale_byte": sbyte, "scale_e4m3": sval, "tensor_amax": amax,
               "tensor_scale_s_enc": s_enc, "block_amax_element": k_amax,
               "block_amax": float(x[k_amax]), "block_amax_decoded": float(y[r, k_amax])}
    plotting.write_json(out / "fig1.json", summary)
    return summary


def fp8_accumulation(out: Path, quick: bool = False) -> dict:
    """DeepSeek-V3's FP8 accumulation claim (paper_repro/fp8_accumulation.py)."""
    from . import fp8_accumulation as fa
    return fa.make(out, quick)


def appb4(out: Path, quick: bool = False) -> dict:
    """MXFP4's lost binade. A 32-element block (real activation values rescaled so the amax is exactly 3.01):
    MXFP4's power-of-two scale puts amax/scale in (3, 6], so 3.01 decodes to 3 (and the codes for 4 and 6 go
    unused), while NVFP4's E4M3 scale maps the amax to 6 and keeps ~3.01. Then the share of each E2M1 magnitude
    on a real activation tensor under NVFP4 and MXFP4."""
    import fp4sim as fs
    plt = plotting.pyplot()
    act_name = "smollm2.blk0.ffn_down.input"
    A = _sample(act_name)
    blk = A[0, :32].astype(np.float64)
    blk = (blk / np.abs(blk).max() * 3.01).astype(np.float32)
    k = int(np.argmax(np.abs(blk)))
    blk[k] = np.float32(3.01) * np.sign(blk[k])
    res = {}
    rows = []
    for lab, kw in (("nvfp4", dict(scheme="nvfp4")), ("mxfp4_rceil", dict(scheme="mxfp4", scale_mode="rceil")),
                    ("mxfp4_floor", dict(scheme="mxfp4", scale_mode="floor"))):
        q = fs.quantize(blk[None, :], **kw)
        d = fs.dequantize(q)[0]
        res[lab] = {"amax_decoded": float(abs(d[k])), "scales": [int(s) for s in np.asarray(q.scales).reshape(-1)],
                    "max_code": int(fs.layout.unpack_fp4(q.codes)[0].max() & 7)}
        for i in range(32):
            rows.append({"figure": "appB4", "part": "block", "scheme": lab, "element": i, "x": float(blk[i]),
                         "dequantized": float(d[i]), "magnitude_code": "", "share": ""})
    hist = {}
    for lab, kw in (("nvfp4", dict(scheme="nvfp4")), ("mxfp4_rceil", dict(scheme="mxfp4", scale_mode="rceil")),
                    ("mxfp4_floor", dict(scheme="mxfp4", scale_mode="floor"))):
        c = fs.layout.unpack_fp4(fs.quantize(A, **kw).codes) & 7
        h = np.bincount(c.reshape(-1), minlength=8) / c.size
        hist[lab] = [float(v) for v in h]
        for code in range(8):
            rows.append({"figure": "appB4", "part": "histogram", "scheme": lab, "element": "", "x": "",
                         "dequantized": "", "magnitude_code": code, "share": float(h[code])})
    plotting.write_csv(out / "appB4.csv", list(rows[0]), rows)
    f, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = np.arange(32)
    a0.plot(xs, blk, "o", color="0.5", ms=4, label="input (amax 3.01)")
    for lab, mk, col in (("nvfp4", "x", "tab:green"), ("mxfp4_rceil", "+", "tab:red")):
        d = [r["dequantized"] for r in rows if r["scheme"] == lab and r["part"] == "block"]
        a0.plot(xs, d, mk, color=col, ms=7, label=f"{lab}: amax decodes to {res[lab]['amax_decoded']:.4g}")
    a0.set(xlabel="element", ylabel="value", title="one 32-element block whose amax is 3.01")
    a0.legend(fontsize=8)
    w = 0.27
    vals = fs.E2M1.values[:8]
    for i, (lab, col) in enumerate((("nvfp4", "tab:green"), ("mxfp4_rceil", "tab:red"),
                                    ("mxfp4_floor", "tab:orange"))):
        a1.bar(np.arange(8) + (i - 1) * w, hist[lab], w, color=col, label=lab)
    a1.set_xticks(np.arange(8), [f"{v:g}" for v in vals])
    a1.set_yscale("log")
    a1.set(xlabel="|E2M1 value| of the code", ylabel="share of elements",
           title=f"code usage on a real activation ({act_name})")
    a1.title.set_fontsize(9)
    a1.legend(fontsize=8)
    for a in (a0, a1):
        a.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(out / "appB4.png", dpi=130)
    plt.close(f)
    summary = {"block": res, "histogram": hist, "tensor": act_name}
    plotting.write_json(out / "appB4.json", summary)
    return summary


@dataclass(frozen=True)
class Figure:
    """A figure of ``python -m paper_repro``. ``route``: "none" (made from tensors, no training), "runs" (its runs
    come from :func:`runs_for` and the shared training-figure / ablation code) or "own" (trains through its own
    module: scaling, gpt_snr, accumulation, fp8_hopper, the teacher figures)."""
    name: str
    what: str
    route: str

    @property
    def trains(self) -> bool:
        """Whether making the figure trains models (by either route)."""
        return self.route != "none"

    @property
    def generic(self) -> bool:
        """Whether its runs come from :func:`runs_for` (and it redraws with ``replot``)."""
        return self.route == "runs"


FIGURES = {
    "fig1": Figure("fig1", "an NVFP4 block with its E2M1 codes, E4M3 block scale and FP32 tensor scale", "none"),
    "appB4": Figure("appB4", "MXFP4's lost binade (amax 3.01 decodes to 3) and code usage on a real tensor", "none"),
    "fig2": Figure("fig2", "validation loss: NVFP4 (paper recipe) vs BF16 and FP8 blockwise, relative difference", "runs"),
    "fig6a": Figure("fig6a", "relative difference from BF16: NVFP4 vs MXFP4 (RHT d=32), same BF16 layers", "runs"),
    "fig6b": Figure("fig6b", "MXFP4 on 0.4x-1.5x of NVFP4's tokens (--short: 1.0x-1.5x): the multiplier that matches NVFP4's loss", "runs"),
    "fig4": Figure("fig4", "ablation: the full recipe branched at 34% into no SR / no RHT / no 2D / no BF16 blocks", "runs"),
    "fig7": Figure("fig7", "ablation: switching forward / backward / both to BF16 at 82% (and both at 99%)", "runs"),
    "fig8": Figure("fig8", "ablation: the recipe built up one part at a time, in two orders", "runs"),
    "fig10": Figure("fig10", "ablation: SR on gradients / all backward operands / activations / weights", "runs"),
    "fig11": Figure("fig11", "ablation: RHT on Wgrad / also Fprop / also Dgrad / none", "runs"),
    "fig12": Figure("fig12", "ablation: RHT size d in {2, 4, 16, 128}, branched from d=16 at 34%", "runs"),
    "fig9": Figure("fig9", "ablation: which blocks stay BF16, with each layer's Wgrad GEMM error logged", "runs"),
    "fig14": Figure("fig14", "ablation: NVFP4 on weights only (16x16, 1x16 two ways) or activations only", "runs"),
    "fig13": Figure("fig13", "ablation: RHT sign vectors: TE's, one from the seed, one per transform, none", "runs"),
    "scaling": Figure("scaling", "the FP4 gap to BF16 against tokens per parameter (D/N 0.5-50), WSD cooldowns "
                      "branched from one trunk per format and seed", "own"),
    "gpt_snr": Figure("gpt_snr", "per-layer weight-gradient SNR through the D/N 10 runs (BF16, NVFP4, MXFP4) "
                      "against sqrt(3), beside the excess loss over BF16", "own"),
    "accumulation": Figure("accumulation", "the final loss of NVFP4 D/N 10 runs under each GEMM accumulation model "
                           "(exact, exact_sum, k64_rtz, fast), paired by seed, against NVFP4's gap to BF16", "own"),
    "fp8_hopper": Figure("fp8_hopper", "the scaling sweep's FP8 blockwise runs at D/N 20 and 50 with Hopper's "
                         "tensor-core accumulation against the exact rule, paired by seed", "own"),
    "fp8_accumulation": Figure("fp8_accumulation", "DeepSeek-V3's FP8 accumulation claim on the Hopper tensor-core "
                                "model: relative error against K, fast accumulation vs promotion every 128",
                                "none"),
    "teacher_formats": Figure("teacher_formats", "teacher-student regression (precision-limited): BF16, FP8, "
                              "MXFP8, MXFP4, NVFP4, NVFP4 + 4over6, paired by seed; gradient SNR", "own"),
    "teacher_recipe": Figure("teacher_recipe", "teacher-student regression: the NVFP4 recipe's parts (SR, RHT, 2D "
                             "weights, BF16 last layer, late switch, ...), paired by seed", "own"),
    "teacher_depth": Figure("teacher_depth", "residual teacher-student regression (4 blocks): BF16 last block vs "
                            "first block, MXFP4, MXFP8 (loss spikes), per-layer gradient SNR, paired by seed", "own"),
    "teacher_variants": Figure("teacher_variants", "teacher-student regression: delayed amax, midpoint SR, per-layer "
                               "RHT signs, backward_override, per-token NVFP4 against the full recipe", "own"),
}
TEACHER = ("teacher_formats", "teacher_recipe", "teacher_depth", "teacher_variants")
PART1 = ("fig1", "appB4", "fig2", "fig6a", "fig6b")


def check_outputs(fig: str, out: Path, quick: bool, seeds: int, nproc: int = 1):
    """Raise if a figure's files are missing or inconsistent (the --quick self-check)."""
    out = Path(out)
    for ext in ("png", "csv", "json"):
        p = out / f"{fig}.{ext}"
        if not p.is_file() or p.stat().st_size == 0:
            raise RuntimeError(f"{fig}: {p} was not written")
    with open(out / f"{fig}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise RuntimeError(f"{fig}: {fig}.csv has no rows")
    if FIGURES[fig].generic:
        from .train import diverged
        runs = [(lab, x, replace(c, nproc=nproc)) for lab, x, c in runs_for(fig, quick, seeds)]
        want = sum(len(c.eval_steps()) for _, _, c in runs if not diverged(out / "runs" / c.key()))
        if sum(1 for r in rows if r["val_loss"] != "nan") != want:
            raise RuntimeError(f"{fig}: {len(rows)} rows in {fig}.csv, expected {want}")
        bad = [r for r in rows if not math.isfinite(float(r["val_loss"])) and r["val_loss"] != "nan"]
        if bad:
            raise RuntimeError(f"{fig}: non-finite validation loss in {len(bad)} rows")
