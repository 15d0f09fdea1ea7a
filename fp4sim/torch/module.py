"""The :class:`QuantLinear` module: its recipes, its state (call count, delayed amaxes, per-layer RHT signs, the
recipe fingerprint its checkpoint carries), and its forward in eager mode and under torch.compile."""
from __future__ import annotations

import json
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .. import emulate
from ..training import OPERANDS, Recipe
from .compile_ops import _HAVE_OPS, _register
from .distributed import _recipe_id
from .function import _Fn

__all__ = ["QuantLinear", "RecipeMismatchWarning", "drop_extra_state"]


def _resolve(recipe) -> Recipe:
    if isinstance(recipe, str):
        return Recipe.preset(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a fp4sim.training.Recipe or a preset name, not {type(recipe).__name__}")
    return recipe


class RecipeMismatchWarning(UserWarning):
    """A QuantLinear loaded a state saved under another recipe (a branch, or a mistake)."""


class QuantLinear(torch.nn.Linear):
    """``torch.nn.Linear`` (same parameters and initialisation) whose Fprop, Dgrad and Wgrad GEMMs run under
    ``recipe`` (a :class:`~fp4sim.training.Recipe` or a preset name). The bias is added in float32 after the
    GEMM; the output has the input's dtype. ``recipe="none"`` is exactly ``nn.Linear``.

    As ``nn.Linear``: a floating-point input on the weight's device only (TypeError / ValueError otherwise), and
    an empty input (no rows, or no
    features) gives an empty output and zero gradients. The layer counts its forward calls; the count keys the
    Philox bits of stochastic rounding and travels in the state_dict (``_extra_state``: ``{"calls": n}``, with
    ``"amax"``: the held tensor amaxes of operands with ``amax="delayed"`` / ``"history"`` as one JSON string,
    ``"rht_signs"``: the vectors of ``rht_signs="per_layer"``, and ``"recipe"`` / ``"recipe_names"``: the
    forward and backward recipes' fingerprints and names), so a model saved and loaded again — by torch.save or
    torch.distributed.checkpoint — draws the bits an uninterrupted run would. Loading a state saved under another
    recipe warns (:class:`RecipeMismatchWarning`). A state_dict without it (a plain ``nn.Linear`` model's) loads
    strictly and leaves the count as it is; :func:`drop_extra_state` makes one that a plain model loads
    strictly. Under torch.distributed, stochastic rounding draws the bits of the process's rank
    (:func:`set_data_parallel_rank`) and delayed amaxes are the maximum over the ranks."""

    def __init__(self, in_features, out_features, bias=True, recipe="nvfp4_paper", device=None, dtype=None,
                 layer_index: int = 0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, layer_index)

    def _setup(self, recipe, layer_index):
        self.recipe = recipe
        self.recipe_backward = self.recipe
        self.layer_index = int(layer_index)
        self._calls, self._stats, self._wgrad_probe = 0, None, None
        self._grad_sink = None                 # fp4sim.torch.gradient_sinks: where the weight gradient goes
        self._track_osc = True                 # collect_stats(oscillation=False) turns the copies off
        self._amax_state = {}                  # operands with a delayed tensor amax: emulate.held_amax
        self._osc = (None, None)               # collect_stats: the quantized weight of the last two Fprop calls
        self._nonfinite_warned = set()
        self._sr_rank = None                   # set_data_parallel_rank; None: torch.distributed's rank
        self._ranks_checked = False
        self._pending = {}                     # torch.compile: forward calls waiting for their backward
        _register(self)

    def __getstate__(self):                    # forwards waiting for a backward stay with this process's layer
        state = self.__dict__.copy()
        state["_pending"] = {}
        return state

    def __setstate__(self, state):             # a copy (copy.deepcopy, pickle) is a layer of its own
        super().__setstate__(state)
        self._pending = {}
        _register(self)

    @property
    def recipe(self) -> Recipe:
        """The recipe of the forward GEMM (a preset name is resolved when set); setting it leaves the backward
        recipe as it is (``set_recipe`` changes both)."""
        return self.__dict__["_recipe"]

    @recipe.setter
    def recipe(self, value):
        self.__dict__["_recipe"] = _resolve(value)

    @property
    def recipe_backward(self) -> Recipe:
        """The recipe of the Dgrad and Wgrad GEMMs."""
        return self.__dict__["_recipe_backward"]

    @recipe_backward.setter
    def recipe_backward(self, value):
        self.__dict__["_recipe_backward"] = _resolve(value)

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear, recipe, layer_index: int = 0) -> "QuantLinear":
        q = cls.__new__(cls)
        torch.nn.Module.__init__(q)
        q.in_features, q.out_features = lin.in_features, lin.out_features
        q.weight = lin.weight
        q.bias = lin.bias
        q._setup(recipe, layer_index)
        return q

    def _per_layer_signs(self) -> dict:
        """{d: the +-1 sign vector} of the RHTs this layer runs with ``rht_signs="per_layer"`` (forward or
        backward recipe)."""
        out = {}
        for rec in (self.recipe, self.recipe_backward):
            for op in OPERANDS:
                o = getattr(rec, op)
                if o.rht and o.rht_signs == "per_layer":
                    out[str(o.rht)] = [int(v) for v in emulate.per_layer_signs(rec.seed, self.layer_index, o.rht)]
        return out

    def get_extra_state(self):
        st = {"calls": int(self._calls), "recipe": [_recipe_id(self.recipe), _recipe_id(self.recipe_backward)],
              "recipe_names": [self.recipe.name, self.recipe_backward.name]}
        # one string, always present: torch.distributed.checkpoint loads the keys a fresh model's state holds,
        # and a fresh model holds no amax yet (a nested dict of its own would be dropped on loading)
        st["amax"] = json.dumps({k: {f: (list(v) if isinstance(v, list) else v) for f, v in d.items()}
                                 for k, d in self._amax_state.items()}, sort_keys=True)
        signs = self._per_layer_signs()
        if signs:
            st["rht_signs"] = signs            # what replicas and a resumed run must agree on
        return st

    def set_extra_state(self, state):
        if not isinstance(state, dict) or not isinstance(state.get("calls"), int) or state["calls"] < 0:
            raise ValueError(f"QuantLinear extra state {state!r}: expected {{'calls': n}} with n >= 0 (saved by "
                             "a QuantLinear's state_dict)")
        saved, mine = state.get("rht_signs") or {}, self._per_layer_signs()
        for d, v in saved.items():
            if d in mine and list(v) != mine[d]:
                raise ValueError(f"QuantLinear {getattr(self, '_fp4sim_name', '#' + str(self.layer_index))}: the "
                                 f"checkpoint's per-layer {d}-point RHT signs differ from this layer's (recipe seed "
                                 f"{self.recipe.seed}, layer index {self.layer_index}); build the model with the seed "
                                 "and layer order it was saved with")
        saved = state.get("recipe")
        mine = [_recipe_id(self.recipe), _recipe_id(self.recipe_backward)]
        if saved is not None and list(saved) != mine:
            names = state.get("recipe_names") or ["?", "?"]
            warnings.warn(RecipeMismatchWarning(
                f"QuantLinear {getattr(self, '_fp4sim_name', '#' + str(self.layer_index))}: the checkpoint was saved "
                f"under recipe {names[0]!r} / backward {names[1]!r}, which differs from this layer's "
                f"({self.recipe.name!r} / {self.recipe_backward.name!r}; seeds and switches count); the "
                "parameters and call count load, and the layer goes on under its own recipe. Convert the model "
                "with the recipe it was saved with (or call set_recipe before loading) to resume that run; "
                "filter fp4sim.torch.RecipeMismatchWarning where a branch to another recipe is meant"),
                stacklevel=3)
        self._calls = state["calls"]
        amax = state.get("amax") or {}
        if isinstance(amax, str):
            amax = json.loads(amax)
        self._amax_state = {k: {f: (list(v) if isinstance(v, list) else float(v)) for f, v in d.items()}
                            for k, d in amax.items()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        n = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "_extra_state"
        if key in missing_keys[n:]:             # a plain nn.Linear checkpoint: no call count, keep ours
            missing_keys.remove(key)

    def _oscillation(self, qw, sink):
        """Weight oscillation of this Fprop call against the layer's previous logged ones, into the fprop_w
        record: ``w_changed`` (the share of weight elements whose quantized value differs from the previous
        call's) and ``w_flipped_back`` (the share whose value differs from the previous call's and equals the one
        before: A -> B -> A)."""
        rec = next((r for r in sink if r["operand"] == "fprop_w"), None)
        if rec is None or not self._track_osc:   # an unquantized weight: nothing oscillates
            return
        from ..quantize import dequantize
        v = dequantize(qw) if hasattr(qw, "codes") else np.array(qw, np.float32)
        prev, prev2 = self._osc
        changed = v != prev if prev is not None and prev.shape == v.shape else None
        rec["w_changed"] = float(changed.mean()) if changed is not None else float("nan")
        rec["w_flipped_back"] = (float((changed & (v == prev2)).mean()) if changed is not None and prev2 is not None
                                 and prev2.shape == v.shape else float("nan"))
        self._osc = (v, prev)

    def _stats_sink(self, gemm_name, call):
        if self._stats is None:
            return None
        sink = []
        self._stats.append(dict(layer=getattr(self, "_fp4sim_name", str(self.layer_index)), call=call,
                                gemm=gemm_name, records=sink))
        return sink

    def forward(self, x):
        weight = self.weight
        if self._grad_sink is not None and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                raise RuntimeError("fp4sim.torch.gradient_sinks works in eager mode only (not under torch.compile)")
            weight = weight.detach().requires_grad_()     # a leaf of this call: its gradient goes to the sink
            if self.recipe.identity and self.recipe_backward.identity:
                from .function import _RefFn
                return _RefFn.apply(x, weight, self.bias, self)
        if self.recipe.identity and self.recipe_backward.identity:
            return F.linear(x, self.weight, self.bias)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"QuantLinear takes a floating-point input, not {what}; convert it first "
                            "(x.float(), or the weight's dtype)")
        if x.device != self.weight.device:
            raise ValueError(f"QuantLinear: the input is on {x.device} and the weight on {self.weight.device}; "
                             f"move one of them (x.to({str(self.weight.device)!r}) or the module .to(...))")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            rows = x[..., :1].numel() if x.dim() else 1
            k = x.shape[-1] if x.dim() else 1
            name = getattr(self, "_fp4sim_name", None)
            raise RuntimeError(f"{'layer ' + repr(name) + ': ' if name else 'QuantLinear: '}mat1 and mat2 shapes cannot "
                               f"be multiplied ({rows}x{k} and {self.in_features}x{self.out_features}): the layer "
                               f"takes {self.in_features} input features, the input's last axis has {k}")
        if x.numel() == 0 or self.weight.numel() == 0:
            self._calls += 1                   # no rows (an MoE expert without tokens) or no features
            if weight is not self.weight:      # its zero gradient goes to the sink too
                weight.register_hook(lambda g: self._grad_sink(g.float()))
            return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if torch.compiler.is_compiling():
            return self._compiled_forward(x)
        return _Fn.apply(x, weight, self.bias, self)

    def _compiled_forward(self, x):
        """The forward as torch.compile sees it: fp4sim::qlinear (an opaque operator, the same bits as the eager
        path), then the bias in float32 and the input's dtype, as _Fn does."""
        if not _HAVE_OPS:
            raise RuntimeError(f"torch.compile of a QuantLinear needs torch.library.custom_op (torch >= 2.4; this is "
                               f"torch {torch.__version__})")
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        y, _ = torch.ops.fp4sim.qlinear(x, self.weight, self._fp4sim_key, grad)     # (_register: a graph input)
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        r = self.recipe.name + ("" if self.recipe_backward is self.recipe else f" / backward {self.recipe_backward.name}")
        return super().extra_repr() + f", recipe={r}"


def drop_extra_state(state_dict: dict) -> dict:
    """A copy of ``state_dict`` without QuantLinear's ``_extra_state`` entries (the SR call counts), which a model
    of plain ``nn.Linear`` layers loads with ``strict=True``."""
    return type(state_dict)((k, v) for k, v in state_dict.items() if not k.endswith("._extra_state")
                            and k != "_extra_state")


def _quant_layers(model):
    """[(name, layer)] of the model's QuantLinear layers (named as convert named them); ValueError if none."""
    mods = [(getattr(m, "_fp4sim_name", n), m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not mods:
        raise ValueError("the model has no QuantLinear layers: fp4sim.torch.convert(model, recipe) first")
    return mods
