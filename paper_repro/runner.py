"""Run a figure's training runs (one after another: on two cores one run with both threads is faster than two
runs side by side) with one progress bar, reusing every run already finished under ``DIR/runs/``."""
from __future__ import annotations

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


def run_all(cfgs: list[RunConfig], out: Path, *, quiet: bool = False, ckpt_seconds: float = 120.0) -> dict:
    """{config key: log rows} for every config, training the ones not finished yet."""
    runs = Path(out) / "runs"
    uniq = {c.key(): c for c in cfgs}
    todo = [c for k, c in uniq.items() if not is_done(runs / k, c)]
    bar, tick = token_bar(sum(c.steps * c.batch * c.model.ctx for c in todo), quiet)
    out_rows = {}
    try:
        for i, (k, c) in enumerate(uniq.items()):
            if c in todo:
                ops = f" + NVFP4 {','.join(o[0] for o in c.operands)}" if c.operands else ""
                bar.set_description(f"run {todo.index(c) + 1}/{len(todo)} {c.key().rsplit('-', 1)[0]}{ops}")
            out_rows[k] = train(c, runs / k, ckpt_seconds=ckpt_seconds, progress=tick if c in todo else None)
    finally:
        bar.close()
    return out_rows
