"""Checkpoints whose fused GEMMs share one tensor scale, as the exporters write them: a small Llama (SmolLM2's
shapes, scaled down, built offline) quantized with ModelOpt's NVFP4 recipe and written by ModelOpt's own
``export_hf_checkpoint``, which gives q / k / v one ``weight_scale_2`` and gate / up another (the group's largest
amax); compressed-tensors' fused global scale (llm-compressor takes the smallest of the group's global scales).
A clean export validates byte for byte; a fault inside a shared group is named on its tensor alone; codes whose
header says I8 and references that hold none (or not all) of the weights are faults, never a silent pass."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from fp4sim.checkpoint import compressed_tensors_quantize, read_checkpoint
from fp4sim.validate.checkpoint import check_checkpoint, shared_scale_groups
from peers import import_or_missing, torch_or_skip
from test_checkpoint import SAMPLE, _cli, _save, write_tensors

L0 = "model.layers.0"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the ModelOpt export folder, the reference folder, {module: reference weight float32})."""
    torch = torch_or_skip()
    tf = import_or_missing("transformers")
    mtq = import_or_missing("modelopt.torch.quantization")
    export = import_or_missing("modelopt.torch.export")
    base = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(base / "ref")
    ref = {n[: -len(".weight")]: p.detach().float().numpy().copy() for n, p in model.named_parameters()}

    def calibrate(m):
        with torch.no_grad():
            m(torch.randint(0, 256, (2, 16)))
    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, calibrate)
    export.export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=base / "mo")
    return base / "mo", base / "ref", ref


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _copy(src: Path, dst: Path, tensors: dict) -> Path:
    """``src``'s config files with ``tensors`` as its one safetensors file."""
    dst.mkdir(parents=True)
    for f in src.glob("*.json"):
        if not f.name.endswith(".index.json"):
            (dst / f.name).write_text(f.read_text())
    return write_tensors(dst, tensors, sharded=False)


def test_modelopt_fused_export_validates_byte_for_byte(llama, tmp_path):
    d, ref, w = llama
    t = _tensors(d)
    ws2 = {m: np.float32(t[f"{L0}.{m}.weight_scale_2"].item()) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    # the export does share: q / k / v one scale, gate / up another, each from the group's largest amax, which is
    # not every member's own (else the test would not exercise the shared rule)
    assert ws2["self_attn.q_proj"] == ws2["self_attn.k_proj"] == ws2["self_attn.v_proj"]
    assert ws2["mlp.gate_proj"] == ws2["mlp.up_proj"]
    own = {m: np.float32(np.float32(np.abs(w[f"{L0}.{m}"]).max()) / np.float32(2688)) for m in ws2}
    assert any(own[m] != ws2[m] for m in ws2)
    grp = max(np.float32(np.abs(w[f"{L0}.self_attn.{p}"]).max()) for p in ("q_proj", "k_proj", "v_proj"))
    assert ws2["self_attn.q_proj"] == np.float32(grp / np.float32(2688))
    ck = read_checkpoint(d)
    assert len(ck.weights) == 14
    groups = shared_scale_groups(ck)
    assert sorted(len(g) for g in groups) == [2, 2, 3, 3]
    rep = check_checkpoint(d, ref)
    assert rep.ok, rep.summary()
    assert all(t["exact"] and t["rule"] == "ModelOpt's rule" for t in rep.tensors.values()), rep.summary()
    assert rep.tensors[f"{L0}.self_attn.k_proj"]["shared_scale"] == [f"{L0}.self_attn.{p}" for p in
                                                                     ("k_proj", "q_proj", "v_proj")]
    # without the reference: consistent, and the sharing is said once, not once per weight or per group
    rep = check_checkpoint(d)
    assert rep.ok, rep.summary()
    assert not any(t["notes"] for t in rep.tensors.values()), rep.summary()
    assert len(rep.notes) == 1 and "4 groups of sibling weights share one weight_scale_2" in rep.notes[0]
    r = _cli(d, "--reference", ref)
    assert r.returncode == 0 and "CONSISTENT; 14 of 14 equal to the reference" in r.stdout, r.stdout + r.stderr
    assert "FAULT" not in r.stdout


def test_a_fault_inside_a_shared_group_is_named_on_its_tensor(llama, tmp_path):
    torch = torch_or_skip()
    d, ref, w = llama
    t = _tensors(d)
    # one flipped code in k_proj
    k = f"{L0}.self_attn.k_proj.weight"
    c = t[k].clone()
    c[3, 7] ^= 0x01
    bad = dict(t)
    bad[k] = c
    rep = check_checkpoint(_copy(d, tmp_path / "code", bad), ref)
    wrong = [n for n, e in rep.tensors.items() if not e["ok"]]
    assert wrong == [k[: -len(".weight")]], rep.summary()
    assert any("1 of 128 blocks differ" in f and "row 3, block 0" in f for f in rep.tensors[wrong[0]]["faults"])
    # the group member of the smallest amax written with its own tensor scale (a per-weight scale in a fused
    # export): its bytes no longer follow the scale it claims, and only it is named
    ams = {p: np.abs(w[f"{L0}.self_attn.{p}"]).max() for p in ("q_proj", "k_proj", "v_proj")}
    low = min(ams, key=ams.get)
    bad = dict(t)
    bad[f"{L0}.self_attn.{low}.weight_scale_2"] = torch.tensor(np.float32(np.float32(ams[low]) / np.float32(2688)))
    rep = check_checkpoint(_copy(d, tmp_path / "scale", bad), ref)
    wrong = [n for n, e in rep.tensors.items() if not e["ok"]]
    assert wrong == [f"{L0}.self_attn.{low}"], rep.summary()
    r = _cli(tmp_path / "scale", "--reference", ref)
    assert r.returncode == 1 and r.stdout.count("FAULT") == 1, r.stdout + r.stderr


def _relabel_i8(tensors: dict, key: str) -> dict:
    import torch
    out = dict(tensors)
    out[key] = tensors[key].view(torch.int8)
    return out


def test_codes_labelled_i8_are_a_fault_not_a_dropped_layer(llama, tmp_path):
    """A header that says I8 for the packed codes: the layer stays in the check and is named (both formats)."""
    torch = torch_or_skip()
    d, ref, w = llama
    k = f"{L0}.mlp.down_proj"
    bad = _copy(d, tmp_path / "mo", _relabel_i8(_tensors(d), f"{k}.weight"))
    rep = check_checkpoint(bad)
    assert len(rep.tensors) == 14 and not rep.ok, rep.summary()
    assert any("is stored as I8" in f for f in rep.tensors[k]["faults"]), rep.summary()
    assert sum(not e["ok"] for e in rep.tensors.values()) == 1
    rep = check_checkpoint(bad, ref)                          # its bytes are still compared, as U8
    assert rep.tensors[k]["exact"], rep.summary()
    r = _cli(bad)
    assert r.returncode == 1 and f"FAULT {k}: weight is stored as I8" in r.stdout, r.stdout
    # compressed-tensors: weight_packed relabelled
    from test_checkpoint_ct import ct_compress, write_ct
    z = np.load(SAMPLE)
    q = torch.from_numpy(z["minilm.encoder.layer.0.attention.self.query.weight"]).to(torch.bfloat16)
    tens = {f"a.{n}": v for n, v in ct_compress(q).items()}
    tens.update({f"b.{n}": v for n, v in ct_compress(q[:128]).items()})
    ct = write_ct(tmp_path / "ct", _relabel_i8(tens, "b.weight_packed"))
    rep = check_checkpoint(ct)
    assert set(rep.tensors) == {"a", "b"} and not rep.tensors["b"]["ok"] and rep.tensors["a"]["ok"], rep.summary()
    assert any("weight_packed is stored as I8" in f for f in rep.tensors["b"]["faults"])
    # the header itself says I8 (safetensors' own label, read back without torch)
    with open(ct / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        assert json.loads(f.read(n))["b.weight_packed"]["dtype"] == "I8"


def test_a_reference_that_holds_none_or_not_all_of_the_weights_is_a_fault(llama, tmp_path):
    torch = torch_or_skip()
    d, ref, w = llama
    other = tmp_path / "other"
    other.mkdir()
    _save(other / "model.safetensors", {"encoder.query.weight": torch.zeros(64, 64)})
    rep = check_checkpoint(d, other)
    assert not rep.ok and any("none of the 14 quantized weights was compared" in f for f in rep.faults), \
        rep.summary()
    r = _cli(d, "--reference", other)
    assert r.returncode == 1 and "CONSISTENT" not in r.stdout, r.stdout + r.stderr
    # one weight missing from the reference: the rest compare, the shortfall is a fault naming it
    part = tmp_path / "part"
    part.mkdir()
    sd = _tensors(ref)
    gone = "model.layers.1.mlp.down_proj.weight"
    del sd[gone]
    _save(part / "model.safetensors", sd)
    rep = check_checkpoint(d, part)
    assert not rep.ok and sum(bool(t["exact"]) for t in rep.tensors.values()) == 13, rep.summary()
    assert any(f.startswith("1 of 14 quantized weights were not compared") and gone[: -len(".weight")] in f
               for f in rep.faults), rep.summary()
    # a member of a shared group without its reference leaves the group's amax unknown: not compared, said
    sd = _tensors(ref)
    del sd[f"{L0}.mlp.up_proj.weight"]
    (tmp_path / "grp").mkdir()
    _save(tmp_path / "grp" / "model.safetensors", sd)
    rep = check_checkpoint(d, tmp_path / "grp")
    assert any(f.startswith("2 of 14 quantized weights were not compared") for f in rep.faults), rep.summary()
    assert any("shared amax is not known" in n for n in rep.tensors[f"{L0}.mlp.gate_proj"]["notes"])


def test_compressed_tensors_fused_global_scale_is_reproduced():
    """llm-compressor's fused layers: every member's global scale is the group's smallest (that of the largest
    amax); compressed_tensors_quantize(amax=the group's largest) gives compressed-tensors' bytes for each."""
    torch = torch_or_skip()
    from test_checkpoint_ct import _bytes, _ct
    h, scheme, comp = _ct()
    z = np.load(SAMPLE)
    q = torch.from_numpy(z["minilm.encoder.layer.0.attention.self.query.weight"]).to(torch.bfloat16)
    members = [q, (q[:128] * 0.37).to(torch.bfloat16), (q[128:256] * 1.9).to(torch.bfloat16)]
    gs = min((h.generate_gparam(m.min(), m.max()) for m in members), key=lambda g: g.item())
    amax = max(np.float32(m.abs().max().float()) for m in members)
    for m in members:
        R, K = m.shape
        g = m.reshape(R, K // 16, 16)
        scale, zp = h.calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs)
        theirs = _bytes(comp.compress({"weight": m, "weight_scale": scale, "weight_global_scale": gs,
                                       "weight_zero_point": zp}, scheme))
        ours = compressed_tensors_quantize(m.float().numpy(), "bfloat16", amax=amax)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
        assert ours[2].tobytes() == theirs[2].tobytes()
    own = compressed_tensors_quantize(members[1].float().numpy(), "bfloat16")
    assert own[2] != ours[2]                        # the shared scale is not the member's own
    with pytest.raises(ValueError, match="amax: nan"):
        compressed_tensors_quantize(q.float().numpy(), amax=np.nan)


def test_a_checkpoint_without_quantized_linears_is_not_consistent(tmp_path):
    """A ModelOpt config over weights of which none is quantized: nothing was checked, so it cannot pass."""
    torch = torch_or_skip()
    d = tmp_path / "plain"
    d.mkdir()
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}))
    _save(d / "model.safetensors", {"a.weight": torch.zeros(32, 32), "norm.weight": torch.ones(32)})
    rep = check_checkpoint(d)
    assert not rep.ok and any("no quantized linear found" in f for f in rep.faults), rep.summary()
    r = _cli(d)
    assert r.returncode == 1 and "CONSISTENT" not in r.stdout, r.stdout + r.stderr
