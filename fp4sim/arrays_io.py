"""Reading arrays from .npy, .npz, .safetensors and .pt files (torch and safetensors optional)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["load_array", "check_writable", "input_paths"]


class _Clear(ValueError):
    """An error whose message already says what is wrong (not re-wrapped)."""


def input_paths(ns, outputs=()) -> list:
    """The existing files and folders that the options of an argparse namespace ``ns`` name (a value ``PATH:KEY``
    names PATH; lists are looked into), leaving out the output options named in ``outputs``."""
    found = []
    for k, v in vars(ns).items():
        if k in outputs:
            continue
        for item in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(item, (str, os.PathLike)) and str(item):
                s = str(item)
                for cand in (s, s.rpartition(":")[0]):
                    if cand and os.path.exists(cand):
                        found.append(cand)
                        break
    return found


# the files fp4sim's commands read inside a folder they are given: tensors, checkpoints and their metadata
READ_IN_FOLDERS = ("*.npy", "*.npz", "*.safetensors", "*.pt", "*.pth", "*.gguf", "*.nc", "config.json",
                   "*.index.json", "*roles.json", "hf_quant_config.json", "tokenizer*", "generation_config.json")


def _is_input(p: Path, inputs) -> str | None:
    """The input that writing ``p`` would overwrite — ``p`` itself, or a file inside an input folder of a kind
    the commands read there (:data:`READ_IN_FOLDERS`) — or None."""
    import fnmatch
    if not p.exists():
        return None
    rp = p.resolve()
    for i in inputs:
        ip = Path(i)
        if not ip.exists():
            continue
        ri = ip.resolve()
        if rp == ri or (ip.is_dir() and ri in rp.parents
                        and any(fnmatch.fnmatch(rp.name.lower(), pat) for pat in READ_IN_FOLDERS)):
            return str(i)
    return None


def check_writable(path, what: str, directory: bool = False, inputs=()) -> None:
    """Raise ValueError (naming the option ``what``) unless ``path`` can be written: checked before any work
    starts, so a long run never ends in an unwritable output. ``directory``: the path is a folder to create.
    ``inputs``: the files and folders the command reads (:func:`input_paths`): an output that is one of them, or
    a file inside one, is refused — writing it would destroy what the command reads (a folder to write into may
    be an input folder: the files written there are new)."""
    p = Path(path)
    hit = None if directory else _is_input(p, inputs)
    if hit is not None:
        inside = "" if Path(hit).resolve() == p.resolve() else f" (inside the input {hit})"
        raise ValueError(f"{what} {path}: is an input of this command{inside}; writing it would overwrite it: give "
                         "another name")
    if directory:
        if p.exists() and not p.is_dir():
            raise ValueError(f"{what} {path}: is a file, not a directory")
        q = p
        while not q.exists():
            q = q.parent
        if not q.is_dir() or not os.access(q, os.W_OK | os.X_OK) or not _can_create_in(q):
            raise ValueError(f"{what} {path}: cannot create it ({q} is not a writable directory)")
        return
    if p.is_dir():
        raise ValueError(f"{what} {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: the directory {parent} does not exist")
    if (p.exists() and not os.access(p, os.W_OK)) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: not writable")


def _can_create_in(d: Path) -> bool:
    """Whether a file can be made in ``d``, tried (the permission bits do not tell for root, nor for folders such as
    /proc that refuse new entries)."""
    import tempfile
    try:
        fd, name = tempfile.mkstemp(dir=d, prefix=".fp4sim-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


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
            from ._safetensors import load_safetensors, safetensors_keys
            return load_safetensors(p, _entry(safetensors_keys(p), key, path))
        if suf in (".pt", ".pth"):
            try:
                import torch
            except ImportError:
                raise _Clear(f"{path}: reading .pt files needs torch (pip install torch)") from None
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = _pick(obj, key, path)
            if not isinstance(obj, torch.Tensor):
                raise _Clear(f"{path}: holds a {type(obj).__name__}, not a tensor")
            return _torch_to_numpy(obj)
    except _Clear:
        raise
    except Exception as e:  # noqa: BLE001 - every reader's own error becomes one clear ValueError
        msg = str(e).lower()
        if "pickle" in msg or "weights_only" in msg or "unpickl" in msg:
            raise ValueError(f"{path}: holds pickled objects, which are refused (only plain tensors and arrays are "
                             "read); save plain arrays") from None
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ValueError(f"{path}: cannot be read as {suf} ({type(e).__name__}: {first})") from None
    raise ValueError(f"{path}: unsupported file type {suf!r}; use .npy, .npz, .safetensors or .pt")


def _entry(names, key: str, path: str) -> str:
    """The entry ``key`` names among ``names`` (the only one when no key is given), or a clear error."""
    if key:
        if key not in names:
            raise _Clear(f"{path}: has no entry {key!r}; entries: {sorted(names)}")
        return key
    if len(names) != 1:
        raise _Clear(f"{path}: holds {len(names)} entries {sorted(names)[:8]}; name one as {path}:NAME")
    return next(iter(names))


def _pick(d: dict, key: str, path: str):
    return d[_entry(list(d), key, path)]


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


def number_or_array(spec: str, per_row: bool = False, flag: str = "--global-amax"):
    """A command-line value given as a file holding one float32 (any number of them with ``per_row``) or as a
    number written out (the validate commands' --global-amax, --tensor-scale, --a-amax ...)."""
    if not Path(spec).exists() and not Path(spec.rpartition(":")[0] or spec).exists():
        try:
            return np.float32(float(spec))
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: neither a file nor a number") from None
    ga = np.asarray(load_array(spec), dtype=np.float32).reshape(-1)
    if per_row:
        return ga
    if ga.size != 1:
        raise ValueError(f"{flag} {spec}: must hold one number, found {ga.size}")
    return ga[0]
