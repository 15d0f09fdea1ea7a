"""``QuantLinear``: a drop-in ``torch.nn.Linear`` whose three GEMMs run as a :class:`~fp4sim.training.Recipe`
says, on CPU (Numba backend, zero-copy NumPy views of float32 tensors) or any CUDA GPU (CuPy backend through
DLPack, no host round trip)."""
from __future__ import annotations

import atexit
import contextlib
import fnmatch
import json
import re
import sys
import warnings
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from .. import emulate, threads
from .._xp import matmul_by
from ..planning import NAN_E2M1
from ..training import OPERANDS, Recipe

__all__ = ["QuantLinear", "convert", "set_recipe", "collect_stats", "suggest_high_precision", "drop_extra_state",
           "gradient_fidelity", "wgrad_errors", "rank_high_precision", "set_data_parallel_rank",
           "RecipeMismatchWarning", "flush_warnings"]

HEAD_NAMES = ("lm_head", "output", "head")      # a model's output head, by the last component of its name
_FP4 = ("nvfp4", "mxfp4")                       # element E2M1: NaN encodes as +6 and does not propagate


def _to_array(t: torch.Tensor):
    """A float32 NumPy (CPU) or CuPy (CUDA) view of ``t`` (a copy where it is not float32 and contiguous). On the
    CPU the view goes through DLPack, not ``Tensor.numpy()``, which would mark the storage as not resizable: FSDP2
    frees a gathered weight after the forward by resizing its storage to zero."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    t = t.contiguous()
    if t.is_cuda:
        import cupy
        return cupy.from_dlpack(t)
    return np.from_dlpack(t)


def _to_tensor(a, like: torch.Tensor, dtype):
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return t.to(device=like.device, dtype=dtype)


def _resolve(recipe) -> Recipe:
    if isinstance(recipe, str):
        return Recipe.preset(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a fp4sim.training.Recipe or a preset name, not {type(recipe).__name__}")
    return recipe


_WHAT = {"x": "the input", "w": "the weight", "dy": "the output gradient"}


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: one sum first (NaN or Inf anywhere makes it NaN or Inf; about
    ten times cheaper than an element-wise test), the element-wise test only where the sum is not finite
    (then an overflowing sum of finite values still counts as finite)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _check_finite(layer, mode: str, which: str, t: torch.Tensor, uses):
    """Warn or raise (``mode``: the running pass's recipe's ``on_nonfinite``) when ``t`` (``which``: x, w or dy)
    holds NaN or Inf and a recipe quantizes one of the operands made from it (``uses``: (recipe, operand name)
    pairs); the quantization itself stays as the hardware does it. On a CUDA device the warning (not the raise)
    is deferred: :func:`_defer_nan_check`."""
    _poll_nan_checks()
    if mode == "ignore":
        return
    ops = [(r, n) for r, n in uses if not r.identity and getattr(r, n).quantized]
    if not ops:
        return
    if mode == "warn" and _defers(t):
        fp4 = [n for r, n in ops if getattr(r, n).scheme in _FP4 and (which, n) not in layer._nonfinite_warned]
        if fp4:
            _defer_nan_check(layer, which, fp4, t)
        return
    if _all_finite(t):
        return
    nan = bool(torch.isnan(t).any())
    kind = "NaN" if nan else "Inf"
    layer_name = getattr(layer, "_fp4sim_name", f"#{layer.layer_index}")
    if mode == "raise":
        raise FloatingPointError(f"layer {layer_name!r}: {_WHAT[which]} (operands {', '.join(n for _, n in ops)}) "
                                 f"holds {kind} (on_nonfinite='raise')")
    fp4 = [n for r, n in ops if getattr(r, n).scheme in _FP4 and (which, n) not in layer._nonfinite_warned]
    if nan and fp4:                                # an Inf warns where it is quantized; each NaN operand once
        _warn_nan(layer, which, fp4)


def _warn_nan(layer, which, fp4):
    if all((which, n) in layer._nonfinite_warned for n in fp4):
        return
    layer._nonfinite_warned.update((which, n) for n in fp4)
    layer_name = getattr(layer, "_fp4sim_name", f"#{layer.layer_index}")
    warnings.warn(f"layer {layer_name!r}: {_WHAT[which]} (operands {', '.join(fp4)}) holds NaN; E2M1 encodes "
                  "NaN as +6 (CUDA's satfinite rule), so it does not reach the GEMM's output and training goes "
                  "on. Recipe(..., on_nonfinite='raise') stops at the first NaN or Inf (this warning comes once "
                  "per layer and operand)", RuntimeWarning, stacklevel=5)


def _defers(t: torch.Tensor) -> bool:
    """Whether the NaN check of ``t`` is deferred (a CUDA tensor: reading the result at once would stall the
    device every call)."""
    return t.is_cuda


_NAN_CHECKS: list = []      # deferred checks: (layer, which, operands, host flag, CUDA event or None)


def _defer_nan_check(layer, which, fp4, t: torch.Tensor):
    """Queue the NaN test of ``t`` without waiting for it: one reduction on the device (aminmax propagates NaN),
    its flag copied to pinned host memory behind it; a later check (:func:`_poll_nan_checks`) warns once the flag
    has arrived, and :func:`flush_warnings` (also at exit) waits for the rest."""
    lo, hi = torch.aminmax(t.detach())
    flag = torch.isnan(lo) | torch.isnan(hi)
    event = None
    if flag.is_cuda:
        flag = flag.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    _NAN_CHECKS.append((weakref.ref(layer), which, tuple(fp4), flag, event))


def _poll_nan_checks(wait: bool = False):
    """Warn for the deferred NaN checks whose flags have reached the host (all of them with ``wait``)."""
    if not _NAN_CHECKS:
        return
    keep = []
    for item in _NAN_CHECKS:
        ref, which, fp4, flag, event = item
        if event is not None and not event.query():
            if not wait:
                keep.append(item)
                continue
            event.synchronize()
        layer = ref()
        if layer is not None and bool(flag):
            _warn_nan(layer, which, list(fp4))
    _NAN_CHECKS[:] = keep


def flush_warnings():
    """Emit the warnings that wait for values on a CUDA device: the layers' NaN checks and fp4sim's own GPU
    warnings (:func:`fp4sim.gpu.flush_warnings`). They arrive by themselves at a later call once their values
    have reached the host; this waits for all of them (it runs at exit too)."""
    _poll_nan_checks(wait=True)
    if "fp4sim.gpu.ops" in sys.modules:
        sys.modules["fp4sim.gpu.ops"].flush_warnings()


def _flush_at_exit():
    try:
        _poll_nan_checks(wait=True)
    except Exception:  # noqa: BLE001 - the CUDA context may be gone at exit: nothing left to read then
        pass


atexit.register(_flush_at_exit)


@contextlib.contextmanager
def _kernel_threads():
    """For the duration of one pass: Numba's thread count as :func:`fp4sim.threads.bridge_threads` says (by
    default torch's own thread count: under torchrun, which sets OMP_NUM_THREADS=1 per process, one thread, not
    Numba's count of every core), the GEMMs through ``torch.matmul`` (torch's threads, which Numba's kernels share:
    :mod:`fp4sim.threads`), and fs.quantize's NaN warning left to the layer's own (:func:`_check_finite`, which
    names the layer and comes once). torch's thread count is as it was after the pass: Numba's OpenMP layer
    sets the runtime's count when it runs a kernel, and torch.compile guards on that count (a change makes
    every compiled frame compile again)."""
    before = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(NAN_E2M1[:60]), category=RuntimeWarning)
            with threads.numba_threads(threads.bridge_threads() or before), matmul_by(_torch_matmul):
                yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _torch_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` of two NumPy arrays by torch (zero-copy views in and out; a read-only or negatively strided
    operand is copied first)."""
    def t(x):
        try:
            return torch.from_numpy(x) if x.flags.writeable else torch.from_numpy(x.copy())
        except ValueError:                                    # negative strides
            return torch.from_numpy(np.ascontiguousarray(x))
    return torch.matmul(t(a), t(b)).numpy()


def _dp_rank(layer) -> int:
    """The data-parallel rank whose stochastic-rounding bits the layer draws (:func:`fp4sim.emulate.sr_key`): the
    one :func:`set_data_parallel_rank` gave it, else the process's rank in torch.distributed's default group
    (0 where none is initialised)."""
    r = layer.__dict__.get("_sr_rank")
    if r is not None:
        return r
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else 0


def _recipe_id(rec: Recipe) -> str:
    """A short fingerprint of a recipe (every field), the same in every process."""
    import hashlib
    return hashlib.sha1(repr(rec).encode()).hexdigest()[:12]


def _check_ranks_agree(layer):
    """On a layer's first call in a torch.distributed run of several processes: every rank runs it with the same
    forward and backward recipes and layer index (one all_gather of a fingerprint); RuntimeError naming the ranks
    that differ. Once per layer and process."""
    layer._ranks_checked = True
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() < 2:
        return
    mine = (_recipe_id(layer.recipe), _recipe_id(layer.recipe_backward), int(layer.layer_index))
    got = [None] * d.get_world_size()
    d.all_gather_object(got, mine)
    if any(g != got[0] for g in got):
        name = getattr(layer, "_fp4sim_name", f"#{layer.layer_index}")
        differ = [i for i, g in enumerate(got) if g != got[0]]
        raise RuntimeError(f"layer {name!r}: ranks {differ} run it with another recipe or layer index than rank 0 "
                           f"({layer.recipe.name!r} here on rank {d.get_rank()}): convert the model with the same "
                           "recipe, seed and layer order on every rank")


def _amax_reducer(layer, device):
    """The maximum over torch.distributed's ranks, for the delayed amaxes of :func:`fp4sim.emulate.held_amax`
    (None in a single process or where the layer has no such operand)."""
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() < 2:
        return None
    if all(getattr(r, op).amax == "current" for r in (layer.recipe, layer.recipe_backward) for op in OPERANDS):
        return None

    def reduce(v):
        t = torch.tensor([v], dtype=torch.float32, device=device)
        d.all_reduce(t, op=d.ReduceOp.MAX)
        return float(t.item())
    return reduce


@contextlib.contextmanager
def _device_stream(device):
    """On a CUDA device: CuPy (fp4sim's GPU kernels and arrays) works on that device and on torch's current stream
    there, so that the layer's kernels are ordered with torch's work around them, in a ``torch.cuda.stream(s)``
    block too. Elsewhere nothing."""
    if getattr(device, "type", None) != "cuda":
        yield
        return
    import cupy
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(idx), cupy.cuda.ExternalStream(torch.cuda.current_stream(idx).cuda_stream, idx):
        yield


@contextlib.contextmanager
def _pass(layer, rank, device):
    """One forward or backward pass of a layer: kernel threads, the data-parallel rank's SR bits, the ranks'
    common delayed amax, torch's current CUDA stream."""
    with _kernel_threads(), emulate.data_parallel_rank(rank), \
            emulate.amax_reduction(_amax_reducer(layer, device)), _device_stream(device):
        yield


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        return _Fn.run_forward(ctx, x, weight, bias, layer)

    @staticmethod
    def backward(ctx, dy):
        return _Fn.run_backward(ctx, dy)

    @staticmethod
    def run_forward(ctx, x, weight, bias, layer):
        if not layer._ranks_checked:
            _check_ranks_agree(layer)
        ctx.rank = _dp_rank(layer)
        with _pass(layer, ctx.rank, x.device):
            return _Fn._forward(ctx, x, weight, bias, layer)

    @staticmethod
    def run_backward(ctx, dy):
        with _pass(ctx.layer, ctx.rank, dy.device):
            return _Fn._backward(ctx, dy)

    @staticmethod
    def _forward(ctx, x, weight, bias, layer):
        rec = layer.recipe
        call = layer._calls
        layer._calls += 1
        rb = layer.recipe_backward
        bw = rb.backward_recipe()                              # what the backward GEMMs quantize with
        _check_finite(layer, rec.on_nonfinite, "x", x, ((rec, "fprop_x"), (bw, "wgrad_x")))
        _check_finite(layer, rec.on_nonfinite, "w", weight, ((rec, "fprop_w"), (bw, "dgrad_w")))
        lead = x.shape[:-1]
        x2 = _to_array(x.reshape(-1, x.shape[-1]))
        w = _to_array(weight)
        stats = layer._stats_sink("fprop", call)
        y, qw, qx = emulate.fprop(x2, w, rec, layer.layer_index, call, stats, return_qx=True,
                                  amax_state=layer._amax_state)
        if stats is not None:
            layer._oscillation(qw, stats)
        ctx.layer, ctx.call, ctx.lead, ctx.x_dtype = layer, call, lead, x.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        deq = rb.backward_override == "dequantized"         # the backward runs on fprop's operands, dequantized
        ctx.qw = qw if deq or rec.dgrad_w_reuse_fprop or emulate.serves(qw, rb.dgrad_w) else None
        ctx.qx = qx if deq or rec.wgrad_x_reuse_fprop or emulate.serves(qx, rb.wgrad_x) else None
        out = _to_tensor(y.reshape(*lead, y.shape[-1]), x, torch.float32)      # not a view (FSDP2 warns of one)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(x.dtype)

    @staticmethod
    def _backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer, call = ctx.layer, ctx.call
        rec = layer.recipe_backward
        bw = rec.backward_recipe()
        _check_finite(layer, rec.on_nonfinite, "dy", dy, ((bw, "dgrad_dy"), (bw, "wgrad_dy")))
        dy2t = dy.reshape(-1, dy.shape[-1])
        dy2 = _to_array(dy2t)
        dx = dw = db = None
        cache = {}                                 # dgrad's output-gradient values, for wgrad (fast path)
        if ctx.needs_input_grad[0]:
            stats = layer._stats_sink("dgrad", call)
            d = emulate.dgrad(dy2, _to_array(weight), rec, layer.layer_index, call, ctx.qw, stats, cache,
                              layer._amax_state)
            dx = _to_tensor(d, x, ctx.x_dtype).reshape(*ctx.lead, -1)
        if ctx.needs_input_grad[1]:
            stats = layer._stats_sink("wgrad", call)
            d = emulate.wgrad(dy2, _to_array(x.reshape(-1, x.shape[-1])), rec, layer.layer_index, call, stats,
                              ctx.qx, cache, layer._amax_state)
            dw = _to_tensor(d, weight, weight.dtype)
            if layer._wgrad_probe is not None:
                layer._wgrad_probe(d, dy2, _to_array(x.reshape(-1, x.shape[-1])))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2t.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None


# ------------------------------------------------------------------------------- torch.compile: custom ops
# Under torch.compile a QuantLinear runs as two opaque operators, fp4sim::qlinear and fp4sim::qlinear_backward,
# which call the same forward and backward as the eager autograd.Function (the same bits). What the forward keeps
# for the backward besides x and the weight (the quantized operands that the recipe reuses, the call index, the
# rank) waits in the layer's ``_pending`` under the call index, which the forward returns as a tensor: the count
# that keys stochastic rounding never becomes a guard, so a compiled step does not recompile from call to call.
_LAYERS = weakref.WeakValueDictionary()     # a layer's key -> the QuantLinear (the operators take the key)
_PENDING_MAX = 16                    # forwards kept for a backward per layer (more: the oldest are dropped)


class _Ctx:
    """What autograd's ctx gives _Fn._forward / _backward, for the custom-op path."""

    def __init__(self, needs):
        self.needs_input_grad = needs

    def save_for_backward(self, *t):
        self.saved_tensors = t


def _register(layer):
    """Give ``layer`` a key of its own for the operators: a CPU int64 scalar tensor attribute (not a buffer: no
    state_dict entry, and ``.to(device)`` leaves it on the host, so reading it costs no device round trip).
    torch.compile lifts it as a graph input and guards on its shape and dtype, not on its value or on the
    layer's identity, so the decoder blocks of a deep model share one compiled graph (a Python int here
    would be a constant of the graph, guarded per layer: one recompile per block, up to dynamo's limit)."""
    key = id(layer)
    layer.__dict__["_fp4sim_key"] = torch.tensor(key, dtype=torch.int64)
    _LAYERS[key] = layer


def _layer_of(key):
    key = int(key)
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"fp4sim::qlinear: no QuantLinear with key {key} (the module was deleted)")
    return layer


def _register_ops():
    """Define fp4sim::qlinear and fp4sim::qlinear_backward (torch.library.custom_op, torch >= 2.4)."""
    @torch.library.custom_op("fp4sim::qlinear", mutates_args=())
    def _qlinear_op(x: torch.Tensor, weight: torch.Tensor, key: torch.Tensor, grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = _layer_of(key)
        ctx = _Ctx((True, True, False, False))
        out = _Fn.run_forward(ctx, x, weight, None, layer)
        if grad:
            ctx.saved_tensors = ()                 # the backward operator receives x and the weight itself
            layer._pending[ctx.call] = ctx
            while len(layer._pending) > _PENDING_MAX:
                layer._pending.pop(next(iter(layer._pending)))
        return out.to(torch.float32), torch.tensor(ctx.call, dtype=torch.int64)

    @_qlinear_op.register_fake
    def _(x, weight, key, grad):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32), x.new_empty((), dtype=torch.int64)

    @torch.library.custom_op("fp4sim::qlinear_backward", mutates_args=())
    def _qlinear_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, call: torch.Tensor,
                             key: torch.Tensor, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
        layer = _layer_of(key)
        ctx = layer._pending.pop(int(call), None)
        if ctx is None:
            raise RuntimeError(f"fp4sim::qlinear_backward: layer {getattr(layer, '_fp4sim_name', int(key))!r} holds no "
                               f"forward call {int(call)} (a second backward through one graph is not supported, "
                               f"or more than {_PENDING_MAX} forwards waited for theirs: the oldest are dropped)")
        ctx.saved_tensors = (x, weight)
        ctx.needs_input_grad = (need_dx, need_dw, False, False)
        dx, dw, _, _ = _Fn.run_backward(ctx, dy)
        return (dx if dx is not None else x.new_empty(0)), (dw if dw is not None else weight.new_empty(0))

    @_qlinear_backward_op.register_fake
    def _(dy, x, weight, call, key, need_dx, need_dw):
        return (x.new_empty(x.shape) if need_dx else x.new_empty(0),
                weight.new_empty(weight.shape) if need_dw else weight.new_empty(0))

    def _qlinear_setup(ctx, inputs, output):
        x, weight, key, _ = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.key = key

    def _qlinear_grad(ctx, dy, _dcall):
        x, weight, call = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = torch.ops.fp4sim.qlinear_backward(dy.contiguous(), x, weight, call, ctx.key, need_dx, need_dw)
        return (dx if need_dx else None), (dw if need_dw else None), None, None

    _qlinear_op.register_autograd(_qlinear_grad, setup_context=_qlinear_setup)


_HAVE_OPS = hasattr(torch.library, "custom_op")
if _HAVE_OPS:
    _register_ops()


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
        if rec is None:                          # an unquantized weight: nothing oscillates
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
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if torch.compiler.is_compiling():
            return self._compiled_forward(x)
        return _Fn.apply(x, self.weight, self.bias, self)

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


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _n_blocks(recipe, names):
    blocks = [recipe.block_of(n) for n in names]
    return max([b for b in blocks if b is not None], default=-1) + 1 or None


def _tied_to_embedding(model, lin) -> bool:
    return any(isinstance(m, torch.nn.Embedding) and m.weight is lin.weight for m in model.modules())


def is_output_head(model, name: str, lin) -> bool:
    """Whether the Linear ``name`` is the model's output head: named ``lm_head``, ``output`` or ``head`` (the last
    component of its name), or its weight is an ``nn.Embedding``'s (tied embeddings)."""
    return name.rpartition(".")[2] in HEAD_NAMES or _tied_to_embedding(model, lin)


def _unmatched(globs, names, what):
    for g in globs:
        if not any(fnmatch.fnmatchcase(n, g) for n in names):
            near = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"{what} {g!r} matches no linear layer of the model (its layers: {near}); give a name "
                             "or glob (fnmatch) of the model's own layer names")


def _refuse_sharded(model):
    """ValueError where FSDP2 (fully_shard) or FSDP1 already wraps the model: convert comes first."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                                                 # a torch without distributed
        return
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) or type(p).__name__ == "FlatParameter":
            raise ValueError(f"convert: parameter {n!r} is already sharded ({type(p).__name__}): call "
                             "fp4sim.torch.convert(model, recipe) before fully_shard / FSDP / DDP, as you would "
                             "any module swap (docs/training.md, 'Training at scale')")


def set_data_parallel_rank(model: torch.nn.Module, rank):
    """Make every QuantLinear of ``model`` draw the stochastic-rounding bits of data-parallel rank ``rank``
    (:func:`fp4sim.emulate.sr_key`): a single process reproduces any rank's draws this way. ``rank=None``
    restores the default, the process's rank in torch.distributed's default group (0 where none is
    initialised). Returns the model."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank={rank!r}: an integer >= 0, or None (torch.distributed's rank)")
    for _, m in _quant_layers(model):
        m._sr_rank = rank
    return model


def convert(model: torch.nn.Module, recipe="nvfp4_paper", keep_high_precision=(), quantize_head: bool = False
            ) -> torch.nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`QuantLinear` sharing its parameters.

    Layers run under the recipe's high-precision recipe (BF16 by default) when they match its ``keep`` globs or
    ``keep_high_precision`` (more globs), lie in its first / last ``keep_first`` / ``keep_last`` blocks, or are
    the output head: a Linear named ``lm_head``, ``output`` or ``head`` (the last part of its name), or one whose
    weight is tied to an ``nn.Embedding``, as the paper, TransformerEngine and torchao keep it. Pass
    ``quantize_head=True`` to quantize the head as well. A glob that matches no layer raises ValueError. Layer
    indices (which key their stochastic rounding) follow the module order. A model converted before is converted
    again: its QuantLinear modules stay (parameters and SR call counts too) and each takes the new recipe, or its
    high-precision recipe where the keep rules say so, for both its forward and its backward GEMMs. Returns the
    model."""
    recipe = _resolve(recipe)
    if isinstance(keep_high_precision, str):
        keep_high_precision = (keep_high_precision,)
    if not isinstance(quantize_head, bool):
        raise TypeError(f"quantize_head={quantize_head!r}: give True or False")
    lins = _linears(model)
    if not lins:
        raise ValueError("the model has no torch.nn.Linear layers to convert")
    _refuse_sharded(model)
    names = [n for n, _ in lins]
    _unmatched(keep_high_precision, names, "keep_high_precision")
    _unmatched(recipe.keep, names, f"recipe {recipe.name!r}: keep glob")
    n_blocks = _n_blocks(recipe, names)
    slow = recipe.general_path_operands() if not recipe.identity else {}
    if slow:
        from ..training import SlowPathWarning
        whys = sorted(set(slow.values()))
        warnings.warn(f"recipe {recipe.name!r}: {', '.join(slow)} take fp4sim's general path ({'; '.join(whys)}); "
                      "the bits are the same, a training step several times slower than the presets' (see "
                      "docs/training.md, 'Speed'). Filter fp4sim.training.SlowPathWarning to silence this",
                      SlowPathWarning, stacklevel=2)
    for i, (name, lin) in enumerate(lins):
        kept = (recipe.keeps(name, n_blocks) or any(fnmatch.fnmatchcase(name, g) for g in keep_high_precision)
                or (not quantize_head and is_output_head(model, name, lin)))
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
    Layers kept in high precision by :func:`convert` keep theirs unless ``include_kept``; of the others, those the
    new recipe keeps (its ``keep`` globs, ``keep_first`` / ``keep_last``) take its high-precision recipe. A model
    without QuantLinear layers, or a keep glob that matches none, raises ValueError."""
    recipe = _resolve(recipe)
    if which not in ("forward", "backward", "both"):
        raise ValueError(f"which={which!r}: use 'forward', 'backward' or 'both'")
    mods = _quant_layers(model)
    names = [n for n, _ in mods]
    _unmatched(recipe.keep, names, f"recipe {recipe.name!r}: keep glob")
    n_blocks = _n_blocks(recipe, names)
    high = recipe.high_precision_recipe() if not recipe.identity else recipe
    for name, m in mods:
        if getattr(m, "_fp4sim_kept", False) and not include_kept:
            continue
        r = high if recipe.keeps(name, n_blocks) else recipe
        if which in ("forward", "both"):
            m.recipe = r
        if which in ("backward", "both"):
            m.recipe_backward = r
    return model


@contextlib.contextmanager
def collect_stats(model: torch.nn.Module):
    """Log, per layer, GEMM and operand, while the block runs, of every quantized operand: ``rel_mse``,
    ``underflow`` (the share of nonzero elements that become 0), ``max_code`` (the share of FP4 codes at +-6, the
    largest E2M1 magnitude, which every block's amax element takes by design: about 1/16 on Gaussian data) and
    ``clipped`` (the share of elements whose magnitude exceeds their block's dequantized 6: what the clamp lost,
    where the E4M3 block scale rounded below amax / 6); and per layer the weight's oscillation between logged Fprop
    calls (``w_changed``: the share of quantized weight elements whose value changed since the previous call;
    ``w_flipped_back``: the share that changed back to the value of the call before, A -> B -> A, as TetraJet-v2
    tracks it). ``with collect_stats(model) as log: ...`` then ``log.dataset()`` (xarray). A model without
    QuantLinear layers raises ValueError."""
    log = _StatsLog()
    mods = [m for _, m in _quant_layers(model)]
    for m in mods:
        m._stats = log.entries
    try:
        yield log
    finally:
        for m in mods:
            m._stats = None
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
    squared norm (``with wgrad_errors(model) as calls: ...``). A layer running under the ``"none"`` recipe (plain
    ``F.linear``) adds nothing. :func:`suggest_high_precision` ranks the layers by these sums."""
    mods = _quant_layers(model)
    calls = {n: [] for n, _ in mods}

    def probe(name):
        def f(d, dy2, x2):
            xp = np if isinstance(d, np.ndarray) else __import__("cupy")
            ref = xp.matmul(dy2.T.astype(np.float64), x2.astype(np.float64))
            calls[name].append((float(((d - ref) ** 2).sum()), float((ref ** 2).sum())))
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
    bufs = [b.detach().clone() for b in model.buffers()]
    calls = [m._calls for _, m in mods]
    recipes = [(m.recipe, m.recipe_backward) for _, m in mods]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def reset():
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for b, v in zip(model.buffers(), bufs):
            b.data.copy_(v)
        for (_, m), c in zip(mods, calls):
            m._calls = c
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
        return [m.weight.grad.detach().to(torch.float64).clone() for _, m in mods]

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
        nr, nd = float(r.norm()), float((q - r).norm())
        snr.append(nr / nd if nd > 0 else float("inf"))
        den = float(q.norm()) * nr
        cos.append(float((q * r).sum()) / den if den > 0 else float("nan"))
    snr = np.array(snr)
    with np.errstate(divide="ignore"):
        rel = np.where(np.isinf(snr), 0.0, 1.0 / snr)
    return xr.Dataset({"snr": ("layer", snr), "rel_error": ("layer", rel), "cosine": ("layer", np.array(cos))},
                      coords={"layer": [n for n, _ in mods]}, attrs={"snr_threshold": SNR_THRESHOLD})
