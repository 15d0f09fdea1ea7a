"""The registry of exporter rules (fp4sim.checkpoints.rules): every rule's values read from its own bytes as an
independent decoder reads them (ml_dtypes' E2M1, E4M3 and E8M0, gguf-py's dequantize for ggml's blocks), each
tensor quantized once per rule by validate checkpoint and analyze --requantize (counted), and the registry's
own refusals."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fp4sim.checkpoints import rules as R
from fp4sim.checkpoints.gguf import to_gguf_blocks
from fp4sim.layout import unpack_fp4
from peers import import_or_missing, write_gguf

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "fp4sim" / "data" / "sample_dump.npz"
QUERY = "minilm.encoder.layer.0.attention.self.query.weight"


def _query():
    return np.load(SAMPLE)[QUERY].astype(np.float32)


def _e2m1(codes):
    """E2M1 values of packed codes, through ml_dtypes' float4_e2m1fn (element 2i in the low nibble)."""
    c = unpack_fp4(codes)
    return c.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _oracle_values(key, b):
    """The values a rule's bytes stand for, by the formula its docs give, decoded with ml_dtypes."""
    if key == "compressed-tensors-mxfp6":                  # E2M3 packed four to three bytes: the library's unpacker
        torch = import_or_missing("torch")
        h = import_or_missing("compressed_tensors.compressors.mxfp6.helpers")
        R, nb = b.codes.shape
        e2m3 = h.unpack_fp6_from_uint8(torch.from_numpy(b.codes), R, nb * 4 // 3, torch.float32).numpy()
        s = b.scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
        return e2m3.astype(np.float64) * np.repeat(s, e2m3.shape[1] // s.shape[1], axis=1)
    if key in ("mlx-mxfp8", "compressed-tensors-mxfp8"):    # E4M3 element bytes, not packed FP4
        e4m3 = b.codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        s = b.scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
        return e4m3 * np.repeat(s, e4m3.shape[1] // s.shape[1], axis=1)
    e2m1 = _e2m1(b.codes)
    n = e2m1.shape[1] // b.scales.shape[1]
    mx = ("ocp-mxfp4-rceil", "ocp-mxfp4-floor", "ocp-mxfp4-ceil", "ocp-mxfp4-even", "ggml-mxfp4",
          "compressed-tensors-mxfp4", "mlx-mxfp4")
    if key in mx:
        s = b.scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    else:
        s = (b.scales & 0x7F if key == "ggml-nvfp4" else b.scales).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        if key.startswith("modelopt"):
            s = (s.astype(np.float32) * np.float32(b.tensor_scale)).astype(np.float64)
        elif key.startswith("compressed-tensors"):
            s = (s.astype(np.float32) / np.float32(b.tensor_scale)).astype(np.float64)
        elif key == "te-nvfp4-32":
            s = s * np.float64(b.tensor_scale)
        elif key in ("te-nvfp4", "torchao-nvfp4"):
            return None                              # an fp4sim scheme: its dequantize is checked elsewhere
    return e2m1 * np.repeat(s, n, axis=1)


@pytest.mark.parametrize("key", list(R.RULES))
def test_every_rules_values_are_its_bytes_read_independently(key):
    x = _query()[:64, :128]
    opts = {"amax": np.float32(np.abs(x).max() * 1.5)} if key.endswith("-fused") else {}
    b = R.rule(key)(x, **opts)
    assert b.codes.dtype == np.uint8 and b.codes.shape == ((64, 128) if key.endswith("mxfp8") else
                                                           (64, 96) if key.endswith("mxfp6") else (64, 64))
    assert b.scales.dtype == np.uint8 and b.scales.shape == (64, 128 // R.rule(key).block)
    want = _oracle_values(key, b)
    got = R.rule(key).decode(b)
    if want is None:
        from fp4sim.quantize import dequantize
        want = np.asarray(dequantize(b.qt), np.float64)
    assert np.array_equal(got, want), key


@pytest.mark.parametrize("key, kind", [("ggml-mxfp4", "MXFP4"), ("ggml-nvfp4", "NVFP4")])
def test_ggml_rules_values_are_gguf_pys_dequantize_of_their_blocks(key, kind):
    gg = import_or_missing("gguf")
    gq = import_or_missing("gguf.quants")
    x = _query()[:32, :128]
    b = R.rule(key)(x)
    theirs = gq.dequantize(to_gguf_blocks(b.codes, b.scales, kind), gg.GGMLQuantizationType[kind])
    assert np.array_equal(R.rule(key).decode(b), theirs.astype(np.float64))


def _counting(monkeypatch):
    """Every rule of the registry wrapped to count its calls per (rule, the bytes of the weight it was given)."""
    calls = {}

    def wrap(r):
        def fn(x, **o):
            k = (r.key, tuple(sorted(o)), np.ascontiguousarray(x).tobytes())
            calls[k] = calls.get(k, 0) + 1
            return r.fn(x, **o)
        return dataclasses.replace(r, fn=fn)
    monkeypatch.setattr(R, "RULES", {k: wrap(r) for k, r in R.RULES.items()})
    return calls


def test_a_gguf_tensor_is_quantized_once_per_rule(tmp_path, monkeypatch):
    """validate checkpoint with a reference names the rule and costs every rule on each tensor, and analyze
    --requantize does the same: each rule runs once per tensor in each (the verdict and the costs used to
    quantize the same tensor twice by ggml's MXFP4 and the floor and rceil modes)."""
    from fp4sim.requantize import requantize_study
    from fp4sim.validate.checkpoint import check_checkpoint
    w = _query()
    c, s = R.ggml_mxfp4_quantize(w)
    f = write_gguf(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (to_gguf_blocks(c, s, "MXFP4"), "MXFP4")})
    ref = write_gguf(tmp_path / "ref.gguf", {"blk.0.attn_q.weight": w})
    calls = _counting(monkeypatch)
    rep = check_checkpoint(f, ref)
    assert rep.ok and rep.tensors["blk.0.attn_q.weight"]["rule"] == "ggml's MXFP4 quantizer", rep.summary()
    assert calls and set(calls.values()) == {1}, calls.values()
    used = {k[0] for k in calls}
    assert {"ggml-mxfp4", "ocp-mxfp4-floor", "ocp-mxfp4-rceil", "te-nvfp4", "te-nvfp4-32", "ggml-nvfp4"} <= used
    calls.clear()
    st = requantize_study([f], ref)
    assert st["tensors"][0]["file_rule"] == ["ggml's MXFP4 quantizer"]
    assert calls and set(calls.values()) == {1}, calls.values()


def test_the_registrys_refusals():
    x = _query()[:16, :64]
    with pytest.raises(ValueError, match="the registry's rules are"):
        R.rule("modelopt")
    with pytest.raises(TypeError, match="dtype: the ggml-mxfp4 rule takes no options"):
        R.rule("ggml-mxfp4")(x, dtype="bfloat16")
    with pytest.raises(ValueError, match="requantized: made from another weight"):
        R.rule_costs(x, R.Requantized(x * 2))
    assert R.rules_for("gguf", "NVFP4") == ["ggml-nvfp4"]
    assert R.rules_for("modelopt", "NVFP4") == ["modelopt-nvfp4"]
    assert R.mx_rule_key("ggml") == "ggml-mxfp4" and R.mx_rule_key("floor") == "ocp-mxfp4-floor"
    with pytest.raises(ValueError, match="the MXFP4 rules are"):
        R.mx_rule_key("nearest")


def test_every_layout_fault_undone_is_in_the_table():
    """The faults the undo transforms name are entries of FAULTS, for the formats they are undone in."""
    from fp4sim.checkpoints.faults import FAULTS, undo_gguf, undo_mxfp4
    from fp4sim.checkpoints.gguf import GGUFTensor
    w = _query()[:32, :64]
    c, s = R.ggml_mxfp4_quantize(w)
    t = GGUFTensor("t", "MXFP4", (32, 64), to_gguf_blocks(c, s, "MXFP4"))
    mx = dataclasses.make_dataclass("W", [("codes", object), ("scales", object), ("shape", tuple)])(c, s, (1, 32, 64))
    for fmt, undone in (("gguf", undo_gguf(t, 32)), ("gpt-oss", undo_mxfp4(mx)),
                        ("compressed-tensors mxfp4", undo_mxfp4(mx))):
        for key, _, codes, scales in undone:
            assert key in FAULTS and fmt in FAULTS[key].formats, (fmt, key)
            assert codes.shape == c.shape and scales.shape == s.shape
