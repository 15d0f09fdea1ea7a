"""fp4sim: bit-exact emulation and analysis of 4-bit floating-point (NVFP4, MXFP4) LLM training numerics."""
import os as _os

# OpenMP workers that spin between Numba's parallel regions take the cores the main thread needs (5-8x slower
# chunked analyses on two cores); sleeping workers cost microseconds. A value you set yourself is kept.
import sys as _sys

# Whether torch's OpenMP pool, if torch is loaded, spins: it read the policy when torch was imported
# (fp4sim.threads.torch_pool_spins; the torch bridge then keeps Numba off the cores those workers hold).
_TORCH_POOL_SPINS = (("torch" in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ)
                     or _os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "ACTIVE")
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# OpenBLAS's workers (NumPy's matmuls) spin about 2^28 cycles after each call by default, holding a core that
# Numba's kernels then wait for; 2^4 cycles lets them sleep at once. Read when NumPy loads OpenBLAS: in effect
# only where fp4sim is imported before NumPy (else threads.blas_spins() is True and the torch bridge adapts).
_BLAS_SPINS = "numpy" in _sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in _os.environ
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .elements import decode, encode
from .formats import BF16, E2M1, E4M3, E5M2, FORMATS, UE5M3, UE8M0, Format, get_format
from .qtensor import QuantizedTensor
from .quantize import dequantize, fake_quantize, quantize, rht
from .gemm import gemm
from .tensorcore import scaled_mm
from .schemes import SCHEMES, get_scheme
from . import layout, rng, tensorcore, threads, training

threads._TORCH_POOL_SPINS, threads._BLAS_SPINS = _TORCH_POOL_SPINS, _BLAS_SPINS

__version__ = "0.1.0"
__all__ = ["layout", "rng", "tensorcore", "threads", "training", "gemm", "scaled_mm", "encode", "decode", "quantize", "dequantize", "fake_quantize", "rht", "QuantizedTensor", "SCHEMES",
           "get_scheme", "Format", "get_format", "FORMATS", "E2M1", "E4M3", "E5M2", "UE8M0", "UE5M3", "BF16"]
