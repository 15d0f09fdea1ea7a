"""What ``fp4sim inspect`` will hold, estimated before the model loads, and what the machine has.

The model of the memory (docs/large_models.md shows it against measured peaks):

- the process before the model (Python, torch, transformers, fp4sim): measured, not estimated;
- the weights as inspect holds them: every ``nn.Linear`` weight as stored (bfloat16: 2 bytes per weight), every
  other tensor (embeddings, norms, a head tied to the embeddings) in float32;
- each quantized layer's weight as the forward quantized it, kept for its backward (packed FP4 codes and block
  scales: 0.5625 bytes per weight);
- one batch's activations, held from the forward to the backward: per token and decoder block about
  ``10 d + 4 f + 4 kv + heads x seq_len`` float32 values (d the hidden size, f the MLP width, kv the key/value
  width, the last term the attention probabilities), and ``6 x vocabulary`` per token for the logits, their
  log-softmax and gradients;
- the largest layer's working set while it is studied (its widened weight, dequantized copies, the two weight
  gradients): 24 bytes per weight of that layer, and 256 MB for the float64 pieces of the comparisons;
- 384 MB for what loads after the estimate: the model's code, and Numba compiling fp4sim's kernels on a first
  run.

Nothing else grows with the model: each layer's gradients are reduced to their statistics as the backward makes
them (:func:`fp4sim.torch.streaming_fidelity`), the float32 pass's written to a temporary file (4 bytes per
weight of disk).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Estimate", "estimate", "available_bytes"]

GB = 2 ** 30
#: What the process takes after the estimate beyond the parts: the model's code, and Numba compiling fp4sim's
#: kernels on a first run (measured: 0.28 GB with an empty Numba cache on a two-block model).
KERNELS = 384 * 2 ** 20
_NOT_LINEAR = ("embed", "wte", "wpe", "position", "token_type", "norm", "ln_", "layernorm", "rotary")


@dataclass
class Estimate:
    """Bytes: ``weights`` (held as inspect holds them), ``working`` (everything else beyond ``base``), ``base``
    (this process now), ``disk`` (the temporary file of the float32 gradients); ``params`` and the parts."""
    weights: int
    working: int
    base: int
    disk: int
    params: int
    parts: dict

    @property
    def total(self) -> int:
        return self.base + self.weights + self.working


def _tensors(model_dir: Path):
    """[(name, dtype bytes, shape)] of the stored weights (safetensors headers, or a GGUF file read as float32 by
    transformers); None where neither is there."""
    from ._safetensors import safetensors_entries
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
        out = []
        try:
            for f in files:
                for name, e in safetensors_entries(f).items():
                    out.append((name, size.get(e["dtype"], 4), tuple(e["shape"])))
        except (OSError, ValueError, KeyError, TypeError):
            return None                      # the loader says what is wrong with the file
        return out
    ggufs = sorted(model_dir.glob("*.gguf"))
    if len(ggufs) == 1:
        from .checkpoints.gguf import read_gguf
        try:
            g = read_gguf(ggufs[0])
        except (ValueError, ImportError):
            return None
        return [(n, 4, tuple(t.shape)) for n, t in g.tensors.items()]    # dequantized to float32 on loading
    return None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _cfg(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None) if not isinstance(config, dict) else config.get(n)
        if isinstance(v, int) and v > 0:
            return v
    return default


def estimate(model_dir, config, batch_size: int, seq_len: int) -> Estimate | None:
    """The memory ``fp4sim inspect`` will need for the model in ``model_dir`` (its transformers configuration
    ``config``) at one batch of ``batch_size`` x ``seq_len`` tokens (see the module docstring); None where the
    weights' sizes cannot be read before loading (a folder of ``.bin`` files)."""
    model_dir = Path(model_dir)
    tensors = _tensors(model_dir)
    if not tensors:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    weights = params = linear = largest = 0
    for name, nbytes, shape in tensors:
        n = _numel(shape)
        params += n
        low = name.lower()
        if len(shape) == 2 and low.endswith(".weight") and not any(k in low for k in _NOT_LINEAR):
            weights += nbytes * n
            linear += n
            largest = max(largest, n)
        else:
            weights += 4 * n
    d = _cfg(config, "hidden_size", "n_embd", "d_model", default=0)
    layers = _cfg(config, "num_hidden_layers", "n_layer", "num_layers", default=0)
    f = _cfg(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * d)
    heads = _cfg(config, "num_attention_heads", "n_head", default=max(1, d // 64))
    kv = _cfg(config, "num_key_value_heads", default=heads) * (d // heads if heads else 0)
    vocab = _cfg(config, "vocab_size", default=0)
    tokens = batch_size * seq_len
    parts = {"quantized_weights": int(0.5625 * linear),
             "activations": 4 * tokens * layers * (10 * d + 4 * f + 4 * kv + heads * seq_len),
             "logits": 4 * 6 * tokens * vocab,
             "largest_layer": 24 * largest + 256 * 2 ** 20,
             "kernels": KERNELS}
    return Estimate(weights=int(weights), working=int(sum(parts.values())), base=_rss(), disk=4 * linear,
                    params=params, parts=parts)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def peak_bytes() -> int:
    """This process's peak resident memory: VmHWM (Linux), which, unlike ``getrusage``'s ``ru_maxrss``, is not
    carried over from the process that started this one (``ru_maxrss`` survives ``exec``: a command started from
    a large process would report that process's peak); ``ru_maxrss`` elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import resource
    import sys
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, or less where a cgroup (a container's limit) allows
    less; None where neither can be read (not Linux)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        lim = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        cur = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if lim != "max":
            room = int(lim) - cur
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    if avail is not None:
        avail += _rss()                     # what this process holds now counts towards the estimate's total
    return avail


def describe(e: Estimate) -> str:
    """One line: the two figures and the parts."""
    return (f"{e.weights / GB:.2f} GB of weights + {(e.working + e.base) / GB:.2f} GB working set "
            f"(activations {e.parts['activations'] / GB:.2f}, logits {e.parts['logits'] / GB:.2f}, quantized "
            f"weights {e.parts['quantized_weights'] / GB:.2f}, largest layer {e.parts['largest_layer'] / GB:.2f}, "
            f"kernels {e.parts['kernels'] / GB:.2f}, this process {e.base / GB:.2f})")

