"""How many threads the Numba kernels use, and how they live beside torch's.

fp4sim leaves the process's thread pools as it finds them: importing it sets no environment variable, so
torch's own operations run as fast in a process that imported fp4sim as in one that did not, and the emulated
training step costs the same whatever the import order (``benchmarks/bench_training.py --model paper
--import-order torch|numpy|fp4sim`` measures it).

What makes the torch bridge's passes fast on CPU is that no thread pool of their own competes with torch's.
The bridge's GEMMs run through ``torch.matmul`` (:func:`fp4sim._xp.matmul_by`), on torch's threads, instead of
NumPy's OpenBLAS, whose workers spin for about 2^28 cycles after every call on the cores the next kernel
needs. Numba's parallel kernels use its OpenMP threading layer; started after torch was imported (whatever the
import order, since importing fp4sim runs no kernel), it binds to the OpenMP runtime torch loaded for the whole
process on Linux, so the kernels run on the very threads torch's operations use. Started before torch (a kernel
ran, then ``import torch``), Numba keeps a runtime of its own; measured on two cores, a ``nvfp4_paper`` step
then costs the same. Numba's other threading layers (``NUMBA_THREADING_LAYER=workqueue``) run a pool that is
slower beside torch's (about 1.5x the step time on two cores).

:func:`configure` sets the thread count of fp4sim's kernels: a number you give, or the idle cores — the cores
this process may use minus the one-minute load average, at least one; :func:`bridge_threads` one for the
bridge's passes only (by default torch's own thread count).
"""
from __future__ import annotations

import contextlib
import os

__all__ = ["configure", "idle_cores", "bridge_threads", "numba_threads"]


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


_BRIDGE_THREADS = None


def bridge_threads(threads: int | None = None) -> int | None:
    """The Numba thread count the torch bridge runs its kernels with, or None (the default: torch's thread count
    at the pass, ``torch.get_num_threads()`` — one per process under torchrun, which sets OMP_NUM_THREADS=1).
    ``bridge_threads(n)`` sets it (``n = 0``: back to the default); returns the value in force. Either way a pass
    leaves torch's thread count as it found it."""
    global _BRIDGE_THREADS
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads={threads!r}: give a positive number of threads, or 0 for the default")
        _BRIDGE_THREADS = threads or None
    return _BRIDGE_THREADS


@contextlib.contextmanager
def numba_threads(n: int | None):
    """Within the block, Numba's thread count (for the calling thread) set to ``n`` (capped at Numba's maximum);
    ``None`` leaves it as it is."""
    if not n:
        yield
        return
    import numba
    old = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(old)
