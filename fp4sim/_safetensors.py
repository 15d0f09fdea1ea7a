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

__all__ = ["safetensors_keys", "safetensors_entries", "load_safetensors", "load_safetensors_rows",
           "safetensors_entry"]

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


def _entry(path, key: str):
    """(dtype, shape, absolute offset of the entry's data) of entry ``key``, its header checked against the file."""
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
    return dt, shape, start + lo


def safetensors_entry(path, key: str) -> tuple:
    """(NumPy dtype, shape) of entry ``key`` from the header (no data read); KeyError or ValueError as
    :func:`load_safetensors`."""
    return _entry(path, key)[:2]


def _read_into(path, offset: int, out: np.ndarray) -> np.ndarray:
    """``out`` filled with the file's bytes from ``offset`` (read straight into it: no second copy)."""
    buf = memoryview(out.reshape(-1).view(np.uint8))
    with open(path, "rb") as f:
        f.seek(offset)
        got = 0
        while got < len(buf):
            n = f.readinto(buf[got:])
            if not n:
                raise ValueError(f"{path}: ended {len(buf) - got} bytes early (truncated while it was read)")
            got += n
    return out


def load_safetensors(path, key: str) -> np.ndarray:
    """Entry ``key`` as a NumPy array (bfloat16 and float8 as ml_dtypes types); ValueError saying what is wrong
    for an unknown entry or dtype, or offsets that do not fit the file."""
    dt, shape, offset = _entry(path, key)
    return _read_into(path, offset, np.empty(shape, dt))


def load_safetensors_rows(path, key: str, rows: int, r0: int, r1: int) -> np.ndarray:
    """Rows ``r0`` to ``r1`` of entry ``key`` seen as ``rows`` C-ordered rows (each row the entry's size / rows
    elements: a weight's rows for its codes, scales or blocks, whatever the entry's own shape), as a
    (r1 - r0, size / rows) array of the entry's dtype; only those bytes are read. ValueError where the entry does
    not split into ``rows`` rows or the range is not in it."""
    dt, shape, offset = _entry(path, key)
    n = int(np.prod(shape, dtype=np.int64))
    if rows <= 0 or n % rows:
        raise ValueError(f"entry {key!r} of shape {shape} does not split into {rows} rows")
    if not 0 <= r0 <= r1 <= rows:
        raise ValueError(f"rows {r0}..{r1} are not within the {rows} rows of entry {key!r}")
    per = n // rows
    return _read_into(path, offset + r0 * per * dt.itemsize, np.empty((r1 - r0, per), dt))
