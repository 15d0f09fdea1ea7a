"""The array module (NumPy or CuPy) an array belongs to, without importing CuPy unless it is in use."""
from __future__ import annotations

import contextlib
import contextvars
import sys

import numpy as np


def is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def xp_of(*arrays):
    """cupy if any argument is a CuPy array, else numpy."""
    if any(is_cupy(a) for a in arrays):
        return sys.modules["cupy"]
    return np


def table(xp, values: np.ndarray):
    """A (small) NumPy lookup table on the device of ``xp``."""
    return values if xp is np else xp.asarray(values)


_MATMUL = contextvars.ContextVar("fp4sim_matmul", default=None)


def matmul(a, b):
    """``a @ b`` for fp4sim's GEMMs: NumPy's (or CuPy's) matmul, or for NumPy arrays the function
    :func:`matmul_by` installed in this context (the torch bridge installs torch's, so that its GEMMs run on
    torch's threads; see :mod:`fp4sim.threads`)."""
    f = _MATMUL.get()
    if f is not None and type(a) is np.ndarray and type(b) is np.ndarray:
        return f(a, b)
    return xp_of(a, b).matmul(a, b)


@contextlib.contextmanager
def matmul_by(f):
    """Within the block, :func:`matmul` of NumPy arrays calls ``f(a, b)`` (which returns a NumPy array)."""
    token = _MATMUL.set(f)
    try:
        yield
    finally:
        _MATMUL.reset(token)


def absmax(a, axis=None):
    """max |a| over ``axis`` (None: all) of a non-empty float32 (or float16) array, NaN ignored (all-NaN gives 0),
    from the bit patterns: the same float32 on NumPy and CuPy, subnormals included. ``axis=None`` returns a
    NumPy float32 scalar, otherwise an array of ``a``'s module."""
    xp = xp_of(a)
    bits = xp.ascontiguousarray(a, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    bits = xp.where(bits > np.uint32(0x7F800000), np.uint32(0), bits)
    if axis is None:
        return np.uint32(int(bits.max())).view(np.float32)
    return bits.max(axis=axis).view(np.float32)
