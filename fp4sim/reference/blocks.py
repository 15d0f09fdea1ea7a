"""Reference block-scaled quantizers: SPEC §2-3 written out block by block with numpy float32 scalars
(every ``fl(.)`` is one float32 operation) and the exact reference element encoders.

Each function takes a 2-D float32 array (rows, K) with the block axis last and returns unpacked codes
(rows, Kp) and scales; slow by design.
"""
from __future__ import annotations

import math

import numpy as np

from ..formats import E2M1, E4M3, Format
from .elements import encode_scalar, ue8m0_scalar

f32 = np.float32
FLT_MAX = f32(np.finfo(np.float32).max)
R6 = f32(1.0) / f32(6.0)


def _pad(x2: np.ndarray, rb, bk: int, tile: int = 1):
    R, K = x2.shape
    Rp, Kp = -(-R // tile) * tile, -(-K // bk) * bk
    xp = np.zeros((Rp, Kp), np.float32)
    xp[:R, :K] = x2
    rp = np.zeros((Rp, Kp), np.int64)
    if rb is not None:
        rp[:R, :K] = rb
    return xp, rp


def _amax(block: np.ndarray) -> np.float32:
    """max |x| ignoring NaN (0 if none)."""
    a = np.abs(block[~np.isnan(block)])
    return f32(a.max()) if a.size else f32(0.0)


def _e4m3(v) -> int:
    return 0xFF if np.isnan(v) else encode_scalar(float(v), E4M3, "rne", True)


def nvfp4_ref(x2, flavor="te", tile=1, global_amax=None, rounding="rne", rb=None, n=8, row_scaled=False,
              per_tensor_scale=True):
    """Reference NVFP4: returns (codes (R, Kp) unpacked, scales (ceil(R/tile), Kp/16) uint8).

    ``row_scaled``: the second-level scale of each row comes from that row's amax (or ``global_amax[row]``);
    ``per_tensor_scale=False`` (torchao): no second-level scale, i.e. a per-tensor scale of exactly 1."""
    R, K = x2.shape
    xp, rp = _pad(x2, rb, 16, tile)
    codes = np.zeros(xp.shape, np.uint8)
    scales = np.zeros((xp.shape[0] // tile, xp.shape[1] // 16), np.uint8)
    tensor_amax = None if row_scaled else (_amax(x2) if global_amax is None else f32(global_amax))
    for g in range(scales.shape[0]):
        if row_scaled:
            amax_g = _amax(x2[g]) if global_amax is None else f32(np.asarray(global_amax).reshape(-1)[g])
        else:
            amax_g = tensor_amax
        with np.errstate(all="ignore"):
            if flavor in ("te", "paper"):
                s_enc = f32(1.0) if amax_g == 0 else min(f32(2688.0) / amax_g, FLT_MAX)
                s_enc = f32(1.0) if s_enc == 0 else f32(s_enc)
                s_dec = f32(1.0) / s_enc
            else:
                pts = amax_g / f32(2688.0) if per_tensor_scale else f32(1.0)
        for j in range(scales.shape[1]):
            blk = xp[g * tile:(g + 1) * tile, j * 16:(j + 1) * 16]
            amax_b = _amax(blk)
            with np.errstate(all="ignore"):
                if flavor == "te":
                    s = _e4m3(min(amax_b * (s_enc * R6), FLT_MAX))
                    enc = min(f32(1.0) / (E4M3.values[s] * s_dec), FLT_MAX)
                elif flavor == "paper":
                    s = _e4m3(min((amax_b / f32(6.0)) * s_enc, FLT_MAX))
                    enc = min(f32(1.0) / (E4M3.values[s] * s_dec), FLT_MAX)
                elif flavor == "torchao":
                    sf = (amax_b / f32(6.0)) / pts
                    s = _e4m3(sf if np.isnan(sf) else min(max(sf, f32(2.0**-6)), f32(448.0)))
                    enc = (f32(1.0) / pts) / E4M3.values[s]
                elif flavor == "modelopt":
                    sf = amax_b / (f32(6.0) * pts)
                    sf = f32(1.0) if sf == 0 else sf
                    s = _e4m3(sf if np.isnan(sf) else min(max(sf, f32(2.0**-9)), f32(448.0)))
                    den = E4M3.values[s] * pts
                else:
                    raise ValueError(flavor)
            scales[g, j] = s
            for rr in range(tile):
                for t in range(16):
                    r, k = g * tile + rr, j * 16 + t
                    v = xp[r, k]
                    with np.errstate(all="ignore"):
                        y = v / den if flavor == "modelopt" else v * enc
                    c = encode_scalar(float(y), E2M1, rounding, True, int(rp[r, k]), n)
                    if np.isnan(v):
                        c = 7
                    elif flavor == "torchao" and np.isnan(enc):
                        c = 0xC
                    elif flavor == "modelopt" and y == 0:
                        c = 0
                    codes[r, k] = c
    return codes[:R], scales


def mx_scale_ref(amax: np.float32, mode: str, elem: Format) -> int:
    """UE8M0 byte of a block amax (SPEC §2.2), from the float bits."""
    bits = int(np.array([amax], np.float32).view(np.uint32)[0])
    if mode == "rceil":
        return ue8m0_scalar(float(amax * (f32(1.0) / f32(elem.max))), "rp", True)
    if amax == 0:
        return 0
    if mode == "even":  # round amax to the element's precision first (2^21 for E2M1's one mantissa bit)
        bits += 1 << (22 - elem.mbits)
    e = ((bits >> 23) & 0xFF) - 127 - elem.emax
    if mode == "ceil" and bits & 0x7FFFFF:
        e += 1
    return min(max(e, -127), 127) + 127


def mx_ref(x2, elem: Format = E2M1, scale_mode="rceil", rounding="rne", rb=None, n=8):
    """Reference MX: returns (codes (R, Kp) unpacked, scales (R, Kp/32) uint8)."""
    R, K = x2.shape
    xp, rp = _pad(x2, rb, 32)
    codes = np.zeros(xp.shape, np.uint8)
    scales = np.zeros((R, xp.shape[1] // 32), np.uint8)
    for r in range(R):
        for j in range(scales.shape[1]):
            e = mx_scale_ref(_amax(xp[r, j * 32:(j + 1) * 32]), scale_mode, elem)
            scales[r, j] = e
            mul = f32(math.ldexp(1.0, 127 - e))
            for k in range(j * 32, (j + 1) * 32):
                codes[r, k] = encode_scalar(float(xp[r, k] * mul), elem, rounding, True, int(rp[r, k]), n)
    return codes, scales


def fp8_tensor_ref(x2, elem: Format = E4M3):
    """Reference FP8 current scaling: (codes, fl(1/scale))."""
    amax = _amax(x2)
    scale = f32(elem.max) / amax if (amax > 0 and np.isfinite(amax)) else f32(1.0)
    scale = min(scale, FLT_MAX)
    codes = np.array([[encode_scalar(float(v * scale), elem, "rne", True) for v in row] for row in x2], np.uint8)
    return codes, f32(1.0) / scale


def fp8_blockwise_ref(x2, tile=1):
    """Reference FP8 blockwise: (codes, float32 scales fl(amax_b/448)); a zero-amax block encodes x*0."""
    R, K = x2.shape
    codes = np.zeros((R, K), np.uint8)
    scales = np.zeros((-(-R // tile), -(-K // 128)), np.float32)
    for g in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x2[g * tile:(g + 1) * tile, j * 128:(j + 1) * 128]
            s = _amax(blk) / f32(448.0)
            scales[g, j] = s
            for (rr, kk), v in np.ndenumerate(blk):
                with np.errstate(all="ignore"):
                    y = v / s if s != 0 else v * f32(0.0)
                codes[g * tile + rr, j * 128 + kk] = encode_scalar(float(y), E4M3, "rne", True)
    return codes, scales


def nvfp4_4over6_ref(x2, tile=1, global_amax=None, err_mode="mae", fast_math=False, e4m3_max=448, ties_map4=False,
                     row_scaled=False):
    """Reference 4over6 NVFP4 (TransformerEngine's ``nvfp4_use_4over6``), block by block with float32 scalars:
    returns (codes (R, Kp) unpacked, scales (ceil(R/tile), Kp/16), map-to-4 chosen per block/tile).
    ``ties_map4``: equal errors choose map-to-4 (TE keeps map-to-6). ``row_scaled`` (1x16): each row's second
    level comes from that row's amax (or ``global_amax[row]``)."""
    R, K = x2.shape
    xp, _ = _pad(x2, None, 16, tile)
    denom = f32(f32(6.0) * f32(e4m3_max))

    def second_level(g):
        with np.errstate(all="ignore"):
            s_enc = f32(1.0) if g == 0 else min(denom / g, FLT_MAX)
            s_enc = f32(1.0) if s_enc == 0 else f32(s_enc)
            return s_enc, f32(1.0) / s_enc

    if row_scaled:
        if tile != 1:
            raise ValueError("row_scaled 4over6 takes 1x16 blocks")
        gs = [(_amax(x2[r]) if global_amax is None else f32(np.asarray(global_amax).reshape(-1)[r]))
              for r in range(R)]
    else:
        gs = [_amax(x2) if global_amax is None else f32(global_amax)] * (xp.shape[0] // tile)
    codes = np.zeros(xp.shape, np.uint8)
    scales = np.zeros((xp.shape[0] // tile, xp.shape[1] // 16), np.uint8)
    pick4 = np.zeros(scales.shape, bool)
    for t in range(scales.shape[0]):
        g = gs[t]
        s_enc, s_dec = second_level(g)
        for j in range(scales.shape[1]):
            blk = xp[t * tile:(t + 1) * tile, j * 16:(j + 1) * 16]
            amax_b = _amax(blk)
            with np.errstate(all="ignore"):
                base = (amax_b / f32(6.0)) * s_enc
            cands = []
            for sf in (base * f32(1.5), base):                        # map to 4, map to 6
                s = _e4m3(min(sf, f32(448.0)))
                sval = E4M3.values[s]
                with np.errstate(all="ignore"):
                    enc = min(f32(1.0) / (sval * s_dec), FLT_MAX)
                c = np.zeros(blk.shape, np.uint8)
                row_err = []
                for rr in range(blk.shape[0]):
                    e = f32(0.0)
                    for k in range(16):
                        v = blk[rr, k]
                        with np.errstate(all="ignore"):
                            y = min(max(v * enc, f32(-6.0)), f32(6.0)) if not np.isnan(v) else v
                        c[rr, k] = 7 if np.isnan(v) else encode_scalar(float(y), E2M1, "rne", True)
                        q = E2M1.values[c[rr, k]]
                        with np.errstate(all="ignore"):
                            if fast_math:  # E2M1 x E4M3 has <= 6 significant bits: exact in FP16 (subnormals too)
                                prod = f32(np.nan) if (s & 0x7F) == 0x7F else f32(float(q) * float(sval))
                                d = prod - v * s_enc
                            else:
                                d = (((q * sval) * g) / denom) - v
                            e = e + (d * d if err_mode == "mse" else abs(d))
                    row_err.append(f32(e))
                if tile == 16:                                        # the kernel's tree over the 16 rows
                    r = [f32(row_err[i] + row_err[i + 8]) for i in range(8)]
                    r = [f32(r[i] + r[i + 4]) for i in range(4)]
                    r = [f32(r[i] + r[i + 2]) for i in range(2)]
                    err = f32(r[0] + r[1])
                else:
                    err = row_err[0]
                cands.append((err, s, c))
            use4 = cands[0][0] < cands[1][0] or (ties_map4 and cands[0][0] == cands[1][0])  # TE: ties map to 6
            err, s, c = cands[0] if use4 else cands[1]
            scales[t, j], pick4[t, j] = s, use4
            codes[t * tile:(t + 1) * tile, j * 16:(j + 1) * 16] = c
    return codes[:R], scales, pick4
