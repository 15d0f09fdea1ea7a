"""Where the CUDA kernels run: on a GPU through CuPy (``CupyBackend``), or — for the tests — the same
source compiled for the host and called through ctypes (``HostBackend``). Both expose ``xp`` (the array
module) and ``launch(name, threads, *args)``; scalar arguments carry their C type as a NumPy scalar type."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("kernels.cu")
BLOCK = 256


def kernel_source() -> str:
    """``kernels.cu`` with the ids of :mod:`fp4sim.ids` prepended, as every compiler of it must see it."""
    from ..ids import cuda_defines
    return cuda_defines() + SOURCE.read_text()


def write_ids_header(directory) -> Path:
    """Write ``fp4sim_ids.h`` (the ids as #defines) into ``directory`` for a host or nvcc build that includes
    ``kernels.cu`` itself (``-include fp4sim_ids.h``)."""
    from ..ids import cuda_defines
    path = Path(directory) / "fp4sim_ids.h"
    path.write_text(cuda_defines())
    return path
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")


class CupyBackend:
    """Kernels compiled once per process by NVRTC (CuPy caches the binary on disk)."""

    def __init__(self):
        import cupy as cp
        self.xp = cp
        self.module = cp.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
        self._functions = {}        # (device id, kernel name) -> the loaded function: one lookup per launch

    def launch(self, name, threads, *args):
        threads = int(threads)
        if threads <= 0:
            return
        key = (self.xp.cuda.Device().id, name)
        fn = self._functions.get(key)
        if fn is None:
            fn = self._functions[key] = self.module.get_function(name)
        fn(((threads + BLOCK - 1) // BLOCK,), (BLOCK,), args)


_CTYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.uint32: ctypes.c_uint,
           np.uint64: ctypes.c_ulonglong, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


class HostBackend:
    """The same kernels compiled for the CPU (see tests/oracles/gpu_host_driver.cpp); NumPy arrays."""

    def __init__(self, library_path):
        self.xp = np
        self.lib = ctypes.CDLL(str(library_path))

    def launch(self, name, threads, *args):
        fn = getattr(self.lib, "host_" + name)
        ctargs, types = [ctypes.c_longlong(int(threads))], [ctypes.c_longlong]
        for a in args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous, name
                ctargs.append(ctypes.c_void_p(a.ctypes.data))
                types.append(ctypes.c_void_p)
            else:
                t = _CTYPES[type(a)]
                ctargs.append(t(a.item() if hasattr(a, "item") else a))
                types.append(t)
        fn.argtypes, fn.restype = types, None
        fn(*ctargs)


@functools.lru_cache(maxsize=1)
def default_backend() -> CupyBackend:
    """The process's CuPy backend (compiles the kernels on first use)."""
    return CupyBackend()
