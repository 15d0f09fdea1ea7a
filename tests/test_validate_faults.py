"""Fault injection for the quantize validator: a correct kernel output with one layout fault injected (permuted
blocks, rows or columns, a wrong row stride, swizzled scale tiles out of order, scale bytes one binade off, the
nibbles of each byte swapped, the scale matrix transposed) is never EXACT, the report says where the first bad
block is and the pattern of bad rows and blocks, and names the fault."""
from __future__ import annotations

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.layout import pack_fp4, swizzle_scales, unpack_fp4
from fp4sim.validate import compare

rng = np.random.default_rng(31)


def _x(R, K):
    s = np.exp2(rng.uniform(-3, 3, (R, K // 16))).repeat(16, 1)
    return (rng.standard_normal((R, K)) * s).astype(np.float32)


def swap_blocks(codes, scales, bk):
    c = codes.copy().reshape(codes.shape[0], -1, bk // 2)
    c[:, [2, 5]] = c[:, [5, 2]]
    s = scales.copy()
    s[:, [2, 5]] = s[:, [5, 2]]
    return c.reshape(codes.shape), s


def swap_rows(codes, scales, bk):
    c, s = codes.copy(), scales.copy()
    c[[3, 17]] = c[[17, 3]]
    s[[3, 17]] = s[[17, 3]]
    return c, s


def swap_columns(codes, scales, bk):
    u = unpack_fp4(codes)
    u[:, [4, 37]] = u[:, [37, 4]]
    return pack_fp4(u), scales.copy()


def row_stride(codes, scales, bk):
    R, rb = codes.shape
    flat = np.zeros(R * rb, np.uint8)
    for r in range(R):
        if r * (rb + 8) + rb <= flat.size:
            flat[r * (rb + 8): r * (rb + 8) + rb] = codes[r]
    return flat.reshape(R, rb), scales.copy()


def binade_high(codes, scales, bk):
    s = scales.astype(np.int16)
    return codes.copy(), np.where(s < 0x70, s + 8, s).astype(np.uint8)


def swap_nibbles(codes, scales, bk):
    return ((codes >> 4) | (codes << 4)).astype(np.uint8), scales.copy()


def transpose_scales(codes, scales, bk):
    return codes.copy(), np.ascontiguousarray(scales.T).reshape(scales.shape)


FAULTS = {   # fault -> (inject, a phrase of the report that names it, the first bad (row, block))
    "permuted blocks": (swap_blocks, "K blocks permuted, the same way in every row: block 2 holds block 5", (0, 2)),
    "permuted rows": (swap_rows, "row 3 holds row 17", (3, 0)),
    "permuted columns": (swap_columns, "column 4 holds column 37", None),
    "wrong row stride": (row_stride, "a row stride of 136 bytes instead of 128", (1, None)),
    "scale one binade high": (binade_high, "one binade high (the E4M3 exponent field +1", (0, 0)),
    "swapped nibbles": (swap_nibbles, "element 2i is in the high nibble", (0, 0)),
    "transposed scales": (transpose_scales, "the transposed matrix: 16 blocks x 48 rows", (0, None)),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_injected_fault_is_flagged_located_and_named(fault):
    inject, phrase, first = FAULTS[fault]
    x = _x(48, 256)
    q = fs.quantize(x, "nvfp4")
    assert compare(x, q.codes, q.scales, "nvfp4", global_amax=q.global_amax).exact      # the clean output
    codes, scales = inject(q.codes, q.scales, 16)
    r = compare(x, codes, scales, "nvfp4", global_amax=q.global_amax)
    assert r.verdict == "mismatch" and not r.exact
    text = r.summary()
    assert any(phrase in f for f in r.diagnosis["layout"]), text
    assert "layout: " in text and "where: first bad block at row" in text
    fb = r.where["first_bad"]
    if fault == "permuted columns":
        bad_rows = np.flatnonzero((unpack_fp4(q.codes)[:, [4, 37]] != unpack_fp4(codes)[:, [4, 37]]).any(1))
        assert (fb["row"], fb["block"]) == (bad_rows[0], 0)
    else:
        assert fb["row"] == first[0] and (first[1] is None or fb["block"] == first[1]), fb
    if fault == "permuted rows":
        assert r.where["bad_rows"] == 2 and "2 of 48 rows (3, 17)" in r.where["pattern"]
    if fault == "permuted blocks":
        assert "every row (48)" in r.where["pattern"] and "2 of 16 blocks (2, 5)" in r.where["pattern"]


def test_swizzled_scale_tiles_out_of_order():
    x = _x(256, 512)
    q = fs.quantize(x, "nvfp4", scale_layout="swizzled")
    sw = np.asarray(q.scales).reshape(-1, 512).copy()
    assert np.array_equal(sw.reshape(-1), swizzle_scales(q.linear_scales()))
    sw[[1, 6]] = sw[[6, 1]]
    r = compare(x, q.codes, sw.reshape(-1), "nvfp4", global_amax=q.global_amax, scale_layout="swizzled")
    assert r.verdict == "mismatch"
    assert any("tile 1 holds tile 6" in f and "tile 6 holds tile 1" in f for f in r.diagnosis["layout"]), r.summary()
    # tile 1 of the 128-row band 0 covers blocks 4-7 of rows 0-127
    assert r.where["first_bad"]["row"] == 0 and 4 <= r.where["first_bad"]["block"] < 8


def test_mx_faults_binade_low_and_permuted_blocks():
    x = _x(40, 256)
    q = fs.quantize(x, "mxfp4")
    s = q.scales.astype(np.int16) - 1
    r = compare(x, q.codes, s.astype(np.uint8), "mxfp4")
    assert r.verdict == "mismatch" and any("one binade low (the UE8M0 exponent field -1" in f
                                           for f in r.diagnosis["layout"]), r.summary()
    c, s = swap_blocks(q.codes, q.scales, 32)
    r = compare(x, c, s, "mxfp4")
    assert any("block 2 holds block 5" in f for f in r.diagnosis["layout"]), r.summary()


def test_a_clean_output_has_no_findings_and_a_code_fault_names_no_layout():
    """No false findings: one flipped code is located, and no layout fault is claimed for it."""
    x = _x(48, 256)
    q = fs.quantize(x, "nvfp4")
    c = q.codes.copy()
    c[9, 21] ^= 0x01
    r = compare(x, c, q.scales, "nvfp4", global_amax=q.global_amax)
    assert r.verdict == "mismatch" and r.diagnosis["layout"] == []
    assert r.where["first_bad"] == {"row": 9, "block": 2} and r.where["bad_cells"] == 1


def test_duplicate_and_zero_rows_or_blocks_are_not_reported_as_moved():
    """Rows 0-1 all zero and rows 5 and 6 equal (a zero-padded batch, a repeated token), blocks 0-1 zero in every
    row: a row (block) that equals its own expected row (block) is in place, so only the truly swapped rows 3 and
    17 (blocks 2 and 5) are named, never "row 1 holds row 0" or "row 6 holds row 5"."""
    x = _x(48, 256)
    x[0:2] = 0
    x[6] = x[5]
    q = fs.quantize(x, "nvfp4")
    codes, scales = swap_rows(q.codes, q.scales, 16)
    r = compare(x, codes, scales, "nvfp4", global_amax=q.global_amax)
    rows = [f for f in r.diagnosis["layout"] if f.startswith("rows permuted")]
    assert rows == ["rows permuted: 2 of 48 rows hold another row's codes and scales (row 3 holds row 17, "
                    "row 17 holds row 3)"], r.diagnosis["layout"]
    xb = _x(48, 256)
    xb[:, :32] = 0
    qb = fs.quantize(xb, "nvfp4")
    codes, scales = swap_blocks(qb.codes, qb.scales, 16)
    r = compare(xb, codes, scales, "nvfp4", global_amax=qb.global_amax)
    blocks = [f for f in r.diagnosis["layout"] if f.startswith("K blocks permuted")]
    assert blocks == ["K blocks permuted, the same way in every row: block 2 holds block 5, block 5 holds block 2"], \
        r.diagnosis["layout"]
