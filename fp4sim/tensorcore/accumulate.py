"""The accumulator of a GEMM as a tensor core and its library compute it: the block-FMA chain of each K run
(``chain``), the runs a library walks K in (``plan``: slow-accumulation restarts, split-K layouts) and their
float32 combination, and the IEEE values of non-finite sums (``accumulate``)."""
from __future__ import annotations

import numpy as np

from ..cpu import tensorcore as _cpu
from .models import BlockFMA, TensorCoreModel, get_model

__all__ = ["EMIN", "chain", "chain_runs", "chain_exp", "plan", "accumulate", "exponents"]

EMIN = {"e4m3": -6, "e5m2": -14, "e2m3": 0, "e3m2": -2, "bf16": -126, "fp16": -14, "tf32": -126}
_CANON_NAN32 = np.uint32(0x7FFFFFFF)


def exponents(v: np.ndarray, fmt: str) -> np.ndarray:
    """int32 floor(log2|v|) clamped below at the format's smallest normal exponent; zeros get a very negative
    exponent (never a step's maximum)."""
    m, e = np.frexp(v.astype(np.float64))
    e = np.maximum(e.astype(np.int32) - 1, EMIN[fmt])
    return np.where(v != 0, e, np.int32(_cpu.ZERO_EXP)).astype(np.int32)


def _pad(idx: np.ndarray, n: int) -> np.ndarray:
    r = (-len(idx)) % n
    return np.concatenate([idx, np.full(r, -1, np.int64)]) if r else idx


def _host(a):
    return a.get() if hasattr(a, "get") else a


def chain(A, B, fmt_a: str, fmt_b: str, step: BlockFMA, idx=None, C=None, backend=None) -> np.ndarray:
    """float32 (M, N): the chain of block-FMA steps over K (or the K indices ``idx``, -1 a zero element) of A
    (M, K) and B (N, K) finite float32 values of formats fmt_a / fmt_b, from ``C`` (float32 (M, N); None: +0)."""
    A = np.ascontiguousarray(A, np.float32)
    B = np.ascontiguousarray(B, np.float32)
    if idx is None:
        idx = np.arange(A.shape[1], dtype=np.int64)
    return chain_runs(A, B, fmt_a, fmt_b, step, [idx], backend, C)[0]


def _c_emin(step: BlockFMA) -> int:
    return _cpu.ZERO_EXP if step.c_emin is None else step.c_emin


def chain_runs(A, B, fmt_a: str, fmt_b: str, step: BlockFMA, runs, backend=None, C=None) -> np.ndarray:
    """float32 (R, M, N): :func:`chain` from ``C`` (None: +0) over each of the R K-index runs (int64 arrays, -1
    a zero element), the operands' exponents found once."""
    A = np.ascontiguousarray(A, np.float32)
    B = np.ascontiguousarray(B, np.float32)
    if backend is not None:
        EA, EB = exponents(A, fmt_a), exponents(B, fmt_b)
        return np.stack([chain_exp(A, EA, B, EB, step, idx, C, backend) for idx in runs]) if runs else \
            np.zeros((0, A.shape[0], B.shape[0]), np.float32)
    return _cpu.chain_runs(A, EMIN[fmt_a], B, EMIN[fmt_b], runs, step.nfma, step.frac, step.frac_out,
                           step.min_exp, step.late, _c_emin(step), C)


def chain_exp(A, EA, B, EB, step: BlockFMA, idx=None, C=None, backend=None) -> np.ndarray:
    """:func:`chain` with the inputs' exponents given (int32, as :func:`exponents` makes them): A and B may then
    be float64 values whose exponents include a power-of-two block scale. ``backend``: a CUDA backend
    (:mod:`fp4sim.gpu.backend`) whose kernel runs the chain instead of Numba (the same bits)."""
    if idx is None:
        idx = np.arange(A.shape[1], dtype=np.int64)
    idx = _pad(np.asarray(idx, np.int64), step.nfma)
    c_emin = _c_emin(step)
    if backend is not None:
        from ..gpu import ops
        xp = backend.xp
        return _host(ops.kernels(backend).tc_chain(xp.asarray(A), xp.asarray(EA), xp.asarray(B), xp.asarray(EB),
                                                   xp.asarray(idx), step.nfma, step.frac, step.frac_out, step.min_exp,
                                                   int(step.late), c_emin, None if C is None else xp.asarray(C)))
    return _cpu.chain(A, np.ascontiguousarray(EA, np.int32), B, np.ascontiguousarray(EB, np.int32), idx,
                      step.nfma, step.frac, step.frac_out, step.min_exp, step.late, c_emin, C)


def plan(K: int, model: TensorCoreModel, *, fast: bool, split_k=1) -> tuple:
    """(splits, scheme): ``splits[s]`` is the list of the K-index runs (int64, -1 padding) split s chains, each
    from +0; the runs of a split are added in order in float32 from +0 (one run under fast accumulation), the
    splits combined by ``scheme`` ("none", "serial", "pairwise", "contiguous")."""
    if isinstance(split_k, int) and not isinstance(split_k, bool):
        S, scheme = split_k, None
    elif (isinstance(split_k, tuple) and len(split_k) == 2 and isinstance(split_k[0], int)
          and not isinstance(split_k[0], bool) and isinstance(split_k[1], str)):
        S, scheme = split_k
    else:
        raise ValueError(f"split_k={split_k!r}: use 1 (unsplit) or (S, scheme), e.g. (2, 'contiguous')")
    if S < 1:
        raise ValueError(f"split_k={split_k!r}: the number of splits must be at least 1")
    if S > 1 and scheme is None:
        hint = f" (S, scheme): ({S}, {model.split_schemes[0]!r})" if model.split_schemes else " 1"
        raise ValueError(f"split_k={split_k!r}: use 1 (unsplit) or (S, scheme) naming how the splits are "
                         f"combined; here{hint}")
    if not fast and model.slow_chunk is None:
        raise ValueError(f"use_fast_accum=False: slow accumulation is not characterised for model={model.name!r} "
                         f"({model.chip}); use use_fast_accum=True")
    if S == 1:
        ks = np.arange(K, dtype=np.int64)
        if fast:
            return [[ks]], "none"
        c = model.slow_chunk
        return [[ks[i:i + c] for i in range(0, K, c)] or [ks]], "none"
    if not model.split_schemes:
        raise ValueError(f"split_k={split_k!r}: split-K is not characterised for model={model.name!r} ({model.chip})")
    if scheme not in model.split_schemes:
        raise ValueError(f"split_k={split_k!r}: {model.name}'s library splits K as "
                         f"{' or '.join(repr(s) for s in model.split_schemes)}, not {scheme!r}")
    tile = model.split_tile
    T = -(-K // tile)
    tiles = [np.where(np.arange(t * tile, (t + 1) * tile) < K, np.arange(t * tile, (t + 1) * tile), -1)
             for t in range(T)]
    if scheme == "contiguous":                   # split s: tiles [s q, (s + 1) q), q = ceil(T / S)
        q = -(-T // S)
        own = [tiles[s * q:(s + 1) * q] for s in range(S)]
        per_run = 1 if not fast else None        # slow: every k-tile its own chain (a 128-wide tile)
    else:                                        # tile t to split t mod S; slow: a restart every 2 own tiles
        own = [tiles[s::S] for s in range(S)]
        per_run = None if fast else max(1, model.slow_chunk // tile)
    splits = []
    for ts in own:
        if not ts:
            splits.append([])
        elif per_run is None:
            splits.append([np.concatenate(ts)])
        else:
            splits.append([np.concatenate(ts[i:i + per_run]) for i in range(0, len(ts), per_run)])
    return splits, scheme


def _combine(parts, scheme):
    if len(parts) == 1:
        return parts[0]
    if scheme in ("serial", "contiguous"):
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc
    S = len(parts)                               # pairwise: h = ceil(S / 2), slots p_i + p_(i+h) where i+h < S-1
    h = -(-S // 2)
    acc = parts[S - 1]
    for i in range(h):
        acc = acc + (parts[i] + parts[i + h] if i + h < S - 1 else parts[i])
    return acc


def accumulate(A, B, fmt_a: str, fmt_b: str, model, family: str, *, fast: bool, split_k=1,
               backend=None) -> np.ndarray:
    """float32 (M, N): the accumulator of A (M, K) · B (N, K)ᵀ (float32 values of formats fmt_a / fmt_b, NaN and
    Inf allowed) before any scale, as ``model``'s tensor core and library compute it (canonical NaN 0x7FFFFFFF);
    ``backend``: a CUDA backend that runs the chains (:func:`chain_exp`)."""
    model = get_model(model)
    step = model.step(family)
    A = np.asarray(A, np.float32)
    B = np.asarray(B, np.float32)
    M, K = A.shape
    N = B.shape[0]
    splits, scheme = plan(K, model, fast=fast, split_k=split_k)
    if not (M and N):
        return np.zeros((M, N), np.float32)
    bad_a, bad_b = ~np.isfinite(A), ~np.isfinite(B)
    As = np.where(bad_a, np.float32(0), A) if bad_a.any() else A
    Bs = np.where(bad_b, np.float32(0), B) if bad_b.any() else B
    every = [idx for runs in splits for idx in runs]
    outs = iter(chain_runs(As, Bs, fmt_a, fmt_b, step, every, backend=backend))
    parts = []
    for runs in splits:
        part = np.zeros((M, N), np.float32)
        for _ in runs:
            c = next(outs)
            part = c if (fast and len(runs) == 1) else part + c
        parts.append(part)
    acc = _combine(parts, scheme)
    rows, cols = bad_a.any(1), bad_b.any(1)
    if rows.any() or cols.any():                 # the IEEE value of the sum wherever it is not finite
        acc = acc.copy()
        r, c = np.nonzero(rows)[0], np.nonzero(cols)[0]
        with np.errstate(invalid="ignore", over="ignore"):
            for i in r:
                acc[i] = _ieee_row(A[i], B)
            if len(c):
                for i in np.nonzero(~rows)[0]:
                    acc[i, c] = _ieee_row(A[i], B[c])
    nan = np.isnan(acc)
    if nan.any():
        acc = acc.copy()
        acc.view(np.uint32)[nan] = _CANON_NAN32
    return acc


def _ieee_row(a, B):
    """The float64 sums of a (K,) · B (n, K)ᵀ term by term: its non-finite entries are the IEEE class of the exact
    sum (finite products of these formats cannot overflow float64)."""
    return (B.astype(np.float64) * a.astype(np.float64)[None, :]).sum(1).astype(np.float32)
