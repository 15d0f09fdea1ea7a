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
    if got_s is not None and got_s.size != scales.size:
        R, nb = scales.shape
        if got_s.size == swizzled_size(R, nb) and np.array_equal(got_s,
                                                                  np.asarray(swizzle_scales(scales)).reshape(-1)):
            _fail(t, "the block scales are in cuBLAS's swizzled 128x4 layout, not the linear rows x blocks layout")
        else:
            _fail(t, f"weight_scale holds {got_s.size} bytes, {scales.size} expected")
        return
    if got_s is None or got_c.shape != codes.shape or (c_ok and s_ok):
        return
    _layout_fault(t, x, amax, got_c, got_s.reshape(scales.shape), codes, scales)


def _layout_fault(t, x, amax, got_c, got_s, codes, scales):
    """Codes or scale bytes of the reference's shape that differ: the layout faults fp4sim.validate names in a
    kernel's output (locate.layout_findings: swapped nibbles, scales one binade off or transposed, rows, blocks
    or columns permuted, another row stride), else another flavour's rounding order, else where they differ."""
    from ..layout import unpack_fp4
    from ..quantize import quantize
    from .locate import layout_findings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = quantize(x, "nvfp4", flavor="modelopt", global_amax=amax)
    found = layout_findings(q, got_c, got_s, "linear", unpack_fp4(codes), unpack_fp4(got_c), scales, got_s)
    for f in found:
        _fail(t, f)
    if found:
        return
    for other in ("te", "torchao"):
        oc, os_ = _flavour_bytes(x, other, amax)
        if np.array_equal(os_, got_s) and np.array_equal(oc, got_c):
            _fail(t, f"the codes and scales are those of the {other} flavour's rounding order, not ModelOpt's "
                     f"(they differ where a block scale falls on an E4M3 rounding boundary: "
                     f"{int((os_ != scales).sum())} blocks here)")
            return
    bad = np.argwhere((got_s != scales) | (unpack_fp4(got_c) != unpack_fp4(codes)).reshape(*scales.shape, 16)
                      .any(-1))
    _fail(t, f"{len(bad)} of {scales.size} blocks differ from the reference quantized with ModelOpt's rule (first "
             f"at row {int(bad[0][0])}, block {int(bad[0][1])})")
