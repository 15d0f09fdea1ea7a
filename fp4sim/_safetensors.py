"""Reading one entry of a ``.safetensors`` file as a NumPy array, with the 8-bit float and bfloat16 entries as their
ml_dtypes types (the safetensors package's NumPy reader fails on a whole file once it holds an F8 entry, since
NumPy has no float8 types).

The format: an 8-byte little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data, each entry C-ordered and little-endian at
its offsets from the end of the header.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["safetensors_keys", "safetensors_entries", "load_safetensors"]

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
          "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


def _header(path):
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"is truncated or not a safetensors file (a header of {n} bytes in a file of {size})")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("is not a safetensors file (its header is not JSON)") from None
    if not isinstance(meta, dict):
        raise ValueError("is not a safetensors file (its header is not a JSON object)")
    meta.pop("__metadata__", None)
    return meta, 8 + n, size


def safetensors_entries(path) -> dict:
    """{entry name: {"dtype", "shape", "data_offsets"}} from the file's header, in the file's order (no data read)."""
    return _header(path)[0]


def safetensors_keys(path) -> list[str]:
    """The entry names, in the file's order."""
    return list(_header(path)[0])


def load_safetensors(path, key: str) -> np.ndarray:
    """Entry ``key`` as a NumPy array (bfloat16 and float8 as ml_dtypes types); ValueError saying what is wrong
    for an unknown entry or dtype, or offsets that do not fit the file."""
    meta, start, size = _header(path)
    if key not in meta:
        raise KeyError(key)
    e = meta[key]
    dt = DTYPES.get(e.get("dtype"))
    if dt is None:
        raise ValueError(f"entry {key!r} has the safetensors dtype {e.get('dtype')!r}, which fp4sim does not read "
                         f"(it reads {', '.join(DTYPES)})")
    dt = np.dtype(dt)
    if dt.itemsize > 1 and sys.byteorder != "little":
        raise ValueError("reading .safetensors needs a little-endian machine")
    shape = tuple(int(d) for d in e["shape"])
    lo, hi = (int(v) for v in e["data_offsets"])
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if hi - lo != n or lo < 0 or start + hi > size:
        raise ValueError(f"entry {key!r} is truncated or corrupt (offsets {lo}..{hi} for {n} bytes of {shape} "
                         f"{e['dtype']}, {size - start} data bytes in the file)")
    with open(path, "rb") as f:
        f.seek(start + lo)
        buf = f.read(n)
    return np.frombuffer(buf, dtype=dt).reshape(shape).copy()
