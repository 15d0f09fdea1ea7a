"""Philox4x32-10 in plain Python integers (Salmon et al. 2011), and SPEC §1.3's element -> byte mapping."""
from __future__ import annotations

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF


def philox_ref(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
    return c0, c1, c2, c3


def philox_bytes_ref(seed: int, indices, stream: int = 0) -> list[int]:
    """Random byte of each element index: byte i%4 of word j=i//4, lane j%4 of Philox(counter (j//4, stream))."""
    key = (seed & MASK, seed >> 32)
    out = []
    for i in indices:
        j = i // 4
        b = j // 4
        word = philox_ref((b & MASK, b >> 32, stream, 0), key)[j % 4]
        out.append((word >> (8 * (i % 4))) & 0xFF)
    return out
