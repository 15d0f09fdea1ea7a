"""The house's structure: no import circles in fp4sim/ or paper_repro/ (imports inside functions included),
neither backend imports the other and the planning layer imports neither, backends import no private names from
the public modules, importing any module of the package in a fresh interpreter works, and the kernel ids live
in one place."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fp4sim"
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


def _modules(top):
    out = {}
    for p in (ROOT / top).rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = {**_modules("fp4sim"), **_modules("paper_repro")}


def _module_of(name, modules):
    """The module of ``modules`` a dotted import target lies in (None outside them)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules=MODULES):
    """module -> the modules of fp4sim / paper_repro it imports anywhere in its source (function bodies too).
    ``from pkg import sub`` counts as importing the submodule ``sub``, not the package's ``__init__``."""
    graph = {}
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets.update(subs)
                if len(subs) < len(node.names):
                    targets.add(base)
        graph[mod] = {m for m in (_module_of(t, modules) for t in targets) if m and m != mod}
    return graph


def circles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle_and_follows_imports_inside_functions(tmp_path):
    """The checker itself, on a made-up package: a -> b at module level, b -> a inside a function, c -> a."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "p" / "a.py").write_text("from .b import f\n")
    (tmp_path / "p" / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (tmp_path / "p" / "c.py").write_text("from p.a import f\n")
    mods = {"p": tmp_path / "p" / "__init__.py", **{f"p.{m}": tmp_path / "p" / f"{m}.py" for m in "abc"}}
    g = import_graph(mods)
    assert g == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert circles(g) == [["p.a", "p.b"]]


def test_no_import_circles_in_the_package_or_the_repro():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("layer, forbidden", [("fp4sim.cpu", ("fp4sim.gpu",)), ("fp4sim.gpu", ("fp4sim.cpu",)),
                                              ("fp4sim.planning", ("fp4sim.cpu", "fp4sim.gpu")),
                                              ("fp4sim.hadamard", ("fp4sim.cpu", "fp4sim.gpu", "fp4sim.planning")),
                                              ("fp4sim.four_over_six", ("fp4sim.cpu", "fp4sim.gpu"))])
def test_neither_backend_imports_the_other_and_the_layers_below_import_no_backend(layer, forbidden):
    g = import_graph()
    for mod, deps in g.items():
        if mod == layer or mod.startswith(layer + "."):
            bad = sorted(d for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))
            assert not bad, f"{mod} imports {bad}"


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
