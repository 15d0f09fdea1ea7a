"""NaN and Inf in a QuantLinear's operands: a warning (once per layer and operand) or an error, as the recipe's
``on_nonfinite`` says; on a CUDA device the test is deferred so that no call waits for the device
(:func:`flush_warnings` waits for the rest, and runs at exit)."""
from __future__ import annotations

import atexit
import sys
import warnings
import weakref

import torch

__all__ = ["flush_warnings"]

# elements without NaN (E2M1, FP6, INT8): a NaN encodes as +max and does not propagate
_FP4 = ("nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxint8")
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
    warnings.warn(f"layer {layer_name!r}: {_WHAT[which]} (operands {', '.join(fp4)}) holds NaN; E2M1 (and FP6, "
                  "INT8) encode NaN as +max (CUDA's satfinite rule), so it does not reach the GEMM's output and training goes "
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
