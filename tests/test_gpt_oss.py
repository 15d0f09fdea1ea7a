"""gpt-oss MXFP4 checkpoints: a folder in gpt-oss's layout (two MoE weights of two experts each, made from real
MiniLM weights, sharded with its index, a router and biases beside them) read back; its values, rounded to
bfloat16 and transposed, are transformers' ``convert_moe_packed_tensors`` output bit for bit; the MXFP4 rule that
wrote each weight is named from its high-precision values, and a weight with its nibbles swapped matches none."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import fp4sim as fs
from fp4sim.gpt_oss import is_gpt_oss, read_gpt_oss, reproducing_rules
from peers import import_or_missing, torch_or_skip

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "fp4sim" / "data" / "sample_dump.npz"
GU = "model.layers.0.mlp.experts.gate_up_proj"
DN = "model.layers.0.mlp.experts.down_proj"


def _experts():
    z = np.load(SAMPLE)
    return {GU: z["minilm.encoder.layer.5.intermediate.dense.weight"].reshape(2, 768, 384),
            DN: z["minilm.encoder.layer.0.attention.self.query.weight"].reshape(2, 192, 384)}


def _pack(x, mode):
    """gpt-oss's two entries of x (experts, rows, K) quantized with fp4sim's mxfp4 in ``mode``."""
    E, R, K = x.shape
    q = fs.quantize(x.reshape(E * R, K), "mxfp4", scale_mode=mode)
    return (np.asarray(q.codes).reshape(E, R, K // 32, 16), np.asarray(q.scales).reshape(E, R, K // 32))


def write_gpt_oss(d: Path, entries: dict):
    from safetensors.numpy import save_file
    d.mkdir(parents=True)
    names = sorted(entries)
    half = [names[: len(names) // 2], names[len(names) // 2:]]
    wm = {}
    for i, part in enumerate(half):
        f = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: entries[k] for k in part}, str(d / f))
        wm.update({k: f for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}))
    return d


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    x = _experts()
    ent = {}
    for name, mode in ((GU, "floor"), (DN, "rceil")):
        b, s = _pack(x[name], mode)
        ent[name + "_blocks"], ent[name + "_scales"] = b, s
        ent[name + "_bias"] = np.zeros(x[name].shape[:2], np.float32)
    ent["model.layers.0.mlp.router.weight"] = np.ones((2, 384), np.float32)
    return write_gpt_oss(tmp_path_factory.mktemp("gptoss") / "ck", ent), x


def test_a_gpt_oss_folder_reads_as_transformers_dequantizes_it(folder):
    torch = torch_or_skip()
    mx = import_or_missing("transformers.integrations.mxfp4")
    d, x = folder
    assert is_gpt_oss(d)
    ck = read_gpt_oss(d)
    assert set(ck.weights) == {GU, DN} and "model.layers.0.mlp.router.weight" in ck.other
    assert ck.excluded[-1] == "lm_head"
    for name in (GU, DN):
        w = ck.weights[name]
        assert w.shape == x[name].shape
        blocks = torch.from_numpy(w._read("blocks").copy())
        scales = torch.from_numpy(w._read("scales").copy())
        theirs = mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)     # [experts, K, rows]
        ours = np.swapaxes(w.values(), -1, -2).astype(ml_dtypes.bfloat16)
        assert theirs.view(torch.int16).numpy().tobytes() == np.ascontiguousarray(ours).view(np.int16).tobytes()


def test_the_rule_that_wrote_each_weight_is_named(folder, tmp_path):
    d, x = folder
    ck = read_gpt_oss(d)
    gu = reproducing_rules(ck.weights[GU], x[GU])
    dn = reproducing_rules(ck.weights[DN], np.swapaxes(x[DN], -1, -2))         # transformers' layout
    assert "floor" in gu and "rceil" not in gu, gu
    assert "rceil" in dn and "floor" not in dn, dn
    # nibbles swapped in one weight: no rule reproduces it
    from fp4sim.gpt_oss import MXFP4Weight
    b, s = _pack(x[GU], "floor")
    bad = write_gpt_oss(tmp_path / "swapped", {GU + "_blocks": ((b >> 4) | (b << 4)).astype(np.uint8),
                                               GU + "_scales": s})
    w = read_gpt_oss(bad).weights[GU]
    assert isinstance(w, MXFP4Weight) and reproducing_rules(w, x[GU]) == []
    with pytest.raises(ValueError, match="reference: shape"):
        reproducing_rules(ck.weights[GU], x[GU][:, :10])


def test_bad_folders_are_named(tmp_path):
    b, s = _pack(_experts()[GU], "floor")
    with pytest.raises(ValueError, match="has no .*_scales beside it"):
        read_gpt_oss(write_gpt_oss(tmp_path / "a", {GU + "_blocks": b}))
    with pytest.raises(ValueError, match="gpt-oss stores blocks"):
        read_gpt_oss(write_gpt_oss(tmp_path / "b", {GU + "_blocks": b, GU + "_scales": s[:, :10]}))
    d = write_gpt_oss(tmp_path / "c", {GU + "_blocks": b, GU + "_scales": s})
    (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert not is_gpt_oss(d)
    with pytest.raises(ValueError, match="not a gpt-oss MXFP4 checkpoint"):
        read_gpt_oss(d)


def _reference(d: Path, x: dict, transformers_layout=True):
    from safetensors.numpy import save_file
    d.mkdir()
    save_file({k: np.ascontiguousarray(np.swapaxes(v, -1, -2) if transformers_layout else v)
               for k, v in x.items()}, str(d / "model.safetensors"))
    return d


FAULTS = {   # fault -> (how the stored bytes are changed, a phrase of the message)
    "nibbles swapped": (lambda b, s: (((b >> 4) | (b << 4)).astype(np.uint8), s), "nibbles are swapped"),
    "ggml order": (lambda b, s: (_ggml(b), s), "ggml's order"),
    "bias 128": (lambda b, s: (b, (s + 1).astype(np.uint8)), "one binade high"),
    "bias 126": (lambda b, s: (b, (s - 1).astype(np.uint8)), "one binade low"),
    "transposed": (lambda b, s: (np.ascontiguousarray(b.transpose(0, 2, 1, 3)).reshape(b.shape),
                                 np.ascontiguousarray(s.transpose(0, 2, 1)).reshape(s.shape)), "transposed"),
}


def _ggml(b):
    from fp4sim.gguf import to_ggml_order
    from fp4sim.layout import unpack_fp4
    E, R, nb, _ = b.shape
    return to_ggml_order(unpack_fp4(b.reshape(E * R, nb * 16)), 32).reshape(b.shape)


def test_validate_checkpoint_on_gpt_oss(folder, tmp_path):
    import subprocess
    import sys
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    ref = _reference(tmp_path / "ref", x)
    rep = check_checkpoint(d)
    assert rep.ok and rep.format == "gpt-oss mxfp4" and set(rep.tensors) == {GU, DN}, rep.summary()
    rep = check_checkpoint(d, ref)
    assert rep.ok and all(t["exact"] for t in rep.tensors.values()), rep.summary()
    assert rep.tensors[GU]["rule"] == "MXFP4, scale mode floor" and rep.tensors[DN]["rule"] == "MXFP4, scale mode rceil"
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "checkpoint", str(d), "--reference", str(ref)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and "2 of 2 equal to the reference" in r.stdout, r.stdout + r.stderr
    # the stored [experts, rows, K] layout is a reference too
    assert check_checkpoint(d, _reference(tmp_path / "ref2", x, False)).ok


@pytest.mark.parametrize("kind", list(FAULTS))
def test_each_gpt_oss_fault_is_named(folder, tmp_path, kind):
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    change, phrase = FAULTS[kind]
    b, s = _pack(x[GU], "floor")
    b2, s2 = change(b, s)
    bad = write_gpt_oss(tmp_path / "bad", {GU + "_blocks": b2, GU + "_scales": s2})
    rep = check_checkpoint(bad, _reference(tmp_path / "ref", {GU: x[GU]}))
    assert not rep.ok and any(phrase in f and "MXFP4, scale mode floor" in f for f in rep.tensors[GU]["faults"]), \
        rep.summary()


def test_gpt_oss_checks_without_a_reference(folder, tmp_path):
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    b, s = _pack(x[GU], "floor")
    s = s.copy()
    s[0, 3, 2] = 255
    bad = write_gpt_oss(tmp_path / "nan", {GU + "_blocks": b, GU + "_scales": s})
    rep = check_checkpoint(bad)
    assert not rep.ok and any("1 E8M0 scale bytes are 255" in f for f in rep.tensors[GU]["faults"]), rep.summary()
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(num_local_experts=2, hidden_size=384, intermediate_size=300)          # 2 x 300 != 768 rows
    (bad / "config.json").write_text(json.dumps(cfg))
    s[0, 3, 2] = 120
    from safetensors.numpy import save_file
    for f in bad.glob("*.safetensors"):
        f.unlink()
    (bad / "model.safetensors.index.json").unlink()
    save_file({GU + "_blocks": b, GU + "_scales": s}, str(bad / "model.safetensors"))
    rep = check_checkpoint(bad)
    assert any("the config's dimensions give (2, 600, 384)" in f for f in rep.tensors[GU]["faults"]), rep.summary()


def test_a_gpt_oss_weight_as_a_quantized_tensor(folder):
    """quantized() holds the file's own bytes (read here with safetensors itself) as an mxfp4 QuantizedTensor of
    (experts x rows, K), which the quantizer that wrote them gives again from the decoded values."""
    from safetensors.numpy import load_file
    d, x = folder
    w = read_gpt_oss(d).weights[GU]
    q = w.quantized()
    raw = {}
    for f in d.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    assert q.scheme.name == "mxfp4" and q.shape == (1536, 384)
    assert np.array_equal(q.codes, raw[GU + "_blocks"].reshape(1536, 192))
    assert np.array_equal(q.scales, raw[GU + "_scales"].reshape(1536, 12))
    again = fs.quantize(np.asarray(fs.dequantize(q)), "mxfp4", scale_mode="floor")
    assert np.array_equal(np.asarray(again.codes).reshape(q.codes.shape), q.codes)


def test_analyze_reads_a_gpt_oss_folder(folder):
    """python -m fp4sim.analyze DIR on a gpt-oss folder: each MXFP4 weight as its stored values (experts x rows,
    K), named NAME.weight with the weight role; the router and biases read as usual (biases as vectors)."""
    from fp4sim.analyze.inputs import discover, load
    d, x = folder
    srcs, problems, _ = discover([str(d)])
    by = {s.name: s for s in srcs}
    assert not problems and {GU + ".weight", DN + ".weight", "model.layers.0.mlp.router.weight"} <= set(by)
    assert not any(n.endswith(("_blocks", "_scales")) for n in by)
    w = read_gpt_oss(d).weights[GU]
    assert by[GU + ".weight"].role == "weight"
    assert load(by[GU + ".weight"]).tobytes() == w.values().reshape(-1, 384).tobytes()


def test_a_truncated_shard_names_its_weight_and_checks_the_others(folder, tmp_path):
    """A shard cut short (an interrupted download): the weight whose bytes it ends before is a fault naming the
    entry; the weight in the other shard is still checked, and exact."""
    import shutil
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    cut = tmp_path / "cut"
    shutil.copytree(d, cut)
    wm = json.loads((cut / "model.safetensors.index.json").read_text())["weight_map"]
    shard = cut / wm[GU + "_blocks"]
    other = DN if wm[DN + "_blocks"] != wm[GU + "_blocks"] else None
    shard.write_bytes(shard.read_bytes()[:-5000])
    rep = check_checkpoint(cut, _reference(tmp_path / "ref", x))
    assert not rep.ok, rep.summary()
    gu = rep.tensors[GU]
    assert any("truncated" in f for f in gu["faults"]) and not gu["ok"], rep.summary()
    if other:
        assert rep.tensors[other]["ok"] and rep.tensors[other]["exact"], rep.summary()


def test_analyze_requantize_on_a_gpt_oss_folder(folder, tmp_path):
    """The study on a gpt-oss folder with transformers-layout references: each weight's writing rule is named
    (floor and rceil), and that rule's re-quantization costs exactly what the stored values cost, which is
    computed here from transformers' own dequantizer."""
    import subprocess
    import sys
    tr = import_or_missing("transformers.integrations.mxfp4")
    torch = torch_or_skip()
    d, x = folder
    ref = _reference(tmp_path / "ref", x)
    js = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(d), "--requantize", str(ref), "--json", str(js),
                        "--quiet", "--schemes", "mxfp4_rceil", "--no-hadamard"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {t["tensor"]: t for t in json.loads(js.read_text())["requantize"]["tensors"]}
    for name, mode in ((GU, "floor"), (DN, "rceil")):
        t = rows[name]
        assert t["file_rule"] == [f"MXFP4, scale mode {mode}"], t["file_rule"]
        b, s = _pack(x[name], mode)
        theirs = tr.convert_moe_packed_tensors(torch.from_numpy(b), torch.from_numpy(s)).float().numpy()
        a = np.swapaxes(x[name], -1, -2).astype(np.float64)            # transformers' [experts, K, rows]
        want = ((theirs.astype(np.float64) - a) ** 2).sum() / (a * a).sum()
        # transformers' values are bfloat16: exact for these E2M1 x 2^k values, so the error is the stored one
        assert t["stored"] == pytest.approx(want, rel=1e-12)
        assert t["rel_mse"][f"MXFP4 {mode}"] == pytest.approx(t["stored"], rel=1e-12)


# ------------------------------------------------------------------------ what users holding gpt-oss files hit
SQ = "model.layers.0.mlp.experts.down_proj"


def _square():
    """Square experts (rows = K = 384, as gpt-oss-20b's and 120b's down_proj have hidden = intermediate = 2880),
    from real MiniLM weights."""
    z = np.load(SAMPLE)
    return np.stack([z["minilm.encoder.layer.0.attention.self.query.weight"],
                     z["minilm.encoder.layer.5.intermediate.dense.weight"][:384]])


@pytest.mark.parametrize("layout", ["stored", "transformers"])
def test_square_experts_match_in_either_reference_layout(tmp_path, layout):
    """Where rows = K the shape cannot tell the reference's layout: the bytes decide, and the report says which
    reading matched. The weight's rule is found, and analyze --requantize names it too."""
    import subprocess
    import sys
    from fp4sim.gpt_oss import TRANSPOSED, STORED
    from fp4sim.validate.checkpoint import check_checkpoint
    x = _square()
    b, s = _pack(x, "rceil")
    d = write_gpt_oss(tmp_path / "sq", {SQ + "_blocks": b, SQ + "_scales": s})
    ref = _reference(tmp_path / "ref", {SQ: x}, transformers_layout=layout == "transformers")
    rep = check_checkpoint(d, ref)
    t = rep.tensors[SQ]
    assert rep.ok and t["exact"] and t["rule"] == "MXFP4, scale mode rceil", rep.summary()
    want = TRANSPOSED if layout == "transformers" else STORED
    assert any(f"square: its bytes match it read in {want}" in n for n in t["notes"]), rep.summary()
    assert reproducing_rules(read_gpt_oss(d).weights[SQ], np.swapaxes(x, -1, -2) if layout == "transformers"
                             else x) == ["rceil"]
    js = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(d), "--requantize", str(ref), "--json", str(js),
                        "--quiet", "--schemes", "mxfp4_rceil", "--no-hadamard"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(js.read_text())["requantize"]["tensors"][0]
    assert row["file_rule"] == ["MXFP4, scale mode rceil"] and row["rel_mse"]["MXFP4 rceil"] == row["stored"], row


def test_one_inconsistent_weight_is_a_fault_and_the_others_are_checked(folder, tmp_path):
    """A _blocks entry with fewer experts than its _scales (1 beside 2): a fault of that weight (not 'bad input' for the
    folder); the other weight is checked against the reference and exact; analyze skips the broken weight with
    its reason and analyses the other."""
    import subprocess
    import sys
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    b, s = _pack(x[GU], "floor")
    b3 = np.ascontiguousarray(b[:1])                                    # 1 expert of blocks, 2 of scales
    db, ds = _pack(x[DN], "rceil")
    bad = write_gpt_oss(tmp_path / "bad", {GU + "_blocks": b3, GU + "_scales": s, DN + "_blocks": db,
                                           DN + "_scales": ds})
    rep = check_checkpoint(bad, _reference(tmp_path / "ref", x))
    assert not rep.ok and rep.tensors[DN]["ok"] and rep.tensors[DN]["exact"], rep.summary()
    assert any("do not make an MXFP4 weight" in f and "gpt-oss stores blocks" in f for f in rep.tensors[GU]["faults"])
    head = rep.summary().splitlines()[0]
    assert "1 of 2 with faults" in head, head
    r = subprocess.run([sys.executable, "-m", "fp4sim.validate", "checkpoint", str(bad)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and "FAULT " + GU in r.stdout, r.stdout + r.stderr
    from fp4sim.analyze import analyze
    ds = analyze([str(bad)], schemes=["mxfp4_rceil"], hadamard=False, quiet=True)
    skipped = json.loads(ds.attrs["skipped"])
    assert any(GU in k["tensor"] and "do not make an MXFP4 weight" in k["reason"] and not k.get("ignored")
               for k in skipped), skipped
    assert list(ds.tensor.values) == [DN + ".weight"], skipped
    r = subprocess.run([sys.executable, "-m", "fp4sim.analyze", str(bad), "--quiet", "--schemes", "mxfp4_rceil",
                        "--no-hadamard"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1 and "do not make an MXFP4 weight" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_headline_counts_tensors_and_checkpoint_faults_apart(folder, tmp_path):
    """One reference problem on one tensor (its reference has another shape): that tensor's fault, and the
    checkpoint's fault that it was not compared — '1 of 2 with faults; 1 fault of the checkpoint as a whole', not
    '2 with faults'. A reference that leaves a weight out: the 'N of M not compared' fault."""
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    rep = check_checkpoint(d, _reference(tmp_path / "ref", {GU: x[GU], DN: x[DN][:, :10]}))
    head = rep.summary().splitlines()[0]
    assert "1 of 2 with faults; 1 fault of the checkpoint as a whole" in head, rep.summary()
    assert "reference: shape" in " ".join(rep.tensors[DN]["faults"]) and rep.tensors[GU]["exact"], rep.summary()
    rep = check_checkpoint(d, _reference(tmp_path / "part", {GU: x[GU]}))
    assert not rep.ok and any(f.startswith("1 of 2 quantized weights were not compared") for f in rep.faults), \
        rep.summary()
    assert any(f"no reference tensor {DN}.weight or {DN}: not compared" == n for n in rep.tensors[DN]["notes"])


def test_a_fault_confined_to_some_blocks_says_how_many_and_where(folder, tmp_path):
    """One block's nibbles swapped and another block's scale byte one off: no rule and no whole-tensor fault
    reproduces the bytes; the fault counts the scale blocks that differ from the closest rule's and names the
    first (expert, row, block)."""
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    b, s = _pack(x[GU], "floor")
    b, s = b.copy(), s.copy()
    b[1, 5, 3] = (b[1, 5, 3] >> 4) | (b[1, 5, 3] << 4)
    assert not np.array_equal(b, _pack(x[GU], "floor")[0])               # the block is no palindrome
    s[0, 700, 2] += 1
    bad = write_gpt_oss(tmp_path / "bad", {GU + "_blocks": b, GU + "_scales": s})
    rep = check_checkpoint(bad, _reference(tmp_path / "ref", {GU: x[GU]}))
    f = " ".join(rep.tensors[GU]["faults"])
    assert "2 of 18432 scale blocks differ from the bytes of MXFP4, scale mode floor" in f, f
    assert "first at expert 0, row 700, block 2" in f, f


def test_without_a_reference_the_report_says_what_it_could_not_see(folder):
    """A checkpoint with its nibbles swapped is CONSISTENT without a reference (nothing in its bytes alone shows
    it), and the report says so and names --reference."""
    from fp4sim.validate.checkpoint import check_checkpoint
    d, x = folder
    text = check_checkpoint(d).summary()
    assert "CONSISTENT" in text and "--reference checks the bytes" in text, text


def test_gpt_oss_sinks_and_expert_biases_are_parameters_not_activations(tmp_path):
    """gpt-oss's attention sinks (1-D) and per-expert biases (2-D) are parameters no GEMM takes: listed as not
    analysed, and analysed under the weight role with --include-vectors (not as activations)."""
    from fp4sim.analyze import analyze
    x = _experts()
    b, s = _pack(x[GU], "floor")
    sinks, bias = "model.layers.0.self_attn.sinks", GU + "_bias"
    rng = np.random.default_rng(0)
    d = write_gpt_oss(tmp_path / "ck", {GU + "_blocks": b, GU + "_scales": s,
                                        sinks: rng.standard_normal(64).astype(np.float32),
                                        bias: rng.standard_normal((2, 768)).astype(np.float32)})
    kw = dict(schemes=["mxfp4_rceil"], hadamard=False, quiet=True)
    ds = analyze([str(d)], **kw)
    ignored = {k["tensor"]: k for k in json.loads(ds.attrs["skipped"])}
    assert {sinks, bias} <= set(ignored) and all(ignored[n].get("ignored") for n in (sinks, bias)), ignored
    assert list(ds.tensor.values) == [GU + ".weight"]
    ds = analyze([str(d)], include_vectors=True, **kw)
    roles = dict(zip(ds.tensor.values, ds.role.values))
    assert roles[sinks] == "weight" and roles[bias] == "weight" and roles[GU + ".weight"] == "weight", roles
