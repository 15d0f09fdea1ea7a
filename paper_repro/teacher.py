"""A precision-limited bench: students trained by regression on a random teacher network, where a format or a
part of the recipe can show beyond seed noise at CPU cost.

Why a teacher: the language-model runs of this repro are optimisation-limited (about 0.5 tokens per parameter), so
a precision effect cannot show there. A teacher the student can represent makes the task realizable: a float32
student can reach it, and a training set with far more targets than the student has weights leaves no room to
overfit, so what keeps a student's held-out error above zero is its optimiser's budget and the arithmetic it
trains in. The design below was sized from the BF16 student alone (its held-out MSE at the end of the budget,
without a quantized run being compared); see paper_repro/README.md for the calibration.

The task (``TASKS["mlp"]``): x in R^256 -> 256 (ReLU) -> 64, no biases, 81,920 weights; the teacher has the same
form with 64 hidden units. Inputs: standard normal, except 8 of the 256 channels (fixed) that are Student-t with 3
degrees of freedom times 8 (heavy-tailed outlier channels, what the RHT is for). Teacher weights
N(0, gain^2 / fan_in) (gain sqrt(2) before the ReLU), its output scaled to unit variance on the training inputs;
32,768 training and 4,096 held-out inputs. The task is the same for every run; a run's seed sets the student's
initial weights (drawn as the teacher's, from another key), its batch order and its stochastic-rounding key, so
runs of one seed are paired. Loss: mean squared error over the 64 outputs; the figures report the final held-out
MSE. Optimiser: AdamW (betas 0.9 / 0.95, no weight decay), learning rate 3e-3, batch 128, 1,000 steps,
warmup-stable-decay schedule (10 warmup steps, linear decay to zero over the last 20%). Every linear layer is
quantized (the output layer too) unless a variant keeps it.

The residual task (``TASKS["resmlp"]``, the teacher_depth figure, for the claims about depth): x in R^256 -> inp
(256 -> 128) -> 4 residual blocks x + down(relu(up(x))) / sqrt(4) (up 128 -> 256, down 256 -> 128) -> proj
(128 -> 64), no biases, no normalisation, 303,104 weights; the teacher has the same form with 32 hidden units per
block. Same inputs, data sizes and targets' scaling as above. Batch 512, 2,000 steps, otherwise the same
optimiser and schedule. Its BF16 student ends near 0.005 (0.002 after 4,000 steps): the task is harder for the
optimiser than the two-layer one, so the step budget was chosen from the BF16 calibration and the compute (see
paper_repro/README.md), before any quantized run of it was compared.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

D_IN, N_OUTLIER, OUTLIER_SCALE, OUTLIER_DOF = 256, 8, 8.0, 3


@dataclass(frozen=True)
class Task:
    kind: str = "mlp"
    n_train: int = 32768
    n_val: int = 4096
    width: int = 256                # the student's hidden width
    teacher_width: int | None = None  # the teacher's hidden width (None: the student's)
    d_out: int = 64
    seed: int = 12345               # the task's own key: teacher, data
    blocks: int = 0                 # resmlp: residual blocks
    d_model: int = 128              # resmlp: the residual stream's width


TASKS = {"mlp": Task("mlp", width=256, teacher_width=64),
         "resmlp": Task("resmlp", width=256, teacher_width=32, blocks=4, d_model=128)}


def _linear(d_in, d_out, gain, gen):
    lin = torch.nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=gen) * (gain / math.sqrt(d_in)))
    return lin


class MLP(torch.nn.Module):
    """x -> down(relu(up(x)))."""

    def __init__(self, task: Task, gen, width=None):
        super().__init__()
        width = width or task.width
        self.up = _linear(D_IN, width, math.sqrt(2.0), gen)
        self.down = _linear(width, task.d_out, 1.0, gen)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ResBlock(torch.nn.Module):
    """x + down(relu(up(x))) / sqrt(blocks): with the branch scaled, the stream's variance at initialisation grows
    by about (1 + 1 / blocks)^blocks (below e) over the whole stack rather than 2^blocks."""

    def __init__(self, d, width, blocks, gen):
        super().__init__()
        self.up = _linear(d, width, math.sqrt(2.0), gen)
        self.down = _linear(width, d, 1.0, gen)
        self.scale = 1.0 / math.sqrt(blocks)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.scale


class ResMLP(torch.nn.Module):
    """x -> proj(blocks(inp(x))): a D_IN -> d_model input layer, ``blocks`` residual blocks (named blocks.N.up /
    blocks.N.down, so a recipe's keep_first / keep_last and globs such as ``blocks.3.*`` find them), a d_model ->
    d_out output layer."""

    def __init__(self, task: Task, gen, width=None):
        super().__init__()
        width = width or task.width
        self.inp = _linear(D_IN, task.d_model, 1.0, gen)
        self.blocks = torch.nn.ModuleList(ResBlock(task.d_model, width, task.blocks, gen) for _ in range(task.blocks))
        self.proj = _linear(task.d_model, task.d_out, 1.0, gen)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.proj(x)


def build(task: Task, seed: int, teacher: bool = False) -> torch.nn.Module:
    """The task's student network, or its teacher (``teacher_width`` inside), with weights from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tw = task.teacher_width if teacher else None
    if task.kind == "mlp":
        return MLP(task, gen, tw)
    if task.kind == "resmlp":
        return ResMLP(task, gen, tw)
    raise ValueError(f"task kind {task.kind!r}: use 'mlp' or 'resmlp'")


def inputs(n: int, gen):
    """n inputs: standard normal with the first N_OUTLIER channels heavy-tailed (Student-t, 3 dof, times 8)."""
    x = torch.randn(n, D_IN, generator=gen)
    z = torch.randn(n, N_OUTLIER, OUTLIER_DOF, generator=gen).pow(2).sum(-1)
    x[:, :N_OUTLIER] = torch.randn(n, N_OUTLIER, generator=gen) / torch.sqrt(z / OUTLIER_DOF) * OUTLIER_SCALE
    return x


_DATA = {}


def data(task: Task):
    """(x_train, y_train, x_val, y_val) of a task (cached per process): the teacher's outputs, unit variance."""
    if task in _DATA:
        return _DATA[task]
    gen = torch.Generator().manual_seed(task.seed)
    teacher = build(task, task.seed + 1, teacher=True)
    xt, xv = inputs(task.n_train, gen), inputs(task.n_val, gen)
    with torch.no_grad():
        yt, yv = teacher(xt), teacher(xv)
        s = yt.std()
    _DATA[task] = (xt, yt / s, xv, yv / s)
    return _DATA[task]


@dataclass(frozen=True)
class Run:
    """One student run. preset / switches: a fp4sim Recipe preset and its switches (``"fp32"``: plain float32);
    keep_last / keep: blocks / layer-name globs kept in BF16; quantize_head: the output layer quantized too; late: (at,
    which) switch to BF16 at a fraction of the run, ``which`` = forward / backward / both; operands: (operand,
    scheme, block, rounding) overrides (weights-only / activations-only)."""
    task: str = "mlp"
    preset: str = "bf16"
    switches: tuple = ()
    keep_last: int = 0
    keep: tuple = ()
    quantize_head: bool = True
    late: tuple = ()
    operands: tuple = ()
    seed: int = 0
    steps: int = 500
    batch: int = 128
    lr: float = 3e-3
    eval_points: int = 10
    fidelity: bool = True

    def key(self) -> str:
        h = hashlib.sha1(json.dumps(asdict(self), sort_keys=True, default=list).encode()).hexdigest()[:10]
        return f"{self.task}-{self.preset}-s{self.seed}-{h}"

    def recipe(self, preset=None):
        from fp4sim.training import Operand, Recipe
        p = preset or self.preset
        if p == "fp32":
            return "none"
        ops = {op: Operand(sch, blk, rnd) for op, sch, blk, rnd in self.operands} if preset is None else {}
        sw = dict(self.switches) if preset is None else {}
        return Recipe.preset(p, keep_last=self.keep_last, keep=tuple(self.keep), seed=self.seed, accumulate="fast",
                             **sw, **ops)

    def eval_steps(self):
        return sorted({max(1, round(self.steps * (i + 1) / self.eval_points)) for i in range(self.eval_points)})


def build_student(run: Run):
    from fp4sim.torch import convert
    task = TASKS[run.task]
    model = build(task, 1_000_003 * (run.seed + 1))
    return convert(model, run.recipe(), quantize_head=run.quantize_head)


JUMP_WINDOW = 100     # steps: a value is compared with the median of the JUMP_WINDOW steps before it
SPIKE = 3.0           # a loss spike: a jump above SPIKE x that median


def max_jump(series, window: int = JUMP_WINDOW) -> dict:
    """{"ratio", "step"}: the largest ratio of a positive series' value (a training loss, or a run's training loss
    over the reference's on the same batch) to the median of the ``window`` values before it, and its (1-based)
    step, the first where it is reached; None for both in a series no longer than the window. A value that is not
    finite ends the scan (the run diverged there)."""
    best = {"ratio": None, "step": None}
    for i in range(window, len(series)):
        if not math.isfinite(series[i]):
            break
        r = series[i] / float(np.median(series[i - window:i]))
        if best["ratio"] is None or r > best["ratio"]:
            best = {"ratio": r, "step": i + 1}
    return best


def train(run: Run, cache: Path | None = None) -> dict:
    """Train one student; returns {"rows": [{step, train_mse, val_mse, snr_median, snr_min, snr_layers}] at the
    evaluations, "diverged", "train_loss": every step's training loss (6 significant digits; the runs of one seed
    see the same batches, so their ratio shows a spike of one run that the batch alone does not explain)}. With a
    cache folder the result is stored there as KEY.json and read back instead of training again."""
    if cache is not None:
        p = Path(cache) / f"{run.key()}.json"
        if p.is_file():
            got = json.loads(p.read_text())
            if got.get("run") == json.loads(json.dumps(asdict(run), default=list)):
                return got
    from fp4sim.torch import gradient_fidelity, set_recipe
    from .train import wsd_lr
    task = TASKS[run.task]
    xt, yt, xv, yv = data(task)
    model = build_student(run)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(run.seed)
    probe = torch.randint(0, task.n_train, (run.batch,), generator=torch.Generator().manual_seed(7))
    evals, rows = set(run.eval_steps()), []
    late_step = None
    if run.late:
        at, which = run.late
        late_step = min(max(int(round(at * run.steps)), 1), run.steps - 1)
    diverged = None
    losses = []
    for step in range(run.steps):
        if step == late_step:
            set_recipe(model, run.recipe("bf16"), which=run.late[1])
        for g in opt.param_groups:
            g["lr"] = wsd_lr(step, run.steps, run.lr, 10, 0.2)
        idx = torch.randint(0, task.n_train, (run.batch,), generator=gen)
        loss = torch.nn.functional.mse_loss(model(xt[idx]), yt[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        lv = float(loss.detach())
        if not math.isfinite(lv):
            diverged = f"training loss {lv} at step {step + 1}"
        losses.append(lv)
        if step + 1 in evals or diverged:
            row = {"step": step + 1, "train_mse": lv}
            with torch.no_grad():
                row["val_mse"] = float(torch.nn.functional.mse_loss(model(xv), yv))
            if run.fidelity and not diverged:
                ds = gradient_fidelity(model, lambda: torch.nn.functional.mse_loss(model(xt[probe]),
                                                                                    yt[probe]).backward())
                q = [float(v) for n, v in zip(ds.layer.values, ds.snr.values)
                     if not getattr(model.get_submodule(str(n)), "_fp4sim_kept", False)]
                row["snr_median"] = float(np.median(q)) if q else math.inf
                row["snr_min"] = float(min(q)) if q else math.inf
                got = {str(n): float(v) for n, v in zip(ds.layer.values, ds.snr.values)}
                row["snr_layers"] = {n: got[n] for n, _ in model.named_modules() if n in got}  # input to output
            rows.append(row)
        if diverged:
            break
    out = {"run": json.loads(json.dumps(asdict(run), default=list)), "rows": rows, "diverged": diverged,
           "train_loss": [float(f"{v:.6g}") for v in losses]}
    if cache is not None:
        Path(cache).mkdir(parents=True, exist_ok=True)
        tmp = Path(cache) / f"{run.key()}.json.tmp"
        tmp.write_text(json.dumps(out))
        os.replace(tmp, Path(cache) / f"{run.key()}.json")
    return out


# ------------------------------------------------------------------------------------------------ the figures
@dataclass(frozen=True)
class Variant:
    label: str
    run: dict              # Run fields over the figure's base run
    paper: str             # the paper's (or the method's) claim about it
    expect: str            # "reference", "worse", "better" or "same" (stats.verdict's rule)
    vs: str | None = None  # compared with this variant instead of the reference


_W16 = (("fprop_w", "nvfp4", (16, 16), "rne"), ("dgrad_w", "nvfp4", (16, 16), "rne"))
_A1 = (("fprop_x", "nvfp4", (1, 16), "rne"), ("wgrad_x", "nvfp4", (1, 16), "rne"))

FIGS = {
    "teacher_formats": ("Teacher-student regression: each format's held-out MSE, paired by seed with BF16", [
        Variant("BF16", {"preset": "bf16"}, "reference", "reference"),
        Variant("FP8 blockwise", {"preset": "fp8_blockwise"}, "FP8 trains as BF16 does", "same"),
        Variant("MXFP8", {"preset": "mxfp8"}, "FP8 trains as BF16 does", "same"),
        Variant("NVFP4 (paper recipe)", {"preset": "nvfp4_paper"}, "NVFP4 ends a little above BF16", "worse"),
        Variant("MXFP4 (paper recipe, RHT d=32)", {"preset": "mxfp4_paper"}, "MXFP4 ends further from BF16 than NVFP4",
                "worse", vs="NVFP4 (paper recipe)"),
        Variant("NVFP4 + 4over6 (MSE)", {"preset": "nvfp4_paper", "switches": (("four_over_six", "mse"),)},
                "4over6 block scales lower NVFP4's error", "better", vs="NVFP4 (paper recipe)"),
    ]),
    "teacher_recipe": ("Teacher-student regression: the NVFP4 recipe's parts, paired by seed with the full recipe", [
        Variant("full recipe", {"preset": "nvfp4_paper"}, "reference", "reference"),
        Variant("no SR", {"switches": (("disable_stochastic_rounding", True),)}, "higher loss without SR on gradients",
                "worse"),
        Variant("no RHT", {"switches": (("disable_rht", True),)}, "higher loss without RHT on Wgrad", "worse"),
        Variant("no 2D weights", {"switches": (("disable_2d_quantization", True),)}, "higher loss with 1x16 weights",
                "worse"),
        Variant("BF16 last layer", {"keep": ("down",)}, "lower loss with the last layer in BF16", "better"),
        Variant("SR on activations", {"switches": (("sr_activations", True),)},
                "SR on forward activations raises the loss", "worse"),
        Variant("RHT also on Fprop and Dgrad", {"switches": (("rht_fprop", True), ("rht_dgrad", True))},
                "no benefit from RHT on Fprop / Dgrad", "same"),
        Variant("RHT d=4", {"switches": (("rht_size", 4), ("rht_signs", "fixed"))}, "a 4-point RHT is too small",
                "worse"),
        Variant("RHT d=128", {"switches": (("rht_size", 128), ("rht_signs", "fixed"))},
                "no gain from d beyond 16", "same"),
        Variant("BF16 forward from 80%", {"late": (0.8, "forward")}, "switching Fprop to BF16 late recovers loss",
                "better"),
        Variant("BF16 backward from 80%", {"late": (0.8, "backward")}, "switching only the backward helps little",
                "same"),
        Variant("BF16 both from 80%", {"late": (0.8, "both")}, "switching to BF16 late recovers loss", "better"),
        Variant("NVFP4 weights only", {"preset": "bf16", "operands": _W16}, "weights alone in NVFP4 cost less",
                "better"),
        Variant("NVFP4 activations only", {"preset": "bf16", "operands": _A1},
                "activations alone in NVFP4 cost less", "better"),
    ]),
    "teacher_depth": ("Residual teacher-student regression: which blocks need BF16, and the MX formats, on a "
                      "4-block student", [
        Variant("BF16", {"preset": "bf16"}, "reference", "reference"),
        Variant("NVFP4 (paper recipe)", {"preset": "nvfp4_paper"}, "NVFP4 ends a little above BF16", "worse"),
        Variant("NVFP4 + BF16 last block", {"preset": "nvfp4_paper", "keep_last": 1},
                "keeping the last blocks in BF16 lowers the loss", "better", vs="NVFP4 (paper recipe)"),
        Variant("NVFP4 + BF16 first block", {"preset": "nvfp4_paper", "keep": ("blocks.0.*",)},
                "the paper keeps mostly the last blocks: the first block in BF16 helps less than the last",
                "worse", vs="NVFP4 + BF16 last block"),
        Variant("MXFP4 (paper recipe, RHT d=32)", {"preset": "mxfp4_paper"}, "MXFP4 ends further from BF16 than NVFP4",
                "worse", vs="NVFP4 (paper recipe)"),
        Variant("MXFP8", {"preset": "mxfp8"},
                "FP8 trains as BF16 does (deep MX proxies report sharp instabilities: see the loss spikes)", "same"),
    ]),
}
FIGS["teacher_variants"] = (
    "Teacher-student regression: the recipe variants the field moved to, paired by seed with the full NVFP4 recipe", [
        Variant("full recipe", {"preset": "nvfp4_paper"}, "reference", "reference"),
        Variant("delayed amax D=50", {"switches": (("delayed_amax", 50),)},
                "a tensor amax held for 50 steps costs nothing (Hu, Luschi, Balanca's UE5M3 recipe)", "same"),
        Variant("midpoint SR", {"switches": (("rbits_mapping", "midpoint"),)},
                "the 8-bit midpoint SR rule (unbiased at the lattice midpoints) trains as TE's", "same"),
        Variant("per-layer RHT signs", {"switches": (("rht_signs", "per_layer"),)},
                "a sign vector per layer (torchao) trains as TE's one fixed vector", "same"),
        Variant("backward high precision", {"switches": (("backward_override", "high_precision"),)},
                "Dgrad and Wgrad on the original operands in BF16 (TE's backward_override) lower the loss", "better"),
        Variant("backward dequantized", {"switches": (("backward_override", "dequantized"),)},
                "Dgrad and Wgrad on the dequantized forward operands in BF16 (gradients of the quantized forward) "
                "lower the loss", "better"),
        Variant("per-token NVFP4", {"switches": (("per_token", True),)},
                "a per-token outer scale improves accuracy (TE's NVFP4PerTokenBlockScaling)", "better"),
        Variant("UE5M3 block scales", {"switches": (("scale_format", "ue5m3"),)},
                "UE5M3 block scales end closer to BF16 than E4M3's (8B runs: -1.93% vs -2.09% NLL, one seed)",
                "better"),
        Variant("UE5M3, no tensor scale", {"switches": (("scale_format", "ue5m3"), ("per_tensor_scale", False))},
                "UE5M3's range makes the FP32 tensor scale unnecessary", "same", vs="UE5M3 block scales"),
        Variant("UE5M3 + delayed amax D=50", {"switches": (("scale_format", "ue5m3"), ("delayed_amax", 50))},
                "with UE5M3's range a tensor amax held for 50 steps costs nothing (their recipe)", "same",
                vs="UE5M3 block scales"),
    ])
FULL_SEEDS, QUICK_SEEDS = 10, 2
BASE = {"teacher_formats": Run(task="mlp", steps=1000), "teacher_recipe": Run(task="mlp", preset="nvfp4_paper",
                                                                           steps=1000),
        "teacher_depth": Run(task="resmlp", steps=2000, batch=512),
        "teacher_variants": Run(task="mlp", preset="nvfp4_paper", steps=1000)}
QUICK = {"steps": 40, "eval_points": 4}


def runs_for(fig: str, quick: bool, seeds: int):
    """[(variant label, Run)] of a figure."""
    title, variants = FIGS[fig]
    base = replace(BASE[fig], **(QUICK if quick else {}))
    out = []
    for s in range(seeds):
        for v in variants:
            out.append((v.label, replace(base, seed=s, **v.run)))
    return out


def make(fig: str, out: Path, quick: bool = False, seeds: int | None = None, quiet: bool = True) -> dict:
    """Train (or read back from DIR/runs/teacher/) every run of a teacher figure and write FIG.png / .csv / .json."""
    from tqdm import tqdm
    from . import plotting
    from . import stats
    from .ablations import paired_verdict
    out = Path(out)
    seeds = seeds or (QUICK_SEEDS if quick else FULL_SEEDS)
    title, variants = FIGS[fig]
    runs = runs_for(fig, quick, seeds)
    cache = out / "runs" / "teacher"
    res = {}
    for lab, r in tqdm(runs, desc=fig, disable=quiet, file=__import__("sys").stderr):
        res[(lab, r.seed)] = train(r, cache)
    rows = []
    for lab, r in runs:
        for row in res[(lab, r.seed)]["rows"]:
            rows.append({"figure": fig, "variant": lab, "seed": r.seed, **{k: row.get(k) for k in
                                                                          ("step", "train_mse", "val_mse",
                                                                           "snr_median", "snr_min")}})
    plotting.write_csv(out / f"{fig}.csv", CSV_COLUMNS, rows)
    ss = list(range(seeds))
    final = {}
    for lab, r in runs:
        got = res[(lab, r.seed)]
        final.setdefault(lab, {})[r.seed] = (got["rows"][-1]["val_mse"], bool(got["diverged"]))
    ref = next(v.label for v in variants if v.expect == "reference")
    summary = {"title": title, "seeds": seeds, "reference": ref, "metric": "final held-out MSE",
               "task": asdict(TASKS[BASE[fig].task]), "base_run": asdict(replace(BASE[fig], **(QUICK if quick else {}))),
               "variants": {}}
    for v in variants:
        ratio = [final[v.label][s][0] / final[ref][s][0] for s in ss]
        summary["variants"][v.label] = {**paired_verdict(v, final, ss, ref, "val_mse"),
                                        "mse_ratio_to_reference_mean": float(np.mean(ratio))}
    if fig in ("teacher_recipe", "teacher_variants"):   # effects in units of the full recipe's gap to BF16, if known
        fmt = out / "teacher_formats.json"
        if fmt.is_file():
            g = json.loads(fmt.read_text())["variants"].get("NVFP4 (paper recipe)", {}).get("effect")
            if g:
                summary["format_gap"] = g
                for v in summary["variants"].values():
                    if "effect" in v:
                        v["effect_over_format_gap"] = v["effect"] / g
    if fig == "teacher_depth":             # the kept-block runs against NVFP4 too, in units of its gap to BF16
        nv = "NVFP4 (paper recipe)"
        g = summary["variants"][nv].get("effect")
        summary["format_gap"] = g
        summary["vs_nvfp4"] = {}
        for v in variants:
            if v.run.get("preset") == "nvfp4_paper" and v.label != nv:
                _, info = stats.verdict("same", [final[v.label][s][0] - final[nv][s][0] for s in ss],
                                        [final[v.label][s][1] or final[nv][s][1] for s in ss])
                summary["vs_nvfp4"][v.label] = {**info, "effect_over_format_gap": info["effect"] / g
                                                if g and "effect" in info else None}
    by_seed = lambda lab: {s: res[(lab, s)]["rows"] for s in ss}  # noqa: E731
    summary["instability"] = {v.label: _instability([res[(v.label, s)] for s in ss], [res[(ref, s)] for s in ss])
                              for v in variants}
    summary["final_snr_by_layer"] = {v.label: _final_snr_by_layer([res[(v.label, s)]["rows"] for s in ss])
                                     for v in variants}
    if fig in ("teacher_formats", "teacher_depth"):
        summary["snr_claim"] = {v.label: stats.snr_claim(by_seed(v.label), by_seed(ref), ss)
                                for v in variants if v.expect != "reference"}
    _plot(fig, runs, res, summary, out, ss)
    plotting.write_json(out / f"{fig}.json", summary)
    return summary


def _instability(results, ref_results) -> dict:
    """Over a variant's runs (paired by seed with the reference's): how many diverged; each run's largest jump of
    its training loss over the median of the JUMP_WINDOW steps before it (``max_loss_jump``: a batch of outliers
    makes every run of a seed jump at the same step, the reference too) and of its loss over the reference's on
    the same batch (``max_excess_jump``: what the batch alone does not explain); ``spiked``: runs whose excess jump
    is above SPIKE (None where the series are missing or no longer than the window)."""
    raw, excess = [], []
    for r, ref in zip(results, ref_results):
        q, b = r.get("train_loss"), ref.get("train_loss")
        raw.append(max_jump(q)["ratio"] if q else None)
        if q and b and r is not ref:
            n = min(len(q), len(b))
            excess.append(max_jump([x / y if y > 0 else math.nan for x, y in zip(q[:n], b[:n])])["ratio"])
        else:
            excess.append(None)
    return {"diverged": sum(bool(r["diverged"]) for r in results),
            "spiked": sum(j is not None and j > SPIKE for j in excess), "spike_threshold": SPIKE,
            "max_excess_jump": excess, "max_loss_jump": raw, "runs": len(results)}


def _final_snr_by_layer(rows_by_seed) -> list:
    """[[layer, geometric mean over seeds of its weight-gradient SNR at the last evaluation]], input to output
    (where logged)."""
    last = [rr[-1].get("snr_layers") for rr in rows_by_seed if rr and rr[-1].get("snr_layers")]
    if not last:
        return []
    return [[n, float(np.exp(np.mean(np.log([d[n] for d in last]))))] for n in last[0]]


CSV_COLUMNS = ("figure", "variant", "seed", "step", "train_mse", "val_mse", "snr_median", "snr_min")


def _plot(fig, runs, res, summary, out, seeds):
    from fp4sim.torch.stats import SNR_THRESHOLD
    from . import plotting
    plt = plotting.pyplot()
    title, variants = FIGS[fig]
    by_layer = fig == "teacher_depth"       # a fourth panel: each layer's gradient SNR at the end, through the depth
    wide = 1.4 if len(variants) > 8 else 1.0        # room for the effect panel's labels
    f, axes = plt.subplots(1, 4 if by_layer else 3, figsize=((22 if by_layer else 17) * wide, 4.8 * wide),
                           gridspec_kw=None if by_layer else {"width_ratios": [1, 1.3 if wide > 1 else 1, 1]})
    a0, a1, a2 = axes[:3]
    cmap = plt.get_cmap("tab20" if len(variants) > 10 else "tab10")
    for i, v in enumerate(variants):
        rows = [res[(v.label, s)]["rows"] for s in seeds]
        n = min(len(r) for r in rows)
        t = [r["step"] for r in rows[0][:n]]
        Y = np.array([[r["val_mse"] for r in rr[:n]] for rr in rows])
        a0.plot(t, np.exp(np.log(Y).mean(0)), color=cmap(i), lw=1.2, label=v.label)
        S = np.array([[r.get("snr_median", np.nan) for r in rr[:n]] for rr in rows], dtype=float)
        if np.isfinite(S).any():
            a2.plot(t, np.exp(np.nanmean(np.log(S), 0)), color=cmap(i), lw=1.2, label=v.label)
        if v.expect == "reference":
            a1.plot([i], [1.0], marker="D", ms=7, mfc="white", mec=cmap(i), mew=1.5, ls="none",
                    label="reference (1 by definition)")
        else:
            vs = v.vs or summary["reference"]
            ratio = np.array([res[(v.label, s)]["rows"][-1]["val_mse"] / res[(vs, s)]["rows"][-1]["val_mse"]
                              for s in seeds])
            lr = np.log(ratio)
            se = lr.std(ddof=1) / math.sqrt(len(lr)) if len(lr) > 1 else 0.0
            a1.errorbar([i], [math.exp(lr.mean())], yerr=[[math.exp(lr.mean()) - math.exp(lr.mean() - 2 * se)],
                                                          [math.exp(lr.mean() + 2 * se) - math.exp(lr.mean())]],
                        fmt="o", color=cmap(i), capsize=4)
    a0.set(xlabel="training step", ylabel="held-out MSE (geometric mean over seeds)", yscale="log")
    plotting.title(a0, f"{title}: held-out MSE over training, {len(seeds)} seeds")
    a0.legend(fontsize=7)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_yscale("log")
    a1.set_xticks(range(len(variants)), [v.label + (f"\n(vs {v.vs})" if v.vs else "") for v in variants],
                  rotation=30, ha="right", fontsize=7)
    a1.set(ylabel="final MSE / the compared run's (geo. mean ± 2 s.e.)")
    plotting.title(a1, "effect at the end of training, paired by seed (verdicts use the MSE differences)")
    a1.legend(fontsize=7)
    a2.axhline(SNR_THRESHOLD, color="k", ls="--", lw=1, label="sqrt(3) (Chmiel et al. 2025)")
    a2.set(xlabel="training step", ylabel="median weight-gradient SNR of the quantized layers", yscale="log")
    plotting.title(a2, "gradient fidelity: ||g_ref|| / ||g_q - g_ref|| on a fixed batch")
    a2.legend(fontsize=6)
    if by_layer:
        a3 = axes[3]
        for i, v in enumerate(variants):
            d = summary["final_snr_by_layer"].get(v.label, [])
            if d:
                a3.plot(range(len(d)), [x for _, x in d], marker="o", ms=3, color=cmap(i), lw=1.2, label=v.label)
                names = [n for n, _ in d]
        a3.axhline(SNR_THRESHOLD, color="k", ls="--", lw=1)
        a3.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        a3.set(ylabel="weight-gradient SNR at the end (geo. mean over seeds)", yscale="log")
        plotting.title(a3, "each layer's gradient fidelity, input to output")
        a3.legend(fontsize=6)
    for a in axes:
        a.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(out / f"{fig}.png", dpi=120)
    plt.close(f)
