"""compressed-tensors NVFP4 checkpoints, written in the tests by compressed-tensors itself (PyPI, CPU): its
generate_gparam / calculate_qparams / NVFP4PackedCompressor.compress from real MiniLM weights (bfloat16, as a
model is held when llm-compressor quantizes it), its ModelOpt converter applied to a ModelOpt export, and an
MoE layout of experts. fp4sim's compressed_tensors_quantize reproduces compressed-tensors' bytes; a clean export
validates byte for byte against its reference with the rule named; its own decompressor and fp4sim's dequantize
give the same values; each export fault injected into a copy is flagged and named with its tensor."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fp4sim.analyze.inputs import discover, load
from fp4sim.checkpoint import compressed_tensors_quantize, dequantize_weight, read_checkpoint
from fp4sim.layout import swizzle_scales
from fp4sim.validate.checkpoint import check_checkpoint
from peers import import_or_missing, torch_or_skip
from test_checkpoint import SAMPLE, D, Q, _cli, _modelopt, _save, write_modelopt, write_tensors

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def _ct(preset="NVFP4", compressor="nvfp4.base.NVFP4PackedCompressor"):
    """compressed-tensors' qparams helpers, the preset's scheme and its compressor class."""
    torch_or_skip()
    h = import_or_missing("compressed_tensors.quantization.utils.helpers")
    qs = import_or_missing("compressed_tensors.quantization.quant_scheme")
    mod, _, cls = compressor.rpartition(".")
    comp = import_or_missing(f"compressed_tensors.compressors.{mod}")
    return h, qs.preset_name_to_scheme(preset, ["Linear"]), getattr(comp, cls)


def ct_compress(w):
    """compressed-tensors' own NVFP4 quantization of one weight (a torch tensor), as its export stores it: the
    global scale from the tensor's min / max, the block scales from each 16-element group's min / max (what
    llm-compressor's observers hand over), then the packed compressor."""
    h, scheme, comp = _ct()
    R, K = w.shape
    gs = h.generate_gparam(w.min(), w.max())
    g = w.reshape(R, K // 16, 16)
    scale, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs)
    return comp.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs,
                          "weight_zero_point": zp}, scheme)


def _tdtype(name):
    import torch
    return getattr(torch, name)


def _bytes(sd):
    import torch
    return (sd["weight_packed"].numpy(), sd["weight_scale"].view(torch.uint8).numpy(),
            np.float32(sd["weight_global_scale"].reshape(-1)[0].item()))


def _edge_cases():
    """Weights that reach each corner of the rule: scales across E4M3's whole range (subnormal, saturating),
    zero blocks and an all-zero row, negative values rounding to zero, one outlier."""
    rng = np.random.default_rng(7)
    out = []
    for trial in range(6):
        x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-14, 5, (64, 1)))).astype(np.float32)
        x[rng.random(x.shape) < 0.02] = 0
        x[3] = 0
        x[5, :16] = 0
        x[6, :16] = -1e-4 * np.abs(x[6, :16]).max()
        if trial % 2:
            x[7, 5] = 300.0
        out.append(x)
    z = np.zeros((32, 64), np.float32)
    out.append(z)
    return out


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_compressed_tensors_quantize_is_compressed_tensors_byte_for_byte(dtype):
    """Codes, scale bytes and global scale equal compressed-tensors' own, for real weights and the corner cases,
    in each dtype a weight is held in (the bfloat16 rule rounds the global scale and the block amax / 6)."""
    torch = torch_or_skip()
    z = np.load(SAMPLE)
    xs = [z[k] for k in z.files if k.endswith(".weight") and z[k].ndim == 2 and z[k].shape[1] % 16 == 0]
    assert len(xs) >= 2
    for x in xs + _edge_cases():
        t = torch.from_numpy(x).to(_tdtype(dtype))
        oc, os_, og = _bytes(ct_compress(t))
        c, s, g = compressed_tensors_quantize(t.float().numpy(), dtype)
        assert np.array_equal(c, oc) and np.array_equal(s, os_), (x.shape, int((s != os_).sum()))
        assert g.tobytes() == og.tobytes()
    bf = xs[0].astype(ml_dtypes.bfloat16)
    assert all(np.array_equal(a, b) for a, b in zip(compressed_tensors_quantize(bf),
                                                     compressed_tensors_quantize(bf.astype(np.float32),
                                                                                 "bfloat16")))


def test_compressed_tensors_quantize_refuses_what_it_cannot_reproduce():
    x = np.ones((4, 32), np.float32)
    with pytest.raises(ValueError, match="x: a 2-D weight"):
        compressed_tensors_quantize(x[0])
    with pytest.raises(ValueError, match="not a multiple of 16"):
        compressed_tensors_quantize(x[:, :24])
    with pytest.raises(ValueError, match="dtype: float64 is not one of"):
        compressed_tensors_quantize(x.astype(np.float64))


def _config(ignore, group="group_0"):
    qc = import_or_missing("compressed_tensors.quantization")
    qs = import_or_missing("compressed_tensors.quantization.quant_scheme")
    cfg = qc.QuantizationConfig(config_groups={group: qs.preset_name_to_scheme("NVFP4", ["Linear"])},
                                format="nvfp4-pack-quantized", ignore=ignore, quantization_status="compressed")
    return {"architectures": ["BertModel"], "quantization_config": cfg.model_dump(mode="json")}


def write_ct(d: Path, tensors: dict, ignore=("lm_head",), sharded=False):
    d.mkdir(parents=True, exist_ok=True)
    write_tensors(d, tensors, sharded)
    (d / "config.json").write_text(json.dumps(_config(list(ignore))))
    return d


def minilm_bf16() -> dict:
    """MiniLM's query and FFN weights and a random head, as bfloat16 torch tensors by module name."""
    torch = torch_or_skip()
    z = np.load(SAMPLE)
    rng = np.random.default_rng(42)
    w = {Q: z[f"minilm.{Q}.weight"], D: z[f"minilm.{D}.weight"],
         "lm_head": (rng.standard_normal((96, 384)) * 0.05).astype(np.float32)}
    return {m: torch.from_numpy(v).to(torch.bfloat16) for m, v in w.items()}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """Real MiniLM weights in bfloat16, their compressed-tensors export and the reference (BF16 safetensors)."""
    torch = torch_or_skip()
    w = minilm_bf16()
    ref = tmp_path_factory.mktemp("ctref")
    _save(ref / "model.safetensors", {f"{m}.weight": v for m, v in w.items()})
    out = {"lm_head.weight": w["lm_head"]}
    for m in (Q, D):
        for k, v in ct_compress(w[m]).items():
            out[f"{m}.{k}"] = v
        out[f"{m}.bias"] = torch.zeros(w[m].shape[0], dtype=torch.bfloat16)
    return ref, out, w


def test_a_compressed_tensors_export_reads_validates_and_round_trips(bf16, tmp_path):
    torch = torch_or_skip()
    ref, out, w = bf16
    d = write_ct(tmp_path / "ct", out, sharded=True)
    ck = read_checkpoint(d)
    assert ck.format == "compressed-tensors" and set(ck.weights) == {Q, D} and ck.excluded == ["lm_head"]
    q = ck.weights[Q]
    assert q.shape == (384, 384) and np.array_equal(q.codes, out[f"{Q}.weight_packed"].numpy())
    assert q.tensor_scale.tobytes() == np.float32(out[f"{Q}.weight_global_scale"].item()).tobytes()
    assert q.global_amax == np.float32(np.float32(2688) / q.tensor_scale)
    rep = check_checkpoint(d)
    assert rep.ok, rep.summary()
    rep = check_checkpoint(d, ref)
    assert rep.ok and all(t["exact"] for t in rep.tensors.values()), rep.summary()
    assert {t["rule"] for t in rep.tensors.values()} == {"compressed-tensors' rule (in bfloat16)"}
    r = _cli(d, "--reference", ref)
    assert r.returncode == 0 and "2 of 2 equal to the reference" in r.stdout, r.stdout + r.stderr
    # compressed-tensors' own decompressor (which returns bfloat16) gives fp4sim's dequantized float32 values
    # rounded to bfloat16, bit for bit
    h, scheme, comp = _ct()
    for m in (Q, D):
        sd = {k.rpartition(".")[2]: v for k, v in out.items() if k.startswith(m + ".") and "weight" in k}
        theirs = comp.decompress(sd, scheme)["weight"]
        assert theirs.dtype == torch.bfloat16
        ours = dequantize_weight(ck.weights[m], ck.format)
        assert theirs.view(torch.int16).numpy().tobytes() == ours.astype(ml_dtypes.bfloat16).tobytes()
        # and python -m fp4sim.analyze reads the checkpoint as those values
        src = next(s for s in discover([str(d)])[0] if s.name == f"{m}.weight")
        assert load(src).tobytes() == ours.tobytes()
    # the float32 rule, which ModelOpt's agrees with on these weights, is not what made them
    mo = _modelopt({m: v.float().numpy() for m, v in w.items()})
    assert not np.array_equal(mo[f"{D}.weight_scale"].view(torch.uint8).numpy(),
                              out[f"{D}.weight_scale"].view(torch.uint8).numpy())


def _ct_gs32(amax):
    f = np.float32
    return f(f(f(1) / f(amax)) * f(2688))


def test_a_modelopt_export_converted_by_compressed_tensors_is_modelopts_rule(tmp_path):
    """compressed-tensors' ModelOpt converter (weight -> weight_packed, 1 / weight_scale_2 -> weight_global_scale)
    on a ModelOpt export: read in compressed-tensors' convention, exact against the reference by ModelOpt's
    rule, converted. The query weight is scaled so that the two rules' float32 global scales differ (by one
    ulp): only ModelOpt's rule reproduces it; on the FFN weight both rules give the same bytes and both are
    named."""
    torch = torch_or_skip()
    conv = import_or_missing("compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4")
    z = np.load(SAMPLE)
    q = z[f"minilm.{Q}.weight"]
    f = np.float32
    for c in np.arange(1.0, 1.1, 0.001, dtype=np.float32):
        a = f(np.abs(q * c).max())
        if _ct_gs32(a) != f(f(1) / f(a / f(2688))):
            break
    else:
        raise AssertionError("no scaling found whose global scales differ")
    dffn = z[f"minilm.{D}.weight"]
    ad = f(np.abs(dffn).max())
    assert _ct_gs32(ad) == f(f(1) / f(ad / f(2688)))
    w = {Q: (q * c).astype(np.float32), D: dffn,
         "lm_head": (np.random.default_rng(1).standard_normal((96, 384)) * 0.05).astype(np.float32)}
    ref = tmp_path / "ref"
    ref.mkdir()
    _save(ref / "model.safetensors", {f"{m}.weight": torch.from_numpy(v) for m, v in w.items()})
    mo = _modelopt(w)
    cv = conv.ModelOptNvfp4Converter(ignore=["lm_head"], targets=["re:.*"])
    out = cv.validate(dict(mo))
    assert f"{Q}.weight_packed" in out and f"{Q}.weight_scale_2" not in out
    d = write_ct(tmp_path / "conv", out)
    ck = read_checkpoint(d)
    mck = read_checkpoint(write_modelopt(tmp_path / "mo", mo, sharded=False))
    for m in (Q, D):
        a, b = ck.weights[m], mck.weights[m]
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales)
        assert a.tensor_scale == np.float32(np.float32(1) / b.tensor_scale)
    rep = check_checkpoint(d, ref)
    assert rep.ok and all(t["exact"] for t in rep.tensors.values()), rep.summary()
    rule = "ModelOpt's rule, converted (weight_global_scale = 1 / weight_scale_2)"
    ct32 = "compressed-tensors' rule (in float32)"
    assert rep.tensors[Q]["rules"] == [rule] and f"made by {rule}" in rep.tensors[Q]["notes"]
    assert rep.tensors[D]["rules"] == [ct32, rule] and rep.tensors[D]["rule"] == ct32
    assert f"equal by {rule}: 1 tensors" in rep.summary()


def _fault(out, w, kind):
    import torch
    t = dict(out)
    if kind == "global scale not inverted":
        t[f"{Q}.weight_global_scale"] = (1 / t[f"{Q}.weight_global_scale"])
    elif kind == "nibbles swapped":
        c = t[f"{D}.weight_packed"]
        t[f"{D}.weight_packed"] = ((c >> 4) | (c << 4)).to(torch.uint8)
    elif kind == "half-size scales":
        t[f"{D}.weight_scale"] = t[f"{D}.weight_scale"][:, ::2].contiguous()
    elif kind == "one binade off":
        s = t[f"{Q}.weight_scale"].view(torch.uint8).clone()
        s[10, 2] -= 8
        t[f"{Q}.weight_scale"] = s.view(torch.float8_e4m3fn)
    elif kind == "ModelOpt's bytes, compressed-tensors' global scale":
        mo = _modelopt({D: w[D].float().numpy()})
        t[f"{D}.weight_packed"] = mo[f"{D}.weight"]
        t[f"{D}.weight_scale"] = mo[f"{D}.weight_scale"]
    return t


CT_FAULTS = {   # fault -> (the tensor named, a phrase of its message with the reference, found without it)
    "global scale not inverted": (Q, "the global scale was not inverted", "looks inverted"),
    "nibbles swapped": (D, "the two codes of every byte are swapped", None),
    "half-size scales": (D, "half of the 1536 x 24", "half of the 1536 x 24"),
    "one binade off": (Q, "the scale bytes of 1 blocks are one binade low", None),
    "ModelOpt's bytes, compressed-tensors' global scale": (
        D, "a mixed export: the codes and scales are those of compressed-tensors' rule (in float32) / ModelOpt's "
           "rule, the weight_global_scale that of compressed-tensors' rule (in bfloat16)", None),
}


@pytest.mark.parametrize("kind", list(CT_FAULTS))
def test_each_export_fault_in_a_compressed_tensors_checkpoint_is_named(bf16, tmp_path, kind):
    ref, out, w = bf16
    d = write_ct(tmp_path / "bad", _fault(out, w, kind))
    name, phrase, alone = CT_FAULTS[kind]
    rep = check_checkpoint(d, ref)
    assert not rep.ok and not rep.tensors[name]["ok"], rep.summary()
    assert any(phrase in f for f in rep.tensors[name]["faults"]), rep.summary()
    # one finding per cause: the check without a reference and the comparison, nothing besides (a nibble swap is
    # not also reported as permuted columns, a half-size scale tensor not twice)
    assert len(rep.tensors[name]["faults"]) == 1 + bool(alone and phrase != alone), rep.summary()
    other = D if name == Q else Q
    assert rep.tensors[other]["ok"] and rep.tensors[other]["exact"], rep.summary()
    if alone:
        rep = check_checkpoint(d)
        assert any(alone in f for f in rep.tensors[name]["faults"]), rep.summary()


def test_an_moe_expert_that_lost_its_global_scale_is_named(tmp_path):
    """Experts of an MoE block (model.layers.0.mlp.experts.E.{gate,up,down}_proj), exported by compressed-tensors;
    one expert's weight_global_scale dropped (as a loader that skipped experts' global scales would save it)."""
    torch = torch_or_skip()
    z = np.load(SAMPLE)
    ffn = torch.from_numpy(z[f"minilm.{D}.weight"]).to(torch.bfloat16)        # (1536, 384)
    out = {}
    for e in range(4):
        rows = ffn[e * 384:(e + 1) * 384]
        for p, m in (("gate_proj", rows[:192]), ("up_proj", rows[192:]), ("down_proj", rows[:, :192].T)):
            for k, v in ct_compress(m.contiguous()).items():
                out[f"model.layers.0.mlp.experts.{e}.{p}.{k}"] = v
    lost = "model.layers.0.mlp.experts.2.up_proj"
    assert check_checkpoint(write_ct(tmp_path / "ok", out, ignore=[])).ok
    del out[f"{lost}.weight_global_scale"]
    rep = check_checkpoint(write_ct(tmp_path / "moe", out, ignore=[]))
    assert len(rep.tensors) == 12
    bad = [n for n, t in rep.tensors.items() if not t["ok"]]
    assert bad == [lost], rep.summary()
    assert any("no tensor scale" in f and f"{lost}.weight_global_scale" in f for f in rep.tensors[lost]["faults"])
    r = _cli(tmp_path / "moe")
    assert r.returncode == 1 and f"FAULT {lost}: no tensor scale" in r.stdout, r.stdout + r.stderr


def test_scales_written_in_the_padded_swizzled_layout_are_named(tmp_path):
    """A weight whose blocks per row (5) are not a multiple of 4: cuBLAS's swizzled layout pads it to 128 x 8
    bytes, so the export's scale tensor has the wrong size; with the reference the bytes are named as the rule's
    scales swizzled."""
    torch = torch_or_skip()
    x = torch.from_numpy((np.random.default_rng(3).standard_normal((200, 80)) * 0.02).astype(np.float32))
    sd = ct_compress(x.to(torch.bfloat16))
    s = sd["weight_scale"].view(torch.uint8).numpy()
    sd["weight_scale"] = torch.from_numpy(np.asarray(swizzle_scales(s)).copy()).view(torch.float8_e4m3fn)
    d = write_ct(tmp_path / "sw", {f"proj.{k}": v for k, v in sd.items()}, ignore=[])
    ref = tmp_path / "ref"
    ref.mkdir()
    _save(ref / "model.safetensors", {"proj.weight": x.to(torch.bfloat16)})
    f = check_checkpoint(d).tensors["proj"]["faults"]
    assert any("the size of cuBLAS's swizzled layout" in m for m in f), f
    f = check_checkpoint(d, ref).tensors["proj"]["faults"]
    assert any("the block scales are compressed-tensors' rule (in bfloat16)'s in cuBLAS's swizzled 128x4 layout"
               in m for m in f), f


def test_dequantized_float32_values_are_compressed_tensors_own(tmp_path):
    """fp4sim's float32 dequantization of a compressed-tensors weight is compressed-tensors' own ``dequantize`` in
    float32, bit for bit (``fl(scale / global_scale)``, then times the element): compared unrounded, where the
    other order of the same operations, ``scale · fl(1 / global_scale)``, differs. The weight: MiniLM's FFN weight
    in float32 times 1.065, a magnitude whose global scale separates the two orders."""
    torch = torch_or_skip()
    fwd = import_or_missing("compressed_tensors.quantization.lifecycle.forward")
    from fp4sim.formats import E2M1, E4M3
    from fp4sim.layout import unpack_fp4
    h, scheme, comp = _ct()
    w = torch.from_numpy(np.load(SAMPLE)[f"minilm.{D}.weight"] * np.float32(1.065))
    sd = ct_compress(w)
    d = write_ct(tmp_path / "ct", {f"{D}.{k}": v for k, v in sd.items()})
    ours = dequantize_weight(read_checkpoint(d).weights[D], "compressed-tensors")
    xq = torch.from_numpy(E2M1.values[unpack_fp4(sd["weight_packed"].numpy())].astype(np.float32))
    theirs = fwd.dequantize(xq, sd["weight_scale"].float(), args=scheme.weights, dtype=torch.float32,
                            global_scale=sd["weight_global_scale"]).numpy()
    assert theirs.dtype == np.float32 and ours.view(np.uint32).tobytes() == theirs.view(np.uint32).tobytes()
    s = E4M3.values[sd["weight_scale"].view(torch.uint8).numpy()].astype(np.float32)
    g = np.float32(sd["weight_global_scale"].item())
    other = (xq.numpy().reshape(*s.shape, 16) * (s * (np.float32(1) / g))[:, :, None]).reshape(ours.shape)
    assert (other.astype(np.float32) != ours).sum() > 100
