"""``scaled_mm``: ``torch._scaled_mm`` with per-tensor scales as a tensor core computes it."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .accumulate import accumulate
from .models import MODELS, get_model

__all__ = ["scaled_mm", "operand_family", "FP8_OPERANDS", "FP6_OPERANDS", "FNUZ_OPERANDS", "OUT_DTYPES", "fp8_operand", "per_tensor_scale", "out_dtype_name",
           "epilogue"]

# what scaled_mm and fp4sim.validate's compare_scaled_mm share: the FP8 operand dtypes (name -> (format, ml_dtypes
# dtype, largest finite value)), the output dtypes (name -> NumPy / ml_dtypes dtype) and the readers below
FP8_OPERANDS = {"float8_e4m3fn": ("e4m3", ml_dtypes.float8_e4m3fn, 448.0),
        "float8_e5m2": ("e5m2", ml_dtypes.float8_e5m2, 57344.0)}
# OCP FP6 (ml_dtypes arrays; torch has no FP6 dtype), Blackwell's kind::f8f6f4 operands: model="b200" or "exact"
FP6_OPERANDS = {"float6_e2m3fn": ("e2m3", ml_dtypes.float6_e2m3fn, 7.5),
                "float6_e3m2fn": ("e3m2", ml_dtypes.float6_e3m2fn, 28.0)}
FP6_MODELS = ("b200", "exact")
# AMD's CDNA3 FP8 (torch.float8_e4m3fnuz / float8_e5m2fnuz on ROCm), for model="cdna3"
FNUZ_OPERANDS = {"float8_e4m3fnuz": ("e4m3fnuz", ml_dtypes.float8_e4m3fnuz, 240.0),
                 "float8_e5m2fnuz": ("e5m2fnuz", ml_dtypes.float8_e5m2fnuz, 57344.0)}
_OUT = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
OUT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
           "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
_CANON_NAN = {"float32": (np.uint32, 0x7FFFFFFF), "bfloat16": (np.uint16, 0x7FFF), "float16": (np.uint16, 0x7FFF),
              "float8_e4m3fn": (np.uint8, 0x7F), "float8_e5m2": (np.uint8, 0x7F)}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _dtype_name(dt) -> str:
    s = str(dt).replace("torch.", "")
    return {"float": "float32", "half": "float16", "<class 'numpy.float32'>": "float32"}.get(s, s)


def operand_family(x) -> str:
    """"fnuz", "fp6" or "ocp" (anything else) from an operand's dtype."""
    n = _dtype_name(x.dtype) if (_is_torch(x) or hasattr(x, "dtype")) else ""
    return "fnuz" if n in FNUZ_OPERANDS else "fp6" if n in FP6_OPERANDS else "ocp"


def fp8_operand(x, name: str, fnuz: bool = False, fp6: bool = False):
    """(float32 values, FP8 format, dtype name, is_torch) of an FP8 matrix (torch tensor or ml_dtypes array):
    OCP's E4M3 / E5M2, or with ``fnuz`` AMD's E4M3FNUZ / E5M2FNUZ; ``fp6`` also takes OCP FP6 (ml_dtypes)."""
    table = FNUZ_OPERANDS if fnuz else ({**FP8_OPERANDS, **FP6_OPERANDS} if fp6 else FP8_OPERANDS)
    want = ("float8_e4m3fnuz or float8_e5m2fnuz (model='cdna3' is AMD's MI300)" if fnuz
            else "float8_e4m3fn or float8_e5m2")
    other = FP8_OPERANDS if fnuz else FNUZ_OPERANDS
    if _is_torch(x):
        n = _dtype_name(x.dtype)
        if n not in table:
            hint = ("; FNUZ FP8 runs on AMD's matrix cores: model='cdna3'" if n in FNUZ_OPERANDS else
                    "; OCP FP8 runs on NVIDIA's models: model='hopper', 'ada' or 'b200_mma'" if n in other else
                    "; quantize it first")
            raise TypeError(f"{name} is a {n} tensor: scaled_mm takes FP8 operands ({want}), as torch._scaled_mm "
                            f"does{hint}")
        import torch
        codes = x.detach().cpu().contiguous().view(torch.uint8).numpy()
        vals = codes.view(table[n][1]).astype(np.float32)
        return vals, table[n][0], n, True
    a = np.asarray(x)
    n = _dtype_name(a.dtype)
    if n not in table:
        hint = ("; FNUZ FP8 runs on AMD's matrix cores: model='cdna3'" if n in FNUZ_OPERANDS else
                "; OCP FP8 runs on NVIDIA's models" if n in other else
                f"; FP6 runs on Blackwell's kind::f8f6f4: model={' or '.join(map(repr, FP6_MODELS))}"
                if n in FP6_OPERANDS else "")
        raise TypeError(f"{name} has dtype {a.dtype}: scaled_mm takes FP8 operands (ml_dtypes {want} arrays, or "
                        f"torch float8 tensors){hint}")
    return a.astype(np.float32), table[n][0], n, False


def per_tensor_scale(s, name: str, finite: bool = False) -> np.float32:
    """A per-tensor scale (a one-element float32 tensor or array, a float32 scalar, or a float that is a float32
    value) as np.float32; ValueError naming ``name`` otherwise. ``finite``: refuse NaN and Inf as well (a check of
    a kernel's output, where a NaN scale makes every model's output NaN)."""
    v = _per_tensor_scale(s, name)
    if finite and not np.isfinite(v):
        raise ValueError(f"{name} is {float(v)!r}: give the finite scale the kernel was called with")
    return v


def _per_tensor_scale(s, name) -> np.float32:
    if _is_torch(s):
        if _dtype_name(s.dtype) != "float32" or s.numel() != 1:
            raise ValueError(f"{name} must be a one-element float32 tensor (a per-tensor scale), got "
                             f"{_dtype_name(s.dtype)} of shape {tuple(s.shape)}; row-wise and block scales are "
                             f"not modelled here")
        return np.float32(s.detach().cpu().reshape(()).item())
    if isinstance(s, float) and not isinstance(s, bool):
        if float(np.float32(s)) != s and not np.isnan(s):
            raise ValueError(f"{name}={s!r} is not a float32 value: pass np.float32({s!r}) if its rounding is meant")
        return np.float32(s)
    a = np.asarray(s)
    if a.dtype != np.float32 or a.size != 1:
        raise ValueError(f"{name} must be a one-element float32 array or scalar (a per-tensor scale), got "
                         f"{a.dtype} of shape {a.shape}; row-wise and block scales are not modelled here")
    return np.float32(a.reshape(()))


def out_dtype_name(out_dtype, default: str) -> str:
    """The output dtype's name from a torch dtype, a NumPy / ml_dtypes dtype or a name (None: ``default``)."""
    if out_dtype is None:
        return default
    if isinstance(out_dtype, str) or _is_torch(out_dtype):
        n = _dtype_name(out_dtype)
    else:
        try:
            n = np.dtype(out_dtype).name
        except TypeError:
            n = repr(out_dtype)
    if n not in _OUT:
        raise ValueError(f"out_dtype={out_dtype!r}: use one of {', '.join(_OUT)} (torch or NumPy / ml_dtypes "
                         f"dtypes, or their names)")
    return n


def epilogue(acc: np.ndarray, scale_a, scale_b, out: str, scale_result=None) -> np.ndarray:
    """cuBLAS's epilogue of a per-tensor FP8 GEMM (mmaemu's measured rules): alpha = RN32(scale_a · scale_b),
    y = RN32(acc · alpha + (+0)) (an exact zero product is +0), then RNE to ``out``; FP8 outputs are multiplied by
    ``scale_result`` (RN32) first and saturated to the format's largest finite value; NaN is canonical."""
    alpha = np.float64(np.float32(np.float64(scale_a) * np.float64(scale_b)))
    with np.errstate(invalid="ignore", over="ignore"):
        y = (acc.astype(np.float64) * alpha + 0.0).astype(np.float32)
        if out in FP8_OPERANDS:
            if scale_result is not None:
                y = (y.astype(np.float64) * np.float64(scale_result)).astype(np.float32)
            mx = np.float32(FP8_OPERANDS[out][2])
            y = np.where(np.isnan(y), y, np.clip(y, -mx, mx))
        r = y.astype(OUT_DTYPES[out])
    nan = np.isnan(y)
    if nan.any():
        ut, bits = _CANON_NAN[out]
        r = r.copy()
        r.view(ut)[nan] = ut(bits)
    return r


def scaled_mm(a, b, scale_a, scale_b, *, out_dtype=None, use_fast_accum: bool = False, model: str = "hopper",
              split_k=1, scale_result=None):
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=..., use_fast_accum=...)`` with per-tensor scales, as
    ``model``'s tensor core and library compute it, bit for bit.

    a: (M, K) FP8 (E4M3 or E5M2), b: (K, N) FP8 — typically ``w.t()`` of a (N, K) weight —, not both E5M2; K and N
    multiples of 16 (torch's shape rules). scale_a, scale_b: one-element float32 tensors / arrays (the decode
    scales: y = a·b · scale_a · scale_b). Torch tensors in give a torch tensor out; NumPy (ml_dtypes) arrays give
    an array. out_dtype: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 (default: a's dtype, as torch);
    FP8 outputs saturate, after multiplication by ``scale_result`` if given.

    model: ``"hopper"`` (H100 / H200, cuBLAS's FP8 GEMMs), ``"ada"`` (sm_89), ``"b200"`` (B200's tcgen05
    ``kind::f8f6f4``, MMA-Sim's model: one chain over K, so use_fast_accum=True; the only NVIDIA model, with ``"exact"``, that takes OCP FP6
    operands, given as ml_dtypes float6_e2m3fn / float6_e3m2fn arrays in any mix with FP8), ``"b200_mma"`` (B200
    mma.sync; fast accumulation only), ``"cdna3"`` (AMD MI300's MFMA model, :mod:`fp4sim.tensorcore.cdna`, on float8_e4m3fnuz /
    float8_e5m2fnuz operands in any mix: one chain of instructions over K from +0, then this epilogue; hipBLASLt's
    own K walk and split-K are not characterised, and FP8 outputs are not modelled) or ``"exact"`` (fp4sim's exact rule: each 128-element block's exact inner product rounded to
    float32, the blocks added in float32, the scales applied once). use_fast_accum=False restarts the chain every
    128 K elements and adds the restarts in float32 (cuBLAS's slow accumulation). split_k: 1, or (S, scheme) with a
    scheme the model's library uses ("contiguous" on hopper, "serial" / "pairwise" on ada); which split cuBLAS
    picks for a shape is its heuristic and is not modelled. See docs/validation.md for the evidence behind each
    model."""
    cdna3 = model == "cdna3"
    fnuz = cdna3 or (model == "exact" and operand_family(a) == "fnuz")     # the exact rule takes any operands
    A, fa, na, ta = fp8_operand(a, "a", fnuz=fnuz, fp6=model in FP6_MODELS)
    Bk, fb, nb_, tb = fp8_operand(b, "b", fnuz=fnuz, fp6=model in FP6_MODELS)
    if ta != tb:
        raise TypeError("a and b must both be torch tensors or both NumPy arrays")
    if A.ndim != 2 or Bk.ndim != 2:
        raise ValueError(f"a and b must be matrices, got shapes {A.shape} and {Bk.shape}")
    M, K = A.shape
    if Bk.shape[0] != K:
        raise ValueError(f"a ({M}x{K}) and b ({Bk.shape[0]}x{Bk.shape[1]}) cannot be multiplied: b is (K, N), "
                         f"typically w.t()")
    N = Bk.shape[1]
    if K % 16 or N % 16:
        raise ValueError(f"K = {K} and N = {N} must be multiples of 16 (torch._scaled_mm's rule); pad them")
    if fa == "e5m2" and fb == "e5m2":
        raise ValueError("a and b are both float8_e5m2: torch._scaled_mm refuses E5M2 x E5M2; use E4M3 for one")
    sa, sb = per_tensor_scale(scale_a, "scale_a"), per_tensor_scale(scale_b, "scale_b")
    if fnuz and (out_dtype is None or out_dtype_name(out_dtype, na) in FP8_OPERANDS):
        raise ValueError("FNUZ operands: pass out_dtype float32, bfloat16 or float16 (an FP8 output of hipBLASLt's "
                         "epilogue is not modelled)")
    if out_dtype is None and na in FP6_OPERANDS:
        raise ValueError("a is FP6: pass out_dtype (float32, bfloat16, float16 or an FP8 dtype); there is no FP6 "
                         "output")
    out = out_dtype_name(out_dtype, na)
    if fa == fb == "e4m3" and out == "float8_e5m2":
        raise ValueError("out_dtype=float8_e5m2 with two E4M3 operands: cuBLASLt refuses this combination "
                         "(CUBLAS_STATUS_NOT_SUPPORTED), so no tensor core computes it")
    if scale_result is not None:
        scale_result = per_tensor_scale(scale_result, "scale_result")
    if not isinstance(use_fast_accum, (bool, np.bool_)):
        raise TypeError(f"use_fast_accum={use_fast_accum!r}: pass True or False")
    Bt = np.ascontiguousarray(Bk.T)
    if cdna3:
        if split_k != 1 or use_fast_accum:
            raise ValueError("model='cdna3' is one MFMA chain over K: split_k=1 and use_fast_accum=False")
        from .cdna import mfma
        acc = mfma(A, Bt, fa, fb)
    elif model == "exact":
        if split_k != 1:
            raise ValueError(f"split_k={split_k!r}: the exact rule has no split")
        acc = _exact(A, Bt)
    else:
        if get_model(model).steps.get("fp8") is None:
            raise ValueError(f"model={model!r} has no FP8 inner-product model: use one of "
                             f"{', '.join(repr(m) for m, v in MODELS.items() if 'fp8' in v.steps)} or 'exact'")
        acc = accumulate(A, Bt, fa, fb, model, "fp8", fast=bool(use_fast_accum), split_k=split_k)
    r = epilogue(acc, sa, sb, out, scale_result)
    if not ta:
        return r
    import torch
    ut = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[r.dtype.itemsize]
    raw = torch.from_numpy(r.view({1: np.uint8, 2: np.int16, 4: np.int32}[r.dtype.itemsize]).copy())
    return raw.view(ut).view(getattr(torch, out)).to(a.device)          # where torch would return it


def _exact(A, Bt):
    """fp4sim's exact FP8 rule: each 128-element block's inner product in float64 (exact for FP8 products) rounded
    once to float32, the blocks added in float32 in K order."""
    M, K = A.shape
    acc = np.zeros((M, Bt.shape[0]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for k0 in range(0, K, 128):
            acc = acc + (A[:, k0:k0 + 128].astype(np.float64) @ Bt[:, k0:k0 + 128].T.astype(np.float64)
                         ).astype(np.float32)
    nan = np.isnan(acc)
    acc.view(np.uint32)[nan] = np.uint32(0x7FFFFFFF)
    return acc
