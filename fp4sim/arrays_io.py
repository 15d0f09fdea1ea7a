"""Reading arrays from .npy, .npz, .safetensors and .pt files (torch and safetensors optional)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["load_array"]


def load_array(spec: str) -> np.ndarray:
    """Load one array. ``spec`` is a path, or ``path:name`` to pick one entry of an .npz/.safetensors/.pt
    file holding several. Pickled objects are refused (``allow_pickle=False``, ``weights_only=True``)."""
    path, _, key = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file")
    suf = p.suffix.lower()
    try:
        if suf == ".npy":
            return np.load(p, allow_pickle=False)
        if suf == ".npz":
            with np.load(p, allow_pickle=False) as z:
                return _pick(dict(z.items()), key, path)
        if suf == ".safetensors":
            try:
                from safetensors.numpy import load_file
            except ImportError as e:
                raise ValueError(f"{path}: reading .safetensors needs the safetensors package ({e})") from None
            return _pick(load_file(str(p)), key, path)
        if suf in (".pt", ".pth"):
            try:
                import torch
            except ImportError:
                raise ValueError(f"{path}: reading .pt files needs torch (pip install torch)") from None
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = _pick(obj, key, path)
            if not isinstance(obj, torch.Tensor):
                raise ValueError(f"{path}: holds a {type(obj).__name__}, not a tensor")
            return _torch_to_numpy(obj)
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: cannot be read as {suf} ({e})") from None
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise ValueError(f"{path}: holds pickled objects, which are refused; save plain arrays") from None
        raise
    raise ValueError(f"{path}: unsupported file type {suf!r}; use .npy, .npz, .safetensors or .pt")


def _pick(d: dict, key: str, path: str):
    if key:
        if key not in d:
            raise ValueError(f"{path}: has no entry {key!r}; entries: {sorted(d)}")
        return d[key]
    if len(d) != 1:
        raise ValueError(f"{path}: holds {len(d)} entries {sorted(d)[:8]}; name one as {path}:NAME")
    return next(iter(d.values()))


def _torch_to_numpy(t):
    import ml_dtypes
    import torch
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    if hasattr(torch, "float8_e8m0fnu") and t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8).numpy()
    return t.numpy()
