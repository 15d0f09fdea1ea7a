"""fp4sim.analyze: metrics on inputs with known answers, the CLI end to end, bad inputs, Dask, roles."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr

import fp4sim as fs
from blockcases import heavy
from fp4sim.analyze import analyze, infer_role
from fp4sim.analyze.metrics import SCHEMES_BY_LABEL, scheme_metrics
from fp4sim.analyze.studies import gradient_bias, kurtosis, outliers, wgrad_gemm


def exactly_nvfp4(rows=32, cols=64, seed=0):
    """A tensor NVFP4 represents exactly: E2M1 values times power-of-two block scales, each block holding a
    +-6 element, and one block of amax 2688 so that S_enc = 1."""
    rng = np.random.default_rng(seed)
    v = fs.E2M1.values[rng.integers(0, 16, (rows, cols))].astype(np.float32)
    v.reshape(rows, -1, 16)[:, :, 0] = 6.0
    s = np.float32(2.0) ** rng.integers(-6, 6, (rows, cols // 16, 1)).astype(np.float32)
    x = (v.reshape(rows, -1, 16) * s).reshape(rows, cols)
    x[0, :16] = v[0, :16] * np.float32(448.0)
    return x


def test_exactly_representable_tensor_has_zero_nvfp4_error():
    x = exactly_nvfp4()
    m, codes, scales = scheme_metrics(x, SCHEMES_BY_LABEL["nvfp4"], "activation")
    assert m["mse"] == 0 and m["max_abs_err"] == 0 and m["underflow_frac"] == 0 and m["sqnr_db"] == np.inf
    assert m["frac_blocks_amax_max"] == 1.0 and codes.sum() == x.size
    assert scales.sum() == x.size // 16
    chunked, _, _ = scheme_metrics(x, SCHEMES_BY_LABEL["nvfp4"], "activation", chunk_elems=128 * 64 // 4)
    assert chunked["mse"] == 0


def test_mxfp4_lost_binade_shows_in_block_metrics():
    d = np.float32(3.0) + np.float32(2.0**-20)
    rng = np.random.default_rng(1)
    x = (rng.uniform(-1, 1, (64, 32)) * 3).astype(np.float32)
    x[:, 0] = d                                    # every block: amax 3 + delta
    mx, hist, _ = scheme_metrics(x, SCHEMES_BY_LABEL["mxfp4_rceil"], "activation")
    nv, _, _ = scheme_metrics(x, SCHEMES_BY_LABEL["nvfp4"], "activation")
    assert mx["frac_blocks_amax_max"] == 0.0       # rceil: the amax decodes as 3, codes +-4 and +-6 unused
    assert hist[[6, 7, 14, 15]].sum() == 0 and hist[[5, 13]].sum() >= 64
    assert nv["frac_blocks_amax_max"] == 1.0
    assert mx["binades_per_block"] < nv["binades_per_block"] and mx["rel_mse"] > nv["rel_mse"]


def test_chunked_metrics_equal_one_piece():
    x = heavy((1000, 96), 4)
    for label in ("nvfp4", "fp8_e4m3", "mxfp4_floor"):
        a, ca, sa = scheme_metrics(x, SCHEMES_BY_LABEL[label], "activation", chunk_elems=1 << 30)
        b, cb, sb = scheme_metrics(x, SCHEMES_BY_LABEL[label], "activation", chunk_elems=256 * 96)
        for k in ("mse", "max_abs_err", "underflow_frac", "zero_code_frac"):
            assert a[k] == pytest.approx(b[k], rel=1e-12), (label, k)
        assert np.array_equal(ca, cb) and np.array_equal(sa, sb)


def test_outlier_and_bias_studies_on_constructed_inputs():
    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    assert kurtosis(np.array([-1.0, 1.0] * 50, np.float32)) == pytest.approx(1.0)
    x[:, 7] *= 50                                   # one outlier channel
    o = outliers(x)
    assert o["n_outlier_cols"] == 1 and o["kurtosis"] > 10
    assert o["nvfp4_rel_mse_without_outlier_cols"] != o["nvfp4_rel_mse"]
    g = heavy((32, 64), 3)
    b = gradient_bias(g)
    # 8-bit SR's expectation is biased toward zero, by less than (hi - lo)/256 per element: with steps of at
    # most a third of each block's amax that is below 1/256 of the mean block amax
    amax_b = np.abs(g[:, :]).reshape(32, -1, 16).max(-1).mean()
    assert -amax_b / 256 / np.abs(g).mean() < b["grad_shrink_sr_expected"] < 0


def test_wgrad_gemm_exact_when_operands_are_exact():
    X = np.zeros((32, 16), np.float32)
    G = np.zeros((32, 8), np.float32)
    X[::16] = 1.0
    G[::16] = 2.0
    r = wgrad_gemm(X, G, seeds=2)
    assert r["rht"] and r["wgrad_rel_err_rne"] == pytest.approx(0, abs=1e-6)


def test_roles_from_names():
    assert infer_role("blk.0.ffn_down.weight") == "weight"
    assert infer_role("blk.0.ffn_down.weight_grad") == "gradient"
    assert infer_role("layer3.act") == "activation" and infer_role("x.grad_output") == "gradient"


@pytest.fixture
def dump_dir(tmp_path):
    rng = np.random.default_rng(0)
    d = tmp_path / "dump"
    d.mkdir()
    np.savez(d / "a.npz", **{"lin.weight": rng.standard_normal((64, 64)).astype(np.float32),
                             "lin.input": heavy((32, 64), 1), "lin.grad_output": heavy((32, 64), 2),
                             "scalar": np.float32(3.0), "empty": np.zeros((0, 4), np.float32),
                             "ints": np.arange(16, dtype=np.int32)})
    np.savez(d / "pickled.npz", obj=np.array([{"a": 1}], dtype=object))
    (d / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    from safetensors.numpy import save_file
    save_file({"h.act": heavy((16, 32), 5).astype(np.float16)}, str(d / "b.safetensors"))
    return d


def test_cli_end_to_end_with_bad_inputs(dump_dir, tmp_path):
    out, js, figs = tmp_path / "r.nc", tmp_path / "r.json", tmp_path / "figs"
    p = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(dump_dir), "--out", str(out), "--json", str(js),
                        "--figures", str(figs), "--quiet"], capture_output=True, text=True)
    assert p.returncode == 1, p.stderr                        # something was skipped
    assert "SQNR (dB)" in p.stdout and "lin.weight" in p.stdout and "skipped" in p.stdout
    for reason in ("0-d", "empty", "dtype int32", "pickled", "corrupt.safetensors"):
        assert reason in p.stdout, reason
    ds = xr.open_dataset(out)
    assert set(ds.tensor.values) == {"lin.weight", "lin.input", "lin.grad_output", "h.act"}
    assert ds.sizes["scheme"] == 9 and "nvfp4_4over6" in ds.scheme.values and "pair" in ds.coords
    assert list(ds.pair.values) == ["lin"]
    w = ds.sel(tensor="lin.weight")
    assert np.isfinite(float(w.sqnr_db.sel(scheme="nvfp4_2d")))
    assert np.isnan(float(ds.sel(tensor="lin.input").sqnr_db.sel(scheme="nvfp4_2d")))  # 2-D tiles: weights only
    # the analysis agrees with fp4sim itself
    x = np.load(dump_dir / "a.npz")["lin.weight"]
    y = fs.fake_quantize(x, "nvfp4")
    want = 10 * np.log10(np.mean(x.astype(np.float64) ** 2) / np.mean((y - x.astype(np.float64)) ** 2))
    assert float(w.sqnr_db.sel(scheme="nvfp4")) == pytest.approx(want, rel=1e-9)
    ds.close()
    summary = json.loads(js.read_text())
    assert summary["tensors"]["lin.grad_output"]["role"] == "gradient" and len(summary["skipped"]) == 5
    assert {f.name for f in figs.iterdir()} >= {"error_by_scheme.png", "scale_histograms.png", "outliers.png",
                                                 "outlier_maps.png", "rht_effect.png", "sr_bias.png"}
    assert all(f.stat().st_size > 10000 for f in figs.glob("*.png"))
    rows = (figs / "tensors.csv").read_text().splitlines()
    assert len(rows) == 5 and {r.split(",")[0] for r in rows[1:]} == {"lin.weight", "lin.input", "lin.grad_output",
                                                                     "h.act"}
    none = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(dump_dir / "pickled.npz"), "--quiet"],
                          capture_output=True, text=True)
    assert none.returncode == 2


def test_role_overrides_and_te_pt_files(tmp_path):
    torch = pytest.importorskip("torch")
    x = heavy((32, 64), 9)
    torch.save({"high_precision": torch.from_numpy(x)}, tmp_path / "layer1.pt")
    (tmp_path / "roles.json").write_text(json.dumps({"layer1": "gradient"}))
    ds = analyze([str(tmp_path)], schemes=["nvfp4"], hadamard=False, quiet=True)
    assert list(ds.tensor.values) == ["layer1"] and ds.role.values[0] == "gradient"
    ds2 = analyze([str(tmp_path)], schemes=["nvfp4"], role_overrides={"layer*": "weight"}, hadamard=False, quiet=True)
    assert ds2.role.values[0] == "weight"


def test_dask_local_cluster_gives_the_same_dataset(dump_dir):
    pytest.importorskip("dask.distributed")
    kw = dict(schemes=["nvfp4", "mxfp4_rceil"], hadamard=False, quiet=True)
    import multiprocessing
    a = analyze([str(dump_dir / "a.npz")], **kw)
    before = set(multiprocessing.active_children())
    b = analyze([str(dump_dir / "a.npz")], dask=True, **kw)
    # the cluster it made is closed with it: no worker process (nor its scheduler's threads) outlives the call
    assert set(multiprocessing.active_children()) <= before
    assert list(a.tensor.values) == list(b.tensor.values)
    np.testing.assert_array_equal(a.sqnr_db.values, b.sqnr_db.values)
    from dask.distributed import LocalCluster
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        c = analyze([str(dump_dir / "a.npz")], scheduler=cluster.scheduler_address, **kw)
    np.testing.assert_array_equal(a.sqnr_db.values, c.sqnr_db.values)


def test_torch_dump_helper_feeds_the_analysis(tmp_path):
    torch = pytest.importorskip("torch")
    from fp4sim.torch import dump_linear_tensors
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    xb = torch.randn(48, 32)
    out = dump_linear_tensors(model, lambda: model(xb).pow(2).mean().backward(), tmp_path / "d.npz")
    assert set(out) == {f"{i}.{k}" for i in (0, 2) for k in ("input", "grad_output", "weight", "weight_grad")}
    np.testing.assert_array_equal(out["0.input"], xb.numpy())
    g = out["2.grad_output"].astype(np.float64).T @ out["2.input"].astype(np.float64)
    np.testing.assert_allclose(g, model[2].weight.grad.numpy(), rtol=1e-4, atol=1e-6)
    ds = analyze([str(tmp_path / "d.npz")], schemes=["nvfp4"], hadamard=False, quiet=True)
    assert set(ds.pair.values) == {"0", "2"} and ds.sizes["tensor"] == 8


def test_bundled_sample_dump_is_real_and_documented():
    from fp4sim.analyze.__main__ import SAMPLE
    assert SAMPLE.exists() and SAMPLE.stat().st_size <= 12 * 2**20
    with np.load(SAMPLE, allow_pickle=False) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        assert "minilm.*" in meta["sources"] and "Q4_1" in meta["sources"]["smollm2.*"]
        w = z["minilm.encoder.layer.0.attention.self.query.weight"]
        assert w.dtype == np.float32 and w.shape == (384, 384) and len(np.unique(w)) > 100000
