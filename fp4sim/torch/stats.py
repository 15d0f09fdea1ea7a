"""What the layers' GEMMs did: :func:`collect_stats` (per operand: error, underflow, clipping, weight oscillation),
:func:`wgrad_errors`, :func:`rank_high_precision` and :func:`suggest_high_precision` (which layers to keep in
high precision), and :func:`gradient_fidelity` (each weight gradient against float32)."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from ..training import OPERANDS
from .module import _quant_layers

__all__ = ["collect_stats", "wgrad_errors", "rank_high_precision", "suggest_high_precision", "gradient_fidelity",
           "SNR_THRESHOLD"]

#: Gradients and GEMM products of at most this many elements are reduced in one piece (:func:`wgrad_errors`,
#: :func:`~fp4sim.torch.streaming.streaming_fidelity`); larger ones in pieces of rows of about this size, one at a
#: time (the same sums, added in another order: the last bits may differ). 2^23: 64 MB per float64 temporary.
CHUNK = 1 << 23


@contextlib.contextmanager
def collect_stats(model: torch.nn.Module, oscillation: bool = True):
    """Log, per layer, GEMM and operand, while the block runs, of every quantized operand: ``rel_mse``,
    ``underflow`` (the share of nonzero elements that become 0), ``max_code`` (the share of FP4 codes at +-6, the
    largest E2M1 magnitude, which every block's amax element takes by design: about 1/16 on Gaussian data) and
    ``clipped`` (the share of elements whose magnitude exceeds their block's dequantized 6: what the clamp lost,
    where the E4M3 block scale rounded below amax / 6); and per layer the weight's oscillation between logged Fprop
    calls (``w_changed``: the share of quantized weight elements whose value changed since the previous call;
    ``w_flipped_back``: the share that changed back to the value of the call before, A -> B -> A, as TetraJet-v2
    tracks it). ``with collect_stats(model) as log: ...`` then ``log.dataset()`` (xarray). A model without
    QuantLinear layers raises ValueError. ``oscillation=False`` leaves the oscillation out (it keeps two float32
    copies of every quantized weight between calls: 8 bytes per weight)."""
    log = _StatsLog()
    mods = [m for _, m in _quant_layers(model)]
    for m in mods:
        m._stats = log.entries
        m._track_osc = bool(oscillation)
    try:
        yield log
    finally:
        for m in mods:
            m._stats = None
            m._track_osc = True
            m._osc = (None, None)             # the next log starts afresh; the copies are freed


_STAT_KEYS = ("rel_mse", "underflow", "max_code", "clipped")
_OSC_KEYS = ("w_changed", "w_flipped_back")   # fprop_w only; from a layer's second (third) logged call on


class _StatsLog:
    def __init__(self):
        self.entries = []

    def records(self):
        out = []
        for e in self.entries:
            for r in e["records"]:
                out.append(dict(layer=e["layer"], call=e["call"], gemm=e["gemm"], **r))
        return out

    def dataset(self):
        """An xarray Dataset with dims (layer, operand) of the mean over the logged calls."""
        import xarray as xr
        recs = self.records()
        layers = list(dict.fromkeys(r["layer"] for r in recs))
        ops = [o for o in OPERANDS if any(r["operand"] == o for r in recs)]
        data = {k: np.full((len(layers), len(ops)), np.nan) for k in _STAT_KEYS}
        count = np.zeros((len(layers), len(ops)))
        for r in recs:
            i, j = layers.index(r["layer"]), ops.index(r["operand"])
            for k in data:
                data[k][i, j] = (0 if count[i, j] == 0 else data[k][i, j]) + r[k]
            count[i, j] += 1
        with np.errstate(invalid="ignore"):
            ds = xr.Dataset({k: (("layer", "operand"), v / np.where(count, count, np.nan)) for k, v in data.items()},
                            coords={"layer": layers, "operand": ops})
        ds["calls"] = (("layer", "operand"), count.astype(int))
        osc = [r for r in recs if r["operand"] == "fprop_w" and "w_changed" in r]
        if osc:
            for k in _OSC_KEYS:                       # the mean over the calls where it is defined
                v = np.full(len(layers), np.nan)
                for i, name in enumerate(layers):
                    vals = [r[k] for r in osc if r["layer"] == name and r[k] == r[k]]
                    v[i] = np.mean(vals) if vals else np.nan
                ds[k] = ("layer", v)
            ds["w_changed"].attrs["description"] = ("share of the quantized weight's elements that changed since the "
                                                    "layer's previous logged Fprop call (mean over calls)")
            ds["w_flipped_back"].attrs["description"] = ("share that changed and returned to the value of the call "
                                                         "before (A -> B -> A): oscillation")
        return ds


@contextlib.contextmanager
def wgrad_errors(model: torch.nn.Module):
    """While active, every quantized weight-gradient GEMM of the model's QuantLinear layers appends ``(e, r)`` to
    ``calls[name]``: its squared error against the float64 product of the same operands, and that product's
    squared norm (``with wgrad_errors(model) as calls: ...``); a GEMM of more than
    :data:`CHUNK` outputs is compared in pieces of rows, in bounded memory (the same sums
    added in another order). A layer running under the ``"none"`` recipe (plain
    ``F.linear``) adds nothing. :func:`suggest_high_precision` ranks the layers by these sums."""
    mods = _quant_layers(model)
    calls = {n: [] for n, _ in mods}

    def probe(name):
        def f(d, dy2, x2):
            xp = np if isinstance(d, np.ndarray) else __import__("cupy")
            if d.size <= CHUNK:
                ref = xp.matmul(dy2.T.astype(np.float64), x2.astype(np.float64))
                calls[name].append((float(((d - ref) ** 2).sum()), float((ref ** 2).sum())))
                return
            x64, e, r = x2.astype(np.float64), 0.0, 0.0       # a large layer: pieces of rows, one at a time
            step = max(1, CHUNK // max(1, d.shape[1]))
            for i in range(0, d.shape[0], step):
                ref = xp.matmul(dy2[:, i:i + step].T.astype(np.float64), x64)
                e += float(((d[i:i + step] - ref) ** 2).sum())
                r += float((ref ** 2).sum())
            calls[name].append((e, r))
        return f

    for n, m in mods:
        m._wgrad_probe = probe(n)
    try:
        yield calls
    finally:
        for n, m in mods:
            m._wgrad_probe = None


def rank_high_precision(calls: dict, fraction: float = 0.15):
    """``(names to keep, {name: relative Wgrad error})`` from :func:`wgrad_errors`'s record: each layer's error
    pooled over its calls, ``sqrt(sum e / sum r)``, worst first; the worst ``fraction`` (the nearest whole number
    of layers to ``fraction`` x their count, halves to even as ``round``, at least one) to keep."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r}: a share of the layers in (0, 1]")
    rel = {}
    for n, c in calls.items():
        e, r = sum(v[0] for v in c), sum(v[1] for v in c)
        rel[n] = (e / r) ** 0.5 if r > 0 else 0.0
    order = sorted(rel, key=lambda n: -rel[n])
    k = max(1, round(fraction * len(order)))
    return order[:k], {n: rel[n] for n in order}


def suggest_high_precision(model: torch.nn.Module, batch_fn, fraction: float = 0.15, steps: int = 1):
    """Rank the QuantLinear layers by the relative error of their quantized weight-gradient GEMM (against the
    float64 product of the same operands) over ``steps`` calls of ``batch_fn()`` (a forward and backward pass),
    and propose the worst ``fraction`` for high precision — the diagnostic the paper suggests (its App. E.2): the
    nearest whole number of layers to ``fraction`` x their count (halves to even, as ``round``), at least one.
    Returns ``(names to keep, {name: relative Wgrad error})``, the dict ordered worst first (its first entries are
    the names to keep); the model's gradients are left as they were."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r}: a share of the layers in (0, 1]")
    grads = {id(p): (p.grad.clone() if p.grad is not None else None) for p in model.parameters()}
    try:
        with wgrad_errors(model) as calls:
            for _ in range(steps):
                batch_fn()
        if not any(calls.values()):
            raise ValueError("batch_fn ran no backward pass through the QuantLinear layers (no weight gradient "
                             "was computed): it must run the forward pass and loss.backward()")
    finally:
        for p in model.parameters():
            p.grad = grads[id(p)]
    return rank_high_precision(calls, fraction)


class _PassStart:
    """What the quantized and the float32 pass of one batch start from alike: the torch RNG (CUDA's too), the
    module buffers and the layers' SR call counts, taken now; ``reset()`` puts them back."""

    def __init__(self, model, mods):
        self.model, self.mods = model, mods
        self.bufs = [b.detach().clone() for b in model.buffers()]
        self.calls = [m._calls for _, m in mods]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def reset(self):
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        for b, v in zip(self.model.buffers(), self.bufs):
            b.data.copy_(v)
        for (_, m), c in zip(self.mods, self.calls):
            m._calls = c


def gradient_sums(q: torch.Tensor, r: torch.Tensor, chunk: int | None = None) -> tuple:
    """``(sum r^2, sum (q - r)^2, sum q^2, sum q r)`` in float64 of two weight gradients of one shape, from which
    :func:`gradient_fidelity` and :func:`~fp4sim.torch.streaming.streaming_fidelity` take the SNR and the cosine.
    On the CPU one fused pass over the float32 values (fp4sim.cpu.analysis.gradient_sums: 1024-element segments
    in element order, added with Neumaier's compensation); on a device, torch's float64 sums, in pieces of rows
    where the gradient has more than ``chunk`` (:data:`CHUNK`) elements."""
    q, r = q.detach(), r.detach()
    if q.device.type == "cpu":
        from ..cpu.analysis import gradient_sums as fused
        a = q.to(torch.float32).contiguous().reshape(-1).numpy()
        b = r.to(torch.float32).contiguous().reshape(-1).numpy()
        return tuple(float(v) for v in fused(a, b))
    return _torch_sums(q, r, chunk)


def _torch_sums(q, r, chunk=None) -> tuple:
    """:func:`gradient_sums` in torch's float64 operations, in pieces of rows of at most about ``chunk`` elements."""
    chunk = CHUNK if chunk is None else int(chunk)
    q2, r2 = q.reshape(q.shape[0] if q.dim() else 1, -1), r.reshape(r.shape[0] if r.dim() else 1, -1)
    step = max(1, chunk // max(1, q2.shape[1]))
    s = [0.0, 0.0, 0.0, 0.0]
    for i in range(0, q2.shape[0], step):
        a, b = q2[i:i + step].to(torch.float64), r2[i:i + step].to(torch.float64)
        for k, v in enumerate(((b * b).sum(), ((a - b) ** 2).sum(), (a * a).sum(), (a * b).sum())):
            s[k] += float(v)
    return tuple(s)


def snr_cosine(sums) -> tuple:
    """``(snr, cosine)`` from :func:`gradient_sums`' four sums: ``||r|| / ||q - r||`` (inf when equal) and
    ``<q, r> / (||q|| ||r||)`` (NaN where a gradient is zero)."""
    nr2, nd2, nq2, dot = sums
    nr, nd, nq = math.sqrt(nr2), math.sqrt(nd2), math.sqrt(nq2)
    den = nq * nr
    return (nr / nd if nd > 0 else float("inf")), (dot / den if den > 0 else float("nan"))


SNR_THRESHOLD = 3 ** 0.5       # Chmiel et al. 2025: quantized training stops helping below this gradient SNR


def gradient_fidelity(model: torch.nn.Module, batch_fn):
    """How faithful each QuantLinear's weight gradient is: ``batch_fn()`` (a forward and backward pass on one
    batch) runs once as the model is (``g_q``) and once with every QuantLinear, kept layers included, under the
    ``"none"`` recipe (plain float32 ``nn.Linear``: ``g_ref``), on the same weights, and with the torch RNG, the
    module buffers and the SR call counts reset between the two, the same batch and dropout masks. Returns an
    xarray Dataset over ``layer`` (the QuantLinear names) with ``snr = ||g_ref|| / ||g_q - g_ref||`` (inf when
    equal), ``rel_error = 1 / snr`` and ``cosine = cos(g_q, g_ref)``, and the threshold ``sqrt(3)`` in its attrs
    (Chmiel et al. 2025, "FP4 All the Way": below it, the quantized gradient's noise outweighs its signal).
    Afterwards the model's parameters, gradients, buffers, recipes, SR call counts and the torch RNG are as they
    were."""
    import xarray as xr
    mods = _quant_layers(model)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    recipes = [(m.recipe, m.recipe_backward) for _, m in mods]
    start = _PassStart(model, mods)

    def reset():
        start.reset()
        for p in params:
            p.grad = None

    def run(what):
        reset()
        batch_fn()
        missing = [n for n, m in mods if m.weight.grad is None]
        if missing:
            raise ValueError(f"batch_fn ran no backward pass through {missing[0]!r} ({what} run; "
                             f"{len(missing)} of {len(mods)} layers got no weight gradient): it must run the "
                             "forward pass and loss.backward() through every QuantLinear")
        return [m.weight.grad.detach().clone() for _, m in mods]

    try:
        g_q = run("quantized")
        for _, m in mods:
            m.recipe = m.recipe_backward = "none"
        g_ref = run("float32 reference")
    finally:
        reset()
        for (_, m), (rf, rb) in zip(mods, recipes):
            m.recipe, m.recipe_backward = rf, rb
        for p, g in zip(params, grads):
            p.grad = g
    snr, cos = [], []
    for q, r in zip(g_q, g_ref):
        a, b = snr_cosine(gradient_sums(q, r))
        snr.append(a)
        cos.append(b)
    snr = np.array(snr)
    with np.errstate(divide="ignore"):
        rel = np.where(np.isinf(snr), 0.0, 1.0 / snr)
    return xr.Dataset({"snr": ("layer", snr), "rel_error": ("layer", rel), "cosine": ("layer", np.array(cos))},
                      coords={"layer": [n for n, _ in mods]}, attrs={"snr_threshold": SNR_THRESHOLD})
