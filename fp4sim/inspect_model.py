"""``fp4sim inspect MODEL_DIR --text FILE``: what a recipe does to a Hugging Face model, layer by layer.

The model folder is read offline (config.json, safetensors weights, its tokenizer); FILE is tokenized with the
folder's tokenizer into ``--batches`` fixed batches of ``--batch-size`` x ``--seq-len`` tokens (the text repeated
when it is shorter, which the summary says). Every ``nn.Linear`` becomes a :class:`~fp4sim.torch.QuantLinear` under
the recipe (the output head kept in BF16, as convert does), its weight held as stored and widened where a GEMM
reads it, every other tensor in float32; each layer's gradients and operands are reduced to their statistics as
the passes reach the layer (:func:`~fp4sim.torch.streaming_fidelity`), and the memory this needs is estimated
before the model loads (:mod:`fp4sim.inspect_memory`; docs/large_models.md). The loss: next-token cross
entropy for a causal LM; for an encoder without an LM head, a contrastive (InfoNCE) loss between the mean-pooled
embeddings of each sequence's two halves, temperature 0.05.

Per linear layer, over the batches:

- the forward error of its operands (:func:`~fp4sim.torch.collect_stats`: relative MSE, underflow, ...);
- its weight-gradient SNR and cosine against float32 on the same batch (:func:`~fp4sim.torch.streaming_fidelity`,
  :func:`~fp4sim.torch.gradient_fidelity` one layer at a time), per batch and their mean and spread;
- outlier channels of its input (``|x| > 6 sigma``, from the first batch) and its kurtosis;
- the RHT's effect on its Wgrad operands (x and dy of the first batch, quantized along the tokens with NVFP4,
  relative MSE without and with the 16-point RHT);
- :func:`~fp4sim.torch.suggest_high_precision`'s ranking (relative Wgrad GEMM error), and the layers it
  recommends for BF16 (``--fraction``, 0.15) against the paper's rule (the last ~15% of blocks), with the share of
  the linear FLOPs each holds.

Outputs in ``--out``: ``layers.nc`` (xarray), ``summary.json`` and ``report.html`` (one self-contained page, its
figures embedded). Exit 0, or 2 with a one-line error for bad input.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from pathlib import Path

import numpy as np

__all__ = ["inspect_model", "main"]


class BadInput(Exception):
    pass


def _load(model_dir: Path, seq_len: int | None = None, batch_size: int | None = None, check_memory=None,
          spill_dir=None):
    """(model, tokenizer, kind) from a local folder; BadInput naming what is missing, or a ``seq_len`` longer than
    the configuration's context (checked before the weights load). With ``check_memory`` (a list, which gets the
    :class:`~fp4sim.inspect_memory.Estimate`), a model whose estimated need at ``batch_size`` x ``seq_len`` tokens
    exceeds the memory available, or whose temporary file exceeds the free disk of ``spill_dir``, is refused
    before it loads, with both figures."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise BadInput(f"fp4sim inspect needs torch and transformers: pip install 'fp4sim[inspect]' ({e})") from None
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.set_verbosity_error()        # fp4sim's progress bar and errors, not the loader's
    transformers.utils.logging.disable_progress_bar()
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: not a folder (give a Hugging Face model folder: config.json and weights)")
    from .checkpoints.compressed_tensors_mx import is_compressed_tensors_mx
    from .checkpoints.mlx import is_mlx
    from .checkpoints.nvfp4 import is_checkpoint
    what = ("an NVFP4 checkpoint (ModelOpt or compressed-tensors export)" if is_checkpoint(model_dir) else
            "a compressed-tensors MX checkpoint" if is_compressed_tensors_mx(model_dir) else
            "an MLX-quantized checkpoint (mlx-lm's conversion)" if is_mlx(model_dir) else None)
    if what:
        raise BadInput(f"{model_dir}: {what}; fp4sim inspect "
                       "takes the high-precision model it was made from and quantizes it itself. Check the "
                       "checkpoint with python -m fp4sim.validate checkpoint DIR --reference HIGH_PRECISION_DIR, or "
                       "analyse its stored values with python -m fp4sim.analyze DIR")
    ggufs = sorted(model_dir.glob("*.gguf"))
    kw = dict(local_files_only=True)
    if not (model_dir / "config.json").is_file():
        if len(ggufs) != 1:
            raise BadInput(f"{model_dir}: no config.json (not a Hugging Face model folder)" +
                           (f", and {len(ggufs)} .gguf files (one is read where there is no config.json)"
                            if ggufs else ""))
        for need in ("gguf", "accelerate"):
            try:
                __import__(need)
            except ImportError:
                raise BadInput(f"{ggufs[0].name}: transformers reads GGUF files with the {need} package: "
                               f"pip install {need}") from None
        kw["gguf_file"] = ggufs[0].name          # a causal LM whose weights transformers dequantizes to float
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(model_dir), **kw)
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"{model_dir}: transformers cannot read its configuration ({str(e).splitlines()[0]})") \
            from None
    ctx = _context_of(cfg)
    if seq_len is not None and ctx is not None and seq_len > ctx:
        raise BadInput(f"--seq-len {seq_len}: longer than the model's context ({ctx} positions)")
    if check_memory is not None and seq_len is not None and batch_size is not None:
        _check_memory(model_dir, cfg, batch_size, seq_len, spill_dir, check_memory)
    archs = " ".join(getattr(cfg, "architectures", None) or [])
    tq = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"           # transformers' GGUF conversion bar (a tqdm of its own)
    try:
        # the weights as stored (a GGUF file's dequantized to float32 by the loader); _widen_all_but_linear
        dtype = "float32" if "gguf_file" in kw else "auto"
        if "CausalLM" in archs or "gguf_file" in kw or getattr(cfg, "is_decoder", False) and "Masked" not in archs:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kw)
            kind = "causal"
        else:
            model = transformers.AutoModel.from_pretrained(str(model_dir), dtype=dtype, **kw)
            kind = "encoder"
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"{model_dir}: the model does not load offline ({str(e).splitlines()[0]})") from None
    finally:
        if tq is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tq
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), **kw)
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"{model_dir}: no tokenizer that loads offline ({str(e).splitlines()[0]})") from None
    _widen_all_but_linear(model)
    return model.eval(), tok, kind


def _check_memory(model_dir, cfg, batch_size, seq_len, spill_dir, out: list) -> None:
    import shutil
    import tempfile

    from .inspect_memory import GB, available_bytes, describe, estimate
    est = estimate(model_dir, cfg, batch_size, seq_len)
    if est is None:
        return
    out.append(est)
    avail = available_bytes()
    if avail is not None and est.total > avail:
        raise BadInput(f"{model_dir}: needs about {est.total / GB:.1f} GB ({describe(est)}) and this machine has "
                       f"{avail / GB:.1f} GB available: give fewer tokens per batch (--batch-size, --seq-len), "
                       "run on a machine with more memory, or pass --no-memory-check to try anyway")
    folder = spill_dir or tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if est.disk > free:
        raise BadInput(f"--spill-dir {folder}: the float32 weight gradients need {est.disk / GB:.1f} GB of "
                       f"temporary disk there and it has {free / GB:.1f} GB free: give a folder with room "
                       "(--spill-dir), or pass --no-memory-check to try anyway")


def _widen_all_but_linear(model) -> None:
    """Every parameter and floating-point buffer in float32, except the weights of ``nn.Linear`` layers that no
    other module shares (a head tied to the embedding is widened): those stay as stored (bfloat16: 2 bytes per
    weight) and are widened per layer when used (QuantLinear widens its operands exactly; the float32 pass widens
    them in :class:`~fp4sim.torch.streaming` fashion). The model computes in float32 as before."""
    import torch
    lin = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    shared = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}
    for m in model.modules():
        for k, p in list(m.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != torch.float32 and (id(p) not in lin or id(p) in shared):
                p.data = p.data.float()
        for k, b in list(m.named_buffers(recurse=False)):
            if b.is_floating_point() and b.dtype != torch.float32:
                m._buffers[k] = b.float()


def _gguf_quantized_types(model_dir: Path) -> dict:
    """{ggml type: number of tensors} of the tensors stored in a quantized type (Q4_1, MXFP4, ...) in the GGUF
    file a folder without config.json is read from ({} for any other folder): weights that were low-precision
    before fp4sim quantizes their dequantized values again."""
    from .checkpoints.gguf import read_gguf
    ggufs = sorted(model_dir.glob("*.gguf"))
    if (model_dir / "config.json").is_file() or len(ggufs) != 1:
        return {}
    try:
        f = read_gguf(ggufs[0])
    except (ValueError, ImportError):
        return {}
    out = {}
    for t in f.tensors.values():
        if t.type not in ("F32", "F16", "BF16", "F64") and not (t.type[:1] in "IU" and t.type[1:].isdigit()):
            out[t.type] = out.get(t.type, 0) + 1
    return out


def _context(model) -> int | None:
    return _context_of(model.config)


def _context_of(c) -> int | None:
    for k in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(c, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _batches(tok, text: str, n: int, b: int, L: int):
    """n tensors (b, L) of token ids from the text, repeated when too short; (batches, repeats)."""
    import torch
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise BadInput("--text: the tokenizer finds no tokens in the file")
    need = n * b * L
    reps = -(-need // len(ids))
    stream = (ids * reps)[:need]
    t = torch.tensor(stream, dtype=torch.long).reshape(n, b, L)
    return [t[i] for i in range(n)], reps


def _loss(model, kind, ids):
    import torch
    if kind == "causal":
        out = model(input_ids=ids)
        logits = out.logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    h = model(input_ids=ids).last_hidden_state.float()
    half = h.shape[1] // 2
    a = torch.nn.functional.normalize(h[:, :half].mean(1), dim=-1)
    p = torch.nn.functional.normalize(h[:, half:].mean(1), dim=-1)
    logits = a @ p.T / 0.05
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(ids)))


def _kind_of(name: str) -> str:
    """A layer's kind from the last part of its name (q_proj -> attention, up_proj -> mlp, ...)."""
    last = name.rsplit(".", 1)[-1].lower()
    if any(k in name.lower() for k in ("attn", "attention")) or last in ("query", "key", "value", "q_proj", "k_proj",
                                                                         "v_proj", "o_proj", "qkv"):
        return "attention"
    if any(k in name.lower() for k in ("mlp", "ffn", "intermediate", "feed_forward")) or last in (
            "up_proj", "gate_proj", "down_proj", "fc1", "fc2", "dense"):
        return "mlp"
    return "other"


def inspect_model(model_dir, text_file, recipe="nvfp4_paper", batches=4, batch_size=4, seq_len=128,
                  fraction=0.15, seed=0, progress=None, accumulate="fast", spill_dir=None,
                  check_memory=True) -> tuple:
    """Run the inspection; returns ``(dataset, summary)`` (see the module docstring)."""
    import torch
    import xarray as xr

    from .analyze.studies import kurtosis, outliers
    from .cpu.analysis import operand_stats
    from .quantize import fake_quantize, rht
    from .torch import (QuantLinear, collect_stats, convert, gradient_sinks, rank_high_precision, streaming_fidelity,
                        wgrad_errors)
    from .training import Recipe
    progress = progress or (lambda what: None)
    model_dir, text_file = Path(model_dir), Path(text_file)
    for k, v in (("--batches", batches), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BadInput(f"{k} {v!r}: a whole number >= 1")
    if not 0 < fraction <= 1:
        raise BadInput(f"--fraction {fraction!r}: a share of the layers in (0, 1]")
    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--text {text_file}: cannot read it as UTF-8 text ({e})") from None
    if not text.strip():
        raise BadInput(f"--text {text_file}: the file is empty")
    if isinstance(recipe, str):
        try:
            Recipe.preset(recipe, seed=seed)
        except ValueError as e:
            raise BadInput(f"--recipe: {e}") from None
        try:
            rec = Recipe.preset(recipe, seed=seed, accumulate=accumulate)
        except ValueError as e:
            raise BadInput(f"--accumulate {accumulate}: {e}") from None
    else:
        rec = recipe
    if spill_dir is not None and not Path(spill_dir).is_dir():
        raise BadInput(f"--spill-dir {spill_dir}: not a folder (give one with room for 4 bytes per weight)")
    est = [] if check_memory else None
    model, tok, kind = _load(model_dir, seq_len, batch_size, est, spill_dir)
    source = _gguf_quantized_types(model_dir)
    progress("model loaded")
    ctx = _context(model)
    if ctx is not None and seq_len > ctx:
        raise BadInput(f"--seq-len {seq_len}: longer than the model's context ({ctx} positions)")
    data, reps = _batches(tok, text, batches, batch_size, seq_len)
    try:
        convert(model, rec)
    except ValueError as e:                 # no nn.Linear at all, a keep glob that matches nothing
        raise BadInput(f"{model_dir}: {e}") from None
    # a layer the loss does not reach (a BERT pooler under mean pooling) has no weight gradient to inspect: found
    # in one float32 pass, it becomes the plain nn.Linear it was (in float32), and is listed as unused
    # no parameter takes a gradient (the weights' go to the studies as made, gradient_sinks); the embeddings'
    # output requires one, so that every layer's Dgrad runs as when the embeddings are trained
    for p in model.parameters():
        p.requires_grad_(False)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        emb.register_forward_hook(lambda mod, inp, out: out.requires_grad_() if torch.is_grad_enabled() else None)
    quant = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    reached = set()
    saved = [(m.recipe, m.recipe_backward, m._calls) for _, m in quant]
    try:
        for _, m in quant:
            m.recipe = m.recipe_backward = "none"
        with gradient_sinks(model, lambda n, g: reached.add(n)):
            _loss(model, kind, data[0]).backward()
    finally:
        for (_, m), (rf, rb, c) in zip(quant, saved):
            m.recipe, m.recipe_backward, m._calls = rf, rb, c
    unused = [n for n, m in quant if getattr(m, "_fp4sim_name", n) not in reached]
    for n in unused:
        q = model.get_submodule(n)
        lin = torch.nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        lin.weight, lin.bias = q.weight, q.bias
        lin.weight.data = lin.weight.data.float()
        parent, _, last = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, last, lin)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not layers:
        raise BadInput(f"{model_dir}: no linear layer takes part in the loss")
    names = [n for n, _ in layers]
    torch.manual_seed(seed)
    # per batch one float32 and one quantized pass (streaming_fidelity: each layer's weight gradient compared as
    # its backward makes it, never all layers' at once), and every study reads them: the operand errors
    # (collect_stats) and the Wgrad GEMM errors (wgrad_errors) log the quantized pass; on the first batch's
    # quantized pass each layer's input is reduced to its outliers and kurtosis as the forward reaches it, and with
    # its output gradient to the RHT study as the backward reaches it. Batch i draws its stochastic rounding at
    # call count i, as the i-th step of a run would.
    snr = np.full((len(names), batches), np.nan)
    cos = np.full((len(names), batches), np.nan)
    losses, losses_ref = [], []
    n_out = np.zeros(len(names), np.int64)
    kurt = np.full(len(names), np.nan)
    rht_err = np.full((len(names), 2, 2), np.nan)        # layer, operand (x, dy), rht (no, yes)

    def study_input(j, x):
        o = outliers(x)
        n_out[j] = int(o["n_outlier_cols"])
        kurt[j] = float(kurtosis(x))

    def study_wgrad(j, x, dy):
        M = x.shape[0] // 16 * 16
        for k, a in enumerate((x[:M], dy[:M])):
            if M == 0:
                continue
            ms = None
            for r in (0, 1):
                b = rht(a, 16, "te", axis=0, out="bf16") if r else a
                y = fake_quantize(b, "nvfp4", axis=0)           # one fused pass
                (sb, se, _), _ = operand_stats(b, y, np.zeros((1, 1), np.uint8), False, False)   # float64 sums, one read
                ms = sb / b.size if ms is None else ms          # the mean square of the operand itself
                rht_err[j, k, r] = se / b.size / ms if ms else np.nan

    def flat(t):
        return t.detach().reshape(-1, t.shape[-1]).float().cpu().numpy()

    def hook(j):
        def f(mod, inp, out):
            x = flat(inp[0])
            study_input(j, x)
            out.register_hook(lambda g: study_wgrad(j, x, flat(g)))
        return f

    with collect_stats(model, oscillation=False) as log, wgrad_errors(model) as werr:
        for i in range(batches):
            def fn(quantized, i=i):
                hooks = [m.register_forward_hook(hook(j)) for j, (_, m) in enumerate(layers)] \
                    if quantized and i == 0 else []
                try:
                    return _loss(model, kind, data[i])
                finally:
                    for h in hooks:
                        h.remove()

            g, lq, lr = streaming_fidelity(model, fn, spill_dir)
            losses.append(lq)
            losses_ref.append(lr)
            order = [names.index(str(n)) for n in g.layer.values]
            snr[order, i] = g.snr.values
            cos[order, i] = g.cosine.values
            for _, m in layers:
                m._calls += 1                        # streaming_fidelity restored it: the next batch is the next call
            progress(f"batch {i + 1} of {batches} done")
    stats = log.dataset()
    keep, rel = rank_high_precision(werr, fraction)
    rel_b = np.full((len(names), batches), np.nan)     # the Wgrad GEMM error of each batch
    for j, n in enumerate(names):
        for i, (e, r) in enumerate(werr[n][:batches]):
            rel_b[j, i] = (e / r) ** 0.5 if r > 0 else 0.0
    progress("outlier and RHT studies done")
    blocks = {n: rec.block_of(n) for n in names}
    nb = max((b for b in blocks.values() if b is not None), default=-1) + 1
    n_last = max(1, math.ceil(0.15 * nb)) if nb else 0
    paper = [n for n in names if blocks[n] is not None and blocks[n] >= nb - n_last]
    flops = {n: int(m.in_features) * int(m.out_features) for n, m in layers}
    total = sum(flops.values())
    share = lambda sel: sum(flops[n] for n in sel) / total if total else 0.0  # noqa: E731
    ops = [str(o) for o in stats.operand.values]
    ds = xr.Dataset(
        {"snr": (("layer", "batch"), snr), "cosine": (("layer", "batch"), cos),
         "snr_mean": ("layer", np.nanmean(snr, 1)), "snr_spread": ("layer", np.nanstd(snr, 1)),
         "cosine_mean": ("layer", np.nanmean(cos, 1)),
         "rel_mse": (("layer", "operand"), stats.rel_mse.sel(layer=names).values),
         "underflow": (("layer", "operand"), stats.underflow.sel(layer=names).values),
         "outlier_channels": ("layer", n_out), "input_kurtosis": ("layer", kurt),
         "wgrad_rel_mse": (("layer", "wgrad_operand", "rht"), rht_err),
         "wgrad_gemm_rel_error": ("layer", np.array([rel[n] for n in names])),
         "wgrad_gemm_rel_error_batch": (("layer", "batch"), rel_b),
         "recommended": ("layer", np.array([n in keep for n in names])),
         "paper_rule": ("layer", np.array([n in paper for n in names])),
         "block": ("layer", np.array([-1 if blocks[n] is None else blocks[n] for n in names])),
         "kind": ("layer", np.array([_kind_of(n) for n in names])),
         "flops_share": ("layer", np.array([flops[n] / total for n in names]))},
        coords={"layer": names, "batch": np.arange(batches), "operand": ops, "wgrad_operand": ["x", "dy"],
                "rht": [False, True]})
    ds.attrs.update(model=str(model_dir), recipe=rec.name, loss=("next-token cross entropy" if kind == "causal"
                                                                  else "contrastive InfoNCE, mean-pooled halves, "
                                                                       "temperature 0.05"),
                    sqrt3=math.sqrt(3.0))
    summary = {
        "model": str(model_dir), "kind": kind, "loss": ds.attrs["loss"], "recipe": rec.name,
        "arguments": {"text": str(text_file), "batches": batches, "batch_size": batch_size, "seq_len": seq_len,
                      "fraction": fraction, "seed": seed, "accumulate": rec.accumulate},
        "already_quantized": ({"types": source, "note": "the GGUF file stores these weights in quantized types ("
                               + ", ".join(f"{n} x {t}" for t, n in sorted(source.items())) + "): the model's "
                               "weights were already low-precision, and the recipe quantizes their dequantized "
                               "values again; the numbers measure that second quantization"} if source else None),
        "text_repeated": reps, "losses": losses, "losses_float32": losses_ref, "versions": _versions(),
        "memory": _memory(est),
        "unused_layers": unused,
        "layers": [{"name": n, "block": blocks[n], "kind": _kind_of(n), "snr": _num(ds.snr_mean.values[j]),
                    "snr_spread": _num(ds.snr_spread.values[j]), "cosine": _num(ds.cosine_mean.values[j]),
                    "rel_mse": {o: _num(ds.rel_mse.values[j, k]) for k, o in enumerate(ops)},
                    "outlier_channels": int(n_out[j]), "wgrad_gemm_rel_error": _num(rel[n]),
                    "wgrad_gemm_rel_error_spread": _num(np.std(rel_b[j])) if batches > 1 else None,
                    "wgrad_rel_mse": {"x": _num(rht_err[j, 0, 0]), "x_rht": _num(rht_err[j, 0, 1]),
                                      "dy": _num(rht_err[j, 1, 0]), "dy_rht": _num(rht_err[j, 1, 1])},
                    "recommended": n in keep, "paper_rule": n in paper, "flops_share": flops[n] / total}
                   for j, n in enumerate(names)],
        "recommendation": keep, "paper_rule": paper, "blocks": nb,
        "flops_share": {"recommended": share(keep), "paper_rule": share(paper)},
        "overlap_with_paper_rule": sorted(set(keep) & set(paper)),
        "below_sqrt3": [n for j, n in enumerate(names) if ds.snr_mean.values[j] < math.sqrt(3.0)],
    }
    summary["verdict"] = verdict(names, rel, rel_b, keep, losses, losses_ref, share, len(summary["below_sqrt3"]))
    return ds, summary


def verdict(names, rel, rel_b, keep, losses, losses_ref, share, n_below) -> dict:
    """What the numbers decide, as the report's first section says it.

    Per layer the ranking's measure, the Wgrad GEMM relative error pooled over the batches (``rel``), and its
    per-batch values (``rel_b``, layer x batch): their standard error ``se = sd / sqrt(batches)``. A layer is a
    *clear outlier* when even ``rel - 2 se`` lies above the bulk of the layers, ``median + 3 x 1.4826 MAD`` of
    the pooled errors. A recommended layer is *resolved* when ``rel - 2 se`` lies above ``rel + 2 se`` of every
    layer left out; the others rank within the batch-to-batch noise of the cutoff. The loss: each batch's loss
    under the recipe against the same batch's float32 loss (gradient_fidelity's reference pass); ``share``: the
    share of the linear FLOPs a list of layers holds. Which list to
    follow: the resolved recommendation where all of it is resolved; the clear outliers plus the paper's rule
    where only some layers stand out; the paper's rule where none does (the ranking has no evidence to pick
    layers there)."""
    n_b = rel_b.shape[1]
    r = np.array([rel[n] for n in names])
    se = np.nanstd(rel_b, axis=1) / math.sqrt(n_b) if n_b > 1 else np.full(len(names), np.nan)
    med = float(np.median(r))
    mad = float(1.4826 * np.median(np.abs(r - med)))
    bulk = med + 3 * mad
    lo, hi = r - 2 * np.nan_to_num(se), r + 2 * np.nan_to_num(se)
    idx = {n: j for j, n in enumerate(names)}
    outliers = [n for n in sorted(names, key=lambda n: -rel[n]) if n_b > 1 and lo[idx[n]] > bulk]
    left = [j for j, n in enumerate(names) if n not in keep]
    top_left = float(max(hi[left])) if left else -math.inf
    resolved = [n for n in keep if n_b > 1 and lo[idx[n]] > top_left]
    d = np.array(losses) - np.array(losses_ref)
    loss = {"recipe": float(np.mean(losses)), "float32": float(np.mean(losses_ref)), "difference": float(np.mean(d)),
            "difference_se": float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None,
            "batches": len(d)}
    if n_b < 2:
        follow, why = "paper_rule", ("one batch gives no spread, so no layer can be told apart from the noise: run "
                                     "--batches 2 or more; until then the paper's rule")
    elif keep and len(resolved) == len(keep):
        follow, why = "recommendation", (f"all {len(keep)} recommended layers stand above every layer left out "
                                         "beyond the batch-to-batch spread")
    elif outliers:
        within = len(keep) - len(resolved)
        follow, why = "outliers_and_paper_rule", (
            f"{len(outliers)} layer{'s' * (len(outliers) > 1)} stand{'s' * (len(outliers) == 1)} out from the "
            f"bulk beyond the batch-to-batch spread and should stay in BF16; {within} of the {len(keep)} "
            "recommended layers rank within noise of the layers left out, so the recommendation beyond the "
            "outliers is no better evidence than the paper's rule, which the paper validated at scale")
    else:
        follow, why = "paper_rule", ("no layer's Wgrad error stands out from the others beyond the batch-to-batch "
                                     "spread: the ranking cannot pick layers on this evidence (more --batches may "
                                     "resolve it), so the paper's rule, validated at scale by the paper")
    return {"clear_outliers": outliers, "resolved": resolved, "within_noise": [n for n in keep if n not in resolved],
            "bulk": {"median": med, "robust_sd": mad, "threshold": bulk}, "loss": loss, "follow": follow,
            "why": why, "below_sqrt3": n_below, "layers": len(names), "flops_share_outliers": share(outliers)}


def _memory(est) -> dict:
    """The estimate made before loading and the process's peak resident memory so far, in GB."""
    from .inspect_memory import peak_bytes
    out = {"peak_gb": round(peak_bytes() / 2 ** 30, 3)}
    if est:
        e = est[0]
        out.update(estimate_gb=round(e.total / 2 ** 30, 3), weights_gb=round(e.weights / 2 ** 30, 3),
                   working_gb=round((e.working + e.base) / 2 ** 30, 3), params=e.params)
    return out


def _num(v):
    v = float(v)
    return v if math.isfinite(v) else None


def _versions():
    import importlib.metadata as md
    out = {}
    for p in ("fp4sim", "torch", "transformers", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


# ------------------------------------------------------------------------------------------------ the report
def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _figures(ds) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    names = [str(n) for n in ds.layer.values]
    f, a = plt.subplots(figsize=(9, 3.6))
    x = np.arange(len(names))
    a.errorbar(x, ds.snr_mean.values, yerr=ds.snr_spread.values, fmt="o", ms=4, capsize=2, label="mean ± sd over "
               "batches")
    a.axhline(math.sqrt(3), color="k", ls="--", lw=1, label="sqrt(3)")
    rec = ds.recommended.values
    a.scatter(x[rec], ds.snr_mean.values[rec], s=80, facecolors="none", edgecolors="C3", label="recommended BF16")
    a.set_yscale("log")
    a.set_xlabel("layer (model order: input to output)")
    a.set_ylabel("weight-gradient SNR")
    a.set_title("Weight-gradient SNR against depth")
    a.legend(fontsize=7, loc="best")
    out.append(("Weight-gradient SNR by layer, against the sqrt(3) threshold", _png(f)))
    plt.close(f)
    f, a = plt.subplots(figsize=(9, 3.6))
    kinds = sorted(set(str(k) for k in ds.kind.values))
    ops = [str(o) for o in ds.operand.values]
    for i, k in enumerate(kinds):
        sel = ds.kind.values == k
        vals = [np.nanmean(ds.rel_mse.values[sel, j]) for j in range(len(ops))]
        a.bar(np.arange(len(ops)) + i * 0.8 / len(kinds), vals, width=0.8 / len(kinds), label=k)
    a.set_xticks(np.arange(len(ops)) + 0.4 - 0.4 / len(kinds), ops, fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("relative MSE (mean over layers)")
    a.set_title("Operand error by layer kind")
    a.legend(fontsize=7)
    out.append(("Forward and backward operand error by layer kind", _png(f)))
    plt.close(f)
    return out


_SORT_JS = """
document.querySelectorAll('#layers th').forEach(function(th, col) {
  th.addEventListener('click', function() {
    var tb = th.closest('table').tBodies[0], rows = Array.from(tb.rows);
    var asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
    rows.sort(function(a, b) {
      var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return asc ? c : -c;
    });
    rows.forEach(function(r) { tb.appendChild(r); });
  });
});
"""


def report_html(ds, summary) -> str:
    """The self-contained report page."""
    e = html.escape
    cols = [("layer", "layer"), ("block", "block"), ("kind", "kind"), ("snr", "Wgrad SNR"),
            ("cosine", "cosine"), ("fprop_x", "rel MSE x"), ("fprop_w", "rel MSE W"), ("dgrad_dy", "rel MSE dy"),
            ("outlier_channels", "outlier channels"), ("x_rht", "Wgrad x: no RHT / RHT"),
            ("wgrad_gemm_rel_error", "Wgrad GEMM rel. error"), ("recommended", "BF16 (recommended)"),
            ("paper_rule", "BF16 (paper rule)")]
    rows = []
    for L in summary["layers"]:
        def cell(v, text=None):
            t = text if text is not None else ("—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
            return f'<td data-v="{e(str("" if v is None else v))}">{e(t)}</td>'
        w = L["wgrad_rel_mse"]
        rht_txt = "—" if w["x"] is None else f"{w['x']:.3g} / {w['x_rht']:.3g}"
        cells = [cell(L["name"]), cell(L["block"]), cell(L["kind"]), cell(L["snr"]), cell(L["cosine"]),
                 cell(L["rel_mse"].get("fprop_x")), cell(L["rel_mse"].get("fprop_w")),
                 cell(L["rel_mse"].get("dgrad_dy")), cell(L["outlier_channels"]), cell(w["x"], rht_txt),
                 cell(L["wgrad_gemm_rel_error"]), cell(int(L["recommended"]), "yes" if L["recommended"] else ""),
                 cell(int(L["paper_rule"]), "yes" if L["paper_rule"] else "")]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    figs = "".join(f'<figure><img alt="{e(t)}" src="data:image/png;base64,{b}"><figcaption>{e(t)}</figcaption>'
                   f'</figure>' for t, b in _figures(ds))
    s = summary

    def names(ns, empty="none", most=12):
        """A list of layer names, at most ``most`` of them and the count of the rest (the table marks them all)."""
        if not ns:
            return empty
        more = f" and {len(ns) - most} more" if len(ns) > most else ""
        return f"{len(ns)} layers: " + ", ".join(ns[:most]) + more

    paper = names(s["paper_rule"], "none (no numbered blocks)")
    v = s.get("verdict")
    verdict_html = _verdict_html(v, s) if v else ""
    rec_table = _recommendation_table(s) if v else f"<p>{e(names(s['recommendation']))}</p>"
    already = (f"\n<p><b>Already quantized:</b> {e(s['already_quantized']['note'])}.</p>"
               if s.get("already_quantized") else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fp4sim inspect: {e(s['model'])}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}td:first-child{{text-align:left}}
th{{cursor:pointer;background:#eee}}figure{{display:inline-block;margin:0 1em 1em 0}}img{{max-width:560px}}
.verdict{{background:#f4f8ff;border:1px solid #9ab;padding:0.5em 1em}}
</style></head><body>
<h1>fp4sim inspect</h1>
<p>Model <code>{e(s['model'])}</code> ({e(s['kind'])}; loss: {e(s['loss'])}) under recipe <code>{e(s['recipe'])}</code>,
{s['arguments']['batches']} batches of {s['arguments']['batch_size']} x {s['arguments']['seq_len']} tokens from
<code>{e(s['arguments']['text'])}</code>{' (the text repeated ' + str(s['text_repeated']) + ' times)'
if s['text_repeated'] > 1 else ''}.</p>{already}
{verdict_html}
<h2>Recommendation</h2>
<p>The worst {s['arguments']['fraction']:.0%} by Wgrad GEMM error (pooled over the batches; sd: its spread over
them), {s['flops_share']['recommended']:.1%} of the linear FLOPs:</p>
{rec_table}
<p>The paper's rule (the last ~15% of the {s['blocks']} blocks): {e(paper)} — {s['flops_share']['paper_rule']:.1%} of
the linear FLOPs. In both: {e(names(s['overlap_with_paper_rule']))}. The table's BF16 columns mark every
layer of both.</p>
{figs}
<h2>Layers</h2><p>Click a column to sort.</p>
<table id="layers"><thead><tr>{''.join(f'<th>{e(t)}</th>' for _, t in cols)}</tr></thead>
<tbody>{''.join(rows)}</tbody></table>
<script>{_SORT_JS}</script>
</body></html>
"""


_FOLLOW = {"recommendation": "the recommendation (the ranking below)",
           "outliers_and_paper_rule": "the clear outliers in BF16, then the paper's rule",
           "paper_rule": "the paper's rule (the last blocks in BF16)"}


def _verdict_html(v, s) -> str:
    """The report's first section: which list to follow and why, the clear outliers with their spread, what the
    ranking resolves, the loss against float32 and the SNR threshold."""
    e = html.escape
    byname = {L["name"]: L for L in s["layers"]}

    def err(n):
        L = byname[n]
        sd = L.get("wgrad_gemm_rel_error_spread")
        return f"{n} ({L['wgrad_gemm_rel_error']:.3g}" + (f" ± {sd:.2g}" if sd is not None else "") + ")"
    out = (", ".join(err(n) for n in v["clear_outliers"][:12])
           + (f" and {len(v['clear_outliers']) - 12} more" if len(v["clear_outliers"]) > 12 else "")) or "none"
    L = v["loss"]
    se = f" ± {L['difference_se']:.3g}" if L["difference_se"] is not None else ""
    k = len(s["recommendation"])
    return f"""<div class="verdict"><h2>Verdict</h2>
<p><b>Follow {e(_FOLLOW[v['follow']])}</b>: {e(v['why'])}.</p>
<ul>
<li>Clear outliers (Wgrad GEMM error, pooled ± sd over {s['arguments']['batches']} batches, above the bulk of the
layers — median {v['bulk']['median']:.3g} + 3 x {v['bulk']['robust_sd']:.2g} robust sd — by more than 2 standard
errors): {e(out)}{f" — {v['flops_share_outliers']:.1%} of the linear FLOPs" if v['clear_outliers'] else ''}.</li>
<li>The recommendation's {k} layers: {len(v['resolved'])} stand above every layer left out beyond 2 standard
errors, {len(v['within_noise'])} rank within the batch-to-batch noise of the cutoff (their places can swap with
another batch or seed).</li>
<li>Loss under <code>{e(s['recipe'])}</code>: {L['recipe']:.4f} against {L['float32']:.4f} in float32 on the same
batches: {L['difference']:+.4f}{se} nats ({L['batches']} batches, difference ± standard error).</li>
<li>Weight-gradient SNR below √3: {v['below_sqrt3']} of {v['layers']} layers. The SNR compares against a float32
step whose forward differs too, so on a pretrained model most layers sit below √3; it ranks layers, the
threshold alone does not decide.</li>
</ul></div>"""


def _recommendation_table(s) -> str:
    e = html.escape
    v = s["verdict"]
    byname = {L["name"]: L for L in s["layers"]}
    rows = []
    for n in s["recommendation"]:
        L = byname[n]
        sd = L.get("wgrad_gemm_rel_error_spread")
        status = ("clear outlier" if n in v["clear_outliers"] else "resolved" if n in v["resolved"]
                  else "within noise")
        cells = [n, "" if L["block"] is None else str(L["block"]), L["kind"], f"{L['wgrad_gemm_rel_error']:.4g}",
                 "—" if sd is None else f"{sd:.2g}", "—" if L["snr"] is None else f"{L['snr']:.3g}", status,
                 "yes" if L["paper_rule"] else "", f"{L['flops_share']:.2%}"]
        rows.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    head = ["layer", "block", "kind", "Wgrad GEMM rel. error", "sd over batches", "Wgrad SNR", "against the rest",
            "in the paper's rule", "FLOPs"]
    return (f"<table class=\"rec\"><thead><tr>{''.join(f'<th>{e(h)}</th>' for h in head)}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def _quiet_loaders():
    """The command's stderr holds its progress and its errors: torch's notices about Enum registrations (which
    torchao's import triggers through transformers) and torchao's note on CUDA extensions a CPU build cannot load
    are not printed on every run."""
    import logging
    for name in ("torch.utils._pytree", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _write_outputs(out: Path, ds, summary) -> None:
    """layers.nc, summary.json and report.html into ``out``, each written under a temporary name and renamed when
    whole: an interruption (Ctrl-C) leaves the files of an earlier run or none, never a partial one."""
    out.mkdir(parents=True, exist_ok=True)
    page = report_html(ds, summary)
    done = []
    try:
        for name, write in (("layers.nc", lambda p: ds.to_netcdf(p)),
                            ("summary.json", lambda p: p.write_text(json.dumps(summary, indent=1))),
                            ("report.html", lambda p: p.write_text(page, encoding="utf-8"))):
            tmp = out / f".{name}.partial"
            done.append(tmp)
            write(tmp)
        for tmp in done:
            tmp.replace(out / tmp.name[1:-len(".partial")])
    finally:
        for tmp in done:
            tmp.unlink(missing_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fp4sim inspect", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="a Hugging Face model folder (config.json, safetensors, tokenizer)")
    ap.add_argument("--text", required=True, help="a UTF-8 text file to draw the batches from")
    ap.add_argument("--recipe", default="nvfp4_paper", help="a fp4sim.training preset (default nvfp4_paper)")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--fraction", type=float, default=0.15, help="share of the layers to recommend for BF16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accumulate", default="fast",
                    help="the GEMMs' accumulation model (default fast: dequantize + float32 BLAS; exact is slower)")
    ap.add_argument("--out", default="inspect_out", help="output folder (layers.nc, summary.json, report.html)")
    ap.add_argument("--quick", action="store_true", help="2 batches of 2 x 32 tokens: a smoke test")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--spill-dir", default=None, help="a folder for the temporary file of the float32 weight "
                    "gradients (4 bytes per weight; default: the system's temporary folder)")
    ap.add_argument("--no-memory-check", action="store_true", help="start even where the estimated memory "
                    "exceeds what the machine has available")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.batch_size, a.seq_len = 2, 2, 32
    _quiet_loaders()
    from tqdm import tqdm
    # one tick for the model's loading, one per batch (its quantized and float32 passes), one for the studies
    bar = None if a.quiet else tqdm(total=a.batches + 2, file=sys.stderr, unit="step",
                                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")

    def progress(what):
        if bar is not None:
            bar.set_postfix_str(what)
            bar.update(1)

    out = Path(a.out)
    try:
        from .arrays_io import check_writable, input_paths
        try:
            check_writable(out, "--out", directory=True, inputs=input_paths(a, outputs=("out",)))
        except ValueError as e:
            raise BadInput(str(e)) from None
        ds, summary = inspect_model(a.model_dir, a.text, a.recipe, a.batches, a.batch_size, a.seq_len, a.fraction,
                                    a.seed, progress, a.accumulate, a.spill_dir, not a.no_memory_check)
    except BadInput as e:
        if bar is not None:
            bar.close()
        print(f"fp4sim inspect: bad input: {e}", file=sys.stderr)
        return 2
    if bar is not None:
        bar.close()
    _write_outputs(out, ds, summary)
    from ._tool import say
    v, rec = summary["verdict"], summary["recommendation"]
    say(f"fp4sim inspect: {len(summary['layers'])} linear layers; verdict: follow {_FOLLOW[v['follow']]} "
        f"({len(v['clear_outliers'])} clear outliers; {len(v['resolved'])} of the {len(rec)} recommended layers "
        f"resolved beyond the batch-to-batch spread); loss {v['loss']['difference']:+.4f} nats against float32; "
        f"wrote {out}/layers.nc, summary.json, report.html")
    return 0


if __name__ == "__main__":
    from ._tool import run_tool
    raise SystemExit(run_tool(main, "fp4sim inspect"))
