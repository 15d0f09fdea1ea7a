"""Redraw a training figure from its own CSV, without the runs: ``python -m paper_repro replot FIG [--out DIR]``.

FIG.csv holds every logged evaluation of every run of the figure (run label, seed, step, tokens, learning rate,
training and validation loss, and the mean Wgrad error where it was logged); fig12's Wgrad errors at the branch
point are in fig12_wgrad_error.csv. From them the figure's numbers are computed again exactly as after training
(the CSV is written back with the same bytes, the JSON summary with the same values), so a change to how a figure
is drawn needs no retraining. A run whose last evaluation comes before its configured last step stopped early,
which the trainer does only when the run diverged; it is marked diverged, as its done.json said.
"""
from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path

from . import ablations, figures


def _num(v: str):
    return int(v) if v.lstrip("-").isdigit() else float(v)


def runs_from_csv(fig: str, out: Path, quick: bool = False):
    """(runs, logs, diverged) of a figure read back from DIR/FIG.csv: the figure's run configurations (for the
    seeds the CSV holds), each run's log rows keyed by its configuration's key, and {key: reason or None}."""
    path = Path(out) / f"{fig}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (make the figure first: python -m paper_repro {fig})")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or rows[0].get("figure") != fig:
        raise ValueError(f"{path}: not a {fig} CSV (its first row names figure {rows[0].get('figure') if rows else None!r})")
    seeds = sorted({int(r["seed"]) for r in rows})
    if seeds != list(range(len(seeds))):
        raise ValueError(f"{path}: seeds {seeds}; a figure's runs use seeds 0..n-1")
    # fig2 / fig6a / fig6b in full mode: at the sweep's scale, or the earlier short runs (--short), told apart
    # by the length of their runs
    short = not quick and fig in figures.SCALED and \
        max(int(r["tokens"]) for r in rows) <= figures._tok(figures.FULL, max(figures.MULTS))
    runs = figures.runs_for(fig, quick, len(seeds), short)
    by = {}
    for r in rows:
        d = {k: _num(r[k]) for k in ("step", "tokens", "lr", "train_loss", "val_loss")}
        if r.get("wgrad_rel_error_mean"):
            d["wgrad_error"] = {"mean": float(r["wgrad_rel_error_mean"])}
        by.setdefault((r["run"], int(r["seed"])), []).append(d)
    logs, diverged = {}, {}
    for lab, _, c in runs:
        got = by.get((lab, c.seed))
        if not got:
            raise ValueError(f"{path}: no rows of run {lab!r} seed {c.seed} (made with other settings? --quick "
                             "redraws a figure made with --quick)")
        logs[c.key()] = sorted(got, key=lambda d: d["step"])
        last = logs[c.key()][-1]["step"]
        diverged[c.key()] = None if last >= c.steps else f"stopped at step {last} of {c.steps} (from {path.name})"
    return runs, logs, diverged


def replot(fig: str, out: Path, quick: bool = False) -> dict:
    """Redraw DIR/FIG.png (and rewrite FIG.csv / FIG.json) from DIR/FIG.csv."""
    if fig not in figures.FIGURES or not figures.FIGURES[fig].generic:
        trained = [f for f, v in figures.FIGURES.items() if v.generic]
        raise ValueError(f"replot {fig!r}: only training figures are redrawn from their CSV ({', '.join(trained)})")
    out = Path(out)
    runs, logs, diverged = runs_from_csv(fig, out, quick)
    if fig not in ablations.ABLATIONS:
        return figures.make_training_figure(fig, runs, logs, out)
    at_branch = None
    if fig == "fig12":
        with open(out / "fig12_wgrad_error.csv", newline="") as f:
            at_branch = [{"seed": int(r["seed"]), "variant": r["variant"], "layer": r["layer"],
                          "rel_error": float(r["rel_error"])} for r in csv.DictReader(f)]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for k, why in diverged.items():
            d = Path(tmp) / k
            d.mkdir()
            (d / "done.json").write_text(json.dumps({"diverged": why}))
            dirs[k] = d
        return ablations.make(fig, runs, logs, out, dirs, wgrad_at_branch=at_branch)
