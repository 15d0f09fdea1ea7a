"""``fp4sim.analyze`` on a device (``device="cuda"``) gives the CPU path's numbers: codes, scale bytes, histograms,
counts, extrema, percentiles and per-block records exactly, float64 sums to the reassociation tolerance. Without a
GPU the device path runs on the host build of the same CUDA kernels (NumPy arrays); with one, on CuPy."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.analyze import analyze
from fp4sim.analyze import device as dev
from fp4sim.analyze import studies
from fp4sim.analyze.__main__ import SAMPLE
from fp4sim.analyze.metrics import BLOCK_FIELDS, DEFAULT_SCHEMES, EXTRA_SCHEMES, scheme_metrics
from fp4sim.gpu.backend import HostBackend

RTOL = 1e-12           # float64 sums of the same terms in another order
# the metrics that are float64 sums over a chunk (the others are counts, extrema, percentiles, ratios of counts)
SUMMED = {"mse", "rel_mse", "sqnr_db", "blockmax_rel_err", "scale_std"}


@pytest.fixture(scope="module", params=["host", pytest.param("cupy", marks=pytest.mark.gpu)])
def device(request):
    """The device path on the host build of the kernels (NumPy arrays), and on a GPU (CuPy) where there is one."""
    if request.param == "cupy":
        if not fs.gpu.available():
            pytest.skip("no CUDA device with CuPy: pip install '.[gpu]' (from the repository root)")
        from fp4sim.gpu.backend import default_backend
        return dev.Device(default_backend())
    return dev.Device(HostBackend(request.getfixturevalue("host_lib")))


# the weight-gradient GEMM's biases are means of differences of two float64 GEMMs (cuBLAS's order and FMAs on a GPU,
# NumPy's on the host), about 1e3 times smaller than the products: their reassociation shows 1e3 times larger
RTOL_WGRAD_BIAS = 1e-10


def _close(a, b, rtol=RTOL) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))
                                              | (np.abs(a - b) <= rtol * np.abs(b))))


def _same(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def _compare_datasets(got, ref):
    assert list(got.data_vars) == list(ref.data_vars)
    for v in ref.data_vars:
        g, r = got[v].values, ref[v].values
        if r.dtype.kind in "iubUO":
            assert np.array_equal(g, r), v
        elif v in SUMMED or not v.startswith(("code_hist", "scale_hist", "absmax_map", "n_")):
            assert _close(g, r, RTOL_WGRAD_BIAS if v.startswith("wgrad_bias") else RTOL), (v, g, r)
        else:
            assert _same(g, r), v
    for v in ("code_hist", "scale_hist", "absmax_map", "n_nan", "n_inf", "n_outlier_rows", "n_outlier_cols",
              "underflow_frac", "saturation_frac", "zero_code_frac", "lost_frac", "block_err_p50", "block_err_p90",
              "block_err_p99", "max_abs_err", "scale_min", "scale_max", "frac_blocks_amax_max", "binades_per_block",
              "gamax_window_out_frac", "dead_zone_frac", "status"):
        if v in ref:
            assert got[v].equals(ref[v]), v                    # exactly, not to a tolerance


def test_device_analysis_of_the_sample_equals_the_cpu(device):
    """Every tensor of the bundled sample, every default scheme, the studies and the weight-gradient GEMM of the
    sample's pair, in several row chunks."""
    ref = analyze([str(SAMPLE)], quiet=True, chunk_elems=1 << 16)
    got = analyze([str(SAMPLE)], quiet=True, chunk_elems=1 << 16, device=device.be)
    assert got.sizes["tensor"] == ref.sizes["tensor"] == 7 and "pair" in ref.coords
    _compare_datasets(got, ref)
    assert json.loads(got.attrs["skipped"]) == json.loads(ref.attrs["skipped"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_bfloat16_checkpoint_goes_to_the_device_as_stored(device, tmp_path, monkeypatch):
    """bfloat16 safetensors entries are copied to the device as they are and widened there from their bits
    (subnormals, NaN and Inf included): the CPU's numbers, and no float32 copy is made on the host."""
    import ml_dtypes
    from safetensors.numpy import save_file
    rng = np.random.default_rng(9)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    w[0, :5] = [1e-39, -3e-40, np.nan, np.inf, -np.inf]
    save_file({"model.layers.0.mlp.up_proj.weight": w.astype(ml_dtypes.bfloat16),
               "model.layers.0.mlp.down_proj.weight": rng.standard_normal((96, 64)).astype(ml_dtypes.bfloat16)},
              str(tmp_path / "model.safetensors"))
    ref = analyze([str(tmp_path)], quiet=True)
    widened = []
    real = np.ascontiguousarray

    def spy(a, dtype=None, **kw):
        if dtype is not None and a.dtype == np.dtype(ml_dtypes.bfloat16):
            widened.append(a.shape)
        return real(a, dtype=dtype, **kw)
    monkeypatch.setattr("fp4sim.analyze.inputs.np.ascontiguousarray", spy)
    got = analyze([str(tmp_path)], quiet=True, device=device.be)
    assert not widened
    _compare_datasets(got, ref)
    assert int(got["n_nan"].sum()) == 1 and int(got["n_inf"].sum()) == 2


def _adversarial():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((300, 40)) * np.exp(rng.normal(0, 3, (300, 1)))).astype(np.float32)
    x[0, :16] = 0                                     # an all-zero block
    x[1, :] = 3.0                                     # constant blocks
    x[2, 5] = np.float32(3e38)                        # near FLT_MAX
    x[3, :7] = np.float32(1e-41)                      # subnormals
    x[4, 3], x[5, 17], x[6, 39] = np.nan, np.inf, -np.inf
    x[7:9] = np.float32(2.0 ** -130)
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("role", ["weight", "gradient"])
def test_device_scheme_metrics_equal_the_cpu_on_adversarial_tensors(device, role):
    """Ragged blocks (40 columns), several chunks, zeros, constant blocks, extremes, subnormals, NaN and Inf: every
    scheme's metrics, histograms and per-block records (bytes)."""
    x = _adversarial()
    for spec in DEFAULT_SCHEMES + EXTRA_SCHEMES:
        if role not in spec.roles:
            continue
        gb, rb = [], []
        with np.errstate(all="ignore"):
            got = dev.scheme_metrics(device, device.upload(x), spec, role, 5, 1 << 12, blocks=gb)
            ref = scheme_metrics(x, spec, role, 5, 1 << 12, blocks=rb)
        for k in ref[0]:
            ok = _close if k in SUMMED else _same
            assert ok(got[0][k], ref[0][k]), (spec.label, k, got[0][k], ref[0][k])
        assert np.array_equal(got[1], ref[1]) and np.array_equal(got[2], ref[2]), spec.label
        assert len(gb) == len(rb) == 3
        for g, r in zip(gb, rb):
            for f in BLOCK_FIELDS:
                assert g[f].dtype == r[f].dtype and np.array_equal(g[f].view(np.uint8), r[f].view(np.uint8)), \
                    (spec.label, f)
    device.k.poll_warnings(wait=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_device_studies_equal_the_cpu_on_adversarial_tensors(device):
    x = _adversarial()
    xd = device.upload(x)
    with np.errstate(all="ignore"):
        got, ref = dev.outliers(device, xd, chunk_elems=1 << 12), studies.outliers(x, chunk_elems=1 << 12)
        for k in ref:
            assert (_close if k in ("kurtosis", "max_over_rms") or "rel_mse" in k or "share" in k else _same)(
                got[k], ref[k]), (k, got[k], ref[k])
        assert _same(dev.absmax_map(device, xd, chunk_elems=1 << 12), studies.absmax_map(x, chunk_elems=1 << 12))
        g, r = dev.gradient_bias(device, xd, 3, chunk_elems=1 << 12), studies.gradient_bias(x, 3,
                                                                                            chunk_elems=1 << 12)
        for k in r:
            assert _close(g[k], r[k]), (k, g[k], r[k])
        x16 = x[:, :32].copy()                                         # every transform length applies
        x16[~np.isfinite(x16)] = 1.0
        dg, eg, kg = dev.hadamard_effect(device, device.upload(x16), 2, chunk_elems=1 << 12)
        dr, er, kr = studies.hadamard_effect(x16, 2, chunk_elems=1 << 12)
        assert dg == dr and _close(eg, er) and _close(kg, kr)
    device.k.poll_warnings(wait=True)          # the inputs' deferred warnings, under this test's filter


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_device_sums_are_the_exact_sums_to_the_tolerance(device):
    """an_sums against math.fsum over the finite elements (an independent oracle for the partial sums)."""
    import math
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(100_003) * 1e3).astype(np.float32)
    y = fs.fake_quantize(x, "mxfp4")
    x[[5, 70_000]] = [np.nan, np.inf]
    s, am = device.sums(device.upload(x), device.upload(y), mean=0.5)
    f = np.isfinite(x)
    x64, e = x[f].astype(np.float64), y[f].astype(np.float64) - x[f]
    assert s[dev.N] == f.sum() and s[dev.NNAN] == 1 and s[dev.NINF] == 1
    assert am[0] == np.inf and am[1] == np.abs(x[f]).max()
    for col, terms in ((dev.S1, x64), (dev.S2, x64 ** 2), (dev.EA2, e ** 2), (dev.EA, e), (dev.SABS, np.abs(x64)),
                       (dev.D2, (x64 - 0.5) ** 2), (dev.EAS, e * np.sign(x64))):
        exact = math.fsum(terms)
        assert abs(s[col] - exact) <= 1e-13 * math.fsum(np.abs(terms)), col


def test_percentiles_from_a_sorted_array_are_numpys():
    """A device's block-error percentiles come from its sorted copy, the CPU's from one partition at the order
    statistics they read, with NumPy's interpolation rule applied on the host: np.percentile's bits, for every
    size, ties, Inf, NaN and the edges (NumPy itself is the oracle)."""
    from fp4sim.analyze.metrics import percentile_indices, percentile_of_sorted
    rng = np.random.default_rng(0)
    qs = (0, 1, 33.3, 50, 90, 99, 100)
    for n in list(range(1, 140)) + [1000, 4097, 65536]:
        for kind in range(4):
            a = rng.standard_normal(n) ** 2
            if kind == 1:
                a = np.round(a, 1)                           # ties
            if kind == 2 and n > 3:
                a[:2] = np.inf
            if kind == 3 and n > 3:
                a[n // 2] = np.nan
            part = np.partition(a, percentile_indices(n, qs))
            for q in qs:
                with np.errstate(invalid="ignore"):
                    want = np.float64(np.percentile(a, q))
                for got in (np.float64(percentile_of_sorted(np.sort(a), q)),
                            np.float64(percentile_of_sorted(part, q))):
                    assert want.view(np.int64) == got.view(np.int64) or np.isnan(want) and np.isnan(got), \
                        (n, kind, q)


def test_summaries_on_a_device_module_equal_numpys():
    """metrics.summarise with an array module that is not NumPy (the device's route: sort, then percentiles from
    two order statistics) gives NumPy's route's numbers, bit for bit."""
    from fp4sim.analyze.metrics import summarise

    class OtherXp:                                            # NumPy's functions under another module
        def __getattr__(self, name):
            return getattr(np, name)
    rng = np.random.default_rng(5)
    spec = DEFAULT_SCHEMES[0]
    blk = [rng.standard_normal(n) ** 2 for n in (1000, 37, 4096)]
    sv = [rng.standard_normal(300).astype(np.float32)]
    acc = dict(sx2=3.0, se2=0.5, n=5133, max_err=0.1, under=3, nz=5000, sat=1, zero=7, bm_err=2.0, bm_n=300, nblk=300,
               blk_max=12, binades=700.0, fin=5133, lost=0, win_out=2, dead=4)
    want = summarise(dict(acc), list(blk), list(sv), np.zeros(256, np.int64), np.zeros(16, np.int64), spec, "tensor")
    got = summarise(dict(acc), list(blk), list(sv), np.zeros(256, np.int64), np.zeros(16, np.int64), spec, "tensor",
                    OtherXp())
    for k in want[0]:                     # the worst 1% summed in ascending order on both routes: the same bits
        assert _same(got[0][k], want[0][k]), k


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fp4sim.analyze", *args], capture_output=True, text=True, timeout=120)


def test_cli_device_cuda_without_a_gpu_is_refused_with_the_fix():
    if fs.gpu.available():
        pytest.skip("a CUDA device is present: the refusal is for machines without one")
    r = _cli("--device", "cuda", "--quiet")
    assert r.returncode == 2 and "--device cuda" in r.stderr and "pip install '.[gpu]'" in r.stderr
    r = _cli("--device", "cuda", "--dask", "--quiet")
    assert r.returncode == 2 and "leave out --dask" in r.stderr
    with pytest.raises(ValueError, match="device='cuda' needs CuPy"):
        analyze([str(SAMPLE)], device="cuda", quiet=True)
    with pytest.raises(ValueError, match="give 'cpu' or 'cuda'"):
        analyze([str(SAMPLE)], device="gpu", quiet=True)


@pytest.mark.gpu
def test_device_cuda_analysis_of_the_sample_equals_the_cpu():
    if not fs.gpu.available():
        pytest.skip("no CUDA device with CuPy: pip install '.[gpu]' (from the repository root)")
    ref = analyze([str(SAMPLE)], quiet=True, chunk_elems=1 << 16)
    got = analyze([str(SAMPLE)], quiet=True, chunk_elems=1 << 16, device="cuda")
    _compare_datasets(got, ref)
