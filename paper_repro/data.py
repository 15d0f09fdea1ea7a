"""The training text and its tokenizer.

Tokenizer: characters. The vocabulary is fixed — newline and the 95 printable ASCII characters, 96 tokens —
because the shipped text is normalised to exactly that set (``build_data.normalise``). Characters rather than a
byte-level BPE because the token budgets that fit two CPU cores (a few million tokens per run) train a
character model well into its learning curve, while a BPE vocabulary of a few thousand entries would put most
of a tiny model's parameters into its embedding and head (which the paper's recipe keeps in BF16 anyway), and
would leave the quantized transformer blocks a smaller share of the computation being compared.

Split: the text is cut into 4096-character chunks; every 50th chunk (2%) is validation, the rest training,
so both halves span the whole corpus (all eras of the addresses and the novel).
"""
from __future__ import annotations

import functools
import lzma
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).parent / "data" / "corpus.txt.xz"
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
CHUNK, VAL_EVERY = 4096, 50


def encode(text: str) -> np.ndarray:
    """Token ids (uint8) of text made of VOCAB's characters; any other character is an error."""
    b = np.frombuffer(text.encode("ascii", errors="strict"), np.uint8)
    ids = np.where(b == 10, 0, b.astype(np.int16) - 31)
    if (b != 10).any() and ((b[b != 10] < 32) | (b[b != 10] > 126)).any():
        raise ValueError("text holds characters outside the 96-character vocabulary")
    return ids.astype(np.uint8)


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


@functools.lru_cache(maxsize=2)
def splits(path: str = str(CORPUS)) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token arrays of the shipped corpus."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: rebuild it with python -m paper_repro.build_data")
    ids = encode(lzma.open(p).read().decode("ascii"))
    n = len(ids) // CHUNK
    chunks = ids[: n * CHUNK].reshape(n, CHUNK)
    is_val = np.arange(n) % VAL_EVERY == VAL_EVERY - 1
    return np.ascontiguousarray(chunks[~is_val].reshape(-1)), np.ascontiguousarray(chunks[is_val].reshape(-1))


def train_batch(train: np.ndarray, seed: int, step: int, batch: int, ctx: int) -> np.ndarray:
    """The (batch, ctx + 1) windows of training step ``step``: positions drawn from a generator keyed by (seed,
    step) alone, so the data order is fixed per seed and a resumed run sees exactly the batches it would have."""
    rng = np.random.default_rng([int(seed), int(step), 0x5EED])
    starts = rng.integers(0, len(train) - ctx - 1, size=batch)
    return np.stack([train[s:s + ctx + 1] for s in starts]).astype(np.int64)


def val_windows(val: np.ndarray, n: int, ctx: int) -> np.ndarray:
    """``n`` fixed (n, ctx + 1) validation windows, evenly spaced over the validation text (the same for every
    run, so runs are compared on identical tokens)."""
    starts = np.linspace(0, len(val) - ctx - 2, n).astype(np.int64)
    return np.stack([val[s:s + ctx + 1] for s in starts]).astype(np.int64)
