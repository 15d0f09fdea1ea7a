"""IEEE float32 arithmetic that gives the same bits on NumPy and CuPy arrays.

NumPy's float32 operations are IEEE, subnormals included. CuPy compiles its elementwise kernels with
``-ftz=true``: a subnormal float32 input or result of its arithmetic, casts and ``abs`` / ``max`` becomes zero.
For CuPy arrays the functions here therefore widen float32 operands to float64 from their bits (a kernel), compute
in float64 (exact for the product or sum of two float32 values; a quotient rounded twice, which is innocuous
because float64 has more than 2*24+2 significant bits) and round to float32 by integer code (a kernel). NumPy
operands take NumPy's own operations, unchanged. Scalars (Python or NumPy) may be mixed with arrays of either.
"""
from __future__ import annotations

import numpy as np

from ._xp import absmax, is_cupy

__all__ = ["mul", "div", "add", "absmax"]


def _kernels():
    from .gpu import ops
    return ops.kernels(ops.backend())


def _wide(k, a):
    if is_cupy(a):
        return a if a.dtype == np.float64 else k.f64(a)
    return float(a)                                # a scalar: exact in float64


def _op(a, b, f):
    if not (is_cupy(a) or is_cupy(b)):
        return None
    k = _kernels()
    return k.f32(f(_wide(k, a), _wide(k, b)))


def mul(a, b):
    """``a * b`` rounded once to float32 (NumPy: NumPy's own product, its dtype as NumPy gives it)."""
    y = _op(a, b, lambda u, v: u * v)
    return a * b if y is None else y


def div(a, b):
    """``a / b`` rounded to float32 (NumPy: NumPy's own quotient)."""
    y = _op(a, b, lambda u, v: u / v)
    return a / b if y is None else y


def add(a, b):
    """``a + b`` rounded once to float32 (NumPy: NumPy's own sum)."""
    y = _op(a, b, lambda u, v: u + v)
    return a + b if y is None else y
