"""One QuantLinear call as an autograd Function: the forward's Fprop GEMM and the backward's Dgrad and Wgrad, each
pass with its kernel threads, its rank's stochastic-rounding bits, the ranks' common delayed amax and torch's
CUDA stream."""
from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from .. import emulate, threads
from .._xp import matmul_by
from ..planning import NAN_NO_NAN_RE
from .distributed import _amax_reducer, _check_ranks_agree, _dp_rank
from .nonfinite import _check_finite
from .views import _to_array, _to_tensor


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
            warnings.filterwarnings("ignore", message=NAN_NO_NAN_RE, category=RuntimeWarning)
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
            if layer._grad_sink is not None:          # handed over in float32 as made, never accumulated
                layer._grad_sink(_to_tensor(d, weight, torch.float32))
            else:
                dw = _to_tensor(d, weight, weight.dtype)
            if layer._wgrad_probe is not None:
                layer._wgrad_probe(d, dy2, _to_array(x.reshape(-1, x.shape[-1])))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2t.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None


class _RefFn(torch.autograd.Function):
    """A layer under the ``"none"`` recipe while its weight gradient goes to a sink: ``F.linear`` on the weight
    widened to float32 (exact from bfloat16 / float16), holding the weight as stored, not the float32 copy, for the
    backward, which widens it again and runs ``F.linear``'s own backward on the same operands (the same bits as
    plain ``nn.Linear`` in float32), and hands the weight gradient to the sink."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(x, weight, bias)
        return torch.nn.functional.linear(x, weight.float(), bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        want_x, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        with torch.enable_grad():
            xx = x.detach().requires_grad_(want_x)
            ww = weight.detach().float().requires_grad_()
            bb = None if bias is None else bias.detach().requires_grad_(want_b)
            ins = [t for t, w in ((xx, want_x), (ww, True), (bb, want_b)) if w]
            got = list(torch.autograd.grad(torch.nn.functional.linear(xx, ww, bb), ins, dy))
        dx = got.pop(0) if want_x else None
        ctx.layer._grad_sink(got.pop(0))
        return dx, None, (got.pop(0) if want_b else None), None
