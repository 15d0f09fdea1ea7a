"""fp4sim inspect on tiny Hugging Face models built here (a LlamaForCausalLM and a BertModel with random weights,
saved as local folders with a word-level tokenizer trained on the text): every output present, the per-layer
numbers those of collect_stats / gradient_fidelity / suggest_high_precision called directly on the same batches,
the HTML holding one table row per linear layer, and bad inputs refused with one line and exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from peers import import_or_missing, torch_or_skip, write_gguf

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat near the door. " * 3 +
        "Numbers such as four and six appear in tables of formats, scales and blocks of sixteen values. " * 3)


def _tokenizer(folder: Path, text: str):
    tk = import_or_missing("tokenizers")
    transformers = import_or_missing("transformers")
    tok = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tk.trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(str(folder))
    return fast


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch = torch_or_skip()
    transformers = import_or_missing("transformers")
    base = tmp_path_factory.mktemp("inspect")
    text = base / "text.txt"
    text.write_text(TEXT)
    torch.manual_seed(0)
    llama = base / "llama"
    tok = _tokenizer(llama, TEXT)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(llama))
    # stored in bfloat16, the head tied to the embeddings: inspect holds the linear weights as stored
    llama16 = base / "llama_bf16"
    _tokenizer(llama16, TEXT)
    cfg16 = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     tie_word_embeddings=True)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg16).to(torch.bfloat16).save_pretrained(str(llama16))
    bert = base / "bert"
    tok = _tokenizer(bert, TEXT)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(str(bert))
    return base, text, llama, bert, llama16


def _float32(folder: Path):
    """The model as transformers loads it in float32, every weight widened (the oracle's model)."""
    transformers = import_or_missing("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()


def _cli(*args):
    """The console script, as a user types it."""
    return subprocess.run([str(Path(sys.executable).parent / "fp4sim"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


class _Rows(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self.imgs, self.depth = 0, 0, 0

    def handle_starttag(self, tag, attrs):
        if tag == "tbody":
            self.depth += 1
        elif tag == "tr" and self.depth:
            self.rows += 1
        elif tag == "img" and dict(attrs).get("src", "").startswith("data:image/png;base64,"):
            self.imgs += 1

    def handle_endtag(self, tag):
        if tag == "tbody":
            self.depth -= 1


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_the_command_on_a_causal_lm_matches_the_functions_it_runs(models, tmp_path, stored):
    """The command holds the linear weights as stored and reduces each layer's gradients and operands as the
    passes reach it (streaming_fidelity); the oracle is the model widened to float32 whole and the functions that
    hold every layer's gradients at once: the same bits."""
    torch = torch_or_skip()
    import xarray as xr
    from fp4sim.inspect_model import _batches, _load, _loss
    from fp4sim.torch import collect_stats, convert, gradient_fidelity, suggest_high_precision, wgrad_errors
    from fp4sim.training import Recipe
    base, text, llama, bert, llama16 = models
    llama = llama16 if stored == "bfloat16" else llama
    out = tmp_path / "out"
    r = _cli("inspect", llama, "--text", text, "--batches", 2, "--batch-size", 2, "--seq-len", 16, "--out", out,
             "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    ds = xr.load_dataset(out / "layers.nc")
    summ = json.loads((out / "summary.json").read_text())
    page = (out / "report.html").read_text()
    # the same computation by hand
    _, tok, kind = _load(llama)
    model = _float32(llama)
    assert kind == "causal" and summ["kind"] == "causal" and "cross entropy" in summ["loss"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    held, _, _ = _load(llama)              # what the command holds: the linear weights as stored, the rest widened
    lin = {n + ".weight" for n, m in held.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    for n, p in held.named_parameters():
        assert p.dtype == (getattr(torch, stored) if n in lin else torch.float32), n
    assert held.lm_head.weight.dtype == torch.float32 and (stored == "float32" or held.lm_head.weight is
                                                           held.get_input_embeddings().weight)   # tied: widened
    data, reps = _batches(tok, TEXT, 2, 2, 16)
    if stored == "bfloat16":
        # a head tied to the embeddings is studied by its own Wgrad GEMM's gradient: the oracle unties it (the
        # tied parameter's .grad, which gradient_fidelity reads, adds the embedding lookup's gradient to it)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    convert(model, Recipe.preset("nvfp4_paper", accumulate="fast"))     # the command's default accumulation
    torch.manual_seed(0)
    assert summ["unused_layers"] == []
    names = [str(n) for n in ds.layer.values]
    assert len(names) == 3 * 7 + 1 and names[-1] == "lm_head"

    def step(i):
        def fn():
            model.zero_grad(set_to_none=True)
            _loss(model, kind, data[i]).backward()
        return fn

    # batch i: gradient_fidelity's quantized and float32 passes at SR call count i, logged by collect_stats and
    # wgrad_errors during the quantized one
    layers = [m for _, m in model.named_modules() if hasattr(m, "_calls")]
    with collect_stats(model) as log, wgrad_errors(model) as werr:
        for i in range(2):
            for m in layers:
                m._calls = i
            g = gradient_fidelity(model, step(i))
            np.testing.assert_array_equal(ds.snr.sel(batch=i).values, g.snr.sel(layer=names).values)
            np.testing.assert_array_equal(ds.cosine.sel(batch=i).values, g.cosine.sel(layer=names).values)
    st = log.dataset()
    np.testing.assert_array_equal(ds.rel_mse.values, st.rel_mse.sel(layer=names).values)
    assert all(len(werr[n]) == 2 for n in names)
    for i in range(2):
        np.testing.assert_array_equal(ds.wgrad_gemm_rel_error_batch.sel(batch=i).values,
                                      [(werr[n][i][0] / werr[n][i][1]) ** 0.5 for n in names])

    def cycle():                                   # suggest_high_precision over the same two batches and calls
        i = cycle.i % 2
        cycle.i += 1
        for m in layers:
            m._calls = i
        step(i)()
    cycle.i = 0
    keep, rel = suggest_high_precision(model, cycle, fraction=0.15, steps=2)
    assert summ["recommendation"] == keep and [n for n in names if ds.recommended.sel(layer=n)] == sorted(
        keep, key=names.index)
    np.testing.assert_array_equal(ds.wgrad_gemm_rel_error.values, [rel[n] for n in names])
    # the losses: the recipe's as the quantized passes gave them, float32's those of the model as loaded
    plain = _float32(llama)
    with torch.no_grad():
        assert summ["losses_float32"] == [float(_loss(plain, kind, data[i])) for i in range(2)]
    v = summ["verdict"]
    d = np.array(summ["losses"]) - np.array(summ["losses_float32"])
    assert v["loss"]["difference"] == pytest.approx(d.mean(), abs=1e-15)
    assert v["loss"]["difference_se"] == pytest.approx(d.std(ddof=1) / 2 ** 0.5, rel=1e-12)
    # the verdict's rule, recomputed from the dataset: outliers above median + 3 x 1.4826 MAD by 2 s.e.
    r = ds.wgrad_gemm_rel_error.values
    se = ds.wgrad_gemm_rel_error_batch.values.std(1) / 2 ** 0.5
    med = np.median(r)
    bulk = med + 3 * 1.4826 * np.median(np.abs(r - med))
    assert v["clear_outliers"] == [names[j] for j in np.argsort(-r, kind="stable") if r[j] - 2 * se[j] > bulk]
    top_left = max(r[j] + 2 * se[j] for j, n in enumerate(names) if n not in keep)
    assert v["resolved"] == [n for n in keep if r[names.index(n)] - 2 * se[names.index(n)] > top_left]
    assert v["follow"] in ("recommendation", "outliers_and_paper_rule", "paper_rule")
    assert summ["paper_rule"] == [n for n in names if n.startswith("model.layers.2.")]   # the last of 3 blocks
    assert abs(sum(L["flops_share"] for L in summ["layers"]) - 1) < 1e-12
    # the RHT study: the Wgrad operands' relative error without and with the RHT, finite for every layer
    assert np.isfinite(ds.wgrad_rel_mse.values).all()
    p = _Rows()
    p.feed(page)
    assert p.rows == len(names) + len(keep) and p.imgs == 2 and "sqrt(3)" in page and "<script>" in page
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Recommendation</h2>") < page.index("<h2>Layers</h2>")


def test_an_encoder_takes_the_contrastive_loss(models, tmp_path):
    base, text, llama, bert, _ = models
    r = _cli("inspect", bert, "--text", text, "--quick", "--out", tmp_path / "o", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    summ = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summ["kind"] == "encoder" and "contrastive" in summ["loss"]
    assert len(summ["layers"]) == 2 * 6                           # q, k, v, attention out, intermediate, output
    assert summ["unused_layers"] == ["pooler.dense"]              # mean pooling: the pooler takes no part


def test_bad_inputs_get_one_line_and_exit_2(models, tmp_path):
    base, text, llama, bert, _ = models
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    nv = tmp_path / "nvfp4_export"                    # a ModelOpt NVFP4 export's config files beside the model's
    nv.mkdir()
    for f in llama.glob("*.json"):
        (nv / f.name).write_text(f.read_text())
    (nv / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4", "group_size": 16}}')
    cases = [
        ((nv, "--text", text), "takes the high-precision model it was made from"),
        ((tmp_path / "noconfig", "--text", text), "no config.json"),
        ((tmp_path / "nowhere", "--text", text), "not a folder"),
        ((llama, "--text", tmp_path / "empty.txt"), "the file is empty"),
        ((llama, "--text", tmp_path / "bin.txt"), "cannot read it as UTF-8"),
        ((llama, "--text", tmp_path / "missing.txt"), "cannot read it"),
        ((llama, "--text", text, "--seq-len", 100), "longer than the model's context (64 positions)"),
        ((llama, "--text", text, "--recipe", "nvfp5"), "--recipe: preset 'nvfp5' is not known"),
    ]
    for args, phrase in cases:
        r = _cli("inspect", *args, "--out", tmp_path / "x", "--quiet")
        ours = [ln for ln in r.stderr.splitlines() if ln.startswith("fp4sim inspect:")]
        assert r.returncode == 2 and len(ours) == 1 and phrase in ours[0], (args, r.stderr)
        assert "Traceback" not in r.stderr and not (tmp_path / "x" / "summary.json").exists()


@pytest.mark.parametrize("folder", sorted(p.name for p in (ROOT / "analyses" / "inspect").glob("*_*")
                                          if (p / "layers.nc").is_file()))
def test_the_committed_reports_regenerate_from_their_data(folder):
    """analyses/inspect/*/report.html is what report_html makes from the committed layers.nc and summary.json
    (python analyses/inspect_models.py --replot), without the models."""
    import xarray as xr
    from fp4sim.inspect_model import report_html
    d = ROOT / "analyses" / "inspect" / folder
    page = report_html(xr.load_dataset(d / "layers.nc"), json.loads((d / "summary.json").read_text()))
    # the same page; the figures' PNG bytes compared as present only (they carry the matplotlib build)
    import re
    strip = lambda t: re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,PNG", t)  # noqa: E731
    assert strip(page) == strip((d / "report.html").read_text(encoding="utf-8"))
    p = _Rows()
    p.feed(page)
    summary = json.loads((d / "summary.json").read_text())      # the layer table and the recommendation's
    assert p.rows == xr.load_dataset(d / "layers.nc").sizes["layer"] + len(summary["recommendation"])
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Recommendation</h2>")


def test_options_are_checked_before_the_model_loads_and_name_themselves(models, tmp_path):
    """--accumulate names itself (not --recipe); --seq-len beyond the configuration's context is refused before the
    weights load: a folder whose weights are corrupt still gets the --seq-len message."""
    base, text, llama, bert, _ = models
    r = _cli("inspect", llama, "--text", text, "--accumulate", "slow", "--out", tmp_path / "x", "--quiet")
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("fp4sim inspect:")]
    assert r.returncode == 2 and len(ours) == 1 and "--accumulate slow" in ours[0] and "--recipe" not in ours[0], \
        r.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in llama.iterdir():
        (broken / f.name).write_bytes(b"not safetensors" if f.suffix == ".safetensors" else f.read_bytes())
    r = _cli("inspect", broken, "--text", text, "--seq-len", 100000, "--out", tmp_path / "y", "--quiet")
    assert r.returncode == 2 and "--seq-len 100000: longer than the model's context (64 positions)" in r.stderr, \
        r.stderr
    r = _cli("inspect", broken, "--text", text, "--seq-len", 32, "--out", tmp_path / "z", "--quiet")
    assert r.returncode == 2 and "does not load" in r.stderr, r.stderr                     # the weights are broken


def test_a_gguf_source_with_quantized_weights_is_named(tmp_path):
    """A folder read from one .gguf file (no config.json) whose tensors are stored in a quantized type: inspect's
    summary says they were low-precision already; a float GGUF, or a folder with a config.json, says nothing."""
    gg = import_or_missing("gguf")
    from fp4sim.inspect_model import _gguf_quantized_types
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    for name, tensors in (("q", {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q8_0", "norm": None}),
                          ("f", {"blk.0.attn_q.weight": None})):
        d = tmp_path / name
        d.mkdir()
        write_gguf(d / "m.gguf", {n: (gg.quants.quantize(w, gg.GGMLQuantizationType[k]), k) if k else w
                                  for n, k in tensors.items()})
    assert _gguf_quantized_types(tmp_path / "q") == {"Q8_0": 2}
    assert _gguf_quantized_types(tmp_path / "f") == {}
    (tmp_path / "q" / "config.json").write_text("{}")
    assert _gguf_quantized_types(tmp_path / "q") == {}


def test_a_model_larger_than_the_memory_is_refused_before_it_loads(models, tmp_path, monkeypatch, capsys):
    """The estimate (fp4sim.inspect_memory) against what the machine has: one line with both figures and exit 2,
    before any weight loads; --no-memory-check runs anyway; a spill folder without room is named the same way."""
    transformers = import_or_missing("transformers")
    import shutil
    from fp4sim import inspect_memory
    from fp4sim.inspect_model import main
    base, text, llama, bert, llama16 = models
    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a) or real(*a, **k))
    monkeypatch.setattr(inspect_memory, "available_bytes", lambda: 2 ** 20)        # 1 MB left
    out = tmp_path / "o"
    assert main([str(llama16), "--text", str(text), "--quick", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GB of weights" in err[0] and "0.0 GB available" in err[0], err
    assert "--no-memory-check" in err[0] and not loads and not out.exists()
    assert main([str(llama16), "--text", str(text), "--quick", "--out", str(out), "--quiet",
                 "--no-memory-check"]) == 0
    assert loads and (out / "summary.json").is_file()
    mem = json.loads((out / "summary.json").read_text())["memory"]
    assert mem["peak_gb"] > 0 and "estimate_gb" not in mem                          # not checked: not estimated
    monkeypatch.setattr(inspect_memory, "available_bytes", lambda: None)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0))
    assert main([str(llama16), "--text", str(text), "--quick", "--out", str(tmp_path / "d"), "--quiet",
                 "--spill-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--spill-dir {tmp_path}" in err[0] and "0.0 GB free" in err[0], err


def test_the_estimate_counts_the_weights_as_held(models):
    """bfloat16 linear weights at 2 bytes, the tied embedding (and everything else) at 4, as _load holds them."""
    torch_or_skip()
    transformers = import_or_missing("transformers")
    from fp4sim.inspect_memory import estimate
    from fp4sim.inspect_model import _load
    base, text, llama, bert, llama16 = models
    for folder in (llama, llama16):
        cfg = transformers.AutoConfig.from_pretrained(str(folder))
        e = estimate(folder, cfg, 2, 32)
        held, _, _ = _load(folder)
        seen = {}
        for p in held.parameters():
            seen[id(p)] = p.numel() * p.element_size()
        assert e.weights == sum(seen.values()), folder
        assert e.params == sum(p.numel() for p in held.parameters()) and e.total > e.weights


def test_an_interrupted_write_leaves_no_partial_output(tmp_path):
    """Ctrl-C while the outputs are written: the files of the run before stay as they were, no partial file."""
    from fp4sim import inspect_model as im
    out = tmp_path / "o"
    out.mkdir()
    (out / "summary.json").write_text("before")

    class Stop:
        def to_netcdf(self, p):
            Path(p).write_bytes(b"half")
            raise KeyboardInterrupt

    import unittest.mock as mock
    with mock.patch.object(im, "report_html", lambda ds, s: "<html>"), pytest.raises(KeyboardInterrupt):
        im._write_outputs(out, Stop(), {"x": 1})
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
    assert (out / "summary.json").read_text() == "before"
