"""rbits_mapping="midpoint": stochastic rounding that rounds up iff delta + (2r + 1) / 512 >= 1 for the random
byte r (Graphcore's StochasticFast; gfloat's RoundMode.StochasticFast is the oracle), unbiased at the 1/256
lattice midpoints where TE's truncating rule is biased. Every one of the 256 bytes at points on and between the
lattice (and their float32 neighbours) in every element format with SR, through encode (both E2M1 paths),
quantize (NVFP4 and MXFP4 block kernels, given and Philox bits) and a training operand; the expectation
over the 256 bytes is the lattice point's midpoint-rounded value."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.reference.blocks import mx_ref, nvfp4_ref
from fp4sim.reference.elements import encode_array


def _gfloat(fmt):
    from gfloat.formats import (format_info_bfloat16, format_info_ocp_e2m1, format_info_ocp_e4m3,
                                format_info_ocp_e5m2)
    return {"e2m1": format_info_ocp_e2m1, "e4m3": format_info_ocp_e4m3, "e5m2": format_info_ocp_e5m2,
            "bf16": format_info_bfloat16}[fmt.name]


def lattice_points(fmt):
    """Between neighbouring grid values in a few binades (the subnormal one included): the 2^9 + 1 points on
    the 1/512 lattice of each gap, their float32 neighbours, and both signs."""
    g = fs.get_format(fmt).finite_values
    pos = np.unique(g[g >= 0]).astype(np.float64)
    pairs = [(pos[i], pos[i + 1]) for i in (0, 1, len(pos) // 2, len(pos) - 2)]
    xs = []
    for lo, hi in pairs:
        pts = (lo + (hi - lo) * np.arange(513) / 512).astype(np.float32)
        xs += [pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))]
    x = np.unique(np.concatenate(xs))
    return np.concatenate([x, -x]).astype(np.float32)


@pytest.mark.parametrize("fmt", [fs.E2M1, fs.E4M3, fs.E5M2, fs.BF16], ids=lambda f: f.name)
def test_every_byte_on_and_between_the_lattice_matches_gfloat(fmt):
    from gfloat import RoundMode, round_ndarray
    x = lattice_points(fmt)
    r = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, x.size)).copy()
    xx = np.broadcast_to(x, r.shape).copy()
    theirs = round_ndarray(_gfloat(fmt), xx.astype(np.float64), RoundMode.StochasticFast, sat=True,
                           srbits=r.astype(np.int64), srnumbits=8).astype(np.float32)
    paths = [{}] + ([{"_generic": True}] if fmt is fs.E2M1 else [])
    for kw in paths:
        codes = fs.encode(xx, fmt, rounding="sr", rbits=r, rbits_mapping="midpoint", **kw)
        ours = fs.decode(codes, fmt)
        assert ours.tobytes() == theirs.tobytes(), kw
    assert np.array_equal(codes, encode_array(xx, fmt, "sr_midpoint", True, r))     # the exact reference
    te = fs.decode(fs.encode(xx, fmt, rounding="sr", rbits=r), fmt)
    assert not np.array_equal(te, ours)                  # the two rules differ on these points


def test_the_expectation_is_the_midpoint_rounded_value():
    """Averaged over the 256 bytes: on the 1/256 lattice (delta = k / 256) the midpoint rule is unbiased; half-way
    between (delta = (2k + 1) / 512) it rounds up with probability (k + 1) / 256, half a lattice step above the
    value, where TE's truncating rule (k / 256) is half a step below it."""
    x = (0.5 + 0.5 * np.arange(257) / 256).astype(np.float32)        # E2M1 gap [0.5, 1]: delta = k / 256
    r = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, x.size)).copy()
    xx = np.broadcast_to(x, r.shape).copy()
    mid = fs.decode(fs.encode(xx, fs.E2M1, rounding="sr", rbits=r, rbits_mapping="midpoint"), fs.E2M1)
    assert np.array_equal(mid.astype(np.float64).mean(0), x.astype(np.float64))      # unbiased on the lattice
    y = (0.5 + 0.5 * (2 * np.arange(256) + 1) / 512).astype(np.float32)  # half-way between lattice points
    yy = np.broadcast_to(y, (256, y.size)).copy()
    te = fs.decode(fs.encode(yy, fs.E2M1, rounding="sr", rbits=r[:, :256]), fs.E2M1).astype(np.float64).mean(0)
    md = fs.decode(fs.encode(yy, fs.E2M1, rounding="sr", rbits=r[:, :256], rbits_mapping="midpoint"),
                   fs.E2M1).astype(np.float64).mean(0)
    exact = y.astype(np.float64)
    assert (te < exact).all()                                          # truncation: biased low by 1/1024
    assert all(Fraction(float(m)) - Fraction(float(e)) == Fraction(1, 1024) for m, e in zip(md, exact))


@pytest.mark.parametrize("scheme,ref", [("nvfp4", "nvfp4"), ("nvfp4_2d", "nvfp4"), ("mxfp4", "mx")])
def test_block_kernels_round_by_the_midpoint_rule(scheme, ref):
    """quantize's block kernels (given bytes and Philox bytes, K not a multiple of the block) against the
    exact reference with the midpoint rule."""
    from fp4sim.rng import philox_bytes
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((48, 72)) * np.exp(rng.uniform(-3, 3, (48, 1)))).astype(np.float32)
    rb = rng.integers(0, 256, x.shape, dtype=np.uint8)
    for bits in ("given", "philox"):
        kw = dict(rbits=rb) if bits == "given" else dict(seed=9)
        q = fs.quantize(x, scheme, rounding="sr", rbits_mapping="midpoint", **kw)
        r = rb if bits == "given" else philox_bytes(9, x.size).reshape(x.shape)
        if ref == "nvfp4":
            codes, scales = nvfp4_ref(x, tile=16 if scheme == "nvfp4_2d" else 1, rounding="sr_midpoint", rb=r)
        else:
            codes, scales = mx_ref(x, rounding="sr_midpoint", rb=r)
        assert np.array_equal(fs.layout.unpack_fp4(q.codes)[:, :72], codes[:, :72]), bits
        assert np.array_equal(np.asarray(q.scales), scales[: q.scales.shape[0]]), bits
        te = fs.quantize(x, scheme, rounding="sr", **kw)
        assert not np.array_equal(te.codes, q.codes)


def test_a_training_operand_rounds_by_the_midpoint_rule():
    """Recipe switch rbits_mapping='midpoint' on nvfp4_paper: every SR operand takes it, on the general and the
    fast path alike, and it equals fs.quantize with the operand's Philox key and stream."""
    from fp4sim import emulate
    from fp4sim.training import Recipe
    rng = np.random.default_rng(2)
    dy = rng.standard_normal((64, 32)).astype(np.float32)
    w = rng.standard_normal((32, 48)).astype(np.float32)
    outs = []
    for acc in ("exact", "fast"):
        rec = Recipe.preset("nvfp4_paper", rbits_mapping="midpoint", accumulate=acc, seed=7)
        assert rec.dgrad_dy.rbits_mapping == rec.wgrad_dy.rbits_mapping == "midpoint"
        assert rec.fprop_x.rbits_mapping == "te" and "SR-mid" in rec.dgrad_dy.label()
        outs.append(emulate.dgrad(dy, w, rec, 2, 3))
    qdy = fs.quantize(dy, "nvfp4", rounding="sr", seed=emulate.layer_seed(7, 2), stream=3 * 8 + 2,
                      rbits_mapping="midpoint")
    qw = fs.quantize(w, "nvfp4", axis=0, block=(16, 16))
    assert outs[0].tobytes() == fs.gemm(qdy, qw).tobytes()
    want = fs.dequantize(qdy).astype(np.float64) @ fs.dequantize(qw).astype(np.float64)
    assert np.abs(outs[1] - want).max() <= 1e-4 * np.abs(want).max()
    te = emulate.dgrad(dy, w, Recipe.preset("nvfp4_paper", seed=7), 2, 3)
    assert not np.array_equal(te, outs[0])


def test_midpoint_is_checked():
    from fp4sim.training import Operand, Recipe
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="rbits_mapping"):
        fs.encode(x, fs.E2M1, rounding="sr", seed=1, rbits_mapping="middle")
    with pytest.raises(ValueError, match="rounds to nearest"):
        Operand("nvfp4", rbits_mapping="midpoint")
    with pytest.raises(ValueError, match="rounds nothing stochastically"):
        Recipe.preset("nvfp4_paper", rbits_mapping="midpoint", disable_stochastic_rounding=True)


def test_validate_names_the_midpoint_rule():
    """Statistically (the kernel's bits unknown): a midpoint kernel passes under rbits_mapping='midpoint', and
    under TE's rule fails with a finding naming the midpoint rule (and the reverse); with the bits given, the
    diagnosis names rbits_mapping='midpoint' as the exact match."""
    from fp4sim.validate import compare
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1024, 2048)).astype(np.float32)
    mid = fs.quantize(x, "nvfp4", rounding="sr", seed=21, rbits_mapping="midpoint")
    te = fs.quantize(x, "nvfp4", rounding="sr", seed=21)
    ok = compare(x, mid.codes, mid.scales, "nvfp4", rounding="sr", rbits_mapping="midpoint")
    assert ok.sr["passed"] and ok.sr["rule"] == "midpoint"
    bad = compare(x, mid.codes, mid.scales, "nvfp4", rounding="sr")
    assert not bad.sr["passed"]
    assert any("that of the midpoint rule" in f and "rbits_mapping='midpoint'" in f for f in bad.sr["findings"])
    rev = compare(x, te.codes, te.scales, "nvfp4", rounding="sr", rbits_mapping="midpoint")
    assert not rev.sr["passed"] and any("TE's truncating rule" in f for f in rev.sr["findings"])
    assert compare(x, te.codes, te.scales, "nvfp4", rounding="sr").sr["passed"]
    small = x[:64, :256]
    rb = rng.integers(0, 256, small.shape, dtype=np.uint8)
    q = fs.quantize(small, "nvfp4", rounding="sr", rbits=rb, rbits_mapping="midpoint")
    r = compare(small, q.codes, q.scales, "nvfp4", rounding="sr", rbits=rb)
    assert not r.exact and r.diagnosis["exact_match"]
    assert "rbits_mapping='midpoint'" in r.diagnosis["best"]["label"]
