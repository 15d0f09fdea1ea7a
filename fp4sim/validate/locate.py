"""Where a kernel's quantized output differs from the emulation, and which layout fault explains it.

``where``: the first bad (row, block), how many rows and blocks hold a mismatch and their pattern. ``layout``:
sentences naming the faults that reproduce the kernel's bytes from the expected ones — rows, K blocks or element
columns permuted, codes written with another row stride, the swizzled scale tiles out of order, the scale matrix
transposed, scale bytes one binade off, the two codes of each byte swapped.
"""
from __future__ import annotations

import numpy as np

from ..layout import swizzle_scales, unpack_fp4
from ..schemes import MX, NVFP4

__all__ = ["where", "layout_findings"]


def _ints(idx, n=6):
    idx = [int(i) for i in idx]
    return ", ".join(map(str, idx[:n])) + (", ..." if len(idx) > n else "")


def _pattern(idx, total, what):
    idx = np.asarray(idx)
    if len(idx) == total:
        return f"every {what} ({total})"
    s = f"{len(idx)} of {total} {what}s ({_ints(idx)})"
    if len(idx) > 1:
        d = np.diff(idx)
        if np.all(d == 1):
            s += f": {what}s {idx[0]}-{idx[-1]}"
        elif np.all(d == d[0]):
            n = int(d[0])
            suf = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
            s += f": every {n}{suf} from {idx[0]}"
    return s


def where(exp_c, act_c, exp_s, act_s, bk: int) -> dict:
    """{first_bad: {row, block} | None, bad_rows, bad_blocks, rows, blocks, pattern} of the mismatches between
    expected and actual (rows, Kp) codes and (rows, blocks) per-row scales."""
    R, nb = exp_s.shape
    cb = (exp_c != act_c).reshape(R, nb, bk).any(axis=2) if exp_c.size else np.zeros((R, nb), bool)
    bad = cb | (exp_s != act_s)
    rows = np.flatnonzero(bad.any(axis=1))
    blocks = np.flatnonzero(bad.any(axis=0))
    first = None
    if len(rows):
        r = int(rows[0])
        first = {"row": r, "block": int(np.flatnonzero(bad[r])[0])}
    pat = "" if not len(rows) else f"{_pattern(rows, R, 'row')}; {_pattern(blocks, nb, 'block')}"
    return {"first_bad": first, "bad_rows": int(len(rows)), "bad_blocks": int(len(blocks)), "rows": int(R),
            "blocks": int(nb), "bad_cells": int(bad.sum()), "pattern": pat}


def _perm(actual, expected):
    """p with actual[i] == expected[p[i]] for every i (rows compared as bytes; an expected row may serve several),
    or None."""
    index = {}
    for j in range(expected.shape[0]):
        index.setdefault(expected[j].tobytes(), j)
    p = []
    for i in range(actual.shape[0]):
        key = actual[i].tobytes()
        if key not in index:
            return None
        j = index[key]
        p.append(i if expected[i].tobytes() == key else j)
    return np.array(p)


def _moved(p):
    return [(i, int(j)) for i, j in enumerate(p) if j != i]


def layout_findings(q, codes, scales, scale_layout: str, exp_c, act_c, exp_s, act_s) -> list[str]:
    """Sentences naming the layout faults that reproduce the kernel's bytes (empty when none does)."""
    sch = q.scheme
    if not isinstance(sch, (NVFP4, MX)):
        return []
    out = []
    R, nb = exp_s.shape
    bk = sch.block[1]
    fp4 = sch.elem.bits == 4
    # scale bytes one binade off: E4M3's exponent field (+-8 in the byte) or UE8M0's (+-1)
    sb = exp_s != act_s
    if sb.any():
        d = act_s[sb].astype(np.int16) - exp_s[sb].astype(np.int16)
        step = 8 if isinstance(sch, NVFP4) else 1
        for off, what in ((step, "high"), (-step, "low")):
            if np.all(d == off):
                out.append(f"the scale bytes of {int(sb.sum())} blocks are one binade {what} (the "
                           f"{'E4M3' if step == 8 else 'UE8M0'} exponent field {'+' if off > 0 else '-'}1: each such "
                           f"block scale {'doubled' if off > 0 else 'halved'})")
    raw_s = np.asarray(scales).view(np.uint8).reshape(-1) if scales is not None else None
    lin = np.asarray(q.linear_scales())
    # the scale matrix transposed: (blocks x rows) row-major
    if raw_s is not None and scale_layout == "linear" and raw_s.size == lin.size and lin.shape[0] > 1 \
            and lin.shape[1] > 1 and not np.array_equal(raw_s, lin.reshape(-1)) \
            and np.array_equal(raw_s, lin.T.reshape(-1)):
        out.append(f"the scale bytes are the transposed matrix: {lin.shape[1]} blocks x {lin.shape[0]} rows, "
                   "row-major, instead of rows x blocks")
    # swizzled 128x4 tiles (512 bytes) out of order
    if raw_s is not None and scale_layout == "swizzled":
        want = np.asarray(swizzle_scales(lin))
        if want.size == raw_s.size and want.size % 512 == 0 and not np.array_equal(want, raw_s):
            p = _perm(raw_s.reshape(-1, 512), want.reshape(-1, 512))
            if p is not None and _moved(p):
                mv = _moved(p)
                out.append("the swizzled scale tiles (128 x 4, 512 bytes each) are out of order: "
                           + ", ".join(f"tile {i} holds tile {j}" for i, j in mv[:4])
                           + (f" (and {len(mv) - 4} more)" if len(mv) > 4 else ""))
    swapped = False
    if fp4:
        # the two codes of each byte swapped
        try:
            sw = unpack_fp4(np.asarray(codes).view(np.uint8).reshape(R, -1), "high_first")
            swapped = not np.array_equal(act_c, exp_c) and np.array_equal(sw, exp_c)
            if swapped:
                out.append("the two codes of every byte are swapped: element 2i is in the high nibble")
        except ValueError:
            pass
    # rows permuted (codes and scales together)
    sig_e = np.concatenate([exp_c, exp_s], axis=1)
    sig_a = np.concatenate([act_c, act_s], axis=1)
    if not np.array_equal(sig_a, sig_e):
        p = _perm(sig_a, sig_e)
        if p is not None and _moved(p):
            mv = _moved(p)
            out.append(f"rows permuted: {len(mv)} of {R} rows hold another row's codes and scales ("
                       + ", ".join(f"row {i} holds row {j}" for i, j in mv[:4]) + (", ..." if len(mv) > 4 else "")
                       + ")")
        else:
            # K blocks permuted within rows (each block's codes with its scale)
            be = np.concatenate([exp_c.reshape(R, nb, bk), exp_s[:, :, None]], axis=2)
            ba = np.concatenate([act_c.reshape(R, nb, bk), act_s[:, :, None]], axis=2)
            perms = [_perm(ba[r], be[r]) for r in range(R)]
            if all(p is not None for p in perms) and any(_moved(p) for p in perms):
                same = all(np.array_equal(p, perms[0]) for p in perms)
                mv = _moved(next(p for p in perms if _moved(p)))
                out.append(("K blocks permuted, the same way in every row: " if same else
                            "K blocks permuted within rows (not the same way in every row), e.g. ")
                           + ", ".join(f"block {i} holds block {j}" for i, j in mv[:4])
                           + (", ..." if len(mv) > 4 else ""))
            elif np.array_equal(act_s, exp_s) and not swapped:
                # element columns permuted along K (scales in place; a nibble swap is already named)
                p = _perm(np.ascontiguousarray(act_c.T), np.ascontiguousarray(exp_c.T))
                if p is not None and _moved(p):
                    mv = _moved(p)
                    out.append(f"element columns permuted along K: {len(mv)} columns hold another column's codes ("
                               + ", ".join(f"column {i} holds column {j}" for i, j in mv[:4])
                               + (", ..." if len(mv) > 4 else "") + ")")
        # codes written with another row stride
        if fp4 and R > 2:
            flat = np.asarray(codes).view(np.uint8).reshape(-1)
            want = np.asarray(q.codes).reshape(R, -1)
            rb = want.shape[1]

            def hits(s):
                return sum(1 for r in range(R) if r * s + rb <= flat.size
                           and np.array_equal(flat[r * s:r * s + rb], want[r]))

            base = hits(rb)
            for s in sorted(range(max(1, rb - 64), rb + 65), key=lambda s: abs(s - rb)):
                if s == rb:
                    continue
                h = hits(s)
                fit = sum(1 for r in range(R) if r * s + rb <= flat.size)
                if h > base and h >= max(2, fit - 1):
                    out.append(f"the codes were written with a row stride of {s} bytes instead of {rb}: row r "
                               f"starts at byte {s} x r ({h} of {R} rows found there)")
                    break
    return out
