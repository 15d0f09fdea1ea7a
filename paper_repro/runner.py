"""Run a figure's training runs (one after another: on two cores one run with both threads is faster than two
runs side by side) with one progress bar, reusing every run already finished under ``DIR/runs/``."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from .train import RunConfig, is_done, train


def set_threads(n: int | None = None) -> int:
    """Use n (default: all cores, at most 2 — what the figures' timings were measured with) threads in torch and
    Numba. The thread count can change float sums in BLAS, so a run's bits are reproducible at a given count."""
    import numba
    import torch
    n = n or min(2, os.cpu_count() or 1)
    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return n


def token_bar(total: int, quiet: bool):
    """A progress bar over ``total`` training tokens on stderr, and the ``progress(ntok, loss)`` callback that
    :func:`paper_repro.train.train` calls (``loss=None``: tokens a resumed or branched run does not train)."""
    from tqdm import tqdm
    bar = tqdm(total=total, unit="tok", unit_scale=True, disable=quiet or not total, file=sys.stderr,
               dynamic_ncols=True, smoothing=0.05)

    def progress(ntok, loss):
        if loss is None:
            bar.total -= ntok
            bar.refresh()
            return
        bar.update(ntok)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    return bar, progress


def chains(cfgs: list[RunConfig]) -> list[list[RunConfig]]:
    """The configs (duplicates dropped) grouped into chains of runs that share a prefix
    (:meth:`RunConfig.prefix_key`: the same run up to the shorter one's decay), each in increasing length; a run
    without a prefix is a chain of its own. The chains keep the order of their first config."""
    out, by = [], {}
    for c in {c.key(): c for c in cfgs}.values():
        k = c.prefix_key()
        if k is None:
            out.append([c])
        elif k in by:
            by[k].append(c)
        else:
            by[k] = [c]
            out.append(by[k])
    for ch in out:
        ch.sort(key=lambda c: c.tokens)
    return out


def train_chain(chain: list[RunConfig], runs: Path, progress=None, ckpt_seconds: float = 120.0,
                describe=None) -> dict:
    """Train a chain (:func:`chains`): the longest run first, leaving a snapshot at every shorter run's decay
    step, then the shorter ones from their snapshots (each a cooldown). {config key: log rows}."""
    runs = Path(runs)
    trunk, out = chain[-1], {}
    for c in [trunk, *chain[:-1]]:
        if describe is not None:
            describe(c)
        snaps = [s.decay_step() for s in chain[:-1]] if c is trunk else ()
        out[c.key()] = train(c, runs / c.key(), ckpt_seconds=ckpt_seconds, progress=progress,
                             snapshot_steps=snaps)
    return out


def run_all(cfgs: list[RunConfig], out: Path, *, quiet: bool = False, ckpt_seconds: float = 120.0) -> dict:
    """{config key: log rows} for every config, training the ones not finished yet (runs that share a prefix as
    one trunk and its cooldowns, :func:`train_chain`)."""
    runs = Path(out) / "runs"
    uniq = {c.key(): c for c in cfgs}
    todo = [k for k, c in uniq.items() if not is_done(runs / k, c)]
    bar, tick = token_bar(sum(uniq[k].steps * uniq[k].batch * uniq[k].model.ctx for k in todo), quiet)

    def describe(c):
        if c.key() in todo:
            ops = f" + NVFP4 {','.join(o[0] for o in c.operands)}" if c.operands else ""
            bar.set_description(f"run {todo.index(c.key()) + 1}/{len(todo)} {c.key().rsplit('-', 1)[0]}{ops}")

    out_rows = {}
    try:
        for ch in chains(list(uniq.values())):
            out_rows.update(train_chain(ch, runs, tick, ckpt_seconds, describe))
    finally:
        bar.close()
    return {k: out_rows[k] for k in uniq}


def final_val_loss(rows: list, c: RunConfig) -> float:
    """The final validation loss of a run's log rows, NaN where the run did not reach its last step."""
    last = rows[-1] if rows else {"val_loss": math.nan, "step": 0}
    return last["val_loss"] if last["step"] == c.steps else math.nan
