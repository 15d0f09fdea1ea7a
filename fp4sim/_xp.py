"""The array module (NumPy or CuPy) an array belongs to, without importing CuPy unless it is in use."""
from __future__ import annotations

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
