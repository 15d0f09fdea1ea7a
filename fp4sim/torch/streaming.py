"""Weight gradients as the backward makes them, one layer at a time: :func:`gradient_sinks` and
:func:`streaming_fidelity` (:func:`~fp4sim.torch.gradient_fidelity` in the memory of one layer).

:func:`~fp4sim.torch.gradient_fidelity` holds every layer's quantized and float32 weight gradient in float64 at
once, 16 bytes per weight beside the ``.grad`` tensors: a model's studies then need several times the model's own
memory. Here each gradient is reduced to what the study needs as soon as its layer's backward has made it: the
float32 pass first, each layer's gradient written to a temporary file as it is made; then the quantized pass,
each layer's gradient compared with the float32 one read back, then dropped."""
from __future__ import annotations

import contextlib
import os
import tempfile

import numpy as np
import torch

from .module import _quant_layers
from . import stats
from .stats import SNR_THRESHOLD, _PassStart, gradient_sums, snr_cosine

__all__ = ["gradient_sinks", "streaming_fidelity"]


@contextlib.contextmanager
def gradient_sinks(model: torch.nn.Module, sink):
    """While active, each QuantLinear of the model hands its weight gradient to ``sink(name, grad)`` (a float32
    tensor on the weight's device, valid during the call only) when its backward has made it, instead of
    accumulating it into ``weight.grad``; this happens whether or not the weight requires grad. A layer under
    the ``"none"`` recipe runs ``F.linear`` on its weight widened to float32 and recomputes that product in its
    backward (the same bits as ``nn.Linear``), so that a bfloat16 weight is held as stored, not as a float32 copy.
    Eager mode only."""
    mods = _quant_layers(model)
    for n, m in mods:
        m._grad_sink = (lambda g, n=n: sink(n, g))
    try:
        yield
    finally:
        for _, m in mods:
            m._grad_sink = None


class _Spill:
    """Float32 arrays written to one unlinked temporary file and read back by key (not mapped: they take no
    process memory between the two)."""

    def __init__(self, folder):
        self.f = tempfile.TemporaryFile(dir=folder)
        self.where, self.end = {}, 0

    def put(self, key, t: torch.Tensor):
        a = np.ascontiguousarray(t.detach().to("cpu", torch.float32).numpy())
        self.f.seek(self.end)
        self.f.write(memoryview(a).cast("B"))
        self.where[key] = (self.end, a.shape)
        self.end += a.nbytes

    def take(self, key) -> np.ndarray:
        off, shape = self.where.pop(key)
        a = np.empty(shape, np.float32)
        self.f.seek(off)
        if self.f.readinto(memoryview(a).cast("B")) != a.nbytes:
            raise OSError("the temporary file of the float32 gradients was cut short (is its disk full?)")
        return a

    def close(self):
        self.f.close()


def _fidelity(q: torch.Tensor, r: torch.Tensor, chunk: int) -> tuple:
    """(snr, cosine) of a quantized gradient ``q`` against the float32 one ``r``: the four float64 sums of
    :func:`~fp4sim.torch.stats.gradient_sums` (on the CPU one fused pass, no float64 copy; on a device in pieces of
    rows where the gradient has more than ``chunk`` elements)."""
    return snr_cosine(gradient_sums(q, r, chunk))


def streaming_fidelity(model: torch.nn.Module, loss_fn, spill_dir=None, chunk: int | None = None):
    """:func:`~fp4sim.torch.gradient_fidelity` holding one layer's gradients at a time. ``loss_fn(quantized)``
    runs the forward pass on one batch and returns the loss (no backward); it runs twice, first with every
    QuantLinear under the ``"none"`` recipe (float32, ``quantized=False``), then as the model is
    (``quantized=True``), with the torch RNG, the module buffers and the SR call counts reset between the two as
    gradient_fidelity resets them. During the float32 backward each layer's weight gradient is written to a
    temporary file in ``spill_dir`` (default: the system's temporary folder; it needs 4 bytes per weight and is
    removed at the end); during the quantized backward each layer's gradient is compared with it and dropped.
    Parameters other than the QuantLinear weights keep their ``requires_grad`` (so that the same backward GEMMs
    run as in gradient_fidelity), and each gradient they get is dropped as it is accumulated: their ``.grad`` is
    as it was before, and never holds the passes' gradients (freeze them, and make the first layer's input
    require grad, to skip computing those gradients at all, as ``fp4sim inspect`` does). Returns ``(dataset,
    loss, loss_float32)``: the dataset as gradient_fidelity's (``snr``, ``rel_error``, ``cosine`` over
    ``layer``), the same values (for gradients of more than ``chunk`` elements, :data:`fp4sim.torch.stats.CHUNK`
    by default, the float64 sums are taken in pieces: equal to the last bits), and the two passes' losses as
    floats. One difference: a weight another module shares (a head tied to
    the embeddings) is studied by its own GEMM's gradient, where gradient_fidelity reads the shared parameter's
    ``.grad``, which adds the other module's (the embedding lookup's) to it."""
    import xarray as xr
    chunk = stats.CHUNK if chunk is None else int(chunk)
    mods = _quant_layers(model)
    names = [n for n, _ in mods]
    params = list(model.parameters())
    recipes = [(m.recipe, m.recipe_backward) for _, m in mods]
    start = _PassStart(model, mods)
    reset = start.reset
    if spill_dir is not None and not os.path.isdir(spill_dir):
        raise ValueError(f"spill_dir={str(spill_dir)!r}: not a folder (give one with room for 4 bytes per weight)")
    spill = _Spill(spill_dir)
    got = {}

    def to_file(name, g):
        spill.put(name, g)

    def compare(name, g):
        if name not in spill.where:
            raise ValueError(f"layer {name!r}: a weight gradient in the quantized pass and none in the float32 "
                             "pass (loss_fn must run the same layers in both)")
        r = torch.from_numpy(spill.take(name)).to(g.device)
        got[name] = _fidelity(g.detach().reshape(r.shape), r, chunk)

    def run(what, sink, quantized):
        reset()
        with gradient_sinks(model, sink):
            loss = loss_fn(quantized)
            loss.backward()
        seen = spill.where if not quantized else got
        missing = [n for n in names if n not in seen]
        if missing:
            raise ValueError(f"loss_fn ran no backward pass through {missing[0]!r} ({what} run; {len(missing)} of "
                             f"{len(mods)} layers got no weight gradient): every QuantLinear must take part in "
                             "the loss")
        return float(loss.detach())

    grads = [p.grad for p in params]
    drops = []
    try:
        for p in params:
            p.grad = None
            if p.requires_grad:
                drops.append(p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)))
        for _, m in mods:
            m.recipe = m.recipe_backward = "none"
        loss_ref = run("float32 reference", to_file, False)
        for (_, m), (rf, rb) in zip(mods, recipes):
            m.recipe, m.recipe_backward = rf, rb
        loss_q = run("quantized", compare, True)
    finally:
        spill.close()
        reset()
        for (_, m), (rf, rb) in zip(mods, recipes):
            m.recipe, m.recipe_backward = rf, rb
        for h in drops:
            h.remove()
        for p, g in zip(params, grads):
            p.grad = g
    snr = np.array([got[n][0] for n in names])
    cos = np.array([got[n][1] for n in names])
    with np.errstate(divide="ignore"):
        rel = np.where(np.isinf(snr), 0.0, 1.0 / snr)
    ds = xr.Dataset({"snr": ("layer", snr), "rel_error": ("layer", rel), "cosine": ("layer", cos)},
                    coords={"layer": names}, attrs={"snr_threshold": SNR_THRESHOLD})
    return ds, loss_q, loss_ref
