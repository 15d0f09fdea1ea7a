"""analyze's per-block data: the --blocks records (each block's scale byte, amax and squared error, checked
against fs.quantize / fs.dequantize called directly on the whole tensor, and summing to the tensor's error) and
the NVFP4 g_amax-window and dead-zone shares (against a plain count over the blocks)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import xarray as xr

import fp4sim as fs
from fp4sim.analyze import analyze
from fp4sim.analyze.metrics import SCHEMES_BY_LABEL, WINDOW, scheme_metrics


def window_case(rows=40, cols=72, seed=3):
    """Blocks spread over 8 decades: some below g_amax / 28672 (subnormal E4M3 scales), zero blocks, zeros inside
    blocks, a last block of 8 elements (72 = 4 x 16 + 8)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    mag = np.float32(10.0) ** rng.uniform(-7, 0, (rows, 5)).astype(np.float32)
    x *= np.repeat(mag, 16, axis=1)[:, :cols]
    x[rng.random(x.shape) < 0.05] = 0
    x[2, 16:32] = 0
    x[7] = 0
    return x


def direct_shares(x, per_row=False):
    """(share of nonzero blocks outside b <= g <= 28672 b, share of nonzero elements below b / 24), counted one
    block at a time in Python floats."""
    g_t = float(np.abs(x).max())
    out = blocks = dead = nz = 0
    for r in range(x.shape[0]):
        g = float(np.abs(x[r]).max()) if per_row else g_t
        for k0 in range(0, x.shape[1], 16):
            blk = [abs(float(v)) for v in x[r, k0:k0 + 16]]
            b = max(blk)
            if b == 0:
                continue
            blocks += 1
            out += b * 28672.0 < g                     # (b > g cannot happen: g is the current amax)
            for v in blk:
                if v != 0:
                    nz += 1
                    dead += v < b / 24.0
    return out / blocks, dead / nz


@pytest.mark.parametrize("label,per_row", [("nvfp4", False), ("nvfp4_2d", False), ("nvfp4_row_scaled", True)])
def test_the_gamax_window_and_dead_zone_shares_are_counted_per_block(label, per_row):
    x = window_case()
    want_out, want_dead = direct_shares(x, per_row)
    assert 0 < want_out < 1 and 0 < want_dead < 1          # the case reaches both sides
    for ch in (1 << 22, 128 * 72 // 4):                     # one chunk, and rows split across chunks
        m, _, _ = scheme_metrics(x, SCHEMES_BY_LABEL[label], "weight", chunk_elems=ch)
        assert m["gamax_window_out_frac"] == pytest.approx(want_out, abs=0) and \
            m["dead_zone_frac"] == pytest.approx(want_dead, abs=0)
    assert WINDOW == 448 / 2.0 ** -6


def test_the_window_does_not_apply_without_an_nvfp4_tensor_scale():
    x = window_case()
    for label in ("mxfp4_rceil", "fp8_e4m3", "nvfp4_torchao_no_tensor_scale"):
        m, _, _ = scheme_metrics(x, SCHEMES_BY_LABEL[label], "weight")
        assert np.isnan(m["gamax_window_out_frac"]) and np.isnan(m["dead_zone_frac"]), label


def test_per_block_records_are_the_blocks_of_the_quantized_tensor(tmp_path):
    """Through analyze(..., blocks=FILE) with rows split over chunks: per NVFP4 / MXFP4 block its scale byte is
    the byte fs.quantize gives the whole tensor, its amax the block's max |x|, its squared error that of
    fs.dequantize(fs.quantize(x)) over the block; per-tensor schemes have one record per row and no byte; each
    tensor's errors sum to mse * numel."""
    x = window_case(rows=300)
    np.save(tmp_path / "w.weight.npy", x)
    f = tmp_path / "blocks.nc"
    ds = analyze([str(tmp_path / "w.weight.npy")], schemes=["nvfp4", "mxfp4_rceil", "bf16"], hadamard=False,
                 quiet=True, chunk_elems=128 * 72, blocks=str(f))
    b = xr.load_dataset(f)
    assert list(b.tensor_name.values) == ["w.weight"] and list(b.scheme_name.values) == ["nvfp4", "mxfp4_rceil",
                                                                                         "bf16"]
    amax = np.float32(np.abs(x).max())
    for j, (label, B) in enumerate((("nvfp4", 16), ("mxfp4_rceil", 32), ("bf16", 72))):
        r = b.isel(record=(b.tensor == 0) & (b.scheme == j))
        nb = -(-72 // B)
        assert r.sizes["record"] == 300 * nb
        rows, blks = r.row.values, r.block.values
        assert np.array_equal(rows, np.repeat(np.arange(300), nb)) and np.array_equal(blks, np.tile(np.arange(nb),
                                                                                                   300))
        pad = np.zeros((300, nb * B), np.float32)
        pad[:, :72] = x
        assert np.array_equal(r.amax.values, np.abs(pad).reshape(300, nb, B).max(-1).ravel())
        if label == "nvfp4":
            q = fs.quantize(x, "nvfp4", global_amax=amax)
        elif label == "mxfp4_rceil":
            q = fs.quantize(x, "mxfp4", scale_mode="rceil")
        if label == "bf16":
            assert (r.scale_byte.values == -1).all()
            y = fs.decode(fs.encode(x, "bf16"), "bf16").astype(np.float64)
        else:
            assert np.array_equal(r.scale_byte.values, np.asarray(q.scales, np.int16).ravel())
            y = fs.dequantize(q).astype(np.float64)
        e2 = np.zeros((300, nb * B))
        e2[:, :72] = (y - x.astype(np.float64)) ** 2
        np.testing.assert_allclose(r.sq_err.values, e2.reshape(300, nb, B).sum(-1).ravel(), rtol=1e-12, atol=0)
        mse = float(ds.mse.sel(tensor="w.weight", scheme=label))
        assert r.sq_err.values.sum() == pytest.approx(mse * x.size, rel=1e-12)


def test_the_blocks_option_of_the_command(tmp_path):
    np.save(tmp_path / "a.weight.npy", window_case())
    f = tmp_path / "b.nc"
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(tmp_path / "a.weight.npy"), "--schemes", "nvfp4",
                        "--no-hadamard", "--quiet", "--blocks", str(f)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"wrote {f}" in r.stdout, r.stderr
    assert xr.load_dataset(f).sizes["record"] == 40 * 5
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(tmp_path / "a.weight.npy"), "--blocks",
                        str(tmp_path / "nowhere" / "b.nc")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--blocks" in r.stderr


@pytest.mark.parametrize("fused", [True, False])
def test_blocks_that_lose_values_have_infinite_error(tmp_path, fused):
    """One Inf and one NaN in a tensor: NVFP4's tensor scale is Inf and every finite value comes back NaN, so every
    NVFP4 block is lost (sq_err +Inf, lost = its finite values), as the table's mse is Inf; MXFP4's blocks keep
    their finite errors (lost 0). The counts against fs.fake_quantize on the whole tensor."""
    from fp4sim.analyze import metrics
    x = np.random.default_rng(0).standard_normal((24, 80)).astype(np.float32)
    x[3, 5], x[10, 20] = np.inf, np.nan
    fin = np.isfinite(x)
    old = metrics._FUSED
    metrics._FUSED = fused
    try:
        for label in ("nvfp4", "mxfp4_rceil"):
            spec = SCHEMES_BY_LABEL[label]
            recs = []
            m, _, _ = scheme_metrics(x, spec, "activation", blocks=recs)
            r = {f: np.concatenate([c[f] for c in recs]) for f in recs[0]}
            y = fs.fake_quantize(x, spec.scheme, **spec.options("activation"))
            B = spec.block
            lost = np.pad(fin & ~np.isfinite(y), ((0, 0), (0, -x.shape[1] % B))).reshape(24, -1, B).sum(-1)
            assert np.array_equal(r["lost"], lost.ravel())
            assert np.array_equal(np.isinf(r["sq_err"]), lost.ravel() > 0)
            if label == "nvfp4":
                assert (lost.ravel() > 0).all() and m["mse"] == np.inf and m["lost_frac"] == 1.0
            else:
                assert lost.sum() == 0 and np.isfinite(m["mse"])
                e = np.where(fin, (y.astype(np.float64) - x) ** 2, 0.0)
                assert r["sq_err"].sum() == pytest.approx(e.sum(), rel=1e-12)
    finally:
        metrics._FUSED = old
