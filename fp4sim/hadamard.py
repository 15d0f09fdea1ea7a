"""The random Hadamard transform's matrices (SPEC §3.1): ``M = diag(s) H_d / sqrt(d)``, the Sylvester matrix H_d and
the sign vector s. Pure NumPy, below the planning layer; the transform itself is :func:`fp4sim.rht`."""
from __future__ import annotations

import numpy as np

from .rng import philox_bytes

__all__ = ["check_d", "hadamard_matrix", "rht_signs", "rht_matrix", "TE_SIGN_MASK"]

TE_SIGN_MASK = 0xD7E8  # TransformerEngine's fixed 16-element sign vector: bit i set <=> s_i = -1


def hadamard_matrix(d: int) -> np.ndarray:
    """Sylvester Hadamard matrix H_d, entry (r, c) = (-1)^popcount(r & c), as float64."""
    check_d(d)
    r = np.arange(d)[:, None] & np.arange(d)[None, :]
    pop = np.zeros_like(r)
    for b in range(8):
        pop += (r >> b) & 1
    return np.where(pop % 2 == 0, 1.0, -1.0)


def check_d(d):
    """d must be a power of two in 2..128."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 2 or d > 128 or d & (d - 1):
        raise ValueError(f"d={d!r} must be a power of two between 2 and 128")


def rht_signs(d: int, signs="te") -> np.ndarray:
    """The sign vector s (+-1.0, length d): ``"te"`` (d = 16 only), an int seed (Philox bits, stream 0:
    s_i = -1 iff bit i%8 of byte i//8 is set), None (all +1) or an explicit array of +-1."""
    check_d(d)
    if signs is None:
        return np.ones(d)
    if isinstance(signs, str):
        if signs != "te":
            raise ValueError(f"signs={signs!r}: use 'te', an integer seed, None or an array of +-1")
        if d != 16:
            raise ValueError(f"signs='te' is TransformerEngine's 16-element vector; d={d} needs a seed or None")
        return np.array([-1.0 if (TE_SIGN_MASK >> i) & 1 else 1.0 for i in range(16)])
    if isinstance(signs, (int, np.integer)) and not isinstance(signs, bool):
        b = philox_bytes(int(signs), -(-d // 8))
        return np.array([-1.0 if (int(b[i // 8]) >> (i % 8)) & 1 else 1.0 for i in range(d)])
    s = np.asarray(signs, dtype=np.float64)
    if s.shape != (d,) or not np.all(np.abs(s) == 1):
        raise ValueError(f"signs as an array must hold {d} values, each +1 or -1")
    return s


def rht_matrix(d: int = 16, signs="te") -> np.ndarray:
    """M = diag(s) H_d / sqrt(d) (float64); ``rht`` computes x_chunk @ M."""
    return rht_signs(d, signs)[:, None] * hadamard_matrix(d) / np.sqrt(d)
