"""Hardware-kernel output validation: ``compare`` a kernel's codes and scales with the emulator, bit for bit,
and explain every mismatch (``python -m fp4sim.validate`` on the command line)."""
from .core import compare
from .report import Report

__all__ = ["compare", "Report"]
