"""Finding, loading and classifying the tensors of a dump.

Sources: ``.npz`` (``allow_pickle=False``), ``.safetensors``, TransformerEngine ``DumpTensors`` ``.pt`` files
(the ``high_precision`` tensor, ``torch.load(weights_only=True)``; torch optional), and directories of them.
Each tensor is loaded only when it is analysed, so memory holds a few tensors at a time.

Roles (the recipe treatment): from the name, first match wins — ``grad`` -> ``gradient``; ``weight`` ->
``weight``; anything else (``act``, ``input``, ``hidden``, ...) -> ``activation``. A JSON sidecar
(``<dump>.roles.json`` beside a file, or ``roles.json`` in a directory: ``{"name or glob": "role"}``) and
``--role PATTERN=ROLE`` override it. Pairs for the weight-gradient GEMM study: ``P.input`` with
``P.grad_output`` (or a dump's ``__meta__`` ``pairs``).
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

ROLES = ("weight", "activation", "gradient")
SUFFIXES = (".npz", ".safetensors", ".pt", ".pth")
_OK_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16))


class TensorError(ValueError):
    """A tensor that cannot be analysed (the run goes on without it)."""


@dataclass(frozen=True)
class Source:
    """Where one tensor lives: a file and the key inside it."""
    name: str
    path: str
    key: str | None
    role: str


def infer_role(name: str) -> str:
    low = name.lower()
    if re.search(r"grad", low):
        return "gradient"
    if re.search(r"weight", low):
        return "weight"
    return "activation"


def _keys(path: Path) -> list[str | None]:
    suf = path.suffix.lower()
    if suf == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return [k for k in z.files if not k.startswith("__")]
    if suf == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), "np") as f:
            return list(f.keys())
    return [None]  # .pt: one tensor per file (TE DumpTensors) or a dict, resolved at load time


def _sidecar(path: Path) -> dict:
    for cand in (path.with_name(path.name + ".roles.json"), path.with_suffix(".roles.json"),
                 path / "roles.json" if path.is_dir() else None):
        if cand is not None and cand.exists():
            d = json.loads(cand.read_text())
            bad = {k: v for k, v in d.items() if v not in ROLES}
            if bad:
                raise ValueError(f"{cand}: roles must be one of {ROLES}, got {bad}")
            return d
    return {}


def _apply(name: str, role: str, overrides: dict) -> str:
    for pat, r in overrides.items():
        if name == pat or fnmatch.fnmatchcase(name, pat):
            role = r
    return role


def discover(paths, role_overrides: dict | None = None) -> tuple[list[Source], list[tuple[str, str]], dict]:
    """Sources of every tensor under ``paths`` (files or directories), problems found while listing, and
    the dumps' metadata (``__meta__`` of .npz files)."""
    sources, problems, meta = [], [], {"pairs": {}}
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            side = _sidecar(p)
            files += [(f, side) for f in sorted(p.rglob("*")) if f.suffix.lower() in SUFFIXES]
        elif p.exists():
            files.append((p, {}))
        else:
            problems.append((str(p), "no such file or directory"))
    for f, side in files:
        try:
            side = {**side, **_sidecar(f)}
            keys = _keys(f)
            if f.suffix.lower() == ".npz":
                with np.load(f, allow_pickle=False) as z:
                    if "__meta__" in z.files:
                        m = json.loads(bytes(z["__meta__"]).decode())
                        meta["pairs"].update(m.get("pairs", {}))
                        meta.setdefault("sources", {}).update(m.get("sources", {}))
        except Exception as e:  # noqa: BLE001 - a broken file is reported and skipped
            problems.append((str(f), f"cannot be read: {type(e).__name__}: {e}"))
            continue
        for k in keys:
            name = k if k is not None else f.stem
            if len(files) > 1 and k is not None and any(s.name == name for s in sources):
                name = f"{f.stem}/{k}"
            role = _apply(name, _apply(name, infer_role(name), side), role_overrides or {})
            sources.append(Source(name, str(f), k, role))
    names = {s.name for s in sources}
    for s in sources:
        if s.name.endswith(".input"):
            pre = s.name[: -len(".input")]
            if pre + ".grad_output" in names:
                meta["pairs"].setdefault(pre, [s.name, pre + ".grad_output"])
    return sources, problems, meta


def load(src: Source) -> np.ndarray:
    """The tensor as float32 (float16/bfloat16 widen exactly; float64 rounds), or TensorError saying why not."""
    path = Path(src.path)
    suf = path.suffix.lower()
    try:
        if suf == ".npz":
            with np.load(path, allow_pickle=False) as z:
                a = z[src.key]
        elif suf == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), "np") as f:
                a = f.get_tensor(src.key)
        else:
            a = _load_pt(path, src.key)
    except TensorError:
        raise
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise TensorError("holds pickled objects, which are refused") from None
        raise TensorError(f"cannot be read: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise TensorError(f"cannot be read: {type(e).__name__}: {e}") from None
    if a.dtype == object:
        raise TensorError("is an object array; save numeric arrays")
    if a.dtype not in _OK_DTYPES:
        raise TensorError(f"has dtype {a.dtype}; fp4sim analyses float32, float16, bfloat16 (or float64) tensors")
    if a.ndim == 0:
        raise TensorError("is 0-d (a scalar); nothing to quantize")
    if a.size == 0:
        raise TensorError(f"is empty (shape {a.shape})")
    return np.ascontiguousarray(a, dtype=np.float32)


def _load_pt(path: Path, key):
    try:
        import torch
    except ImportError:
        raise TensorError("is a .pt file; reading it needs torch (pip install torch)") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise TensorError(f"cannot be loaded with torch.load(weights_only=True): {type(e).__name__}: {e}") from None
    if isinstance(obj, dict):
        obj = obj.get("high_precision", obj.get(key) if key else None)
    if not isinstance(obj, torch.Tensor):
        raise TensorError("holds no tensor (expected a tensor or TE DumpTensors' {'high_precision': tensor})")
    t = obj.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
