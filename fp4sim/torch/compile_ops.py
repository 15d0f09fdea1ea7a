"""torch.compile: a QuantLinear as two opaque operators, ``fp4sim::qlinear`` and ``fp4sim::qlinear_backward``
(``torch.library`` custom ops with fake implementations), which run the eager Function's own code."""
from __future__ import annotations

import weakref

import torch

from .function import _Fn


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
