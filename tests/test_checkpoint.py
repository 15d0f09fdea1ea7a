"""NVFP4 checkpoints: a ModelOpt export written with ModelOpt's own quantizer (NVFP4QTensor.quantize) from real
MiniLM weights, sharded with its index, an excluded head in high precision; compressed-tensors exports written
with compressed-tensors' own functions (tests/test_checkpoint_ct.py). Clean, each validates consistent and byte
for byte equal to the reference re-quantized; each known export fault injected into a copy is flagged and named
with its tensor."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp4sim.checkpoint import read_checkpoint
from fp4sim.layout import swizzle_scales
from fp4sim.validate.checkpoint import check_checkpoint
from peers import import_or_missing, torch_or_skip

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "fp4sim" / "data" / "sample_dump.npz"
Q = "encoder.layer.0.attention.self.query"
D = "encoder.layer.5.intermediate.dense"


def _save(path: Path, tensors: dict):
    """safetensors through torch (F8_E4M3 for float8 tensors)."""
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def weights():
    z = np.load(SAMPLE)
    rng = np.random.default_rng(42)
    return {Q: z[f"minilm.{Q}.weight"], D: z[f"minilm.{D}.weight"],
            "lm_head": (rng.standard_normal((96, 384)) * 0.05).astype(np.float32)}


def _modelopt(weights):
    torch = torch_or_skip()
    qt = import_or_missing("modelopt.torch.quantization.qtensor")
    out = {}
    for m, w in weights.items():
        if m == "lm_head":
            out[f"{m}.weight"] = torch.from_numpy(w)
            continue
        qobj, scale, scale2 = qt.NVFP4QTensor.quantize(torch.from_numpy(w.copy()), 16)
        out[f"{m}.weight"] = qobj._quantized_data
        out[f"{m}.weight_scale"] = scale
        out[f"{m}.weight_scale_2"] = scale2.float().reshape(())
        out[f"{m}.input_scale"] = torch.tensor(0.01, dtype=torch.float32)
        out[f"{m}.bias"] = torch.zeros(w.shape[0])
    return out


def write_modelopt(d: Path, tensors: dict, sharded=True):
    d.mkdir(parents=True, exist_ok=True)
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.47.0"},
                                                        "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                         "exclude_modules": ["lm_head"]}}))
    return write_tensors(d, tensors, sharded)


def write_tensors(d: Path, tensors: dict, sharded: bool):
    """The tensors in one model.safetensors, or in two shards with their model.safetensors.index.json."""
    names = sorted(tensors)
    parts = [names[: len(names) // 2], names[len(names) // 2:]] if sharded else [names]
    wm = {}
    for i, part in enumerate(parts):
        f = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" if sharded else "model.safetensors"
        _save(d / f, {k: tensors[k] for k in part})
        wm.update({k: f for k in part})
    if sharded:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, weights):
    base = tmp_path_factory.mktemp("ckpt")
    torch = torch_or_skip()
    ref = base / "ref"
    ref.mkdir()
    _save(ref / "model.safetensors", {f"{m}.weight": torch.from_numpy(w) for m, w in weights.items()})
    return base, ref, _modelopt(weights)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fp4sim.validate", "checkpoint", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_a_modelopt_export_reads_and_validates_clean(ckpt, tmp_path):
    base, ref, mo = ckpt
    d = write_modelopt(tmp_path / "mo", mo)
    ck = read_checkpoint(d)
    assert ck.format == "modelopt" and set(ck.weights) == {Q, D} and ck.excluded == ["lm_head"]
    w = ck.weights[Q]
    assert not any(isinstance(v, np.ndarray) for v in vars(w).values())      # codes and scales read on use
    assert w.shape == (384, 384)
    assert w.codes.shape == (384, 192) and w.scales.shape == (384, 24) and w.scales.dtype == np.uint8
    assert np.array_equal(w.codes, mo[f"{Q}.weight"].numpy())
    amax = np.float32(np.abs(np.load(SAMPLE)[f"minilm.{Q}.weight"]).max())
    assert w.global_amax == np.float32(np.float32(2688) * np.float32(amax / np.float32(2688)))
    rep = check_checkpoint(d)
    assert rep.ok, rep.summary()
    rep = check_checkpoint(d, ref)
    assert rep.ok and all(t["exact"] for t in rep.tensors.values()), rep.summary()
    r = _cli(d, "--reference", ref, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CONSISTENT" in r.stdout and "2 of 2 equal to the reference" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True


def _fault(mo, kind):
    import torch
    t = dict(mo)
    if kind == "nibbles swapped":
        c = t[f"{Q}.weight"]
        t[f"{Q}.weight"] = ((c >> 4) | (c << 4)).to(torch.uint8)
    elif kind == "global scale inverted":
        t[f"{Q}.weight_scale_2"] = 1 / t[f"{Q}.weight_scale_2"]
    elif kind == "half-size scales":
        t[f"{Q}.weight_scale"] = t[f"{Q}.weight_scale"][:, ::2].contiguous()
    elif kind == "swizzled scales":
        s = t[f"{D}.weight_scale"].view(torch.uint8).numpy()
        t[f"{D}.weight_scale"] = torch.from_numpy(np.asarray(swizzle_scales(s))).view(torch.float8_e4m3fn)
    elif kind == "transposed scales":                   # scales.T's bytes in the linear layout's shape
        s = t[f"{D}.weight_scale"]
        t[f"{D}.weight_scale"] = s.t().contiguous().reshape(s.shape)
    elif kind == "transposed scale shape":              # scales.T stored as it is: (blocks, rows)
        t[f"{D}.weight_scale"] = t[f"{D}.weight_scale"].t().contiguous()
    elif kind == "one binade off":
        s = t[f"{Q}.weight_scale"].view(torch.uint8).clone()
        s[3, 5] += 8
        t[f"{Q}.weight_scale"] = s.view(torch.float8_e4m3fn)
    elif kind == "missing global scale":
        del t[f"{D}.weight_scale_2"]
    elif kind == "head quantized":
        t["lm_head.weight"] = mo[f"{Q}.weight"][:96]
    return t


FAULTS = {   # fault -> (the tensor named, a phrase of its message, needs the reference)
    "nibbles swapped": (Q, "codes of every byte are swapped", True),
    "global scale inverted": (Q, "looks inverted", False),
    "half-size scales": (Q, "half of the 384 x 24", False),
    "swizzled scales": (D, "swizzled", False),
    "transposed scales": (D, "looks transposed", False),
    "transposed scale shape": (D, "the transpose of the (1536, 24) rows x blocks layout", False),
    "one binade off": (Q, "the scale bytes of 1 blocks are one binade high", True),
    "missing global scale": (D, "no tensor scale", False),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_each_known_export_fault_is_flagged_and_named(ckpt, tmp_path, kind):
    base, ref, mo = ckpt
    d = write_modelopt(tmp_path / "bad", _fault(mo, kind))
    name, phrase, needs_ref = FAULTS[kind]
    rep = check_checkpoint(d, ref)
    assert not rep.ok and not rep.tensors[name]["ok"], rep.summary()
    assert any(phrase in f for f in rep.tensors[name]["faults"]), rep.summary()
    other = D if name == Q else Q
    assert rep.tensors[other]["ok"] and rep.tensors[other]["exact"], rep.summary()
    if kind == "swizzled scales":                       # and, with the reference, recognised as such
        assert any("swizzled 128x4 layout, written where" in f for f in rep.tensors[name]["faults"]), rep.summary()
        assert not any("blocks differ" in f for f in rep.tensors[name]["faults"]), rep.summary()
    if not needs_ref:                                   # found from the checkpoint alone
        assert any(phrase in f for f in check_checkpoint(d).tensors[name]["faults"])
        r = _cli(d)
        assert r.returncode == 1 and f"FAULT {name}: " in r.stdout, r.stdout + r.stderr


def test_an_excluded_module_that_is_quantized_and_bad_folders(ckpt, tmp_path):
    base, ref, mo = ckpt
    t = _fault(mo, "head quantized")
    t["lm_head.weight_scale"] = mo[f"{Q}.weight_scale"][:96]
    t["lm_head.weight_scale_2"] = mo[f"{Q}.weight_scale_2"]
    rep = check_checkpoint(write_modelopt(tmp_path / "head", t))
    assert any("excluded module 'lm_head' is quantized" in f for f in rep.faults), rep.summary()
    r = _cli(tmp_path / "nowhere")
    assert r.returncode == 2 and "not a folder" in r.stderr
    (tmp_path / "empty").mkdir()
    assert _cli(tmp_path / "empty").returncode == 2
    plain = tmp_path / "plain"
    plain.mkdir()
    _save(plain / "model.safetensors", {"x.weight": mo["lm_head.weight"]})
    r = _cli(plain)
    assert r.returncode == 2 and "no NVFP4 checkpoint found" in r.stderr
    shutil.rmtree(plain)


def test_analyze_reads_a_checkpoint_as_its_dequantized_weights(ckpt, tmp_path):
    """python -m fp4sim.analyze DIR on a ModelOpt export: each quantized linear is one weight tensor, its values
    those ModelOpt's own dequantize gives; the excluded head is analysed as stored, the scale entries are not
    tensors of their own."""
    torch = torch_or_skip()
    qt = import_or_missing("modelopt.torch.quantization.qtensor")
    from fp4sim.analyze.core import analyze
    from fp4sim.analyze.inputs import discover, load
    base, ref, mo = ckpt
    d = write_modelopt(tmp_path / "mo", mo)
    sources, problems, _ = discover([str(d)])
    names = {s.name for s in sources}
    assert {f"{Q}.weight", f"{D}.weight", "lm_head.weight"} <= names and not problems
    assert not any(n.endswith(("weight_scale", "weight_scale_2", "input_scale")) for n in names)
    src = next(s for s in sources if s.name == f"{Q}.weight")
    got = load(src)
    qobj = qt.NVFP4QTensor(torch.Size((384, 384)), torch.float32, mo[f"{Q}.weight"])
    want = qobj.dequantize(scale=mo[f"{Q}.weight_scale"], double_scale=mo[f"{Q}.weight_scale_2"],
                           block_sizes={-1: 16}).numpy()
    np.testing.assert_array_equal(got, want)
    ds = analyze([str(d)], schemes=["nvfp4"], hadamard=False, quiet=True, blocks=str(tmp_path / "b.nc"))
    assert {f"{Q}.weight", f"{D}.weight", "lm_head.weight"} <= set(ds.tensor.values)
    hist = ds.scale_hist.sel(tensor=f"{Q}.weight", scheme="nvfp4").values
    assert hist.sum() == 384 * 24 and hist[0x7E] >= 1                    # the amax block's 448
    # the per-block records of the dequantized export: NVFP4 (te) re-quantization gives back the stored bytes
    import xarray as xr
    b = xr.load_dataset(tmp_path / "b.nc")
    r = b.isel(record=b.tensor == list(b.tensor_name.values).index(f"{Q}.weight"))
    assert np.array_equal(r.scale_byte.values, mo[f"{Q}.weight_scale"].view(torch.uint8).numpy().ravel())


def test_an_export_of_another_format_is_read_as_plain_files(ckpt, tmp_path):
    """A ModelOpt FP8 export (hf_quant_config.json with quant_algo FP8) is no NVFP4 checkpoint: validate
    checkpoint refuses it naming the algorithm, analyze reads its entries as plain safetensors."""
    from fp4sim.analyze.inputs import discover
    base, ref, mo = ckpt
    d = tmp_path / "fp8"
    d.mkdir()
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    _save(d / "model.safetensors", {"x.weight": mo["lm_head.weight"]})
    r = _cli(d)
    assert r.returncode == 2 and "quant_algo 'FP8' is not NVFP4" in r.stderr
    sources, problems, _ = discover([str(d)])
    assert [s.name for s in sources] == ["x.weight"] and not problems
