"""PyTorch bridge: emulated low-precision training (:class:`QuantLinear`, :func:`convert`, :func:`set_recipe`,
:func:`collect_stats`, :func:`suggest_high_precision`) and dumps of a model's linear layers for
``python -m fp4sim.analyze``.

    from fp4sim.torch import dump_linear_tensors
    dump_linear_tensors(model, lambda: model(batch).loss.backward(), "dump.npz")

torch is optional for fp4sim; this module imports it on use.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

import numpy as np

__all__ = ["dump_linear_tensors", "to_numpy", "QuantLinear", "convert", "set_recipe", "collect_stats",
           "suggest_high_precision", "drop_extra_state", "gradient_fidelity", "wgrad_errors", "rank_high_precision",
           "set_data_parallel_rank", "RecipeMismatchWarning", "flush_warnings", "gradient_sinks",
           "streaming_fidelity"]
_LINEAR = {"gradient_sinks", "streaming_fidelity", "flush_warnings", "QuantLinear", "convert", "set_recipe", "collect_stats", "suggest_high_precision", "drop_extra_state",
           "gradient_fidelity", "wgrad_errors", "rank_high_precision", "set_data_parallel_rank",
           "RecipeMismatchWarning"}


def __getattr__(name):
    if name in _LINEAR:  # imports torch only when used
        from . import linear
        return getattr(linear, name)
    raise AttributeError(f"module 'fp4sim.torch' has no attribute {name!r}")


def to_numpy(t) -> np.ndarray:
    """A torch tensor as a float32 NumPy array (bfloat16/float16 widen exactly)."""
    return t.detach().float().cpu().contiguous().numpy()


def dump_linear_tensors(model, step, path, include: str = "*", max_rows: int | None = None) -> dict:
    """Run ``step()`` (a forward and backward pass) once with hooks on every ``torch.nn.Linear`` whose name
    matches ``include`` and save, per layer ``NAME``: ``NAME.weight``, ``NAME.input`` (the activation it
    multiplies), ``NAME.grad_output`` (the gradient of its output) and ``NAME.weight_grad`` — names that give
    fp4sim.analyze the right roles and pair ``.input`` with ``.grad_output`` for the weight-gradient GEMM
    study. Leading dimensions are flattened to (tokens, features); ``max_rows`` keeps the first rows of the
    input and output gradient only (the weight gradient is the layer's whole one).

    ``NAME.weight_grad`` is the gradient of this ``step()`` alone, also when the parameters held a gradient
    from before (not zeroed): that one is set aside during the step and added back afterwards, so the model's
    ``.grad`` ends as ``step()`` alone would leave it. Layers that multiply the same input tensor (q / k / v, gate /
    up projections) share one copy: the first such layer's ``NAME.input`` is saved, and the dump's ``__meta__``
    (JSON bytes) says which layers share it (``shared_inputs``) and pairs each of them with it for the
    weight-gradient study (``pairs``). Returns the dict of arrays written (``np.savez_compressed``)."""
    import torch
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows={max_rows!r}: give a positive number of rows, or None for all")
    out, hooks = {}, []

    def rows(a):
        a = to_numpy(a).reshape(-1, a.shape[-1])
        return a[:max_rows] if max_rows else a

    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and fnmatch.fnmatchcase(n, include)]
    if not linears:
        raise ValueError(f"no torch.nn.Linear module matches include={include!r}")
    stale = {}
    for name, mod in linears:
        if mod.weight.grad is not None:
            stale[name] = mod.weight.grad
            mod.weight.grad = None
    seen, shared = [], {}                 # (input tensor, the layer that saved it); {layer: that layer}

    def keep_input(name, t):
        first = next((n for u, n in seen if u is t), None)
        if first is None:
            seen.append((t, name))
            out[f"{name}.input"] = rows(t)
        else:
            shared[name] = first

    for name, mod in linears:
        hooks.append(mod.register_forward_hook(lambda m, inp, o, name=name: keep_input(name, inp[0])))
        hooks.append(mod.register_full_backward_hook(
            lambda m, gin, gout, name=name: out.__setitem__(f"{name}.grad_output", rows(gout[0]))))
    try:
        step()
        for name, mod in linears:
            out[f"{name}.weight"] = to_numpy(mod.weight)
            if mod.weight.grad is not None:
                out[f"{name}.weight_grad"] = to_numpy(mod.weight.grad)
    finally:
        for h in hooks:
            h.remove()
        for name, mod in linears:
            if name in stale:
                g = mod.weight.grad
                mod.weight.grad = stale[name] if g is None else stale[name] + g
    seen.clear()
    if shared:
        import json
        meta = {"shared_inputs": {f"{n}.input": f"{f}.input" for n, f in shared.items()},
                "pairs": {n: [f"{f}.input", f"{n}.grad_output"] for n, f in shared.items()
                          if f"{n}.grad_output" in out}}
        out["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **out)
    return out
