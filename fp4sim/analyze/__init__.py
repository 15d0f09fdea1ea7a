"""Analyses of real tensor dumps: quantization error per scheme, code and scale usage, outliers, Hadamard
effects and gradient-rounding bias (``python -m fp4sim.analyze``)."""
from .core import analyze, analyze_tensor
from .figures import write_figures
from .inputs import discover, infer_role, load
from .metrics import DEFAULT_SCHEMES, SchemeSpec
from .report import summary, table

__all__ = ["analyze", "analyze_tensor", "write_figures", "discover", "infer_role", "load", "DEFAULT_SCHEMES",
           "SchemeSpec", "summary", "table"]
