"""Hardware-kernel output validation: ``compare`` a kernel's codes and scales with the emulator, bit for bit,
and explain every mismatch; ``compare_gemm`` names the accumulation model that reproduces a GEMM kernel's output
(``python -m fp4sim.validate`` / ``python -m fp4sim.validate gemm`` on the command line)."""
from .core import compare
from .gemm import GemmReport, compare_gemm
from .report import Report

__all__ = ["compare", "Report", "compare_gemm", "GemmReport"]
