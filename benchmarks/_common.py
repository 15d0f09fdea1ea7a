"""Shared benchmark pieces: the memory-bound baseline kernel and best-of-N timing."""
from __future__ import annotations

import time

import numba as nb
import numpy as np


@nb.njit(parallel=True, cache=True)
def stream_f32_to_u8(x, out):
    """Read float32, write uint8: the floor any encoder's time is compared with."""
    for i in nb.prange(x.shape[0]):
        out[i] = np.uint8(np.int32(x[i]) & 0xFF)


def best(fn, repeat):
    """Best wall time of ``repeat`` calls after one warm-up call (which also compiles)."""
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)



def best_alternating(fns, repeat, rounds=3):
    """Best wall time of each of ``fns``: ``rounds`` rounds that each time every function in turn, best of
    ``repeat`` calls (:func:`best`). A load spike on a shared machine then falls on one round, not on one side.
    (Alternating single calls is worse: OpenBLAS's threads spin on after a matmul and slow the Numba or torch
    call that follows, and a torch step after a quantized one starts with cold caches.)"""
    out = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            out[i] = min(out[i], best(fn, repeat))
    return out
