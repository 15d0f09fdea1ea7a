"""analyze on tensors read a few rows at a time (fp4sim.analyze.lazy): a checkpoint folder's quantized weights
(gpt-oss MXFP4, compressed-tensors MXFP4, ModelOpt NVFP4), a GGUF file's MXFP4 and NVFP4 tensors and large
safetensors entries (bfloat16 with three axes, float64, a gradient) analysed as LazyTensors give the Dataset and the per-block records of the same
analysis with every tensor loaded whole, bit for bit; the row reads are what slicing the whole entry gives; a
gpt-oss weight far larger than its stored bytes is analysed within three times its stored size and one chunk's
working set, where loading it whole takes more than its float32 size, and validated within twice its stored size
and one piece's working set (measured in fresh processes); analyze --requantize in pieces names the rules and
costs of the whole-tensor study."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xarray as xr

import fp4sim as fs
from fp4sim._safetensors import load_safetensors, load_safetensors_rows
from fp4sim.analyze import analyze, lazy
from fp4sim.analyze.inputs import discover, load
from peers import torch_or_skip, write_gguf
from test_checkpoint import write_modelopt
from test_checkpoint_ct_mx import write_ct_mx
from test_gpt_oss import DN, GU, _experts, _pack, write_gpt_oss

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "fp4sim" / "data" / "sample_dump.npz"


def _plain(z):
    """Entries beside the quantized ones: a bfloat16 weight of three axes, a float64 one with Inf and NaN, a
    gradient (its stochastic rounding and bias study), a vector (not a target)."""
    w = z["minilm.encoder.layer.5.intermediate.dense.weight"]            # (1536, 384)
    f64 = z["minilm.encoder.layer.0.attention.self.query.weight"].astype(np.float64) * 3.0
    f64[5, 7], f64[9, 0], f64[200, 300] = np.inf, np.nan, -np.inf
    g = next(v for k, v in z.items() if "grad" in k and v.ndim == 2)
    return {"model.layers.0.mlp.experts.stack.weight": w.reshape(4, 384, 384).astype(ml_dtypes.bfloat16),
            "model.layers.0.self_attn.q_proj.weight": f64,
            "model.layers.0.mlp.grad_output": np.ascontiguousarray(g, np.float32),
            "model.layers.0.input_layernorm.weight": np.ones(384, np.float32)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch = torch_or_skip()
    z = dict(np.load(SAMPLE))
    base = tmp_path_factory.mktemp("lazy")
    x = _experts()
    ent = {}
    for name, mode in ((GU, "floor"), (DN, "rceil")):
        ent[name + "_blocks"], ent[name + "_scales"] = _pack(x[name], mode)
    out = {"gpt-oss": write_gpt_oss(base / "gpt-oss", {**ent, **_plain(z)})}
    mo, ct = {}, {}
    for m, w in (("model.layers.0.mlp.up_proj", x[GU].reshape(-1, 384)),
                 ("model.layers.0.mlp.down_proj", x[DN].reshape(-1, 384))):
        q = fs.quantize(w, "nvfp4")
        mo[f"{m}.weight"] = torch.from_numpy(np.asarray(q.codes))
        mo[f"{m}.weight_scale"] = torch.from_numpy(np.asarray(q.scales)).view(torch.float8_e4m3fn)
        mo[f"{m}.weight_scale_2"] = torch.tensor(np.float32(q.global_amax) / np.float32(2688.0))
        qm = fs.quantize(w, "mxfp4")
        ct[f"{m}.weight_packed"] = torch.from_numpy(np.asarray(qm.codes))
        ct[f"{m}.weight_scale"] = torch.from_numpy(np.asarray(qm.scales))
    out["modelopt"] = write_modelopt(base / "modelopt", mo)
    out["ct-mxfp4"] = write_ct_mx(base / "ct-mxfp4", ct, sharded=True)
    from fp4sim.checkpoints.gguf import to_gguf_blocks
    from fp4sim.checkpoints.rules import ggml_mxfp4_quantize, ggml_nvfp4_quantize
    up, down = x[GU].reshape(-1, 384), x[DN].reshape(-1, 384)
    out["gguf"] = write_gguf(base / "m.gguf", {
        "model.layers.0.mlp.up_proj.weight": (to_gguf_blocks(*ggml_mxfp4_quantize(up), "MXFP4"), "MXFP4"),
        "model.layers.0.mlp.down_proj.weight": (to_gguf_blocks(*ggml_nvfp4_quantize(down), "NVFP4"), "NVFP4"),
        "model.layers.0.self_attn.q_proj.weight": z["minilm.encoder.layer.0.attention.self.query.weight"]})
    return out


def _same(a: xr.Dataset, b: xr.Dataset):
    """Every variable, coordinate and attribute equal; floats bit for bit."""
    assert set(a.variables) == set(b.variables) and a.attrs == b.attrs
    for v in a.variables:
        x, y = a[v].values, b[v].values
        assert x.shape == y.shape and x.dtype == y.dtype, v
        if x.dtype.kind == "f":
            assert np.array_equal(x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}")), v
        else:
            assert np.array_equal(x, y), v


@pytest.mark.parametrize("layout", ["gpt-oss", "modelopt", "ct-mxfp4", "gguf"])
def test_a_lazy_analysis_gives_the_bits_of_the_whole_tensors(folders, layout, tmp_path, monkeypatch):
    d = folders[layout]
    kw = dict(chunk_elems=128 * 384, quiet=True, blocks=None)
    monkeypatch.setattr(lazy, "LAZY_ELEMS", 1 << 62)
    whole = analyze([d], blocks=str(tmp_path / "whole.nc"), **{k: v for k, v in kw.items() if k != "blocks"})
    reads = []
    real = lazy.LazyTensor.__getitem__

    def counted(self, key):
        reads.append(self.what)
        return real(self, key)
    monkeypatch.setattr(lazy, "LAZY_ELEMS", 1)
    monkeypatch.setattr(lazy, "READ_ELEMS", 5 * 384)             # the module's own walks in several pieces too
    monkeypatch.setattr(lazy.LazyTensor, "__getitem__", counted)
    part = analyze([d], blocks=str(tmp_path / "part.nc"), **{k: v for k, v in kw.items() if k != "blocks"})
    names = list(whole.tensor.values)
    quantized = [n for n in names if "mlp" in n and "grad" not in n and "stack" not in n]
    assert len(quantized) == 2
    lazy_ones = quantized if layout == "gguf" else names          # GGUF's float tensors are read whole
    assert all(reads.count(n) > 20 for n in lazy_ones), {n: reads.count(n) for n in names}     # read in pieces
    _same(whole, part)
    with xr.open_dataset(tmp_path / "whole.nc") as bw, xr.open_dataset(tmp_path / "part.nc") as bp:
        _same(bw.load(), bp.load())
    if layout == "gpt-oss":
        assert {"model.layers.0.mlp.experts.stack.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.mlp.grad_output"} <= set(names)
        assert int(part.n_inf.sel(tensor="model.layers.0.self_attn.q_proj.weight")) == 2
        assert int(part.n_nan.sel(tensor="model.layers.0.self_attn.q_proj.weight")) == 1
        assert np.isfinite(float(part.grad_bias_sr.sel(tensor="model.layers.0.mlp.grad_output")))
        assert "input_layernorm" in part.attrs["skipped"]


def test_load_gives_a_lazy_tensor_only_where_the_rows_can_be_read(folders, monkeypatch):
    monkeypatch.setattr(lazy, "LAZY_ELEMS", 1)
    srcs = {s.name: s for s in discover([folders["gpt-oss"]])[0]}
    x = load(srcs[GU + ".weight"] if GU + ".weight" in srcs else srcs[GU], lazy=True)
    assert isinstance(x, lazy.LazyTensor) and x.shape == (2 * 768, 384)
    v = load(srcs["model.layers.0.input_layernorm.weight"], lazy=True)          # one axis: read whole
    assert isinstance(v, np.ndarray) and v.shape == (384,)
    b = load(srcs["model.layers.0.mlp.experts.stack.weight"], lazy=True)
    assert isinstance(b, lazy.LazyTensor) and b.shape == (4, 384, 384)
    whole = load(srcs["model.layers.0.mlp.experts.stack.weight"])
    assert np.array_equal(np.asarray(b), whole) and np.array_equal(b.rows_view()[700:905], whole.reshape(-1, 384)[700:905])
    with pytest.raises(TypeError, match="rows_view"):
        b[3]


def test_row_reads_are_slices_of_the_entry(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 10, 8)).astype(np.float32)
    blocks = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)
    f = tmp_path / "t.safetensors"
    save_file({"a": a, "blocks": blocks}, str(f))
    assert np.array_equal(load_safetensors(f, "a"), a)
    for r0, r1 in ((0, 30), (4, 17), (29, 30), (7, 7)):
        assert np.array_equal(load_safetensors_rows(f, "a", 30, r0, r1), a.reshape(30, 8)[r0:r1])
    assert np.array_equal(load_safetensors_rows(f, "blocks", 12, 5, 9), blocks.reshape(12, 48)[5:9])
    with pytest.raises(ValueError, match="does not split into 7 rows"):
        load_safetensors_rows(f, "a", 7, 0, 1)
    with pytest.raises(ValueError, match="not within the 30 rows"):
        load_safetensors_rows(f, "a", 30, 20, 31)


def test_a_weight_reads_its_rows_as_the_whole_weight_has_them(folders):
    from fp4sim.checkpoints.compressed_tensors_mx import read_compressed_tensors_mx
    from fp4sim.checkpoints.gpt_oss import read_gpt_oss
    from fp4sim.checkpoints.nvfp4 import read_checkpoint
    from fp4sim.checkpoints.gguf import read_gguf
    for ck in (read_gpt_oss(folders["gpt-oss"]), read_checkpoint(folders["modelopt"]),
               read_compressed_tensors_mx(folders["ct-mxfp4"]), read_gguf(folders["gguf"])):
        ws = ck.fp4 if hasattr(ck, "fp4") else ck.weights
        assert len(ws) == 2
        for w in ws.values():
            v = np.asarray(w.values()).reshape(-1, w.shape[-1])
            for r0, r1 in ((0, v.shape[0]), (3, 130), (v.shape[0] - 1, v.shape[0])):
                got = w.rows(r0, r1)
                assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), v[r0:r1].view(np.uint32))


PEAK = r"""
import json, sys
import torch  # noqa: F401  (first, as a user's script)
from fp4sim.analyze import analyze, lazy
if sys.argv[2] == "whole":
    lazy.LAZY_ELEMS = 1 << 62
ds = analyze([sys.argv[1]], schemes=["mxfp4_rceil"], hadamard=False, quiet=True)
# VmHWM: this process's peak (getrusage's ru_maxrss keeps the forking process's peak across exec)
hwm = next(int(v.split()[1]) for v in open("/proc/self/status") if v.startswith("VmHWM:")) * 1024
print(json.dumps({"peak": hwm,
                  "numel": int(ds.numel.sum()), "rel_mse": float(ds.rel_mse.sum())}))
"""


E, R, K = 8, 2048, 4096                     # one gpt-oss expert weight of 2^26 values: 34 MB stored, 268 MB float32
CHUNK = 32 * (1 << 22)                      # one chunk's working set: a few float32 / float64 copies of 2^22 values


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """(a folder with the 2^26-value weight, a folder with only small ones, the big weight's stored bytes)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (E, R, K // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 124, (E, R, K // 32), dtype=np.uint8)
    base = tmp_path_factory.mktemp("big")
    small = {"_blocks": blocks[:1, :64], "_scales": scales[:1, :64]}
    b = write_gpt_oss(base / "big", {GU + "_blocks": blocks, GU + "_scales": scales,
                                     **{DN + k: v for k, v in small.items()}})
    s = write_gpt_oss(base / "small", {**{GU + k: v for k, v in small.items()}, **{DN + k: v for k, v in small.items()}})
    return b, s, blocks.nbytes + scales.nbytes


def _run(*args) -> dict:
    p = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode in (0, 1), p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_weight_larger_than_memory_allows_is_analysed_within_its_stored_size(big):
    """Analysed lazily the process grows by less than three times the weight's stored size and one chunk's
    working set (128 MB) over the same analysis of a small folder (108 MB measured); loaded whole it grows by more
    than its float32 size and more than that bound (349 MB measured), so the bound tells the two apart."""
    d, small, stored = big
    base = _run(PEAK, str(small), "lazy")
    got = _run(PEAK, str(d), "lazy")
    assert got["numel"] == E * R * K + 64 * K
    grew = got["peak"] - base["peak"]
    assert grew < 3 * stored + CHUNK, (grew / 2**20, stored / 2**20)
    whole = _run(PEAK, str(d), "whole")
    assert whole["rel_mse"] == got["rel_mse"]
    assert whole["peak"] - base["peak"] > max(4 * E * R * K, 3 * stored + CHUNK), (whole["peak"] - base["peak"]) / 2**20


VALIDATE = r"""
import json, sys
from fp4sim.validate.checkpoint import check_checkpoint
rep = check_checkpoint(sys.argv[1])
hwm = next(int(v.split()[1]) for v in open("/proc/self/status") if v.startswith("VmHWM:")) * 1024
print(json.dumps({"peak": hwm, "ok": rep.ok, "checked": sorted(rep.tensors)}))
"""


def test_validate_checks_a_weight_within_its_stored_size(big):
    """validate checkpoint grows by less than twice the weight's stored size and one piece's working set (32 MB)
    over checking a small folder: it holds the weight's codes and scale bytes as stored and unpacks the codes a
    piece of rows at a time (45 MB measured; unpacking them whole, as it did, took 226 MB)."""
    d, small, stored = big
    base = _run(VALIDATE, str(small))
    got = _run(VALIDATE, str(d))
    assert got["ok"] and got["checked"] == [DN, GU]
    grew = got["peak"] - base["peak"]
    assert grew < 2 * stored + 8 * (1 << 22), (grew / 2**20, stored / 2**20)


@pytest.mark.parametrize("case", ["experts", "square"])
def test_requantize_in_pieces_is_the_study_of_the_whole_tensors(tmp_path, monkeypatch, case):
    """analyze --requantize reads the reference a piece of rows at a time (an expert's slab transposed at a time
    for transformers' layout) and compares each rule piece by piece: the rules it names and the clipped shares are
    those of the study on whole tensors, its errors the same to the last bits of the float64 sums. "square": a
    square weight whose transformers-layout reference matches only in its second reading."""
    from fp4sim import requantize
    from test_gpt_oss import SQ, _reference, _square
    x = _experts() if case == "experts" else {SQ: _square()}
    ent = {}
    for name, mode in zip(x, ("floor", "rceil") if case == "experts" else ("rceil",)):
        ent[name + "_blocks"], ent[name + "_scales"] = _pack(x[name], mode)
    d = write_gpt_oss(tmp_path / "ck", ent)
    ref = _reference(tmp_path / "ref", x)                                   # transformers' [experts, K, rows]
    whole = requantize.requantize_study([d], ref)
    pieces = []

    class Counted(requantize.Requantized):
        def __init__(self, a):
            pieces.append(a.shape)
            super().__init__(a)
    monkeypatch.setattr(requantize, "Requantized", Counted)
    monkeypatch.setattr(requantize, "PIECE_ELEMS", 384 * 50)                # 50 rows: a partial last piece
    monkeypatch.setattr(lazy, "LAZY_ELEMS", 1)
    part = requantize.requantize_study([d], ref)
    sizes = {p[0] for p in pieces}
    assert len(pieces) >= 30 and 50 in sizes and min(sizes) < 50, sizes
    assert len(whole["tensors"]) == len(part["tensors"]) == len(x) and not part["not_compared"]
    for w, p in zip(whole["tensors"], part["tensors"]):
        assert w["file_rule"] == p["file_rule"] and p["file_rule"], (w["file_rule"], p["file_rule"])
        assert (w["clipped_stored"], w["clipped_ggml_mxfp4"]) == (p["clipped_stored"], p["clipped_ggml_mxfp4"])
        assert p["stored"] == pytest.approx(w["stored"], rel=1e-12, abs=0)
        assert p["rel_mse"] == pytest.approx(w["rel_mse"], rel=1e-12, abs=0)
        assert p["rel_mse"][p["file_rule"][0].replace("MXFP4, scale mode ", "MXFP4 ")] == p["stored"]
