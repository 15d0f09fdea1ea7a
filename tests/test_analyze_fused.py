"""The one-pass analysis kernels give the NumPy reference path's numbers bit for bit: every scalar metric, the
code and scale histograms and the per-block records, for every scheme and role, on the bundled sample's real
tensors and on adversarial ones (zeros, constant blocks, extremes, subnormals, NaN / Inf, ragged blocks,
several chunks)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from fp4sim.analyze.metrics import DEFAULT_SCHEMES, EXTRA_SCHEMES, BLOCK_FIELDS, scheme_metrics
from fp4sim.cpu import analysis as ka

SCHEMES = DEFAULT_SCHEMES + EXTRA_SCHEMES


def _same(a, b) -> bool:
    """Equal as float64 bit patterns (NaN equal to NaN, -0 unequal to +0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and np.array_equal(a.view(np.int64), b.view(np.int64))


def _compare(x, role, chunk_elems=1 << 22):
    for spec in SCHEMES:
        if role not in spec.roles:
            continue
        got_blocks, ref_blocks = [], []
        got = scheme_metrics(x, spec, role, 3, chunk_elems, blocks=got_blocks, _fused=True)
        ref = scheme_metrics(x, spec, role, 3, chunk_elems, blocks=ref_blocks, _fused=False)
        for k in ref[0]:
            assert _same(got[0][k], ref[0][k]), (spec.label, role, k, got[0][k], ref[0][k])
        assert np.array_equal(got[1], ref[1]) and np.array_equal(got[2], ref[2]), spec.label
        assert len(got_blocks) == len(ref_blocks)
        for g, r in zip(got_blocks, ref_blocks):
            for f in BLOCK_FIELDS:
                assert g[f].dtype == r[f].dtype and np.array_equal(g[f].view(np.uint8), r[f].view(np.uint8)), \
                    (spec.label, f)


@pytest.fixture(scope="module")
def sample():
    from fp4sim.analyze.__main__ import SAMPLE
    with np.load(SAMPLE, allow_pickle=False) as z:
        return {k: z[k] for k in z.files if k != "__meta__"}


def test_fused_metrics_equal_the_reference_on_the_bundled_sample(sample):
    from fp4sim.analyze.inputs import infer_role
    done = set()
    for name, x in sample.items():
        role = infer_role(name)
        if x.ndim < 2 or role in done and role != "gradient":
            continue
        done.add(role)
        _compare(x.astype(np.float32), role, chunk_elems=1 << 16)       # several chunks


def _adversarial():
    rng = np.random.default_rng(7)
    g = rng.standard_normal((256, 96)).astype(np.float32)
    out = {"zeros": np.zeros((128, 64), np.float32),
           "negative zeros": np.full((128, 64), -0.0, np.float32),
           "constant blocks": np.repeat(rng.standard_normal((128, 4)).astype(np.float32), 16, axis=1),
           "ragged K": rng.standard_normal((130, 50)).astype(np.float32),
           "one row": rng.standard_normal((1, 300)).astype(np.float32),
           "long rows": rng.standard_normal((4, 3000)).astype(np.float32),
           "subnormals": (rng.standard_normal((128, 64)) * 1e-42).astype(np.float32),
           "extremes": (np.sign(g) * np.float32(3.0e38) * (np.abs(g) > 1.5)).astype(np.float32),
           "spread": (g * np.exp2(rng.integers(-100, 100, g.shape))).astype(np.float32)}
    bad = g.copy()
    bad[3, 5], bad[7, 1], bad[100, 90] = np.nan, np.inf, -np.inf
    out["NaN and Inf"] = bad
    mixed = g.copy()
    mixed[:, :16] = 0
    mixed[5] = 1e-40
    out["zero blocks and tiny rows"] = mixed
    return out


@pytest.mark.parametrize("case", list(_adversarial()))
@pytest.mark.parametrize("role", ["weight", "activation", "gradient"])
def test_fused_metrics_equal_the_reference_on_adversarial_tensors(case, role):
    _compare(_adversarial()[case], role, chunk_elems=1 << 13)


def test_chunk_sums_are_numpys_pairwise_sums():
    """chunk_sums against np.sum itself on lengths around the tree's boundaries (8, 128, odd splits)."""
    rng = np.random.default_rng(1)
    for n in (1, 7, 8, 9, 127, 128, 129, 255, 1000, 8193, 100_003, 1_000_000):
        x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
        y = (x + rng.standard_normal(n).astype(np.float32) * 1e-3).astype(np.float32)
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        assert ka.chunk_sums(x, y, 0) == np.sum((y64 - x64) ** 2), n
        assert ka.chunk_sums(x, y, 1) == np.sum(x64 ** 2), n


def _close(a, b, rel) -> bool:
    """Equal within ``rel`` (NaN where NaN, infinities equal)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        return a.shape == b.shape and bool(np.all(same | (np.abs(a - b) <= rel * np.abs(b))))


@pytest.mark.parametrize("case", ["sample", "spread", "NaN and Inf", "zeros", "ragged K", "subnormals",
                                  "constant blocks", "extremes"])
def test_studies_kernels_equal_the_masked_numpy_path(case, sample, monkeypatch):
    """The outlier study, the kurtosis and the Hadamard study through the one-read kernels (compensated segment
    sums) against the masked NumPy path (float64 copies reduced by NumPy): counts and every quantity that takes
    no float64 sum of the studies' moments bit for bit, the sums' results to 1e-12 (NumPy's own reductions are
    within n * 2^-53 of the exact sum; the kernels within a few ulps, see the next test)."""
    from fp4sim.analyze import studies
    x = next(v for k, v in sample.items() if k.endswith("ffn_down.input")) if case == "sample" else \
        _adversarial()[case]
    x = np.ascontiguousarray(x, np.float32)
    got = {}
    for fast in (True, False):
        monkeypatch.setattr(studies, "_FAST", fast)
        o = studies.outliers(x, chunk_elems=1 << 13)
        dims, err, kur = studies.hadamard_effect(x, 1, chunk_elems=1 << 13)
        got[fast] = (o, err, kur, studies.kurtosis(x))
    (o1, e1, k1, q1), (o0, e0, k0, q0) = got[True], got[False]
    assert o1.keys() == o0.keys()
    for k in o0:
        if k.startswith("n_") or k.endswith("_frac") or k.startswith("nvfp4_") or k.endswith("_share"):
            assert _same(o1[k], o0[k]), (k, o1[k], o0[k])
        else:
            assert _close(o1[k], o0[k], 1e-12), (k, o1[k], o0[k])
    assert _close(e1, e0, 1e-12) and _close(k1, k0, 1e-12) and _close(q1, q0, 1e-12), (e1 - e0, k1 - k0)


@pytest.mark.parametrize("case", ["sample", "spread", "NaN and Inf", "zeros", "negative zeros", "subnormals",
                                  "constant blocks", "extremes", "zero blocks and tiny rows", "several segments"])
def test_hadamard_study_sums_without_the_dequantized_chunks(case, sample):
    """fq_err_moments (the Hadamard study's NVFP4 and MXFP4 errors with the fake-quantized values made inside the
    kernel) gives err_moments's sums over fs.fake_quantize's own outputs bit for bit, for tensor amaxes at,
    above and below the chunk's, zero, Inf and near FLT_MAX, and with and without a mean."""
    import fp4sim as fs
    from fp4sim.analyze import studies
    cases = dict(_adversarial(), sample=next(v for k, v in sample.items() if k.endswith("ffn_down.input")))
    cases["several segments"] = cases["long rows"][:, :2976] * np.float32(1e3)   # rows across 1024-segments
    x = np.ascontiguousarray(cases[case], np.float32)
    assert x.shape[1] % 32 == 0 and studies._fq_consts() is not None
    assert studies._fq_sums(_adversarial()["ragged K"], np.float32(1)) is None      # K % 32 != 0: fake_quantize
    fin = x[np.isfinite(x)]
    a0 = np.float32(np.abs(fin).max()) if fin.size else np.float32(0)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for amax in (a0, np.float32(a0 * 7), np.float32(a0 / 3), np.float32(0), np.float32(np.inf),
                     np.float32(3.0e38)):
            ya = fs.fake_quantize(x, "nvfp4", global_amax=amax).reshape(-1)
            yb = fs.fake_quantize(x, "mxfp4").reshape(-1)
            for mean in (0.0, float(np.mean(fin, dtype=np.float64)) if fin.size else 0.5):
                want = ka.err_moments(x.reshape(-1), ya, yb, 2, mean)
                got = studies._fq_sums(x, amax, mean)
                assert _same(got, want), (case, amax, mean, got, want)


def test_studies_sums_against_exact_sums():
    """The kernels' sums against math.fsum (the exactly rounded sum) of the same float64 terms: the kurtosis, the
    moments' raw sums and the Hadamard study's MXFP4 error, on wide-ranging values with NaN and Inf (masked out)
    and lengths around the segment size."""
    import math
    import fp4sim as fs
    from fp4sim.analyze import studies
    rng = np.random.default_rng(5)
    for n in (1, 1023, 1024, 1025, 3 * 1024 + 7, 200_000):
        x = (rng.standard_normal(n) * np.exp2(rng.integers(-24, 24, n))).astype(np.float32)
        x[::89] = np.nan
        x[1::131] = -np.inf
        out, ab = ka.moments1(x)
        v = x[np.isfinite(x)].astype(np.float64)
        assert out[0] == v.size and out[3] == (np.abs(v).max() if v.size else 0.0)
        assert np.uint32(ab).view(np.float32) == np.max(np.abs(x[~np.isnan(x)]), initial=0)
        # a signed sum: within a few ulps of the sum of magnitudes
        assert abs(out[1] - math.fsum(v)) <= 4 * 2.0 ** -52 * np.abs(v).sum()
        assert _close(out[2], math.fsum(v * v), 1e-13)
        ya = fs.fake_quantize(x.reshape(1, -1), "nvfp4").reshape(-1)
        yb = fs.fake_quantize(x.reshape(1, -1), "mxfp4").reshape(-1)
        mean = out[1] / out[0] if out[0] else 0.0
        em = ka.err_moments(x, ya, yb, 2, mean)
        fin = np.isfinite(x)
        d = v - mean
        want = [math.fsum(v * v), math.fsum((ya[fin].astype(np.float64) - v) ** 2),
                math.fsum((yb[fin].astype(np.float64) - v) ** 2), math.fsum(d * d), math.fsum(d ** 4), v.size]
        assert all(_close(g, w, 1e-13) for g, w in zip(em, want)), (n, em, want)    # 2^-53 * SEG / 2 worst case
    x = (rng.standard_normal((64, 128)) * np.exp(rng.standard_normal((64, 1)))).astype(np.float32)
    v = x.astype(np.float64).ravel()
    d = v - math.fsum(v) / v.size
    m2, m4 = math.fsum(d * d) / v.size, math.fsum(d ** 4) / v.size
    assert _close(studies.kurtosis(x), m4 / m2 ** 2, 1e-14)
    dims, err, _ = studies.hadamard_effect(x, 2, chunk_elems=1 << 12)
    xr = fs.rht(x, 32, 3, out="fp32")
    y = fs.fake_quantize(xr, "mxfp4").astype(np.float64)
    xr64 = xr.astype(np.float64)
    assert _close(err[dims.index(32), 1, 1], math.fsum(((y - xr64) ** 2).ravel()) / math.fsum((xr64 ** 2).ravel()),
                  1e-14)
