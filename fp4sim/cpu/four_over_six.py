"""NVFP4 with TransformerEngine's 4over6 block scales, vectorised over all blocks (NumPy float32 operations,
one per fl(.) of the rule; the block-by-block statement is ``fp4sim.reference.blocks.nvfp4_4over6_ref``).

Per block (1x16) or 16x16 tile with amax ``a`` (NaN ignored), S_enc = min(fl(6·e4m3_max / amax_g), FLT_MAX)
(1 when amax_g = 0), S_dec = fl(1/S_enc):

- base = fl(fl(a / 6) · S_enc); the map-to-6 scale byte is E4M3(min(base, 448)), the map-to-4 byte
  E4M3(min(fl(base · 1.5), 448)) (RNE);
- each candidate's elements: E2M1 RNE of clamp(fl(x · min(fl(1 / fl(s · S_dec)), FLT_MAX)), ±6);
- its error, summed over the 16 elements in order in float32: MAE |d| or MSE d², with
  d = fl(fl(fl(fl(v · s) · amax_g) / fl(6 · e4m3_max)) − x) (v the E2M1 value), or with ``fast_math`` d = the
  FP16 product v · s (as TE's kernel forms it) − fl(x · S_enc);
- 16x16 tiles add their 16 rows' errors as a tree (rows 0-7 + 8-15, then 0-3 + 4-7, 0-1 + 2-3, 0 + 1);
- map-to-4 is kept when its error is strictly smaller (ties keep map-to-6).
"""
from __future__ import annotations

import numba as nb
import numpy as np

from ..formats import E2M1, E4M3
from ..four_over_six import FLT_MAX, second_level
from .elements import e2m1_rne, e2m1_value, encode_one, f32_bits_i32, i32_bits_f32

f32 = np.float32


def fp16_product(q, scale_byte):
    """The E2M1 x E4M3 product as TE's fast-math 4over6 path forms it in FP16 (exact integer construction of
    the FP16 bits, returned as float32): q the E2M1 values, scale_byte the E4M3 bytes."""
    q_sign = (q < 0).astype(np.int64)
    q_sig = (np.abs(q) * 2).astype(np.int64)
    sc = scale_byte.astype(np.int64)
    s_sign, s_exp, s_man = sc >> 7, (sc >> 3) & 0xF, sc & 0x7
    s_sig = np.where(s_exp == 0, s_man, s_man + 8)
    s_exp2 = np.where(s_exp == 0, s_exp - 9, s_exp - 10)
    p_sign = q_sign ^ s_sign
    p_sig = q_sig * s_sig
    p_exp2 = s_exp2 - 1
    log2_sig = sum((p_sig >= t).astype(np.int64) for t in (2, 4, 8, 16, 32, 64, 128, 256))
    floor_exp = log2_sig + p_exp2
    normal = ((floor_exp + 15) << 10) | (np.left_shift(p_sig, np.maximum(10 - log2_sig, 0)) - 1024)
    sub = np.left_shift(p_sig, np.maximum(p_exp2 + 24, 0))
    mag = np.where(floor_exp < -14, sub, normal)
    bits = (p_sign << 15) | mag
    bits = np.where(p_sig == 0, p_sign << 15, bits)
    bits = np.where((sc & 0x7F) == 0x7F, 0x7E00, bits)
    sign = np.where((bits & 0x8000) != 0, f32(-1.0), f32(1.0))
    e, fr = (bits >> 10) & 0x1F, bits & 0x3FF
    normal_f = np.ldexp((fr + 1024).astype(np.float32), (e - 25).astype(np.int32))
    sub_f = np.ldexp(fr.astype(np.float32), (e - 24).astype(np.int32))
    return (sign * np.where(e == 0, sub_f, normal_f)).astype(np.float32)


def _col(v):
    """A per-row (R, 1) constant broadcast against (R, nbk, 16) elements; a scalar unchanged."""
    return v[..., None] if np.ndim(v) else v


def _tree16(err):
    """(Rp, nbk) per-row block errors -> (Rp/16, nbk) tile errors in the CUDA warp reduction's order."""
    r = err.reshape(-1, 16, err.shape[1])
    r = r[:, 0:8] + r[:, 8:16]
    r = r[:, 0:4] + r[:, 4:8]
    r = r[:, 0:2] + r[:, 2:4]
    return r[:, 0] + r[:, 1]


def nvfp4_4over6(x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4, encode):
    """(codes (R, Kp/2) packed, scales (ceil(R/tile), Kp/16) E4M3 bytes, chose map-to-4 per block) of x2.
    ``amax_g``: the tensor's second-level amax, or (1x16 only) a vector with one per row (row-scaled).
    ``encode(values, fmt)``: the backend's round-to-nearest, saturating element encoder (float32 in, codes out).
    Without ``fast_math``, :func:`four_over_six_kernel` computes it (one task per group of ``tile`` rows); with
    it, :func:`nvfp4_4over6_numpy`."""
    if fast_math:
        return nvfp4_4over6_numpy(x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4, encode)
    R, K = x2.shape
    g = np.asarray(amax_g, np.float32)
    if g.ndim and (tile != 1 or g.size != R):
        raise ValueError("a vector of second-level amaxes takes 1x16 blocks and one amax per row")
    s_enc, s_dec, denom = second_level(g, e4m3_max)
    gv, ev, dv = (np.ascontiguousarray(np.reshape(v, -1), np.float32) for v in (g, s_enc, s_dec))
    nbk, ng = -(-K // 16), -(-R // tile)
    codes = np.empty((R, nbk * 8), np.uint8)
    scales = np.empty((ng, nbk), np.uint8)
    pick = np.empty((ng, nbk), np.bool_)
    if R and K:
        four_over_six_kernel(np.ascontiguousarray(x2, np.float32), tile, gv, ev, dv, np.float32(denom),
                             err_mode == "mse", bool(ties_map4), E4M3.values.astype(np.float32), codes, scales, pick)
    return codes, scales, pick


@nb.njit(inline="always", cache=True)
def _nanmin(a, b):
    """np.minimum of two float32 (NaN in a propagates; b is never NaN here)."""
    return a if (a != a or a < b) else b


@nb.njit(parallel=True, cache=True)
def four_over_six_kernel(x2, tile, gv, ev, dv, denom, mse, ties_map4, e4m3_vals, codes, scales, pick):
    """The rule of this module's docstring without ``fast_math``, each fl(.) a float32 operation in the order of
    :func:`nvfp4_4over6_numpy` (which the tests hold it to, bit for bit): per group of ``tile`` rows (zero-padded
    to ``tile`` rows and to whole blocks, as the NumPy path pads), per block both candidates' scale bytes and
    errors, the choice, then the chosen candidate's codes. ``gv``, ``ev``, ``dv``: amax_g, S_enc, S_dec, one for
    the tensor or one per row (row-scaled)."""
    R, K = x2.shape
    nbk = (K + 15) // 16
    Kp = nbk * 16
    ng = (R + tile - 1) // tile
    f = np.float32
    six, lim, fmax = f(6.0), f(448.0), f(3.4028234663852886e+38)
    for gi in nb.prange(ng):
        xt = np.zeros((tile, Kp), np.float32)
        for rr in range(tile):
            r = gi * tile + rr
            if r < R:
                xt[rr, :K] = x2[r]
        ci = np.int64(gi) if gv.shape[0] > 1 else np.int64(0)
        g, s_enc, s_dec = gv[ci], ev[ci], dv[ci]
        errs = np.empty(tile, np.float32)
        for j in range(nbk):
            k0 = j * 16
            m = np.int32(0)
            for rr in range(tile):
                xs = xt[rr, k0:k0 + 16]
                for t in range(16):
                    a = np.int32(f32_bits_i32(xs[t]) & np.int32(0x7FFFFFFF))
                    m = a if (a <= np.int32(0x7F800000) and a > m) else m
            base = (i32_bits_f32(np.int32(m)) / six) * s_enc
            tot = np.zeros(2, np.float32)
            byts = np.zeros(2, np.int64)
            encs = np.zeros(2, np.float32)
            for c in range(2):                              # 0: map to 4, 1: map to 6
                sf = _nanmin(base * f(1.5) if c == 0 else base, lim)
                byte = encode_one(np.uint32(f32_bits_i32(sf)), 0, 0, 8, 3, -6, 7, 0x7E, True, 0x7F, 0x7F, 0x80)
                sval = e4m3_vals[byte]
                enc = _nanmin(f(1.0) / (sval * s_dec), fmax)
                for rr in range(tile):
                    xs = xt[rr, k0:k0 + 16]
                    e = f(0.0)
                    for t in range(16):
                        v = xs[t]
                        y = v * enc
                        y = y if y != y else (six if y > six else (-six if y < -six else y))
                        q = e2m1_value(e2m1_rne(y))
                        d = (((q * sval) * g) / denom) - v
                        e = e + (d * d if mse else abs(d))
                    errs[rr] = e
                if tile == 16:
                    for i in range(8):
                        errs[i] = errs[i] + errs[i + 8]
                    for i in range(4):
                        errs[i] = errs[i] + errs[i + 4]
                    for i in range(2):
                        errs[i] = errs[i] + errs[i + 2]
                    errs[0] = errs[0] + errs[1]
                tot[c] = errs[0]
                byts[c] = byte
                encs[c] = enc
            w4 = tot[0] < tot[1] or (ties_map4 and tot[0] == tot[1])
            w = 0 if w4 else 1
            scales[gi, j] = byts[w]
            pick[gi, j] = w4
            enc = encs[w]
            for rr in range(tile):
                r = gi * tile + rr
                if r >= R:
                    break
                xs = xt[rr, k0:k0 + 16]
                for p in range(8):
                    cs = np.empty(2, np.int32)
                    for h in range(2):
                        y = xs[2 * p + h] * enc
                        y = y if y != y else (six if y > six else (-six if y < -six else y))
                        cs[h] = e2m1_rne(y)
                    codes[r, j * 8 + p] = np.uint8(cs[0] | (cs[1] << 4))


def nvfp4_4over6_numpy(x2, tile, amax_g, e4m3_max, err_mode, fast_math, ties_map4, encode):
    """:func:`nvfp4_4over6` in NumPy float32 operations over all blocks at once (the only path for
    ``fast_math``)."""
    R, K = x2.shape
    nbk = -(-K // 16)
    Kp, Rp = nbk * 16, -(-R // tile) * tile
    xp = np.zeros((Rp, Kp), np.float32)
    xp[:R, :K] = x2
    xb = xp.reshape(Rp, nbk, 16)
    a = np.abs(xb)
    a[np.isnan(a)] = 0
    vec = a.max(-1)
    if tile == 16:
        vec = np.repeat(vec.reshape(Rp // 16, 16, nbk).max(1), 16, axis=0)
    g = np.asarray(amax_g, np.float32)
    if g.ndim:                                                  # row-scaled: one second level per row
        if tile != 1 or g.size != R:
            raise ValueError("a vector of second-level amaxes takes 1x16 blocks and one amax per row")
        g = g.reshape(R, 1)
    else:
        g = f32(g)
    s_enc, s_dec, denom = second_level(g, e4m3_max)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        base = (vec / f32(6.0)) * s_enc
        cand = {}
        for name, sf in (("4", base * f32(1.5)), ("6", base)):
            byte = encode(np.minimum(sf, f32(448.0)), E4M3)
            sval = E4M3.values[byte]
            enc = np.minimum(f32(1.0) / (sval * s_dec), FLT_MAX).astype(np.float32)
            y = np.clip(xb * enc[..., None], f32(-6.0), f32(6.0))
            codes = encode(y, E2M1)
            v = E2M1.values[codes]
            if fast_math:
                d = fp16_product(v, np.repeat(byte[..., None], 16, -1)) - (xb * _col(s_enc))
            else:
                d = (((v * sval[..., None]) * _col(g)) / denom) - xb
            e = np.zeros(vec.shape, np.float32)
            for i in range(16):
                di = d[..., i]
                e = e + (di * di if err_mode == "mse" else np.abs(di))
            cand[name] = (byte, codes, e)
    better = np.less_equal if ties_map4 else np.less          # TE: ties keep map-to-6
    if tile == 16:
        pick = np.repeat(better(_tree16(cand["4"][2]), _tree16(cand["6"][2])), 16, axis=0)
    else:
        pick = better(cand["4"][2], cand["6"][2])
    byte = np.where(pick, cand["4"][0], cand["6"][0]).astype(np.uint8)
    codes = np.where(pick[..., None], cand["4"][1], cand["6"][1]).reshape(Rp, Kp)[:R]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = byte[::tile] if tile == 16 else byte
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales[: -(-R // tile)]), pick[::tile]
