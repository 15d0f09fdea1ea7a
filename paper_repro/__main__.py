"""python -m paper_repro FIG [--quick] [--out DIR] [--seeds N] | list | all [--quick] | ablations [--quick] | table
| replot [FIG ...]

``table`` prints the verdicts of the ablation figures already made in DIR as a Markdown table; ``replot`` redraws
training figures from their CSVs in DIR without their runs.

Regenerates a figure of the NVFP4 paper at small scale: trains the tiny GPTs it needs (resuming any that were
interrupted, reusing any already finished under DIR/runs/) and writes DIR/FIG.png, DIR/FIG.csv and DIR/FIG.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import ablations, figures
from .figures import FIGURES
from fp4sim._tool import say

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "figures"


def _runs(fig: str, quick: bool, seeds: int, short: bool, nproc: int) -> list:
    """The training runs of a generic figure, as data-parallel runs of ``nproc`` processes where ``nproc > 1``
    (other runs, with their own keys, trained by torchrun); ValueError for a configuration a run refuses."""
    runs = figures.runs_for(fig, quick, seeds, short)
    return [(lab, x, replace(c, nproc=nproc)) for lab, x, c in runs] if nproc > 1 else runs


def make(fig: str, quick: bool, out: Path, seeds: int | None, quiet: bool = False, threads: int | None = None,
         scheduler: str | None = None, short: bool = False, nproc: int = 1) -> dict:
    from .runner import run_all, set_threads
    given = seeds
    seeds = seeds or (figures.QUICK_SEEDS if quick else figures.FULL_SEEDS)
    t0 = time.perf_counter()
    runs = _runs(fig, quick, seeds, short, nproc) if FIGURES[fig].generic else None   # (a bad run: before the mkdir)
    out.mkdir(parents=True, exist_ok=True)
    if runs is not None:
        set_threads(threads)
        logs = run_all([c for _, _, c in runs], out, quiet=quiet)
        if fig in ablations.ABLATIONS:
            summary = ablations.make(fig, runs, logs, out, {c.key(): out / "runs" / c.key() for _, _, c in runs})
        else:
            summary = figures.make_training_figure(fig, runs, logs, out)
    elif fig == "scaling":
        from . import scaling
        set_threads(threads)
        summary = scaling.make(out, quick, given, quiet=quiet, scheduler=scheduler)
    elif fig == "gpt_snr":
        from . import gpt_snr
        set_threads(threads)
        summary = gpt_snr.make(out, quick, given, quiet=quiet)
    elif fig == "accumulation":
        from . import accumulation
        set_threads(threads)
        summary = accumulation.make(out, quick, given, quiet=quiet)
    elif fig == "fp8_hopper":
        from . import fp8_hopper
        set_threads(threads)
        summary = fp8_hopper.make(out, quick, given, quiet=quiet)
    elif fig in figures.TEACHER:
        from . import teacher
        set_threads(threads)
        summary = teacher.make(fig, out, quick, given, quiet=quiet)
    else:
        summary = getattr(figures, fig.lower())(out, quick)
    if quick:
        figures.check_outputs(fig, out, quick, seeds, nproc)
        from .plotting import mark_quick
        mark_quick(out / f"{fig}.png", out / f"{fig}.json")
    if not quiet:
        print(f"{fig}: wrote {out / (fig + '.png')}, {fig}.csv, {fig}.json in {time.perf_counter() - t0:.0f} s")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paper_repro", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fig", help=f"list, all (the part-1 figures: {', '.join(figures.PART1)}), ablations (the "
                                f"rest), table (their verdicts), replot (redraw from the CSVs), or one of "
                                f"{', '.join(FIGURES)}")
    ap.add_argument("--quick", action="store_true", help="a tiny model for a few steps (seconds): checks the pipeline")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: figures/)")
    ap.add_argument("--seeds", type=int, help=f"seeds per training curve (default {figures.FULL_SEEDS}; "
                                              f"--quick {figures.QUICK_SEEDS})")
    ap.add_argument("--threads", type=int, help="torch and Numba threads (default: all cores, at most 2)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--scheduler", help="scaling: address of an existing Dask scheduler; each (format, seed) runs "
                                        "there as one job, resuming from its checkpoints under --out/runs")
    ap.add_argument("--short", action="store_true",
                    help="fig2, fig6a, fig6b: the earlier 0.75M-parameter runs at D/N 0.5 (358,400 tokens) instead "
                         "of the scaling sweep's largest budget (D/N 50); figures/dn0.5/ holds what they gave")
    ap.add_argument("--nproc", type=int, default=1,
                    help="training figures: train each run as N data-parallel processes (DDP under torchrun, gloo "
                         "on the CPU; each process takes every N-th sequence of the batch and draws its own "
                         "stochastic rounding). Another run than the single-process one: it has its own key under "
                         "--out/runs (docs/scale.md)")
    ap.add_argument("what", nargs="*", help="with replot: the training figures to redraw from their CSV "
                                            "(default: every one whose CSV is in --out)")
    a = ap.parse_args(argv)
    if a.what and a.fig != "replot":
        ap.error(f"unexpected arguments {a.what} after {a.fig!r} (only replot takes figure names)")
    if a.fig == "replot":
        from .replot import replot
        trained = [f for f, v in FIGURES.items() if v.generic]
        names = a.what or [f for f in trained if (a.out / f"{f}.csv").is_file()]
        if not names:
            print(f"paper_repro: no training figure's CSV in {a.out} to redraw", file=sys.stderr)
            return 2
        for n in names:
            try:
                replot(n, a.out, a.quick)
            except (ValueError, FileNotFoundError) as e:
                print(f"paper_repro: {e}", file=sys.stderr)
                return 2
            if a.quick:
                from .plotting import mark_quick
                mark_quick(a.out / f"{n}.png", a.out / f"{n}.json")
            if not a.quiet:
                print(f"{n}: redrew {a.out / (n + '.png')} from {n}.csv")
        return 0
    if a.fig == "table":
        if not any((a.out / f"{f}.json").is_file() for f in ablations.ABLATIONS):
            print(f"paper_repro: no ablation figure in {a.out} yet; make them with 'python -m paper_repro "
                  f"ablations --out {a.out}'", file=sys.stderr)
            return 2
        say(ablations.verdict_table(a.out).rstrip("\n"))
        return 0
    if a.fig == "list":
        say("\n".join(f"{f.name:6}  {f.what}{'' if f.trains else ' (no training)'}" for f in FIGURES.values()))
        return 0
    names = list(figures.PART1) if a.fig == "all" else list(ablations.ABLATIONS) if a.fig == "ablations" else [a.fig]
    bad = [n for n in names if n not in FIGURES]
    if bad:
        print(f"paper_repro: unknown figure {bad[0]!r}; use list, all or one of {', '.join(FIGURES)}", file=sys.stderr)
        return 2
    if a.seeds is not None and a.seeds < 1:
        print(f"paper_repro: --seeds {a.seeds}: give at least 1", file=sys.stderr)
        return 2
    if a.threads is not None and a.threads < 1:
        print(f"paper_repro: --threads {a.threads}: give at least 1", file=sys.stderr)
        return 2
    if a.short and (a.quick or not set(names) & set(figures.SCALED)):
        print(f"paper_repro: --short applies to {', '.join(figures.SCALED)} in full mode only", file=sys.stderr)
        return 2
    if a.nproc < 1:
        print(f"paper_repro: --nproc {a.nproc}: give at least 1", file=sys.stderr)
        return 2
    if a.nproc > 1 and not all(FIGURES[n].generic for n in names):
        trained = ", ".join(f for f, v in FIGURES.items() if v.generic)
        other = ", ".join(n for n in names if not FIGURES[n].generic)
        print(f"paper_repro: --nproc applies to the training figures ({trained}), not {other}", file=sys.stderr)
        return 2
    if a.scheduler and names != ["scaling"]:
        print("paper_repro: --scheduler applies to scaling only", file=sys.stderr)
        return 2
    from fp4sim.arrays_io import check_writable
    try:
        check_writable(a.out, "--out", directory=True)       # before any run: a long run never ends unwritable
        for n in names:                                      # every run's configuration, before --out is made
            if FIGURES[n].generic:
                _runs(n, a.quick, a.seeds or (figures.QUICK_SEEDS if a.quick else figures.FULL_SEEDS), a.short,
                      a.nproc)
    except ValueError as e:
        print(f"paper_repro: bad input: {e}", file=sys.stderr)
        return 2
    for n in names:
        try:
            make(n, a.quick, a.out, a.seeds, a.quiet, a.threads, a.scheduler, a.short, a.nproc)
        except ValueError as e:
            if not a.scheduler and a.nproc == 1:
                raise
            print(f"paper_repro: {e}", file=sys.stderr)
            return 2
        except OSError as e:                                   # the disk filled, the folder went away, ...
            print(f"paper_repro: {n}: writing under {a.out}: {e.strerror or e} ({e.filename or a.out}); what "
                  "finished is kept, and a rerun resumes from the checkpoints under --out", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    from fp4sim._tool import run_tool
    sys.exit(run_tool(main, "paper_repro"))
