"""How many threads the Numba kernels use.

Two things make the kernels slow on a shared machine: OpenMP worker threads that spin between parallel
regions (taking the cores the main thread needs; fp4sim sets ``OMP_WAIT_POLICY=PASSIVE`` at import unless it is
set already), and more threads than idle cores. :func:`configure` picks the thread count: a number you give,
or the idle cores — the cores this process may use minus the one-minute load average, at least one.

PyTorch's own OpenMP pool reads the wait policy when torch is imported: imported before fp4sim (what most
training scripts do) and without ``OMP_WAIT_POLICY`` in the environment, its workers spin after every torch
operation (torch and Numba share one OpenMP runtime, whose policy is fixed when it loads), and the BLAS
threads of NumPy's matmuls fighting them for the cores made emulated training steps 2-4.5x slower (on two
cores: 4.97x a plain torch step against 2.2x with fp4sim imported first). :func:`torch_pool_spins` says whether
that is the case; the torch bridge (:class:`fp4sim.torch.QuantLinear`) then runs its Numba kernels and BLAS
calls on the calling thread alone (:func:`bridge_threads`; the BLAS libraries through threadpoolctl).

NumPy's OpenBLAS keeps its workers spinning for about 2^28 cycles after every matmul, on the core a Numba
kernel started next needs: on two cores a `nvfp4_paper` step of the paper_repro model took 2.2x the plain
step against 1.7x with ``OPENBLAS_THREAD_TIMEOUT=4``, which fp4sim sets when imported (a value you set is kept).
OpenBLAS reads it when NumPy loads it, so it applies only where fp4sim is imported before NumPy; otherwise
:func:`blas_spins` is True and the bridge runs its Numba kernels on the calling thread, beside the spinning
worker instead of waiting for its core.
"""
from __future__ import annotations

import os

__all__ = ["configure", "idle_cores", "torch_pool_spins", "blas_spins", "bridge_threads", "bridge_blas_threads",
           "blas_controllers"]


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


def torch_pool_spins() -> bool:
    """Whether torch's OpenMP workers spin between operations: torch was imported before fp4sim while
    ``OMP_WAIT_POLICY`` was not set, or the variable is ``ACTIVE``."""
    return _TORCH_POOL_SPINS


_TORCH_POOL_SPINS = _BLAS_SPINS = False    # set by fp4sim's __init__, which sees the import order first
_BRIDGE_THREADS = None


def bridge_threads(threads: int | None = None) -> int | None:
    """The Numba thread count the torch bridge runs its kernels with, or None (the process's setting; the
    default unless :func:`torch_pool_spins` or :func:`blas_spins`, then 1). ``bridge_threads(n)`` sets it, and
    the bridge's BLAS thread count with it (``n = 0``: back to the defaults); returns the value in force."""
    global _BRIDGE_THREADS
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads={threads!r}: give a positive number of threads, or 0 for the default")
        _BRIDGE_THREADS = threads or None
    if _BRIDGE_THREADS is not None:
        return _BRIDGE_THREADS
    return 1 if torch_pool_spins() or blas_spins() else None


def bridge_blas_threads() -> int | None:
    """The BLAS thread count the torch bridge's passes run with, or None (left as it is): the count given to
    :func:`bridge_threads`, else 1 where :func:`torch_pool_spins`."""
    if _BRIDGE_THREADS is not None:
        return _BRIDGE_THREADS
    return 1 if torch_pool_spins() else None


def blas_spins() -> bool:
    """Whether NumPy's OpenBLAS workers spin after each call: NumPy was loaded before fp4sim with no
    ``OPENBLAS_THREAD_TIMEOUT`` set."""
    return _BLAS_SPINS


_BLAS = None


def blas_controllers() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded in this process (found once; empty without
    threadpoolctl, which the ``[torch]`` extra installs)."""
    global _BLAS
    if _BLAS is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            return []
        _BLAS = list(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _BLAS
