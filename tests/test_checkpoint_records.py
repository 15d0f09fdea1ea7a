"""Every reader of fp4sim.checkpoints gives the same weight record — name, shape, codes in fp4sim's packing, the
stored scale bytes, the tensor scale (None where the format has none), the layout and values() — and values()
is the record's bytes read as its layout says, decoded here with ml_dtypes (an independent decoder)."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np

from fp4sim.checkpoints import read_checkpoint, read_gguf, read_gpt_oss
from fp4sim.checkpoints.gguf import to_gguf_blocks
from fp4sim.checkpoints.records import LAYOUTS
from fp4sim.checkpoints.rules import ggml_mxfp4_quantize, ggml_nvfp4_quantize
from fp4sim.layout import unpack_fp4
from peers import torch_or_skip, write_gguf
from test_checkpoint import SAMPLE, _modelopt, write_modelopt


def _decoded(w) -> np.ndarray:
    """float32 (rows, K) from w.codes, w.scales, w.tensor_scale as w.layout says (the product rounded once to
    float32: the values are float32)."""
    L = w.layout
    e2m1 = unpack_fp4(w.codes).astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    rows = e2m1.shape[0]
    s = np.asarray(w.scales, np.uint8).reshape(rows, -1)
    if L.scale == "E8M0":
        f = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    else:
        b = s & 0x7F if L.format == "gguf NVFP4" else s
        f = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        if L.format == "gguf NVFP4":
            f = np.where(b == 0x7F, np.float32(0), f)
        elif L.format == "modelopt":
            f = f * np.float32(w.tensor_scale)
        elif L.format == "compressed-tensors":
            f = f / np.float32(w.tensor_scale)
        f = f.astype(np.float64)
    v = e2m1 * np.repeat(f, L.block, axis=1)
    if L.format.startswith("gguf"):
        v = np.where(e2m1 == 0, 0.0, v)                        # ggml reads code 8 as +0
    return v.astype(np.float32)


def _check(w, fmt):
    assert w.layout is LAYOUTS[fmt] and w.layout.format == fmt
    assert w.codes.dtype == np.uint8 and w.scales.dtype == np.uint8
    assert (w.tensor_scale is None) == (LAYOUTS[fmt].tensor_scale is None)
    got = np.asarray(w.values()).reshape(-1, w.shape[-1])
    assert got.dtype == np.float32
    assert np.array_equal(got, _decoded(w)), fmt


def test_every_reader_gives_the_same_record(tmp_path):
    torch_or_skip()
    z = np.load(SAMPLE)
    q = z["minilm.encoder.layer.0.attention.self.query.weight"].astype(np.float32)
    mo = read_checkpoint(write_modelopt(tmp_path / "mo", _modelopt({"enc.q": q}), sharded=False))
    _check(mo.weights["enc.q"], "modelopt")

    from safetensors.numpy import save_file
    c, s = ggml_mxfp4_quantize(q)
    d = tmp_path / "oss"
    d.mkdir()
    save_file({"e.down_proj_blocks": c.reshape(1, 384, 12, 16), "e.down_proj_scales": s.reshape(1, 384, 12)},
              str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    _check(read_gpt_oss(d).weights["e.down_proj"], "gpt-oss")

    nc, ns = ggml_nvfp4_quantize(q)
    f = write_gguf(tmp_path / "m.gguf", {"a.weight": (to_gguf_blocks(c, s, "MXFP4"), "MXFP4"),
                                         "b.weight": (to_gguf_blocks(nc, ns, "NVFP4"), "NVFP4")})
    g = read_gguf(f)
    _check(g.tensors["a.weight"], "gguf MXFP4")
    _check(g.tensors["b.weight"], "gguf NVFP4")
