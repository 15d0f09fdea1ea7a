"""Hardware-kernel output validation: ``compare`` a kernel's codes and scales with the emulator, bit for bit,
and explain every mismatch; ``compare_gemm`` names the accumulation model that reproduces a GEMM kernel's output
(``python -m fp4sim.validate`` / ``python -m fp4sim.validate gemm`` on the command line), ``compare_scaled_mm`` the
tensor-core model that reproduces an FP8 GEMM's output, ``compare_matmul`` a BF16 / FP16 GEMM's."""
from .core import compare
from .gemm import GemmReport, compare_gemm
from .matmul16 import compare_matmul
from .report import Report
from .scaled_mm import compare_scaled_mm

__all__ = ["compare", "Report", "compare_gemm", "GemmReport", "compare_scaled_mm", "compare_matmul"]
