"""compressed-tensors' MXFP4 checkpoints (mxfp4-pack-quantized): the rule against compressed-tensors' own
calculate_qparams + MXFP4PackedCompressor run here (real MiniLM weights and adversarial blocks, in float32,
bfloat16 and float16), a folder written by that compressor validated, its faults named, analysed and costed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fp4sim as fs
from fp4sim.checkpoints.rules import compressed_tensors_mx_quantize
from peers import import_or_missing, torch_or_skip
from test_checkpoint import D, Q, SAMPLE, _save, write_tensors
from test_checkpoint_ct import _ct as ct_parts
from test_checkpoint_ct import minilm_bf16

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")


def _ct():
    return ct_parts("MXFP4", "mxfp4.base.MXFP4PackedCompressor")


def ct_mx_compress(w):
    """compressed-tensors' own MXFP4 export of one weight (a torch tensor): the scales from each 32-element
    group's min / max (what llm-compressor's observers hand over), then the packed compressor."""
    h, scheme, comp = _ct()
    R, K = w.shape
    g = w.reshape(R, K // 32, 32)
    scale, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    return comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)


def ct_mx8_compress(w):
    """compressed-tensors' own MXFP8 export of one weight: its MX scales, then MXFP8QuantizationCompressor
    (float8_e4m3fn elements, E8M0 bytes)."""
    h, scheme, comp = ct_parts("MXFP8", "mxfp8.base.MXFP8QuantizationCompressor")
    R, K = w.shape
    g = w.reshape(R, K // 32, 32)
    scale, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    out = comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    import torch
    return out["weight"].view(torch.uint8).numpy(), out["weight_scale"].numpy()


def _adversarial():
    """Ties of E2M1 at several scales (subnormal, tiny, large), zeros of both signs, all-zero and all-equal
    blocks, amaxes on the 1.75 x 2^e boundary the scale rounds at and just below it, float32-subnormal blocks."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    base = np.concatenate([mids, -mids, [-0.1, -0.2, 0.2, -1e-3], [4.0, 7.9, -7.5, 6.0, 3.0],
                           [0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.0, -0.0, 1.5]]).astype(np.float32)[:32]
    rows = [base * np.float32(2.0 ** e) for e in (-130, -127, -126, -100, -20, -3, 0, 5, 13, 100)]
    rows += [np.zeros(32, np.float32), np.full(32, -0.0, np.float32)]
    rows += [np.full(32, v, np.float32) for v in (1.75, -1.7421875, 6.0, 7.0, 3.5, 1e-6)]
    rng = np.random.default_rng(0)
    for a in (1.75, 1.7421875, 1.746, 3.5, 3.49, 7.0, 0.875, 14.0):
        r = rng.standard_normal(32).astype(np.float32)
        rows.append(r / np.abs(r).max() * np.float32(a))
    rows.append((rng.standard_normal(32) * 1e-39).astype(np.float32))
    rows += list((rng.standard_normal((16, 32)) * np.exp(rng.uniform(-20, 20, (16, 1)))).astype(np.float32))
    return np.stack(rows).astype(np.float32)


def _ct_bytes(sd):
    return sd["weight_packed"].numpy(), sd["weight_scale"].numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rule_is_compressed_tensors_byte_for_byte(dtype):
    torch = torch_or_skip()
    z = np.load(SAMPLE)
    x = _adversarial()
    for w in (z[f"minilm.{Q}.weight"], z[f"minilm.{D}.weight"], x):
        t = torch.from_numpy(w).to(getattr(torch, dtype))
        t = t[torch.isfinite(t).all(1) & (t.abs().amax(1) < 57344)]   # what the dtype holds, below its top binade
        oc, os_ = _ct_bytes(ct_mx_compress(t))
        c, s = compressed_tensors_mx_quantize(t.float().numpy(), dtype)
        assert np.array_equal(s, os_) and np.array_equal(c, oc), dtype
    # the oracle tells the rules apart: fp4sim's even mode differs from it on -0 alone, the floor mode on the scales
    t = torch.from_numpy(x)
    oc, os_ = _ct_bytes(ct_mx_compress(t))
    q = fs.quantize(x, "mxfp4", scale_mode="even")
    assert np.array_equal(np.asarray(q.scales).reshape(os_.shape), os_)
    assert not np.array_equal(np.asarray(q.codes).reshape(oc.shape), oc)          # -0: code 8 here, 0 there
    assert not np.array_equal(np.asarray(fs.quantize(x, "mxfp4", scale_mode="floor").scales).reshape(os_.shape), os_)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mxfp8_rule_is_compressed_tensors_byte_for_byte(dtype):
    """compressed-tensors' MXFP8 (mxfp8-quantized): the same scale rule with E4M3's offset 8, E4M3 elements, -0
    stored as 0x00 (its zero point added)."""
    torch = torch_or_skip()
    z = np.load(SAMPLE)
    for w in (z[f"minilm.{Q}.weight"], _adversarial()):
        t = torch.from_numpy(w).to(getattr(torch, dtype))
        t = t[torch.isfinite(t).all(1) & (t.abs().amax(1) < 57344)]
        oc, os_ = ct_mx8_compress(t)
        c, s = compressed_tensors_mx_quantize(t.float().numpy(), dtype, bits=8)
        assert np.array_equal(s, os_) and np.array_equal(c, oc), dtype


def ct_mx6_compress(w):
    """compressed-tensors' own MXFP6 export of one weight: its MX scales (E2M3's rounding threshold), then
    MXFP6PackedCompressor (E2M3 codes four to three bytes, E8M0 bytes)."""
    h, scheme, comp = ct_parts("MXFP6A16", "mxfp6.base.MXFP6PackedCompressor")
    R, K = w.shape
    g = w.reshape(R, K // 32, 32)
    scale, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    return comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mxfp6_rule_is_compressed_tensors_byte_for_byte(dtype):
    """compressed-tensors' MXFP6 (mxfp6-pack-quantized): the block amax rounded up to the next power of two from a
    significand of 1.9375 (E2M3's three mantissa bits), offset 2, E2M3 elements with the input's sign (-0 is
    0x20: no +0 zero point here, unlike MXFP4 / MXFP8), packed four to three bytes little-endian."""
    torch = torch_or_skip()
    z = np.load(SAMPLE)
    for w in (z[f"minilm.{Q}.weight"], z[f"minilm.{D}.weight"], _adversarial()):
        t = torch.from_numpy(w).to(getattr(torch, dtype))
        t = t[torch.isfinite(t).all(1) & (t.abs().amax(1) < 57344)]
        sd = ct_mx6_compress(t)
        c, s = compressed_tensors_mx_quantize(t.float().numpy(), dtype, bits=6)
        assert np.array_equal(s, sd["weight_scale"].numpy()) and np.array_equal(c, sd["weight_packed"].numpy())
    # the threshold is E2M3's: an all-1.75 block keeps 2^0 (byte 127 + 0 - 2 = 125; MXFP4's rule rounds it up to
    # 126), and the scale bytes are fp4sim's mxfp6_e2m3 "even" mode's (torchao's rule, the same threshold)
    x = _adversarial()
    sd = ct_mx6_compress(torch.from_numpy(x))
    row = int(np.flatnonzero((x == np.float32(1.75)).all(1))[0])
    assert sd["weight_scale"].numpy()[row, 0] == 125 and compressed_tensors_mx_quantize(x[row:row + 1])[1][0, 0] == 126
    assert np.array_equal(fs.quantize(x, "mxfp6_e2m3", scale_mode="even").scales, sd["weight_scale"].numpy())


def test_float16_scales_below_its_range_are_stored_as_one():
    """In float16 a scale 2^(b - 127) below 2^-24 is 0, replaced by 1 (uint8 scales' "eps"): byte 127 and codes
    of magnitude zero (a negative value keeps its sign, code 8), where float32 keeps the block's values
    (compressed-tensors does the same)."""
    torch = torch_or_skip()
    x = np.full((1, 32), 2.0 ** -20, np.float32)
    x[0, 1] = -(2.0 ** -22)
    c16, s16 = compressed_tensors_mx_quantize(x, "float16")
    c32, s32 = compressed_tensors_mx_quantize(x, "float32")
    u16 = fs.layout.unpack_fp4(c16)
    assert s16[0, 0] == 127 and not (u16 & 7).any() and u16[0, 1] == 8 and s32[0, 0] == 127 - 20 - 2
    assert (fs.layout.unpack_fp4(c32) & 7).any()
    oc, os_ = _ct_bytes(ct_mx_compress(torch.from_numpy(x).half()))
    assert np.array_equal(oc, c16) and np.array_equal(os_, s16)


def test_the_rule_refuses_what_it_cannot_reproduce():
    for x, dtype, phrase in ((np.ones((2, 30), np.float32), "float32", "multiple of 32"),
                             (np.full((1, 32), np.inf, np.float32), "float32", "NaN or Inf"),
                             (np.full((1, 32), 60000.0, np.float32), "float16", "beyond float16's range"),
                             (np.ones((1, 32), np.float32), "int8", "is not one of")):
        with pytest.raises(ValueError, match=phrase):
            compressed_tensors_mx_quantize(x, dtype)
    with pytest.raises(ValueError, match="bits=5"):
        compressed_tensors_mx_quantize(np.ones((1, 32), np.float32), "float32", bits=5)


def _config(ignore=("lm_head",), fmt="mxfp4-pack-quantized", preset="MXFP4"):
    qc = import_or_missing("compressed_tensors.quantization")
    qs = import_or_missing("compressed_tensors.quantization.quant_scheme")
    cfg = qc.QuantizationConfig(config_groups={"group_0": qs.preset_name_to_scheme(preset, ["Linear"])},
                                format=fmt, ignore=list(ignore), quantization_status="compressed")
    return {"architectures": ["BertModel"], "quantization_config": cfg.model_dump(mode="json")}


def write_ct_mx(d: Path, tensors: dict, sharded=False, **cfg):
    d.mkdir(parents=True, exist_ok=True)
    write_tensors(d, tensors, sharded)
    (d / "config.json").write_text(json.dumps(_config(**cfg)))
    return d


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """Real MiniLM weights in bfloat16, their compressed-tensors MXFP4 export (the compressor's own bytes) and
    the reference (BF16 safetensors)."""
    w = minilm_bf16()
    base = tmp_path_factory.mktemp("ctmx")
    ref = base / "ref"
    ref.mkdir()
    _save(ref / "model.safetensors", {f"{m}.weight": v for m, v in w.items()})
    out = {"lm_head.weight": w["lm_head"]}
    for m in (Q, D):
        for k, v in ct_mx_compress(w[m]).items():
            out[f"{m}.{k}"] = v
    return base, ref, out, w


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fp4sim.validate", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def test_an_export_validates_byte_for_byte(export):
    from fp4sim.checkpoints import read_checkpoint
    from fp4sim.checkpoints.compressed_tensors_mx import is_compressed_tensors_mx, read_compressed_tensors_mx
    from fp4sim.validate.checkpoint import check_checkpoint
    base, ref, out, w = export
    d = write_ct_mx(base / "ok", out, sharded=True)
    assert is_compressed_tensors_mx(d)
    ck = read_compressed_tensors_mx(d)
    assert set(ck.weights) == {Q, D} and ck.excluded == ["lm_head"] and not ck.broken
    assert ck.weights[Q].shape == (384, 384) and ck.weights[Q].layout.format == "compressed-tensors mxfp4"
    with pytest.raises(ValueError, match="is not NVFP4"):
        read_checkpoint(d)
    rep = check_checkpoint(d)
    assert rep.ok and rep.format == "compressed-tensors mxfp4" and set(rep.tensors) == {Q, D}, rep.summary()
    rep = check_checkpoint(d, ref)
    assert rep.ok, rep.summary()
    for m in (Q, D):
        t = rep.tensors[m]
        assert t["exact"] and t["rule"] == "compressed-tensors' MXFP4 rule (in bfloat16)", t
        assert "costs" in t
    r = _cli("checkpoint", d, "--reference", ref)
    assert r.returncode == 0 and "CONSISTENT" in r.stdout and "2 of 2 equal to the reference" in r.stdout, \
        r.stdout + r.stderr


def _faulty(out, kind):
    import torch
    bad = dict(out)
    k = f"{Q}.weight_packed"
    if kind == "nibbles":
        p = bad[k]
        bad[k] = ((p >> 4) | (p << 4)).to(torch.uint8)
    elif kind == "bias":
        bad[f"{Q}.weight_scale"] = bad[f"{Q}.weight_scale"] + 1
    elif kind == "nvfp4 tensors":
        h = import_or_missing("compressed_tensors.quantization.utils.helpers")
        qs = import_or_missing("compressed_tensors.quantization.quant_scheme")
        nv = import_or_missing("compressed_tensors.compressors.nvfp4.base")
        sch = qs.preset_name_to_scheme("NVFP4", ["Linear"])
        wq = torch.zeros(384, 384, dtype=torch.bfloat16) + 0.01
        gs = h.generate_gparam(wq.min(), wq.max())
        g = wq.reshape(384, 24, 16)
        sc, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), sch.weights, global_scale=gs)
        for kk, v in nv.NVFP4PackedCompressor.compress({"weight": wq, "weight_scale": sc, "weight_global_scale": gs,
                                                        "weight_zero_point": zp}, sch).items():
            bad[f"{Q}.{kk}"] = v
    return bad


@pytest.mark.parametrize("kind, phrase", [
    ("nibbles", "the nibbles are swapped"),
    ("bias", "the scale bytes are one binade high"),
    ("nvfp4 tensors", "a tensor scale beside the codes is NVFP4's")])
def test_each_fault_is_named_on_its_tensor(export, kind, phrase):
    from fp4sim.validate.checkpoint import check_checkpoint
    base, ref, out, w = export
    d = write_ct_mx(base / kind.replace(" ", "_"), _faulty(out, kind))
    rep = check_checkpoint(d, ref)
    assert not rep.ok and rep.tensors[D]["ok"], rep.summary()
    assert any(phrase in f for f in rep.tensors[Q]["faults"]), rep.summary()
    r = _cli("checkpoint", d, "--reference", ref)
    assert r.returncode == 1 and phrase in r.stdout, r.stdout + r.stderr


def test_an_ignored_module_that_is_quantized_is_a_fault(export):
    from fp4sim.validate.checkpoint import check_checkpoint
    base, ref, out, w = export
    d = write_ct_mx(base / "ignored", out, ignore=(Q,))
    rep = check_checkpoint(d)
    assert not rep.ok and any(f"excluded module {Q!r} is quantized" in f for f in rep.faults), rep.summary()


def test_analyze_reads_the_export_as_compressed_tensors_decompresses_it(export):
    from fp4sim.analyze.inputs import discover, load
    base, ref, out, w = export
    _, scheme, comp = _ct()
    d = write_ct_mx(base / "an", out)
    sources, problems, _ = discover([str(d)])
    byname = {s.name: s for s in sources}
    assert not problems and {f"{Q}.weight", f"{D}.weight", "lm_head.weight"} <= set(byname)
    for m in (Q, D):
        theirs = comp.decompress({"weight_packed": out[f"{m}.weight_packed"], "weight_scale": out[f"{m}.weight_scale"]},
                                 scheme)["weight"].float().numpy()
        assert np.array_equal(load(byname[f"{m}.weight"]), theirs)


def test_requantize_names_the_exporters_rule(export):
    from fp4sim.requantize import requantize_study
    base, ref, out, w = export
    d = write_ct_mx(base / "rq", out)
    st = requantize_study([d], ref)
    rows = {r["tensor"]: r for r in st["tensors"]}
    assert set(rows) == {Q, D} and not st["not_compared"]
    for m in (Q, D):
        assert rows[m]["file_rule"][0] == "compressed-tensors' MXFP4 rule (in bfloat16)"
        # the stored values' error is the error of the rule that wrote them
        x = w[m].float().numpy().astype(np.float64)
        c, s = compressed_tensors_mx_quantize(w[m].float().numpy(), "bfloat16")
        y = np.asarray(fs.dequantize(fs.QuantizedTensor(codes=c, scales=s, global_amax=None,
                                                         scheme=fs.schemes.get_scheme("mxfp4"), axis=1,
                                                         shape=x.shape)), np.float64)
        assert rows[m]["stored"] == pytest.approx(((y - x) ** 2).sum() / (x * x).sum(), rel=1e-12)


def test_mxfp4_tensors_under_an_nvfp4_config_are_named(export):
    """The reverse mislabel: an nvfp4-pack-quantized config over MXFP4 tensors (E8M0 bytes per 32, no global
    scale)."""
    from fp4sim.validate.checkpoint import check_checkpoint
    base, ref, out, w = export
    d = write_ct_mx(base / "nvcfg", out, fmt="nvfp4-pack-quantized", preset="NVFP4")
    rep = check_checkpoint(d)
    assert not rep.ok and rep.format == "compressed-tensors", rep.summary()
    assert any("MXFP4's E8M0 exponents (mxfp4-pack-quantized) under a config that names NVFP4"
               in f for f in rep.tensors[Q]["faults"]), rep.summary()


def _read_as_decompressed(d, mode, comp, scheme, entries, w):
    """The folder ``d`` reads as a compressed-tensors ``mode`` checkpoint of Q and D whose Q weight has the values
    of the library's own decompressor (``entries``: Q's stored tensors), through the reader and analyze's loader."""
    from fp4sim.analyze.inputs import discover, load
    from fp4sim.checkpoints.compressed_tensors_mx import read_compressed_tensors_mx
    ck = read_compressed_tensors_mx(d)
    assert ck.format == f"compressed-tensors {mode}" and set(ck.weights) == {Q, D}
    theirs = comp.decompress(entries, scheme)["weight"].float().numpy()
    assert ck.weights[Q].shape == tuple(w[Q].shape) and np.array_equal(ck.weights[Q].values(), theirs)
    sources, problems, _ = discover([str(d)])
    assert not problems and np.array_equal(load({s.name: s for s in sources}[f"{Q}.weight"]), theirs)


def test_an_mxfp8_export_validates_and_its_faults_are_named(export):
    """compressed-tensors' mxfp8-quantized folder (F8_E4M3 elements, E8M0 bytes per 32), written by its own
    MXFP8 compressor: consistent, its rule named in bfloat16; scale bytes one binade high named; packed FP4 codes
    under the MXFP8 config named."""
    from fp4sim.validate.checkpoint import check_checkpoint
    base, ref, out, w = export
    h, scheme, comp = ct_parts("MXFP8", "mxfp8.base.MXFP8QuantizationCompressor")
    t8 = {"lm_head.weight": w["lm_head"]}
    for m in (Q, D):
        R, K = w[m].shape
        g = w[m].reshape(R, K // 32, 32)
        scale, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
        for k, v in comp.compress({"weight": w[m], "weight_scale": scale, "weight_zero_point": zp}, scheme).items():
            t8[f"{m}.{k}"] = v
    d = write_ct_mx(base / "fp8", t8, fmt="mxfp8-quantized", preset="MXFP8")
    _read_as_decompressed(d, "mxfp8", comp, scheme, {k: t8[f"{Q}.{k}"] for k in ("weight", "weight_scale")}, w)
    rep = check_checkpoint(d, ref)
    assert rep.ok and rep.format == "compressed-tensors mxfp8", rep.summary()
    assert all(t["rule"] == "compressed-tensors' MXFP8 rule (in bfloat16)" for t in rep.tensors.values()), rep.summary()
    bad = dict(t8)
    bad[f"{Q}.weight_scale"] = bad[f"{Q}.weight_scale"] + 1
    rep = check_checkpoint(write_ct_mx(base / "fp8bias", bad, fmt="mxfp8-quantized", preset="MXFP8"), ref)
    assert not rep.ok and rep.tensors[D]["ok"]
    assert any("the scale bytes are one binade high" in f for f in rep.tensors[Q]["faults"]), rep.summary()
    mixed = dict(t8)
    mixed.pop(f"{Q}.weight")
    mixed[f"{Q}.weight_packed"] = out[f"{Q}.weight_packed"]
    rep = check_checkpoint(write_ct_mx(base / "fp8mixed", mixed, fmt="mxfp8-quantized", preset="MXFP8"))
    assert not rep.ok and any("packed FP4 codes" in f for f in rep.tensors[Q]["faults"]), rep.summary()


def test_an_mxfp6_export_validates_and_its_faults_are_named(export):
    """compressed-tensors' mxfp6-pack-quantized folder (E2M3 codes four to three bytes, E8M0 bytes per 32), written
    by its own MXFP6 compressor: read as compressed-tensors decompresses it, analysed, consistent with its rule
    named in bfloat16; codes packed big-endian named; scale bytes one binade low named; MXFP4's packed codes under
    the MXFP6 config named by their size."""
    from fp4sim.layout import pack_fp6, unpack_fp6
    from fp4sim.validate.checkpoint import check_checkpoint
    base, ref, out, w = export
    h, scheme, comp = ct_parts("MXFP6A16", "mxfp6.base.MXFP6PackedCompressor")
    t6 = {"lm_head.weight": w["lm_head"]}
    for m in (Q, D):
        for k, v in ct_mx6_compress(w[m]).items():
            t6[f"{m}.{k}"] = v
    d = write_ct_mx(base / "fp6", t6, fmt="mxfp6-pack-quantized", preset="MXFP6A16")
    _read_as_decompressed(d, "mxfp6", comp, scheme, {k: t6[f"{Q}.{k}"] for k in ("weight_packed", "weight_scale")},
                          w)
    rep = check_checkpoint(d, ref)
    assert rep.ok and rep.format == "compressed-tensors mxfp6", rep.summary()
    assert all(t["rule"] == "compressed-tensors' MXFP6 rule (in bfloat16)" for t in rep.tensors.values()), rep.summary()
    big = dict(t6)
    big[f"{Q}.weight_packed"] = __import__("torch").from_numpy(pack_fp6(unpack_fp6(t6[f"{Q}.weight_packed"].numpy()),
                                                                        "big"))
    rep = check_checkpoint(write_ct_mx(base / "fp6big", big, fmt="mxfp6-pack-quantized", preset="MXFP6A16"), ref)
    assert not rep.ok and rep.tensors[D]["ok"]
    assert any("packed big-endian" in f for f in rep.tensors[Q]["faults"]), rep.summary()
    low = dict(t6)
    low[f"{Q}.weight_scale"] = low[f"{Q}.weight_scale"] - 1
    rep = check_checkpoint(write_ct_mx(base / "fp6bias", low, fmt="mxfp6-pack-quantized", preset="MXFP6A16"), ref)
    assert any("one binade low" in f for f in rep.tensors[Q]["faults"]), rep.summary()
    mixed = dict(t6)
    mixed[f"{Q}.weight_packed"] = out[f"{Q}.weight_packed"]
    rep = check_checkpoint(write_ct_mx(base / "fp6mixed", mixed, fmt="mxfp6-pack-quantized", preset="MXFP6A16"))
    assert not rep.ok and any("mxfp4-pack-quantized" in f for f in rep.tensors[Q]["faults"]), rep.summary()
