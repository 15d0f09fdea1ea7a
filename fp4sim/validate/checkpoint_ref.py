"""A checkpoint's quantized weight against the high-precision weight it was made from, byte for byte, with the
known export faults named (see :mod:`fp4sim.validate.checkpoint`)."""
from __future__ import annotations

import warnings

import numpy as np

from ..layout import swizzle_scales, swizzled_size

C2688 = np.float32(2688.0)


def _fail(t: dict, msg: str):
    t["faults"].append(msg)
    t["ok"] = False


def _flavour_bytes(x, flavor, amax):
    from ..quantize import quantize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = quantize(x, "nvfp4", flavor=flavor, global_amax=amax)
    return np.asarray(q.codes), np.asarray(q.scales)


def compare_to_reference(w, fmt: str, refs: dict, t: dict):
    """Fill ``t`` (a tensor entry of the report) with the comparison of ``w`` against its reference weight."""
    from ..analyze.inputs import TensorError, load
    src = refs.get(f"{w.name}.weight") or refs.get(w.name)
    if src is None:
        t["notes"].append(f"no reference tensor {w.name}.weight: not compared")
        return
    try:
        x = load(src)
    except TensorError as e:
        t["notes"].append(f"the reference {src.name} {e}: not compared")
        return
    if x.shape != tuple(w.shape):
        _fail(t, f"the reference {src.name} has shape {x.shape}; the checkpoint's codes hold {tuple(w.shape)}")
        return
    if fmt != "modelopt":
        t["notes"].append("compressed-tensors: not compared byte for byte (fp4sim does not emulate compressed-"
                          "tensors' own operation order yet); checked for consistency only")
        return
    amax = np.float32(np.nanmax(np.abs(x)))
    codes, scales = _flavour_bytes(x, "modelopt", amax)
    want_ts = np.float32(amax / C2688)
    got_c = np.asarray(w.codes)
    got_s = w.scales
    got_s = None if got_s is None else np.asarray(got_s).reshape(-1)
    c_ok = got_c.shape == codes.shape and np.array_equal(got_c, codes)
    s_ok = got_s is not None and got_s.size == scales.size and np.array_equal(got_s, scales.reshape(-1))
    ts_ok = w.tensor_scale is not None and np.float32(w.tensor_scale) == want_ts
    t["exact"] = bool(c_ok and s_ok and ts_ok)
    if t["exact"]:
        return
    if not ts_ok and w.tensor_scale is not None:
        inv = np.float32(C2688 / amax)
        if np.float32(w.tensor_scale) == inv:
            _fail(t, f"weight_scale_2 is {float(w.tensor_scale)!r} = 2688 / amax, the inverse of ModelOpt's amax / "
                     f"2688 = {float(want_ts)!r}: the global scale was not inverted (compressed-tensors' "
                     "direction written into a ModelOpt checkpoint)")
        else:
            _fail(t, f"weight_scale_2 is {float(w.tensor_scale)!r}; amax / 2688 of the reference is "
                     f"{float(want_ts)!r}")
    if not c_ok and got_c.shape == codes.shape:
        swapped = ((got_c >> 4) | (got_c << 4)).astype(np.uint8)
        if np.array_equal(swapped, codes):
            _fail(t, "the two codes of every byte are swapped: element 2i is in the high nibble (fp4sim, ModelOpt "
                     "and compressed-tensors put it in the low one)")
        elif s_ok:
            n = int((got_c != codes).sum())
            _fail(t, f"{n} of {codes.size} code bytes differ from the reference quantized with ModelOpt's rule "
                     f"(first at row {int(np.argwhere(got_c != codes)[0][0])})")
    if got_s is not None and not s_ok:
        _scales_fault(t, got_s, scales, x, amax, got_c, codes)


def _scales_fault(t, got_s, scales, x, amax, got_c, codes):
    R, nb = scales.shape
    if got_s.size == swizzled_size(R, nb) and np.array_equal(got_s, np.asarray(swizzle_scales(scales)).reshape(-1)):
        _fail(t, "the block scales are in cuBLAS's swizzled 128x4 layout, not the linear rows x blocks layout")
        return
    if got_s.size != scales.size:
        _fail(t, f"weight_scale holds {got_s.size} bytes, {scales.size} expected")
        return
    if R > 1 and nb > 1 and np.array_equal(got_s, np.ascontiguousarray(scales.T).reshape(-1)):
        _fail(t, f"the block scales are the transposed matrix ({nb} blocks x {R} rows, row-major)")
        return
    g = got_s.reshape(R, nb).astype(np.int16)
    e = scales.astype(np.int16)
    d = g - e
    if np.all((d == 0) | (np.abs(d) == 8)):
        k = int((d != 0).sum())
        _fail(t, f"{k} block-scale bytes are one binade off (the E4M3 exponent field +-1: those scales doubled or "
                 "halved)")
        return
    for other in ("te", "torchao"):
        oc, os_ = _flavour_bytes(x, other, amax)
        if np.array_equal(os_.reshape(-1), got_s) and np.array_equal(oc, got_c):
            _fail(t, f"the codes and scales are those of the {other} flavour's rounding order, not ModelOpt's "
                     f"(they differ where a block scale falls on an E4M3 rounding boundary: "
                     f"{int((os_ != scales).sum())} blocks here)")
            return
    bad = np.argwhere(d != 0)
    _fail(t, f"{len(bad)} of {scales.size} block-scale bytes differ from the reference quantized with ModelOpt's "
             f"rule (first at row {int(bad[0][0])}, block {int(bad[0][1])})")
