"""Finding, loading and classifying the tensors of a dump.

Sources: ``.npy`` and ``.npz`` (``allow_pickle=False``), ``.safetensors``, ``.pt``/``.pth`` files
(``torch.load(weights_only=True)``; torch optional) holding one tensor, TransformerEngine ``DumpTensors``'
``{"high_precision": tensor, ...}``, or a state_dict (every tensor in it, nested dicts joined with dots), and
directories of them (searched recursively). Each tensor is loaded only when it is analysed, so memory holds a
few tensors at a time. A file that cannot be read is skipped with its reason; the others are analysed.

Names: a tensor is named by its key in the file (``.npz``/``.safetensors``/state_dict) or by the file's stem
(single-tensor ``.npy``/``.pt``). When several files give the same name (per-step or per-rank subfolders
holding the same files), each such tensor is named by its path relative to the folder given, ``a/t`` or
``a/dump.npz:layer.weight``, so every tensor keeps its own row.

Roles (the recipe treatment): from the name, first match wins — ``grad`` -> ``gradient``; ``weight`` ->
``weight``; anything else (``act``, ``input``, ``hidden``, ...) -> ``activation``. A JSON sidecar
(``<dump>.roles.json`` beside a file, or ``roles.json`` in a directory: ``{"name or glob": "role"}``) and
``--role PATTERN=ROLE`` override it. Pairs for the weight-gradient GEMM study: ``P.input`` with
``P.grad_output`` (or a dump's ``__meta__`` ``pairs``).
"""
from __future__ import annotations

import fnmatch
import os
import json
import re
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

ROLES = ("weight", "activation", "gradient")
SUFFIXES = (".npy", ".npz", ".safetensors", ".pt", ".pth", ".gguf")
_OK_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16))


class TensorError(ValueError):
    """A tensor that cannot be analysed (the run goes on without it)."""


class NotATarget(TensorError):
    """An entry that is no quantization target: an integer or boolean buffer (``position_ids``, masks, codes) or,
    unless asked for, a bias or normalization weight (a 1-D vector that no GEMM takes). Listed with its reason,
    but not counted as a failure (the exit status stays 0)."""


_VECTOR = re.compile(r"(^|[._])(bias|sinks|norm|layernorm|rmsnorm|ln(_?\d+|_f)?)([._]|$)|norm[._]?weight$|_norm$")
_PARAM = re.compile(r"(^|[._])(\w+_)?(bias|sinks)$")          # parameters not named "weight": biases, attention sinks


def is_vector_param(name: str, ndim: int) -> bool:
    """A 1-D bias, attention-sink or normalization weight (``*.bias``, ``*.sinks``, ``*norm*.weight``,
    ``ln_1.weight``, ...), by its name, or a 2-D stack of per-expert biases (gpt-oss's ``*_proj_bias``
    [experts, n]): vectors that no GEMM takes."""
    low = name.lower()
    return ndim == 1 and bool(_VECTOR.search(low)) or ndim == 2 and bool(_PARAM.search(low))


@dataclass(frozen=True)
class Source:
    """Where one tensor lives: a file and the key inside it."""
    name: str
    path: str
    key: str | None
    role: str


def infer_role(name: str) -> str:
    """The role a tensor's name gives: ``grad`` -> gradient; ``weight``, or a parameter named for what it is
    (a bias, gpt-oss's attention ``sinks`` and per-expert ``*_proj_bias``) -> weight; else activation."""
    low = name.lower()
    if re.search(r"grad", low):
        return "gradient"
    if re.search(r"weight", low) or _PARAM.search(low):
        return "weight"
    return "activation"


def _keys(path: Path) -> list[str | None]:
    suf = path.suffix.lower()
    if suf == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise TensorError("is a single .npy array saved under an .npz name; rename it to .npy")
            other = [n for n in z.zip.namelist() if not n.endswith(".npy")]
            if other:
                raise TensorError(f"is a zip archive but not a NumPy .npz (members such as {other[0]!r} are not "
                                  ".npy arrays; a torch .pt file under an .npz name?)")
            return [k for k in z.files if not k.startswith("__")]
    if suf == ".safetensors":
        from .._safetensors import safetensors_keys
        return safetensors_keys(path)
    if suf == ".npy":
        _check_npy(path)
        return [None]
    if suf == ".gguf":
        return list(_gguf_file(path).tensors)
    obj = _torch_load(path)  # .pt: one tensor, TE DumpTensors' dict, or a state_dict
    if _is_tensor(obj) or (isinstance(obj, dict) and "high_precision" in obj):
        return [None]
    if isinstance(obj, dict):
        flat = _flatten(obj)
        if flat:
            return list(flat)
        raise TensorError("holds a dict without tensors")
    raise TensorError(f"holds a {type(obj).__name__}, not a tensor or a dict of tensors")


def _check_npy(path: Path) -> None:
    """TensorError saying what a ``.npy`` file holds when it is no .npy file: NumPy would try it as a pickle and
    call any such file "pickled"."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head == b"\x93NUMPY":
        return
    if head[:2] == b"PK":
        raise TensorError("is a zip archive under a .npy name (an .npz file? rename it to .npz)")
    if head[:1] == b"\x80":
        raise TensorError("holds pickled objects, which are refused")
    raise TensorError("is not a NumPy .npy file: it does not begin with the format's magic bytes (\\x93NUMPY)"
                      + (" — it is empty" if not head else " — a text file, or another format under a .npy name?"))


def _is_tensor(obj) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "detach")


def _flatten(d: dict, prefix: str = "") -> dict:
    """The tensors of a (nested) state_dict, keys joined with dots."""
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        elif _is_tensor(v):
            out[name] = v
    return out


def _torch_load(path: Path):
    try:
        import torch
    except ImportError:
        raise TensorError("is a .pt file; reading it needs torch (pip install torch)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        if "weights_only" in msg or "pickle" in msg.lower():
            raise TensorError("holds pickled Python objects beyond tensors, which are refused "
                              "(torch.load(weights_only=True)); save a tensor or a state_dict") from None
        raise TensorError(f"cannot be loaded with torch.load(weights_only=True): {type(e).__name__}: "
                          f"{_first_line(e)}") from None


def _first_line(e) -> str:
    t = str(e).strip()
    return t.splitlines()[0][:200] if t else ""


def _walk(root: Path) -> tuple:
    """(the files under ``root`` with a suffix fp4sim reads, sorted; the folders under it that cannot be listed):
    a folder the process may not read is reported, not a traceback. Symbolic links to folders are not followed
    (no cycles)."""
    found, unreadable = [], []

    def err(e):
        unreadable.append(str(getattr(e, "filename", None) or e))
    for d, _, names in os.walk(root, onerror=err):
        for n in names:
            f = Path(d) / n
            if Path(n).suffix.lower() in SUFFIXES and f.is_file():
                found.append(f)
    return sorted(found), sorted(unreadable)


def _sidecar(path: Path) -> dict:
    if not path.name:                  # "." or "/": a folder named by no name of its own
        path = path.resolve()
    named = [path.with_name(path.name + ".roles.json"), path.with_suffix(".roles.json")] if path.name else []
    for cand in (*named, path / "roles.json" if path.is_dir() else None):
        if cand is not None and cand.exists():
            try:
                d = json.loads(cand.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"roles file {cand}: not valid JSON ({e})") from None
            if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
                raise ValueError(f"roles file {cand}: must be a JSON object {{\"name or glob\": \"role\"}}")
            bad = {k: v for k, v in d.items() if v not in ROLES}
            if bad:
                raise ValueError(f"roles file {cand}: roles must be one of {ROLES}, got {bad}")
            return d
    return {}


def _apply(names, role: str, overrides: dict) -> str:
    """The role after the overrides whose name or glob matches any of ``names`` (the last match wins)."""
    for pat, r in overrides.items():
        if any(n == pat or fnmatch.fnmatchcase(n, pat) for n in names):
            role = r
    return role


def discover(paths, role_overrides: dict | None = None) -> tuple[list[Source], list[tuple[str, str]], dict]:
    """Sources of every tensor under ``paths`` (files or directories), problems found while listing (files
    that cannot be read, paths that do not exist), and the dumps' metadata (``__meta__`` of .npz files)."""
    problems, meta = [], {"pairs": {}}
    files = []  # (file, the folder it was found under or None, sidecar roles)
    found = []  # (base name, file, root, key, roles, file's meta pairs)
    skip = set()  # (file, key) entries read through a checkpoint instead
    for p in map(Path, paths):
        if p.is_dir() and _quantized_folder(p, files, found, skip, problems):
            continue
        if p.is_dir():
            side = _sidecar(p)
            found_files, unreadable = _walk(p)
            files += [(f, p, side) for f in found_files]
            problems += [(d, "a folder that cannot be listed (permission denied): its files were not read")
                         for d in unreadable]
        elif p.exists() and p.suffix.lower() not in SUFFIXES:
            problems.append((str(p), f"unsupported file type {p.suffix or '(no suffix)'!r}: fp4sim reads "
                                     f"{', '.join(SUFFIXES)} files"))
        elif p.exists():
            files.append((p, None, {}))
        else:
            problems.append((str(p), "no such file or directory"))
    for f, root, side in files:
        try:
            side = {**side, **_sidecar(f)}
            keys = _keys(f)
            pairs = {}
            if f.suffix.lower() == ".npz":
                with np.load(f, allow_pickle=False) as z:
                    if "__meta__" in z.files:
                        m = json.loads(bytes(z["__meta__"]).decode())
                        pairs = m.get("pairs", {})
                        meta.setdefault("sources", {}).update(m.get("sources", {}))
        except ValueError as e:
            if str(e).startswith("roles file"):
                raise
            problems.append((str(f), _reason(e)))
            continue
        except Exception as e:  # noqa: BLE001 - a broken file is reported and skipped
            problems.append((str(f), _reason(e)))
            continue
        for k in keys:
            if (f, k) not in skip:
                found.append((k if k is not None else f.stem, f, root, k, side, pairs))
    count = {}
    for base, *_ in found:
        count[base] = count.get(base, 0) + 1
    sources, used, per_file = [], set(), {}
    for base, f, root, k, side, pairs in found:
        name = base
        if count[base] > 1:
            rel = f.relative_to(root) if root is not None else Path(f.name)
            stem = rel.with_suffix("").as_posix()
            name = stem if k is None else f"{stem}{f.suffix}:{k}"
        uniq, i = name, 2
        while uniq in used:
            uniq, i = f"{name}#{i}", i + 1
        used.add(uniq)
        role = _apply((base, uniq), _apply((base, uniq), infer_role(base), side), role_overrides or {})
        sources.append(Source(uniq, str(f), k, role))
        per_file.setdefault(f, ({}, pairs))[0][base] = uniq
    for names_of, pairs in per_file.values():  # a dump's own __meta__ pairs, in the unique names
        for pname, (a_, g_) in pairs.items():
            if a_ in names_of and g_ in names_of:
                ua = names_of[a_]
                prefix = ua[: -len(a_)] if ua.endswith(a_) else ""
                meta["pairs"].setdefault(prefix + pname, [ua, names_of[g_]])
    names = {s.name for s in sources}
    for s in sources:
        if s.name.endswith(".input"):
            pre = s.name[: -len(".input")]
            if pre + ".grad_output" in names:
                meta["pairs"].setdefault(pre, [s.name, pre + ".grad_output"])
    return sources, problems, meta


CKPT = "nvfp4-checkpoint:"          # the key of an NVFP4 checkpoint's dequantized weight
GPT_OSS = "gpt-oss-mxfp4:"           # the key of a gpt-oss MXFP4 weight's stored values
CT_MX = "ct-mxfp4:"                  # the key of a compressed-tensors MXFP4 weight's stored values
MLX = "mlx:"                         # the key of an MLX module's stored values
_CKPTS: dict = {}                   # checkpoints read in this process, by folder


def _quantized_folder(d: Path, files: list, found: list, skip: set, problems: list) -> bool:
    """An NVFP4 export (ModelOpt, compressed-tensors), a gpt-oss MXFP4 folder or a compressed-tensors MXFP4 one:
    each quantized weight becomes one tensor, ``MODULE.weight`` (its dequantized values; key
    ``nvfp4-checkpoint:MODULE``, ``gpt-oss-mxfp4:NAME`` (a gpt-oss weight as experts x rows by K) or
    ``ct-mxfp4:MODULE``), or an MLX folder in a float mode (``mlx:MODULE``); the other entries of its files are
    read as usual. False for any other folder."""
    from ..checkpoints.compressed_tensors_mx import is_compressed_tensors_mx, read_compressed_tensors_mx
    from ..checkpoints.gpt_oss import is_gpt_oss, read_gpt_oss
    from ..checkpoints.mlx import is_mlx, read_mlx
    from ..checkpoints.nvfp4 import is_checkpoint, read_checkpoint
    if is_checkpoint(d):
        read, prefix = read_checkpoint, CKPT
    elif is_gpt_oss(d):
        read, prefix = (lambda p: read_gpt_oss(p, strict=False)), GPT_OSS
    elif is_compressed_tensors_mx(d):
        read, prefix = (lambda p: read_compressed_tensors_mx(p, strict=False)), CT_MX
    elif is_mlx(d):
        read, prefix = (lambda p: read_mlx(p, strict=False)), MLX
    else:
        return False
    try:
        ck = read(d)
    except ValueError as e:
        problems.append((str(d), str(e)))
        return True
    for m, why in getattr(ck, "broken", {}).items():         # an MXFP4 weight whose entries make none: skipped
        problems.append((f"{d}: {m}", f"its entries do not make an MXFP4 weight: {why}"))
    side = _sidecar(d)
    for m, w in ck.weights.items():
        found.append((m if m.endswith("weight") else f"{m}.weight", d, None, f"{prefix}{m}", side, {}))
        skip.update((e[0], e[1]) for e in w.entries.values())
    files += [(f, d, side) for f in sorted({f for f, _, _ in ck.other.values()})]
    return True


def _reason(e) -> str:
    if isinstance(e, TensorError):
        return str(e)
    msg = str(e)
    if "pickle" in msg.lower():
        return "holds pickled objects, which are refused"
    return f"cannot be read: {type(e).__name__}: {_first_line(e)}"


def load(src: Source, keep_bf16: bool = False, lazy: bool = False) -> np.ndarray:
    """The tensor as float32 (float16/bfloat16 widen exactly; float64 rounds), or TensorError saying why not.
    ``keep_bf16``: a bfloat16 tensor as it is stored (half the bytes to move; the caller widens it). ``lazy``: a
    tensor of two axes or more and at least :data:`~fp4sim.analyze.lazy.LAZY_ELEMS` elements, stored in a
    safetensors entry, as a quantized weight of a checkpoint folder or as a GGUF FP4 tensor, as a
    :class:`~fp4sim.analyze.lazy.LazyTensor` that reads its rows when asked (the same values)."""
    path = Path(src.path)
    suf = path.suffix.lower()
    if lazy:
        try:
            got = _lazy(src, path, suf)
        except TensorError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TensorError(_reason(e)) from None
        if got is not None:
            return got
    try:
        if src.key and src.key.startswith((GPT_OSS, CT_MX, MLX)):
            w = _weight(src)
            a = w.values().reshape(-1, w.shape[-1])
        elif src.key and src.key.startswith(CKPT):
            a = _weight(src).values()
        elif suf == ".npz":
            with np.load(path, allow_pickle=False) as z:
                a = z[src.key]
        elif suf == ".npy":
            a = np.load(path, allow_pickle=False)
        elif suf == ".safetensors":
            from .._safetensors import load_safetensors
            a = load_safetensors(path, src.key)
        elif suf == ".gguf":
            a = _load_gguf(path, src.key)
        else:
            a = _load_pt(path, src.key)
    except TensorError:
        raise
    except Exception as e:  # noqa: BLE001
        raise TensorError(_reason(e)) from None
    if not isinstance(a, np.ndarray):
        raise TensorError(f"is not an array (read a {type(a).__name__})")
    if a.dtype == object:
        raise TensorError("is an object array; save numeric arrays")
    if a.dtype.kind == "V" and a.dtype.itemsize == 2 and a.dtype != np.dtype(ml_dtypes.bfloat16):
        raise TensorError(f"has the raw 2-byte dtype {a.dtype}: NumPy files do not keep bfloat16 (ml_dtypes) "
                          "types; save bfloat16 tensors as .safetensors (which keeps them), or as float32")
    if a.dtype.kind in "biu":
        raise NotATarget(f"has dtype {a.dtype}: an integer or boolean buffer (indices, a mask), not a tensor to "
                         "quantize")
    if a.dtype not in _OK_DTYPES:
        raise TensorError(f"has dtype {a.dtype}; fp4sim analyses float32, float16, bfloat16 (or float64) tensors")
    if a.ndim == 0:
        raise TensorError("is 0-d (a scalar); nothing to quantize")
    if a.size == 0:
        raise TensorError(f"is empty (shape {a.shape})")
    if keep_bf16 and a.dtype == np.dtype(ml_dtypes.bfloat16):
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(a, dtype=np.float32)


def _weight(src: Source):
    """The record of a checkpoint folder's quantized weight that ``src`` names (the folder's headers read once
    per process)."""
    from ..checkpoints.compressed_tensors_mx import read_compressed_tensors_mx
    from ..checkpoints.gpt_oss import read_gpt_oss
    from ..checkpoints.mlx import read_mlx
    from ..checkpoints.nvfp4 import read_checkpoint
    prefix, read = next((p, r) for p, r in ((GPT_OSS, lambda d: read_gpt_oss(d, strict=False)),
                                            (CT_MX, lambda d: read_compressed_tensors_mx(d, strict=False)),
                                            (MLX, lambda d: read_mlx(d, strict=False)), (CKPT, read_checkpoint))
                        if src.key.startswith(p))
    ck = _CKPTS.get(src.path) or _CKPTS.setdefault(src.path, read(src.path))
    return ck.weights[src.key[len(prefix):]]


def stored_nbytes(src: Source) -> int:
    """The bytes ``src`` takes in its file, from the headers (for progress): a safetensors entry's, a checkpoint
    weight's entries', a ``.npy`` file's size; 0 where the layout does not say (``.npz``, ``.pt``, GGUF) or the
    file cannot be read."""
    try:
        path = Path(src.path)
        if src.key and src.key.startswith((GPT_OSS, CT_MX, MLX, CKPT)):
            from .._safetensors import safetensors_entry
            total = 0
            for e in _weight(src).entries.values():
                dt, shape = safetensors_entry(e[0], e[1])
                total += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            return total
        if path.suffix.lower() == ".safetensors" and src.key is not None:
            from .._safetensors import safetensors_entry
            dt, shape = safetensors_entry(path, src.key)
            return int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if path.suffix.lower() == ".npy":
            return path.stat().st_size
    except (OSError, ValueError, KeyError):
        pass
    return 0


def _lazy(src: Source, path: Path, suf: str):
    """:func:`load`'s LazyTensor of ``src``, or None where it is small or its layout is read whole."""
    from .lazy import LAZY_ELEMS, LazyTensor
    if src.key and src.key.startswith((GPT_OSS, CT_MX, MLX, CKPT)):
        w = _weight(src)
        shape = (int(np.prod(w.shape[:-1], dtype=np.int64)), int(w.shape[-1]))
        if shape[0] * shape[1] < LAZY_ELEMS or not shape[0]:
            return None
        return LazyTensor(shape, w.rows, src.name)
    if suf == ".gguf" and src.key is not None:
        t = _gguf_file(path).tensors[src.key]
        rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        if not t.fp4 or t.truncation or rows * int(t.shape[-1]) < LAZY_ELEMS or not rows:
            return None                              # read whole (a cut tensor is refused there, with its reason)
        return LazyTensor((rows, int(t.shape[-1])), t.rows, src.name)
    if suf != ".safetensors" or src.key is None:
        return None
    from .._safetensors import load_safetensors_rows, safetensors_entry
    dt, shape = safetensors_entry(path, src.key)
    n = int(np.prod(shape, dtype=np.int64))
    if len(shape) < 2 or n < LAZY_ELEMS or dt not in _OK_DTYPES or not shape[-1]:
        return None                              # small, or refused (or widened) by the whole-tensor path
    rows = n // shape[-1]
    return LazyTensor(shape, lambda r0, r1: load_safetensors_rows(path, src.key, rows, r0, r1).astype(np.float32),
                      src.name)


_GGUFS: dict = {}                   # GGUF files read in this process (headers; the data is memory-mapped)


def _gguf_file(path: Path):
    from ..checkpoints.gguf import read_gguf
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _GGUFS:
        try:
            _GGUFS[key] = read_gguf(path)
        except (ValueError, ImportError) as e:
            raise TensorError(str(e)) from None
    return _GGUFS[key]


def _load_gguf(path: Path, key):
    """A GGUF tensor's values: ggml's FP4 types (MXFP4, NVFP4) as ggml reads them (fp4sim.gguf), float types as
    stored, other quantized types as gguf-py dequantizes them; ggml's 2-D order (rows, K)."""
    t = _gguf_file(path).tensors[key]
    if t.truncation:                                   # the reader zero-fills what a cut file lacks: never analysed
        raise TensorError(t.truncation)
    if t.fp4:
        return t.values()
    if t.type in ("F32", "F16", "F64"):
        return t.stored().reshape(t.shape)
    if t.type == "BF16":
        return t.stored().view(ml_dtypes.bfloat16).reshape(t.shape)
    if t.type.startswith(("I", "U")) and t.type[1:].isdigit():
        raise NotATarget(f"has the integer type {t.type}: not a tensor to quantize")
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        return dequantize(t.stored(), GGMLQuantizationType[t.type]).reshape(t.shape).astype(np.float32)
    except (NotImplementedError, KeyError, ValueError) as e:
        raise TensorError(f"is a {t.type} GGUF tensor, which gguf-py does not dequantize ({_first_line(e)})") \
            from None


def _load_pt(path: Path, key):
    import torch
    obj = _torch_load(path)
    if isinstance(obj, dict):
        obj = obj["high_precision"] if "high_precision" in obj else _flatten(obj).get(key) if key else None
    if not isinstance(obj, torch.Tensor):
        raise TensorError("holds no tensor (expected a tensor, a state_dict or TE DumpTensors' "
                          "{'high_precision': tensor})")
    t = obj.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if not t.is_floating_point() and not t.is_complex():
        raise NotATarget(f"has dtype {t.dtype}: an integer or boolean buffer (indices, a mask), not a tensor to "
                         "quantize")
    if not t.is_floating_point():
        raise TensorError(f"has dtype {t.dtype}; fp4sim analyses float32, float16, bfloat16 (or float64) tensors")
    return t.numpy()


# ------------------------------------------------------------------ the high-precision weights a checkpoint came from
def reference_sources(reference) -> dict:
    """{tensor name: Source} of the reference weights at ``reference`` (any layout analyze reads); ValueError
    naming ``--reference`` where it holds no tensor."""
    sources, problems, _ = discover([str(reference)])
    if not sources:
        why = "; ".join(f"{p}: {r}" for p, r in problems[:3])
        raise ValueError(f"--reference {reference}: no tensors found" + (f" ({why})" if why else ""))
    return {s.name: s for s in sources}


def reference_names(w) -> list:
    """The names the reference of a checkpoint weight ``w`` may have: ``NAME.weight`` and ``NAME`` for a module's
    name, the name itself where it names a weight already (a GGUF tensor's ``blk.0.attn_q.weight``)."""
    return [w.name] if w.name.endswith(".weight") else [f"{w.name}.weight", w.name]


def reference_source(w, refs: dict):
    """The Source of ``w``'s reference among ``refs`` (:func:`reference_sources`), or None."""
    return next((refs[n] for n in reference_names(w) if n in refs), None)


def reference_weight(w, refs: dict):
    """(the reference weight of ``w`` as float32, None) or (None, why it cannot be compared)."""
    src = reference_source(w, refs)
    if src is None:
        return None, "no reference tensor " + " or ".join(reference_names(w))
    try:
        return load(src), None
    except TensorError as e:
        return None, f"the reference {src.name} {e}"
