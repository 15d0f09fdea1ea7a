"""The backend-neutral part of TransformerEngine's 4over6 NVFP4 rule (the whole rule is stated in
:mod:`fp4sim.cpu.four_over_six` and ``fp4sim.reference.blocks.nvfp4_4over6_ref``): the second-level constants
that both backends compute on the host before they launch their kernels."""
from __future__ import annotations

import numpy as np

__all__ = ["FLT_MAX", "second_level"]

f32 = np.float32
FLT_MAX = f32(np.finfo(np.float32).max)


def second_level(amax_g, e4m3_max):
    """(S_enc, S_dec, fl(6 * e4m3_max)) float32 of a 4over6 tensor (S_enc = 1 when amax_g is 0, as the te
    flavour's kernels). ``amax_g`` is a number, or a vector of per-row amaxes (row-scaled); S_enc and S_dec
    then have its shape."""
    g = np.asarray(amax_g, np.float32)
    num = f32(f32(e4m3_max) * f32(6.0))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = np.where(g == 0, f32(1.0), np.minimum(num / g, FLT_MAX)).astype(np.float32)
        s_enc = np.where(s_enc == 0, f32(1.0), s_enc).astype(np.float32)
        s_dec = (f32(1.0) / s_enc).astype(np.float32)
    if s_enc.ndim == 0:
        return f32(s_enc), f32(s_dec), num
    return s_enc, s_dec, num
