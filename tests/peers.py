"""Loading the peer libraries used as oracles (never copied into fp4sim: imported or read at test time)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

from conftest import oracle_missing

TE_VERSION = "2.20.2"
_RECIPES = "transformer_engine/pytorch/custom_recipes/"


def import_or_missing(name: str):
    """Import a peer module, or skip (fail under FP4SIM_REQUIRE_ORACLES=1) naming how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        oracle_missing(f"{name} is a test oracle: pip install '.[test]' ({e})")


def write_gguf(path, tensors: dict):
    """A GGUF file written by gguf-py's own writer: {name: float array} (stored as F32) or {name: (raw rows, ggml
    type name)} (stored as given)."""
    gg = import_or_missing("gguf")
    wr = gg.GGUFWriter(str(path), "llama")
    for n, v in tensors.items():
        if isinstance(v, tuple):
            wr.add_tensor(n, v[0], raw_dtype=gg.GGMLQuantizationType[v[1]])
        else:
            wr.add_tensor(n, v)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def torch_or_skip():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return import_or_missing("torch")


def te_wheel(tmp_dir: Path) -> Path:
    """The transformer-engine wheel: $FP4SIM_TE_WHEEL, else downloaded from PyPI (1.2 MB, pure Python)."""
    env = os.environ.get("FP4SIM_TE_WHEEL")
    if env and Path(env).exists():
        return Path(env)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"transformer-engine=={TE_VERSION}",
                        "-d", str(tmp_dir), "-q"], capture_output=True, text=True)
    wheels = list(tmp_dir.glob("transformer_engine-*.whl"))
    if r.returncode or not wheels:
        oracle_missing(f"could not fetch transformer-engine=={TE_VERSION} (set FP4SIM_TE_WHEEL): {r.stderr[-300:]}")
    return wheels[0]


def load_te_reference(tmp_dir: Path):
    """Import TE's pure-Python reference_nvfp4 module from the wheel, with stubs for its compiled parts."""
    torch_or_skip()
    whl = te_wheel(tmp_dir)
    src = tmp_dir / "te_src"
    with zipfile.ZipFile(whl) as z:
        for name in ("gemm.py", "reference_utils.py", "reference_nvfp4.py"):
            z.extract(_RECIPES + name, src)
    pkgs = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.tensor",
            "transformer_engine.pytorch.custom_recipes"]
    for p in pkgs:
        m = types.ModuleType(p)
        m.__path__ = [str(src / p.replace(".", "/"))]
        sys.modules[p] = m
    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")

    class Quantizer:  # the reference only subclasses these
        def __init__(self, *a, **k):
            pass

    class QuantizedTensorStorage:
        pass

    qt.Quantizer, qt.QuantizedTensorStorage = Quantizer, QuantizedTensorStorage
    ut = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    ut.is_custom = lambda t: True
    sys.modules[qt.__name__], sys.modules[ut.__name__] = qt, ut
    mods = {}
    for name in ("reference_utils", "gemm", "reference_nvfp4"):
        full = "transformer_engine.pytorch.custom_recipes." + name
        spec = importlib.util.spec_from_file_location(full, src / _RECIPES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["reference_nvfp4"]
