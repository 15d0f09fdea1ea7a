"""``fp4sim inspect`` at several model sizes: peak memory against the model's stored size, and time against plain
torch on the same batches.

    python benchmarks/bench_inspect.py [--sizes 512x8,1024x12,2048x16] [--batches 4] [--batch-size 4]
                                       [--seq-len 128] [--vocab 32000] [--recipe nvfp4_paper] [--json out.json]

Each size ``DxL`` is a Llama-shaped model with random weights built offline from a configuration (hidden size D,
L decoder layers, MLP width 4D rounded to a multiple of 256 as Llama's is, D / 64 heads, a quarter as many
key/value heads, vocabulary ``--vocab``, untied head), saved as bfloat16 safetensors with a word-level tokenizer
trained on the text (the first 200,000 characters of paper_repro's corpus). Each size runs in a fresh process of
its own: first ``inspect_model`` (what ``fp4sim inspect DIR --text FILE`` runs, with the batch options given),
its wall time and the process's peak resident memory when it returns (VmHWM); then, in the same process,
plain torch: the model loaded in float32 and one forward and backward pass of each of the same batches (the
loss inspect uses), timed. Reported per size: parameters, the weights' stored size, inspect's peak memory, that
peak minus the stored size, bytes per parameter, the memory of the process before the model (Python, torch,
fp4sim: the base), the estimate inspect made before loading (fp4sim.inspect_memory), inspect's time, plain
torch's time and their ratio, and the seconds per parameter-token of each.
"""
from __future__ import annotations

import argparse
import json
import lzma
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_gb() -> float:
    from fp4sim.inspect_memory import peak_bytes           # VmHWM: not the starting process's peak, as ru_maxrss
    return peak_bytes() / 2 ** 30


def _current_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 30


def build(folder: Path, d: int, layers: int, vocab: int, text: str) -> int:
    """A random-weight Llama of hidden size d and ``layers`` blocks in ``folder`` (bf16 safetensors, config,
    tokenizer); returns its parameter count."""
    import tokenizers as tk
    import torch
    import transformers
    folder.mkdir(parents=True, exist_ok=True)
    tok = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], tk.trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"],
                                                                 vocab_size=vocab))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
                                         ).save_pretrained(str(folder))
    heads = max(1, d // 64)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=-(-4 * d // 256) * 256,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096,
                                   tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)            # built in bf16: no float32 copy of a 1B model on the way
    try:
        model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(str(folder))
    return n


def one(folder: Path, text_file: Path, recipe: str, batches: int, batch_size: int, seq_len: int) -> dict:
    """In this process: inspect, then plain torch on the same batches."""
    import torch

    from fp4sim.inspect_model import _batches, _loss, inspect_model
    base = _current_gb()
    t = time.perf_counter()
    _, summary = inspect_model(folder, text_file, recipe, batches, batch_size, seq_len)
    t_inspect = time.perf_counter() - t
    peak = _rss_gb()
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    data, _ = _batches(tok, text_file.read_text(encoding="utf-8"), batches, batch_size, seq_len)
    t = time.perf_counter()
    for ids in data:
        model.zero_grad(set_to_none=True)
        _loss(model, "causal", ids).backward()
    t_torch = time.perf_counter() - t
    return {"inspect_s": t_inspect, "torch_s": t_torch, "peak_gb": peak, "base_gb": base,
            "estimate_gb": summary["memory"].get("estimate_gb"), "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512x8,1024x12,2048x16")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--recipe", default="nvfp4_paper")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", nargs=2, metavar=("MODEL_DIR", "TEXT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(Path(a.one[0]), Path(a.one[1]), a.recipe, a.batches, a.batch_size, a.seq_len)))
        return 0
    with lzma.open(ROOT / "paper_repro" / "data" / "corpus.txt.xz", "rt", encoding="utf-8") as f:
        text = f.read(200_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tf = Path(tmp) / "text.txt"
        tf.write_text(text, encoding="utf-8")
        for size in a.sizes.split(","):
            d, L = (int(v) for v in size.lower().split("x"))
            folder = Path(tmp) / size
            n = build(folder, d, L, a.vocab, text)
            stored = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2 ** 30
            r = subprocess.run([sys.executable, __file__, "--one", str(folder), str(tf), "--recipe", a.recipe,
                                "--batches", str(a.batches), "--batch-size", str(a.batch_size),
                                "--seq-len", str(a.seq_len)], capture_output=True, text=True)
            if r.returncode:
                sys.stderr.write(r.stderr[-3000:])
                return r.returncode
            m = json.loads(r.stdout.strip().splitlines()[-1])
            tokens = a.batches * a.batch_size * a.seq_len
            row = {"size": size, "params": n, "stored_gb": stored, **m,
                   "over_stored_gb": m["peak_gb"] - stored, "bytes_per_param": m["peak_gb"] * 2 ** 30 / n,
                   "bytes_per_param_over_base": (m["peak_gb"] - m["base_gb"]) * 2 ** 30 / n,
                   "ratio": m["inspect_s"] / m["torch_s"], "tokens": tokens,
                   "inspect_s_per_param_token": m["inspect_s"] / (n * tokens),
                   "torch_s_per_param_token": m["torch_s"] / (n * tokens)}
            rows.append(row)
            print(f"{size:>9}  {n / 1e6:7.1f} M params  stored {stored:5.2f} GB  inspect peak {m['peak_gb']:5.2f} GB "
                  f"(stored + {row['over_stored_gb']:4.2f} GB, {row['bytes_per_param']:5.1f} B/param, base "
                  f"{m['base_gb']:.2f} GB, estimated {m['estimate_gb']} GB)  inspect {m['inspect_s']:7.1f} s  torch {m['torch_s']:6.1f} s  "
                  f"ratio {row['ratio']:4.2f}", flush=True)
            import shutil
            shutil.rmtree(folder)
    if a.json:
        Path(a.json).write_text(json.dumps({"batches": a.batches, "batch_size": a.batch_size, "seq_len": a.seq_len,
                                            "recipe": a.recipe, "vocab": a.vocab, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
