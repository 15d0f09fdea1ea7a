"""What the safetensors checkpoint formats share: a folder's entries by name (sharded or not), each entry's
header dtype and shape (read once per file), and the folder's JSON config files read with a message naming the
file."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_json", "entry_files", "entry_dtype", "entry_shape", "not_bytes", "folder_says", "open_folder"]


def read_json(p: Path):
    """The JSON value of file ``p``; ValueError naming the file where it cannot be read or parsed."""
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not readable JSON ({e})") from None


def entry_files(d: Path) -> dict:
    """{entry name: safetensors file} of a folder, from its .index.json where there is one."""
    idx = sorted(d.glob("*.safetensors.index.json"))
    if idx:
        wm = read_json(idx[0]).get("weight_map")
        if not isinstance(wm, dict):
            raise ValueError(f"{idx[0]}: no weight_map")
        missing = sorted({f for f in wm.values() if not (d / f).is_file()})
        if missing:
            raise ValueError(f"{idx[0]} names shards that are not in {d}: {', '.join(missing[:4])}")
        return {k: d / f for k, f in wm.items()}
    from .._safetensors import safetensors_keys
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        for k in safetensors_keys(f):
            out[k] = f
    return out


_HEADERS: dict = {}


def _meta(f: Path, n: str) -> dict:
    from .._safetensors import safetensors_entries
    key = (str(f), f.stat().st_mtime_ns)
    if key not in _HEADERS:
        _HEADERS[key] = safetensors_entries(f)
    return _HEADERS[key][n]


def entry_dtype(f: Path, n: str) -> str:
    """The dtype label of entry ``n``'s header in file ``f`` ("U8", "F8_E4M3", ...)."""
    return _meta(f, n).get("dtype")


def entry_shape(f: Path, n: str) -> tuple:
    """The shape of entry ``n`` in file ``f``, from its header."""
    return tuple(int(v) for v in _meta(f, n).get("shape", ()))


def not_bytes(files: dict, keys) -> str | None:
    """The first of ``keys`` (entries of ``files``) whose header dtype is not bytes (U8, or I8 read as U8), said
    as a problem, or None."""
    for k in keys:
        if str(entry_dtype(files[k], k)) not in ("U8", "I8"):
            return f"{k} is {entry_dtype(files[k], k)}, not bytes (U8)"
    return None


def folder_says(d, config) -> bool:
    """Whether ``d`` is a folder for which ``config(folder)`` (a reader of its config files) finds its format; a
    config file that cannot be read says no."""
    try:
        return Path(d).is_dir() and config(Path(d)) is not None
    except ValueError:
        return False


def open_folder(path, config, none: str) -> tuple:
    """(folder, its format's config, {entry: file}) of a checkpoint folder whose format ``config(folder)`` reads
    from its config files; ValueError naming the folder: not a folder, ``none`` (what is missing) where the
    config is not there, no .safetensors files."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{d}: not a folder (give the checkpoint's folder, with its config.json and .safetensors)")
    q = config(d)
    if q is None:
        raise ValueError(f"{d}: {none}")
    files = entry_files(d)
    if not files:
        raise ValueError(f"{d}: no .safetensors files")
    return d, q, files
