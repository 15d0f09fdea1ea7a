"""Input generators shared by the block-scaled tests."""
from __future__ import annotations

import ml_dtypes
import numpy as np


def heavy(shape, seed=0):
    """randn * exp(3 * randn per row): rows spanning many binades, as real activations and gradients."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(3 * rng.standard_normal(shape[:-1] + (1,)))).astype(np.float32)


def cases():
    rng = np.random.default_rng(42)
    out = {
        "randn": rng.standard_normal((8, 64)).astype(np.float32),
        "heavy": heavy((16, 80), 1),
        "bf16": rng.standard_normal((6, 48)).astype(ml_dtypes.bfloat16).astype(np.float32),
        "odd": (rng.standard_normal((5, 37)) * 10).astype(np.float32),
    }
    z = rng.standard_normal((4, 64)).astype(np.float32)
    z[:, 16:32] = 0.0
    z[1, 32:48] = -0.0
    z[2, 48:64] *= 1e-6       # underflowing block scales (E4M3 subnormal / zero)
    z[3, 40:44] = 1e-9
    out["zero_and_tiny_blocks"] = z
    return out
