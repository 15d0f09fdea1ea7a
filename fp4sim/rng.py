"""Philox4x32-10 counter-based random bits, shared by every backend (SPEC §1.3).

One call maps a 128-bit counter and a 64-bit key to four 32-bit words. fp4sim draws stochastic-rounding bits
so that element ``i`` (flattened C-order index of the input in its original shape) takes byte ``i % 4`` of
word ``j = i // 4``; word ``j`` is lane ``j % 4`` of ``philox(counter=(b_lo, b_hi, stream, 0), key)`` with
``b = j // 4`` and ``key = (seed & 0xFFFFFFFF, seed >> 32)``. Every block of 16 consecutive elements thus
shares one Philox call, and the bits of an element do not depend on the tensor's shape.
"""
from __future__ import annotations

import sys

import numba as nb
import numpy as np

__all__ = ["philox4x32_10", "philox_bytes", "seed_key", "PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1"]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_LITTLE = sys.byteorder == "little"


@nb.njit(inline="always", cache=True)
def philox_block(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64-held 32-bit lanes; returns the four output words (as uint64 < 2**32)."""
    m = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        hi0 = p0 >> np.uint64(32)
        lo0 = p0 & m
        hi1 = p1 >> np.uint64(32)
        lo1 = p1 & m
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = (k0 + np.uint64(0x9E3779B9)) & m
        k1 = (k1 + np.uint64(0xBB67AE85)) & m
    return c0, c1, c2, c3


@nb.njit(cache=True)
def _philox_many(counters, key, out):
    for i in range(counters.shape[0]):
        r = philox_block(np.uint64(counters[i, 0]), np.uint64(counters[i, 1]), np.uint64(counters[i, 2]),
                         np.uint64(counters[i, 3]), np.uint64(key[0]), np.uint64(key[1]))
        for lane in range(4):
            out[i, lane] = np.uint32(r[lane])


def seed_key(seed: int) -> tuple[int, int]:
    """Split a 64-bit seed into the Philox key ``(seed & 0xFFFFFFFF, seed >> 32)``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int in [0, 2**64), not {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed={seed} is outside [0, 2**64); pass a non-negative 64-bit integer")
    return seed & _MASK32, seed >> 32


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 of one or many counters.

    ``counter``: 4 uint32 words, or an (N, 4) array; ``key``: 2 uint32 words. Returns uint32 of the same
    leading shape with 4 output words each.
    """
    c = np.asarray(counter, dtype=np.uint64)
    single = c.ndim == 1
    c2 = np.ascontiguousarray(c.reshape(-1, 4))
    if (c2 > _MASK32).any():
        raise ValueError("counter words must fit in 32 bits")
    k = np.asarray(key, dtype=np.uint64).reshape(2)
    if (k > _MASK32).any():
        raise ValueError("key words must fit in 32 bits")
    out = np.empty((c2.shape[0], 4), dtype=np.uint32)
    _philox_many(c2, k, out)
    return out[0] if single else out


@nb.njit(inline="always", cache=True)
def _philox_at(b, k0, k1, stream):
    """The Philox output of 16-element block ``b`` (counter (b_lo, b_hi, stream, 0))."""
    return philox_block(np.uint64(b) & np.uint64(0xFFFFFFFF), np.uint64(b) >> np.uint64(32), np.uint64(stream),
                        np.uint64(0), k0, k1)


@nb.njit(inline="always", cache=True)
def philox_block_for(i, k0, k1, stream):
    """The Philox output covering elements ``16*(i//16) ... 16*(i//16)+15`` (lane ``(i//4)%4``, byte ``i%4``)."""
    return _philox_at(np.uint64(i) >> np.uint64(4), k0, k1, stream)


@nb.njit(inline="always", cache=True)
def byte_of(r, i):
    """Element ``i``'s random byte from the Philox output ``r`` of its 16-element block."""
    lane = (i >> 2) & 3
    w = r[0]
    if lane == 1:
        w = r[1]
    elif lane == 2:
        w = r[2]
    elif lane == 3:
        w = r[3]
    return np.uint8((w >> np.uint64(8 * (i & 3))) & np.uint64(0xFF))


@nb.njit(inline="always", cache=True)
def philox_words(w, b0, bstep, nblk, k0, k1, stream):
    """``w[4i .. 4i+3]`` = the Philox output of block ``b0 + i * bstep`` (counter (b_lo, b_hi, stream, 0)), for
    i < nblk: :func:`philox_block` written as one loop over blocks that the compiler vectorises (4x faster)."""
    m = np.uint64(0xFFFFFFFF)
    for i in range(nblk):
        b = np.uint64(b0 + i * bstep)
        c0 = b & m
        c1 = b >> np.uint64(32)
        c2 = stream
        c3 = np.uint64(0)
        a0 = k0
        a1 = k1
        for _ in range(10):
            p0 = np.uint64(0xD2511F53) * c0
            p1 = np.uint64(0xCD9E8D57) * c2
            n0 = (p1 >> np.uint64(32)) ^ c1 ^ a0
            n2 = (p0 >> np.uint64(32)) ^ c3 ^ a1
            c1 = p1 & m
            c3 = p0 & m
            c0 = n0
            c2 = n2
            a0 = (a0 + np.uint64(0x9E3779B9)) & m
            a1 = (a1 + np.uint64(0xBB67AE85)) & m
        w[4 * i] = np.uint32(c0)
        w[4 * i + 1] = np.uint32(c1)
        w[4 * i + 2] = np.uint32(c2)
        w[4 * i + 3] = np.uint32(c3)


@nb.njit(cache=True)
def philox_bytes_row(out, base, n, k0, k1, stream, mask):
    """``out[t] = mask & (the random byte of flat element index base + t)`` for ``t < n``, one Philox call per
    16-element block the range touches (the kernels' rows, generated in place of a tensor-sized byte array).
    The whole blocks inside the range are generated together (:func:`philox_words`); a partial block at either
    end element by element."""
    b_first = (base + 15) >> 4                 # the whole blocks: b_first .. b_end - 1
    b_end = (base + n) >> 4
    if b_end > b_first:
        nblk = b_end - b_first
        i0 = b_first * 16 - base
        if _LITTLE and i0 % 4 == 0:            # byte t of a word is its t-th byte in memory: write the words
            philox_words(out[i0:i0 + 16 * nblk].view(np.uint32), b_first, 1, nblk, k0, k1, stream)
            if mask != np.uint8(0xFF):
                for t in range(i0, i0 + 16 * nblk):
                    out[t] &= mask
        else:
            w = np.empty(4 * nblk, np.uint32)
            philox_words(w, b_first, 1, nblk, k0, k1, stream)
            for q in range(4 * nblk):
                wq = w[q]
                for t in range(4):
                    out[i0 + 4 * q + t] = np.uint8((wq >> np.uint32(8 * t)) & np.uint32(0xFF)) & mask
    if n <= 0:
        return
    first = base >> 4                          # the blocks at either end (one if the range lies in one block)
    last = (base + n - 1) >> 4
    for b in range(first, last + 1, max(last - first, 1)):
        i0 = b * 16 - base
        if i0 < 0 or i0 + 16 > n:              # partial: element by element
            r = _philox_at(b, k0, k1, stream)
            for t in range(16):
                if 0 <= i0 + t < n:
                    out[i0 + t] = byte_of(r, t) & mask


@nb.njit(cache=True)
def philox_bytes_cols(out, base, stride, n, k0, k1, stream, mask):
    """``out[t, k] = mask & (the random byte of flat index base + k * stride + t)`` for t < 16, k < n: 16 rows of
    a block axis with stride ``stride`` (``base`` and ``stride`` multiples of 16, so each k is one Philox call)."""
    w = np.empty(4 * n, np.uint32)
    philox_words(w, base >> 4, stride >> 4, n, k0, k1, stream)
    if _LITTLE:                                # word j's byte t is byte 4j + t in memory: a (n, 16) transpose
        wb = w.view(np.uint8)
        for t in range(16):
            for k in range(n):
                out[t, k] = wb[16 * k + t] & mask
    else:
        for k in range(n):
            for lane in range(4):
                wq = w[4 * k + lane]
                for t in range(4):
                    out[4 * lane + t, k] = np.uint8((wq >> np.uint32(8 * t)) & np.uint32(0xFF)) & mask


@nb.njit(parallel=True, cache=True)
def _philox_bytes_kernel(start, n, k0, k1, stream, out):
    nblk = (n + 15) // 16
    for blk in nb.prange(nblk):
        lo = blk * 16
        hi = min(lo + 16, n)
        r = philox_block_for(start + lo, k0, k1, stream)
        if hi - lo == 16:  # start is a multiple of 16: lane l holds elements 4l..4l+3, byte k of each word
            for lane in range(4):
                w = r[lane]
                for k in range(4):
                    out[lo + 4 * lane + k] = np.uint8((w >> np.uint64(8 * k)) & np.uint64(0xFF))
        else:
            for t in range(lo, hi):
                out[t] = byte_of(r, start + t)


def philox_bytes(seed: int, n: int, stream: int = 0, start: int = 0) -> np.ndarray:
    """The stochastic-rounding random bytes of elements ``start .. start+n-1`` for ``seed`` and ``stream``.

    ``start`` must be a multiple of 16 (one Philox call covers 16 elements).
    """
    k0, k1 = seed_key(seed)
    if not 0 <= int(stream) <= _MASK32:
        raise ValueError(f"stream={stream} must be in [0, 2**32)")
    if start % 16:
        raise ValueError("start must be a multiple of 16")
    out = np.empty(int(n), dtype=np.uint8)
    if n:
        _philox_bytes_kernel(int(start), int(n), np.uint64(k0), np.uint64(k1), np.uint64(stream), out)
    return out
