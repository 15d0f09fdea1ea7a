"""MLX checkpoints in its float modes, written by mlx-lm itself (load_model, quantize_model, save_model,
save_config) from a small random-weight Llama: read (values equal MLX's own dequantize), validated byte for
byte against the high-precision weights (the rule named in the dtype mlx-lm quantized in), faults and unknown
modes named, analysed and costed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from peers import import_or_missing, torch_or_skip

ROOT = Path(__file__).resolve().parents[1]
MODES = ("mxfp4", "nvfp4", "mxfp8")
DOWN = "model.layers.0.mlp.down_proj"
UP = "model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A random-weight Llama (hidden 64, intermediate 128, two layers; bfloat16 safetensors, the reference) and
    its mlx-lm conversions in each float mode, plus one where mlx-lm leaves the second layer's up_proj in MLX's
    affine mode (its quant_predicate, as mixed-precision conversions do)."""
    torch = torch_or_skip()
    tr = import_or_missing("transformers")
    utils = import_or_missing("mlx_lm.utils")
    base = tmp_path_factory.mktemp("mlx")
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(0)
    tr.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base / "hf")
    out = {"hf": base / "hf"}
    for mode in MODES + ("mixed",):
        model, config = utils.load_model(base / "hf")
        pred = (lambda path, module: {"group_size": 64, "bits": 4, "mode": "affine"} if path == UP else True) \
            if mode == "mixed" else None
        model, config = utils.quantize_model(model, config, None, None, mode="mxfp4" if mode == "mixed" else mode,
                                             quant_predicate=pred)
        d = base / mode
        d.mkdir()
        utils.save_model(d, model)
        utils.save_config(config, d / "config.json")
        out[mode] = d
    return out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fp4sim.validate", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


@pytest.mark.parametrize("mode", MODES)
def test_a_conversion_reads_as_mlx_dequantizes_it(folders, mode):
    mx = import_or_missing("mlx.core")
    from fp4sim.checkpoints.mlx import is_mlx, read_mlx
    d = folders[mode]
    assert is_mlx(d) and not is_mlx(folders["hf"])
    ck = read_mlx(d)
    assert not ck.broken and DOWN in ck.weights and "model.embed_tokens" in ck.weights
    w = ck.weights[DOWN]
    assert w.mode == mode and w.shape == (64, 128) and w.layout.format == f"mlx {mode}"
    raw = mx.load(str(d / "model.safetensors"))
    theirs = mx.dequantize(raw[f"{DOWN}.weight"], raw[f"{DOWN}.scales"], mode=mode).astype(mx.float32)
    assert np.array_equal(w.values(), np.array(theirs))
    assert np.array_equal(w.rows(5, 37), np.array(theirs)[5:37])          # a row range reads only its bytes


@pytest.mark.parametrize("mode", MODES)
def test_a_conversion_validates_byte_for_byte(folders, mode):
    from fp4sim.validate.checkpoint import check_checkpoint
    d, ref = folders[mode], folders["hf"]
    rep = check_checkpoint(d)
    assert rep.ok and rep.format == "mlx", rep.summary()
    rep = check_checkpoint(d, ref)
    assert rep.ok, rep.summary()
    for name, t in rep.tensors.items():
        assert t["exact"] and t["rule"] == f"MLX's {mode} rule (in bfloat16)", (name, t)
    r = _cli("checkpoint", d, "--reference", ref)
    assert r.returncode == 0 and "CONSISTENT" in r.stdout, r.stdout + r.stderr


def _copy_with(src: Path, dst: Path, change=None, config=None) -> Path:
    """A copy of an MLX folder with one tensor changed (``change(name, array) -> array``) or its config edited."""
    mx = import_or_missing("mlx.core")
    shutil.copytree(src, dst)
    if change is not None:
        t = dict(mx.load(str(src / "model.safetensors")))
        for k in list(t):
            new = change(k, np.array(t[k]) if t[k].dtype in (mx.uint8, mx.uint32) else None)
            if new is not None:
                t[k] = mx.array(new)
        mx.save_safetensors(str(dst / "model.safetensors"), t)
    if config is not None:
        c = json.loads((src / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def _swap_nibbles(k, a):
    if k == f"{DOWN}.weight":
        b = a.view(np.uint8)
        return ((b >> 4) | (b << 4)).astype(np.uint8).view(np.uint32)
    return None


def _bias(k, a):
    return (a + 1).astype(np.uint8) if k == f"{DOWN}.scales" else None


@pytest.mark.parametrize("mode, change, phrase", [
    ("mxfp4", _swap_nibbles, "the nibbles are swapped"),
    ("nvfp4", _swap_nibbles, "the nibbles are swapped"),
    ("mxfp4", _bias, "the scale bytes are one binade high"),
    ("mxfp8", _bias, "the scale bytes are one binade high")])
def test_each_fault_is_named_on_its_module(folders, tmp_path, mode, change, phrase):
    from fp4sim.validate.checkpoint import check_checkpoint
    d = _copy_with(folders[mode], tmp_path / "bad", change=change)
    rep = check_checkpoint(d, folders["hf"])
    assert not rep.ok and rep.tensors[UP]["ok"], rep.summary()
    assert any(phrase in f for f in rep.tensors[DOWN]["faults"]), rep.summary()


def test_an_unknown_mode_and_an_affine_module_are_named(folders, tmp_path):
    from fp4sim.validate.checkpoint import check_checkpoint
    rep = check_checkpoint(folders["mixed"], folders["hf"])
    assert not rep.ok and rep.tensors[DOWN]["ok"], rep.summary()
    assert any("MLX's affine (integer) quantization, not a float format" in f for f in rep.tensors[UP]["faults"])

    def six(c):
        c["quantization"]["mode"] = c["quantization_config"]["mode"] = "mxfp6"
    d = _copy_with(folders["mxfp4"], tmp_path / "six", config=six)
    rep = check_checkpoint(d)
    assert not rep.ok and any("an unknown mode 'mxfp6'" in f for t in rep.tensors.values() for f in t["faults"])
    r = _cli("checkpoint", d)
    assert r.returncode == 1 and "mxfp6" in r.stdout, r.stdout + r.stderr


def test_analyze_reads_and_costs_a_conversion(folders):
    from fp4sim.analyze.inputs import discover, load
    from fp4sim.checkpoints.mlx import read_mlx
    from fp4sim.requantize import requantize_study
    d = folders["mxfp4"]
    sources, problems, _ = discover([str(d)])
    byname = {s.name: s for s in sources}
    assert not problems and f"{DOWN}.weight" in byname
    assert np.array_equal(load(byname[f"{DOWN}.weight"]), read_mlx(d).weights[DOWN].values())
    st = requantize_study([d], folders["hf"])
    rows = {r["tensor"]: r for r in st["tensors"]}
    assert rows[DOWN]["file_rule"][0] == "MLX's mxfp4 rule (in bfloat16)", rows[DOWN]


def test_inspect_refuses_a_quantized_folder_saying_what_it_is(folders, tmp_path):
    """fp4sim inspect takes the high-precision model: an MLX conversion is refused with one line that says what
    the folder is and which commands read it (exit 2, no traceback)."""
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten " * 20)
    r = subprocess.run([sys.executable, "-m", "fp4sim.cli", "inspect", str(folders["mxfp4"]), "--text", str(text)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "an MLX-quantized checkpoint" in r.stderr and "fp4sim.validate checkpoint" in \
        r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_module_the_config_leaves_unquantized_must_be_in_high_precision(folders, tmp_path):
    """config.json's quantization["MODULE"] = false: the module is not read as quantized, and its weight must be
    there in high precision — a quantized one (U32 words) under it is a fault naming it."""
    from fp4sim.checkpoints.mlx import read_mlx
    from fp4sim.validate.checkpoint import check_checkpoint

    def skip_up(c):
        c["quantization"][UP] = False
    d = _copy_with(folders["mxfp4"], tmp_path / "off", config=skip_up)
    ck = read_mlx(d)
    assert UP not in ck.weights and UP in ck.excluded and DOWN in ck.weights
    rep = check_checkpoint(d)
    assert not rep.ok and any(f"excluded module {UP!r} is stored as U32" in f for f in rep.faults), rep.summary()
