"""How many threads the Numba kernels use.

Two things make the kernels slow on a shared machine: OpenMP worker threads that spin between parallel
regions (taking the cores the main thread needs; fp4sim sets ``OMP_WAIT_POLICY=PASSIVE`` at import unless it is
set already), and more threads than idle cores. :func:`configure` picks the thread count: a number you give,
or the idle cores — the cores this process may use minus the one-minute load average, at least one.
"""
from __future__ import annotations

import os

__all__ = ["configure", "idle_cores"]


def idle_cores() -> int:
    """Cores this process may run on, minus the one-minute load average (rounded), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return max(1, min(cores, round(cores - load)))


def configure(threads: int | None = None) -> int:
    """Set the Numba thread count to ``threads`` (None: :func:`idle_cores`); returns the count set (capped at
    Numba's maximum, ``NUMBA_NUM_THREADS``)."""
    import numba
    if threads is None:
        n = idle_cores()
    else:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r}: give a positive number of threads")
        n = threads
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n
