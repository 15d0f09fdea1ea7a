"""fp4sim: bit-exact emulation and analysis of 4-bit floating-point (NVFP4, MXFP4) LLM training numerics."""
from .elements import decode, encode
from .formats import (BF16, BINARY8P3, BINARY8P4, E2M1, E2M3, E3M2, E3M4, E4M3, E4M3B11FNUZ, E4M3FNUZ, E5M2, E5M2FNUZ,
                      FORMATS, INT8, UE5M3, UE8M0, Format, get_format)
from .qtensor import QuantizedTensor
from .quantize import dequantize, fake_quantize, quantize, rht
from .gemm import gemm
from .tensorcore import scaled_mm
from .schemes import SCHEMES, get_scheme
from . import layout, rng, tensorcore, threads, training

__version__ = "0.1.0"
__all__ = ["layout", "rng", "tensorcore", "threads", "training", "gemm", "scaled_mm", "encode", "decode", "quantize", "dequantize", "fake_quantize", "rht", "QuantizedTensor", "SCHEMES",
           "get_scheme", "Format", "get_format", "FORMATS", "E2M1", "E4M3", "E5M2", "UE8M0", "UE5M3", "BF16",
           "E2M3", "E3M2", "E3M4", "E4M3FNUZ", "E5M2FNUZ", "E4M3B11FNUZ", "INT8", "BINARY8P3", "BINARY8P4"]
