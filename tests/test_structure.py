"""The planning layer's structure: backends import no private names from the public modules, importing any
module of the package in a fresh interpreter works (no import cycles), and the kernel ids live in one place."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fp4sim"
PUBLIC = {"fp4sim.quantize", "fp4sim.elements", "fp4sim.hadamard", "fp4sim.validate", "fp4sim.analyze"}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    mod = "fp4sim." + ".".join(path.relative_to(PKG).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                yield target, a.name


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_backends_import_no_private_names_from_public_modules(backend):
    for f in (PKG / backend).glob("*.py"):
        for target, name in _imports(f):
            if any(target == p or target.startswith(p + ".") for p in PUBLIC):
                pytest.fail(f"{f.name} imports {name} from the public module {target}")
            if name.startswith("_") and not target.startswith(f"fp4sim.{backend}"):
                pytest.fail(f"{f.name} imports the private name {name} from {target}")


def test_every_module_imports_alone():
    mods = sorted("fp4sim." + ".".join(p.relative_to(PKG).with_suffix("").parts).replace(".__init__", "")
                  for p in PKG.rglob("*.py") if "__main__" not in p.name)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n    [sys.modules.pop(k) for k in list(sys.modules) if k.startswith('fp4sim')]\n"
    r = subprocess.run([sys.executable, "-c", code, *mods],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", "import fp4sim, sys; assert 'torch' not in sys.modules and "
                        "'cupy' not in sys.modules"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_kernel_ids_are_defined_once_and_used_by_the_cuda_source():
    from fp4sim import ids
    src = (PKG / "gpu" / "kernels.cu").read_text()
    # every id the CUDA source uses comes from fp4sim.ids; no flavour/mode/scale-mode literal comparisons left
    used = set(re.findall(r"\b(MODE_[A-Z]+|FL_[A-Z]+|SM_[A-Z]+|DQ_[A-Z0-9_]+)\b", src))
    assert used and used <= set(ids._EXPORT), used - set(ids._EXPORT)
    assert not re.search(r"\b(mode|flavor|scale_mode|kind) *[=<>!]= *\d", src)
    for f in PKG.rglob("*.py"):
        if f.name == "ids.py":
            continue
        text = f.read_text()
        assert not re.search(r"^(FLAVOR_IDS|MODES|SCALE_MODE_IDS) *=", text, re.M), f"{f} redefines kernel ids"
        assert '{"te": 0' not in text and '{"rceil": 0' not in text, f"{f} spells out kernel ids"
