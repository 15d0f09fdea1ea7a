"""fp4sim.gemm's NVFP4 accumulation models (exact_sum, kG_rne, kG_rtz, the 1/1024 grid) against an oracle
written from the rules with exact rational arithmetic: the operands decoded from their code nibbles and scale
bytes by the formats' definitions, every product and sum a Fraction, every rounding done on the rational."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.gemm import NVFP4_MODELS
from fp4sim.training import Recipe

rng = np.random.default_rng(20261203)


def e2m1(c):
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    v = Fraction(m, 2) if e == 0 else (1 + Fraction(m, 2)) * Fraction(2) ** (e - 1)
    return -v if s else v


def e4m3(b):
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return None                                       # NaN
    v = Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
    return -v if s else v


def round32(x: Fraction, mode: str) -> float:
    """x rounded to float32 (normal or subnormal range) to nearest-even ('rne') or toward zero ('rtz')."""
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)                                      # 2^e <= a < 2^(e+1)
    q = a / Fraction(2) ** (e - 23)
    n = q.numerator // q.denominator
    rem = q - n
    if mode == "rne" and (rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2)):
        n += 1
    v = float(Fraction(n) * Fraction(2) ** (e - 23))
    assert np.float32(v) == v
    return v if x > 0 else -v


def decoded(q):
    """Each row's decoded elements (E2M1 value x E4M3 block scale) as Fractions, and whether a scale is NaN."""
    codes = q.codes.reshape(q.lead[0], -1)
    sb = q.scales_per_row()
    rows, nan = [], []
    for r in range(codes.shape[0]):
        nib = [int(c) & 15 for c in codes[r] for c in (c, c >> 4)]
        sc = [e4m3(int(b)) for b in sb[r]]
        nan.append(any(s is None for s in sc))
        rows.append([e2m1(n) * (sc[k // 16] or 0) for k, n in enumerate(nib[:16 * len(sc)])])
    return rows, nan


def alpha(qa, qb):
    """TE's alpha: fl(fl(amax_a * amax_b) / fl(6 * 6 * 448 * 448)) (per row of A / of B when row-scaled)."""
    ga = np.asarray(qa.global_amax, np.float32).reshape(-1, 1)
    gb = np.asarray(qb.global_amax, np.float32).reshape(1, -1)
    div = np.float32(36.0 * qa.scheme.e4m3_max * qb.scheme.e4m3_max)
    return (ga * gb) / div


def parts(q):
    """Each row's E2M1 element values and its decoded E4M3 block scales, as Fractions (None: a NaN scale)."""
    codes = q.codes.reshape(q.lead[0], -1)
    sb = q.scales_per_row()
    return [([e2m1(int(c) & 15) if i % 2 == 0 else e2m1(int(c) >> 4) for c in codes[r] for i in (0, 1)]
             [:16 * sb.shape[1]], [e4m3(int(b)) for b in sb[r]]) for r in range(codes.shape[0])]


def cell(a, b, model, grid=None) -> float:
    """The accumulator (before alpha) of one dot product of decoded rows under a model, from the rule (tcgen05:
    ``a`` and ``b`` are (elements, block scales) pairs from :func:`parts`)."""
    if model == "tcgen05":
        from fp4sim.reference.tensorcore import tcgen05_fp4
        (ea, sa), (eb, sb) = a, b
        pad = (-len(ea)) % 64
        return float(tcgen05_fp4(ea + [0] * pad, sa + [0] * (pad // 16), eb + [0] * pad, sb + [0] * (pad // 16),
                                 16, -6))
    prods = [x * y for x, y in zip(a, b)]
    if model == "exact_sum":
        return round32(sum(prods, Fraction(0)), "rne")
    if model == "te_reference":
        model = "k16_rne"                       # exact per 16-element block, nearest-even sums in block order
    g, rule = int(model[1:].split("_")[0]), model.split("_")[1]
    acc = 0.0
    for k in range(0, len(prods), g):
        p = round32(sum(prods[k:k + g], Fraction(0)), "rne")
        acc = round32(Fraction(acc) + Fraction(p), rule)
    if grid:
        # round(): ties to even; IEEE's roundToIntegral keeps the sign of a negative value that rounds to 0
        acc = float(np.copysign(round32(Fraction(round(Fraction(acc) * grid), grid), "rne"), acc))
    return acc


def oracle(qa, qb, model, grid=None):
    A, na = decoded(qa)
    B, nb = decoded(qb)
    if model == "tcgen05":
        A, B = parts(qa), parts(qb)
    c = np.zeros((len(A), len(B)), np.float32)
    for i, a in enumerate(A):
        for j, b in enumerate(B):
            c[i, j] = np.nan if na[i] or nb[j] else cell(a, b, model, grid)
    return alpha(qa, qb) * c


def spread(R, K, binades=8, zero_blocks=0.0):
    """Rows whose 16-element blocks have amaxes spread over +-``binades`` binades (so group sums exceed 24 bits
    and the rules differ); a share of blocks all zero."""
    nb = -(-K // 16)
    s = np.exp2(rng.uniform(-binades, binades, (R, nb)))
    s[rng.random((R, nb)) < zero_blocks] = 0
    return (rng.standard_normal((R, K)) * s.repeat(16, 1)[:, :K]).astype(np.float32)


def same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    na, nb_ = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb_)
    np.testing.assert_array_equal(a[~na].view(np.uint32), b[~nb_].view(np.uint32))


def pair(M, N, K, block_a=(1, 16), block_b=(1, 16), **kw):
    qa = fs.quantize(spread(M, K, **kw), "nvfp4", block=block_a)
    qb = fs.quantize(spread(N, K, **kw), "nvfp4", block=block_b)
    return qa, qb


CASES = {"K=256": dict(M=5, N=4, K=256), "K=208 (a partial last group)": dict(M=4, N=3, K=208),
         "K=40": dict(M=3, N=3, K=40), "16x16 weights": dict(M=4, N=18, K=192, block_b=(16, 16)),
         "zero blocks": dict(M=4, N=4, K=256, zero_blocks=0.3), "narrow": dict(M=4, N=4, K=320, binades=1)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", NVFP4_MODELS + ("tcgen05",))
def test_models_against_the_rational_oracle(case, model):
    qa, qb = pair(**CASES[case])
    same_bits(fs.gemm(qa, qb, accumulate=model), oracle(qa, qb, model))


@pytest.mark.parametrize("model", ["k64_rtz", "k64_rne", "k32_rtz"])
def test_the_grid_against_the_oracle(model):
    # operands small against their tensor amax (so block scales are small and the accumulator has bits below
    # 1/1024, which the grid removes), and an alpha that is not a power of two (so snapping after alpha differs)
    qa = fs.quantize(spread(6, 256, 4) * np.float32(1e-3), "nvfp4", global_amax=np.float32(3000.0))
    qb = fs.quantize(spread(5, 256, 4) * np.float32(1e-3), "nvfp4", global_amax=np.float32(2900.0))
    assert np.log2(float(alpha(qa, qb)[0, 0])) % 1 != 0
    y = fs.gemm(qa, qb, accumulate=model, grid=1024)
    same_bits(y, oracle(qa, qb, model, grid=1024))
    assert not np.array_equal(y.view(np.uint32), fs.gemm(qa, qb, accumulate=model).view(np.uint32))


def test_k16_rne_is_te_reference_and_models_differ_on_spread_operands():
    """With 16-product groups and nearest additions the model is TE's reference rule (both exact per block, RNE
    in block order); on operands whose block amaxes span 16 binades the models give different outputs."""
    qa, qb = pair(24, 20, 512)
    ref = fs.gemm(qa, qb, accumulate="te_reference")
    same_bits(fs.gemm(qa, qb, accumulate="k16_rne"), ref)
    same_bits(fs.gemm(qa, qb, accumulate="exact"), ref)
    outs = {m: fs.gemm(qa, qb, accumulate=m).view(np.uint32) for m in ("exact_sum", "k64_rtz", "k64_rne", "k32_rtz",
                                                                        "k128_rtz", "te_reference")}
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (outs[a] != outs[b]).any(), (a, b)


def test_the_order_of_the_k_groups_matters_for_rtz_and_not_for_exact_sum():
    """Permuting the 16-element K blocks of both operands alike keeps every product: exact_sum is unchanged, the
    grouped models see other partials in another order (and the oracle follows them)."""
    a, b = spread(6, 512), spread(5, 512)
    perm = rng.permutation(32)
    idx = (perm[:, None] * 16 + np.arange(16)).reshape(-1)
    q = [fs.quantize(x, "nvfp4", global_amax=np.float32(np.abs(x).max())) for x in (a, b, a[:, idx], b[:, idx])]
    same_bits(fs.gemm(q[0], q[1], accumulate="exact_sum"), fs.gemm(q[2], q[3], accumulate="exact_sum"))
    y0, y1 = fs.gemm(q[0], q[1], accumulate="k64_rtz"), fs.gemm(q[2], q[3], accumulate="k64_rtz")
    assert (y0.view(np.uint32) != y1.view(np.uint32)).any()
    same_bits(y1, oracle(q[2], q[3], "k64_rtz"))


def test_row_scaled_alphas_and_nan_scales():
    a, b = spread(4, 128), spread(3, 128)
    qa = fs.quantize(a, "nvfp4", row_scaled=True)
    qb = fs.quantize(b, "nvfp4")
    same_bits(fs.gemm(qa, qb, accumulate="k64_rtz"), oracle(qa, qb, "k64_rtz"))
    q = fs.quantize(a, "nvfp4")
    sc = q.scales.copy()
    sc[2, 4] = 0x7F                                   # an E4M3 NaN scale byte in row 2
    qn = dataclasses.replace(q, scales=sc)
    y = fs.gemm(qn, qb, accumulate="k64_rtz")
    ref = fs.gemm(qn, qb, accumulate="te_reference")
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert np.isnan(y[2]).all() and not np.isnan(np.delete(y, 2, 0)).any()
    same_bits(y, oracle(qn, qb, "k64_rtz"))


def test_accumulate_names_and_errors():
    qa, qb = pair(2, 2, 64)
    with pytest.raises(ValueError, match="accumulate='k64'.*'k64_rtz'"):
        fs.gemm(qa, qb, accumulate="k64")
    with pytest.raises(ValueError, match="grid=1000: a power of two"):
        fs.gemm(qa, qb, accumulate="k64_rtz", grid=1000)
    with pytest.raises(ValueError, match="grid=1024 applies to the kG"):
        fs.gemm(qa, qb, accumulate="exact_sum", grid=1024)
    mx = fs.quantize(spread(2, 64), "mxfp4")
    with pytest.raises(ValueError, match="NVFP4 accumulation model"):
        fs.gemm(mx, mx, accumulate="k64_rtz")
    with pytest.raises(ValueError, match="accumulate='k64_rtz_x'"):
        Recipe.preset("nvfp4_paper", accumulate="k64_rtz_x")


def test_a_recipe_trains_with_an_accumulation_model():
    """Recipe(accumulate="k64_rtz", accumulate_grid=1024): Fprop's NVFP4 GEMM is fs.gemm of its two operands under
    that model (not TE's rule); a BF16 recipe with the same name falls back to its exact rule."""
    from fp4sim import emulate
    x, w = spread(32, 256), spread(24, 256)
    r = Recipe.preset("nvfp4_paper", accumulate="k64_rtz", accumulate_grid=1024)
    y, _ = emulate.fprop(x, w, r)
    qx = emulate.quantize_operand(x, r.fprop_x, 1, r, 0, 0, "fprop_x")
    qw = emulate.quantize_operand(w, r.fprop_w, 1, r, 0, 0, "fprop_w")
    same_bits(y, fs.gemm(qx, qw, accumulate="k64_rtz", grid=1024))
    assert not np.array_equal(y.view(np.uint32), fs.gemm(qx, qw, accumulate="exact").view(np.uint32))
    rb = Recipe.preset("bf16", accumulate="k64_rtz")
    same_bits(emulate.fprop(x, w, rb)[0], emulate.fprop(x, w, Recipe.preset("bf16"))[0])


def _lattice_ints(q):
    """Twice the E2M1 values (rows, Kp) and 512 x the E4M3 block scales (rows, Kp/16) as int64, decoded from the
    code nibbles and scale bytes by the formats' definitions (no NaN scales)."""
    codes = q.codes.reshape(q.lead[0], -1)
    nib = np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1).astype(np.int64)
    s, e, m = nib >> 3, (nib >> 1) & 3, nib & 1
    half = np.where(e == 0, m, (2 + m) << np.maximum(e - 1, 0))          # 2 x (1 + m/2) x 2^(e-1), or m / 2 x 2
    half = np.where(s == 1, -half, half)
    sb = q.scales_per_row().astype(np.int64)
    se, sm = (sb >> 3) & 15, sb & 7
    assert not ((se == 15) & (sm == 7)).any() and not (sb >> 7).any()
    s512 = np.where(se == 0, sm, (8 + sm) << np.maximum(se - 1, 0))      # 512 x E4M3: m/8 x 2^-6 or (1 + m/8) x 2^(e-7)
    return half, s512


def test_a_gemm_larger_than_one_row_chunk_uses_each_chunks_own_rows():
    """M x K/16 x N above the CPU kernel's chunk of 2^22 block dot products: the rows are processed in several
    chunks, and every chunk must scale by its own rows' block scales. exact_sum over the whole matrix against a
    NumPy int64 computation of the exact dot products (rounded once to float32), and every model on cells of
    every chunk against the rational oracle."""
    from fp4sim.cpu import gemm_models
    M, N, K = 100, 384, 4096
    rows = gemm_models._CHUNK // (K // 16 * N)
    assert 1 < rows < M // 2                                # at least three chunks
    a, b = spread(M, K), spread(N, K)
    ga, gb = np.float32(np.abs(a).max()), np.float32(np.abs(b).max())
    qa, qb = fs.quantize(a, "nvfp4", global_amax=ga), fs.quantize(b, "nvfp4", global_amax=gb)
    A, SA = _lattice_ints(qa)
    B, SB = _lattice_ints(qb)
    tot = np.zeros((M, N), np.int64)
    for j in range(K // 16):
        blk = slice(16 * j, 16 * j + 16)
        tot += (A[:, blk] @ B[:, blk].T) * (SA[:, j, None] * SB[None, :, j])
    want = alpha(qa, qb) * (tot.astype(np.float32) * np.float32(2.0 ** -20))
    same_bits(fs.gemm(qa, qb, accumulate="exact_sum"), want)
    pick_r = [0, rows - 1, rows, 2 * rows - 1, 2 * rows, M - 1]      # both ends of every chunk
    pick_c = [0, 191, N - 1]
    sa = fs.quantize(a[pick_r], "nvfp4", global_amax=ga)             # 1x16 blocks: rows quantize independently
    sb = fs.quantize(b[pick_c], "nvfp4", global_amax=gb)
    for model in ("k64_rtz", "k32_rne", "exact_sum"):
        y = fs.gemm(qa, qb, accumulate=model)
        same_bits(np.ascontiguousarray(y[np.ix_(pick_r, pick_c)]), oracle(sa, sb, model))


def test_a_nan_block_scale_in_b_makes_its_output_column_nan():
    """As a NaN scale byte in A makes its output row NaN, one in B makes its column NaN, in every model and in
    TE's reference rule; the other cells keep the oracle's values."""
    a, b = spread(4, 128), spread(5, 128)
    qa, q = fs.quantize(a, "nvfp4"), fs.quantize(b, "nvfp4")
    sc = q.scales.copy()
    sc[3, 5] = 0xFF                                   # -NaN in E4M3 (S.1111.111), row 3 of B
    qb = dataclasses.replace(q, scales=sc)
    for model in ("te_reference", "exact_sum", "k64_rtz", "k128_rne"):
        y = fs.gemm(qa, qb, accumulate=model)
        assert np.isnan(y[:, 3]).all() and not np.isnan(np.delete(y, 3, 1)).any(), model
        same_bits(y, oracle(qa, qb, "k16_rne" if model == "te_reference" else model))
    y = fs.gemm(qa, qb, accumulate="k64_rtz", grid=1024)
    assert np.isnan(y[:, 3]).all() and not np.isnan(np.delete(y, 3, 1)).any()


@pytest.mark.parametrize("grid", [0, -1024, 3, 1024.0, True])
def test_a_grid_that_is_not_a_positive_power_of_two_is_refused(grid):
    qa, qb = pair(2, 2, 64)
    with pytest.raises(ValueError, match=rf"grid={grid!r}: a power of two"):
        fs.gemm(qa, qb, accumulate="k64_rtz", grid=grid)
    with pytest.raises(ValueError, match=rf"grid={grid!r}: a power of two"):
        Recipe.preset("nvfp4_paper", accumulate="k64_rtz", accumulate_grid=grid)
