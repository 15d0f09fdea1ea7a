"""``QuantLinear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run as a :class:`~fp4sim.training.Recipe`
says, on CPU (Numba backend, zero-copy NumPy views of float32 tensors) or any CUDA GPU (CuPy backend through
DLPack, no host round trip)."""
from __future__ import annotations

import contextlib
import fnmatch

import numpy as np
import torch
import torch.nn.functional as F

from .. import emulate
from ..training import OPERANDS, Recipe

__all__ = ["QuantLinear", "convert", "set_recipe", "collect_stats", "suggest_high_precision"]


def _to_array(t: torch.Tensor):
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    t = t.contiguous()
    if t.is_cuda:
        import cupy
        return cupy.from_dlpack(t)
    return t.numpy()


def _to_tensor(a, like: torch.Tensor, dtype):
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return t.to(device=like.device, dtype=dtype)


def _resolve(recipe) -> Recipe:
    if isinstance(recipe, str):
        return Recipe.preset(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a fp4sim.training.Recipe or a preset name, not {type(recipe).__name__}")
    return recipe


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        rec = layer.recipe
        call = layer._calls
        layer._calls += 1
        lead = x.shape[:-1]
        x2 = _to_array(x.reshape(-1, x.shape[-1]))
        w = _to_array(weight)
        stats = layer._stats_sink("fprop", call)
        y, qw, qx = emulate.fprop(x2, w, rec, layer.layer_index, call, stats, return_qx=True)
        ctx.layer, ctx.call, ctx.lead, ctx.x_dtype = layer, call, lead, x.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        ctx.qw = qw if rec.dgrad_w_reuse_fprop else None
        ctx.qx = qx if rec.wgrad_x_reuse_fprop else None
        out = _to_tensor(y, x, torch.float32)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(x.dtype).reshape(*lead, -1)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer, call = ctx.layer, ctx.call
        rec = layer.recipe_backward
        dy2t = dy.reshape(-1, dy.shape[-1])
        dy2 = _to_array(dy2t)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            stats = layer._stats_sink("dgrad", call)
            d = emulate.dgrad(dy2, _to_array(weight), rec, layer.layer_index, call, ctx.qw, stats)
            dx = _to_tensor(d, x, ctx.x_dtype).reshape(*ctx.lead, -1)
        if ctx.needs_input_grad[1]:
            stats = layer._stats_sink("wgrad", call)
            d = emulate.wgrad(dy2, _to_array(x.reshape(-1, x.shape[-1])), rec, layer.layer_index, call, stats,
                              ctx.qx)
            dw = _to_tensor(d, weight, weight.dtype)
            if layer._wgrad_probe is not None:
                layer._wgrad_probe(d, dy2, _to_array(x.reshape(-1, x.shape[-1])))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2t.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None


class QuantLinear(torch.nn.Linear):
    """``torch.nn.Linear`` (same parameters, state_dict and initialisation) whose Fprop, Dgrad and Wgrad GEMMs
    run under ``recipe`` (a :class:`~fp4sim.training.Recipe` or a preset name). The bias is added in float32
    after the GEMM; the output has the input's dtype. ``recipe="none"`` is exactly ``nn.Linear``."""

    def __init__(self, in_features, out_features, bias=True, recipe="nvfp4_paper", device=None, dtype=None,
                 layer_index: int = 0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, layer_index)

    def _setup(self, recipe, layer_index):
        self.recipe = _resolve(recipe)
        self.recipe_backward = self.recipe
        self.layer_index = int(layer_index)
        self._calls, self._stats, self._wgrad_probe = 0, None, None

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear, recipe, layer_index: int = 0) -> "QuantLinear":
        q = cls.__new__(cls)
        torch.nn.Module.__init__(q)
        q.in_features, q.out_features = lin.in_features, lin.out_features
        q.weight = lin.weight
        q.bias = lin.bias
        q._setup(recipe, layer_index)
        return q

    def _stats_sink(self, gemm_name, call):
        if self._stats is None:
            return None
        sink = []
        self._stats.append(dict(layer=getattr(self, "_fp4sim_name", str(self.layer_index)), call=call,
                                gemm=gemm_name, records=sink))
        return sink

    def forward(self, x):
        if self.recipe.identity and self.recipe_backward.identity:
            return F.linear(x, self.weight, self.bias)
        return _Fn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        r = self.recipe.name + ("" if self.recipe_backward is self.recipe else f" / backward {self.recipe_backward.name}")
        return super().extra_repr() + f", recipe={r}"


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def convert(model: torch.nn.Module, recipe="nvfp4_paper", keep_high_precision=()) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`QuantLinear` sharing its parameters.

    Layers matching the recipe's ``keep`` globs or ``keep_high_precision`` (more globs), or in its first/last
    ``keep_first`` / ``keep_last`` blocks, run under the recipe's high-precision recipe (BF16 by default).
    Layer indices (which key their stochastic rounding) follow the module order. Returns the model."""
    recipe = _resolve(recipe)
    if isinstance(keep_high_precision, str):
        keep_high_precision = (keep_high_precision,)
    lins = _linears(model)
    blocks = [recipe.block_of(n) for n, _ in lins]
    n_blocks = max([b for b in blocks if b is not None], default=-1) + 1 or None
    for i, (name, lin) in enumerate(lins):
        kept = recipe.keeps(name, n_blocks) or any(fnmatch.fnmatchcase(name, g) for g in keep_high_precision)
        r = recipe.high_precision_recipe() if kept and not recipe.identity else recipe
        q = lin if isinstance(lin, QuantLinear) else QuantLinear.from_linear(lin, r, i)
        q.recipe = q.recipe_backward = r
        q.layer_index = i
        q._fp4sim_name = name
        q._fp4sim_kept = kept
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    return model


def set_recipe(model: torch.nn.Module, recipe, which: str = "both", include_kept: bool = False):
    """Change the recipe of every QuantLinear mid-run: ``which`` = ``"forward"`` (Fprop), ``"backward"``
    (Dgrad and Wgrad) or ``"both"`` — the paper's late switch to BF16 is ``set_recipe(model, "bf16", which)``.
    Layers kept in high precision keep theirs unless ``include_kept``."""
    recipe = _resolve(recipe)
    if which not in ("forward", "backward", "both"):
        raise ValueError(f"which={which!r}: use 'forward', 'backward' or 'both'")
    for _, m in model.named_modules():
        if not isinstance(m, QuantLinear) or (getattr(m, "_fp4sim_kept", False) and not include_kept):
            continue
        if which in ("forward", "both"):
            m.recipe = recipe
        if which in ("backward", "both"):
            m.recipe_backward = recipe
    return model


@contextlib.contextmanager
def collect_stats(model: torch.nn.Module):
    """Log, per layer, GEMM and operand, the relative MSE, underflow and saturation of every quantized operand
    while the block runs; ``with collect_stats(model) as log: ...`` then ``log.dataset()`` (xarray)."""
    log = _StatsLog()
    mods = [m for _, m in model.named_modules() if isinstance(m, QuantLinear)]
    for m in mods:
        m._stats = log.entries
    try:
        yield log
    finally:
        for m in mods:
            m._stats = None


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
        data = {k: np.full((len(layers), len(ops)), np.nan) for k in ("rel_mse", "underflow", "saturation")}
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
        return ds


def suggest_high_precision(model: torch.nn.Module, batch_fn, fraction: float = 0.15, steps: int = 1):
    """Rank the QuantLinear layers by the relative error of their quantized weight-gradient GEMM (against the
    float32 product of the same operands) over ``steps`` calls of ``batch_fn()`` (a forward and backward pass),
    and propose the worst ``fraction`` for high precision — the diagnostic the paper suggests (its App. E.2).
    Returns ``(names to keep, {name: relative Wgrad error})``; the model's gradients are left as they were."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r}: a share of the layers in (0, 1]")
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not mods:
        raise ValueError("the model has no QuantLinear layers: fp4sim.torch.convert(model, recipe) first")
    err = {n: [0.0, 0.0] for n, _ in mods}
    grads = {id(p): (p.grad.clone() if p.grad is not None else None) for p in model.parameters()}

    def probe(name):
        def f(d, dy2, x2):
            xp = np if isinstance(d, np.ndarray) else __import__("cupy")
            ref = xp.matmul(dy2.T.astype(np.float64), x2.astype(np.float64))
            err[name][0] += float(((d - ref) ** 2).sum())
            err[name][1] += float((ref ** 2).sum())
        return f

    for n, m in mods:
        m._wgrad_probe = probe(n)
    try:
        for _ in range(steps):
            batch_fn()
    finally:
        for n, m in mods:
            m._wgrad_probe = None
        for p in model.parameters():
            p.grad = grads[id(p)]
    rel = {n: (e / r) ** 0.5 if r > 0 else 0.0 for n, (e, r) in err.items()}
    order = sorted(rel, key=lambda n: -rel[n])
    k = max(1, round(fraction * len(order)))
    return order[:k], rel
