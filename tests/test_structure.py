"""The house's structure: no import circles in fp4sim/ or paper_repro/ (imports inside functions included),
every module of fp4sim/ on one floor of :data:`FLOORS` and importing only from its own floor and the floors below
(docs/layout.md shows the same floors; a test keeps them equal), no private name imported across packages,
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


# The floors of the package, top to bottom: a module imports from its own floor and those below it, never from a
# floor above (imports inside functions included). A module belongs to the floor of its longest listed prefix.
FLOORS = [
    ("commands", ["fp4sim.cli", "fp4sim.__main__", "fp4sim.validate.__main__", "fp4sim.analyze.__main__"]),
    ("checkers", ["fp4sim.validate", "fp4sim.inspect_model", "fp4sim.inspect_memory"]),
    ("studies", ["fp4sim.analyze", "fp4sim.requantize"]),
    ("torch bridge", ["fp4sim.torch"]),
    ("checkpoints", ["fp4sim.checkpoints", "fp4sim.checkpoint", "fp4sim.gguf", "fp4sim.gpt_oss"]),
    ("entry points", ["fp4sim", "fp4sim.quantize", "fp4sim.elements", "fp4sim.gemm", "fp4sim.tensorcore",
                      "fp4sim.training", "fp4sim.emulate", "fp4sim.fastpath", "fp4sim.ue5m3", "fp4sim.threads",
                      "fp4sim.arrays_io", "fp4sim._f32"]),
    ("backends", ["fp4sim.cpu", "fp4sim.gpu"]),
    ("planning", ["fp4sim.planning"]),
    ("oracle", ["fp4sim.reference"]),
    ("shared math", ["fp4sim.formats", "fp4sim.schemes", "fp4sim.qtensor", "fp4sim.layout", "fp4sim.hadamard",
                     "fp4sim.four_over_six", "fp4sim.rng", "fp4sim.ids", "fp4sim._inputs", "fp4sim._xp",
                     "fp4sim._safetensors", "fp4sim._tool"]),
]


def floor_of(mod, floors=FLOORS):
    """The index of ``mod``'s floor (its longest listed prefix; the package ``fp4sim`` itself only by name)."""
    best = None
    for i, (_, prefixes) in enumerate(floors):
        for p in prefixes:
            if mod == p or (p != "fp4sim" and mod.startswith(p + ".")):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


def upward_imports(graph, floors=FLOORS):
    """[(module, imported module)] where a module imports from a floor above its own."""
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if floor_of(m, floors) is not None and floor_of(d, floors) is not None
                  and floor_of(d, floors) < floor_of(m, floors))


def private_imports(modules=MODULES):
    """[(module, what it imports)] of private names imported across packages: ``from X import _name`` where X's
    package is not the importer's, or ``from P import _module`` of a private module of another package. A
    package's private modules (``fp4sim._xp``) are its own and its subpackages'."""
    out = []
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                if not a.name.startswith("_") or a.name.startswith("__"):
                    continue
                sub = f"{base}.{a.name}"
                if sub in modules:                 # a private module: its package's own, and its subpackages'
                    owner = base
                    if not (pkg == owner or pkg.startswith(owner + ".")):
                        out.append((mod, sub))
                    continue
                target = _module_of(base, modules)
                if target is None:
                    continue
                tpkg = target if modules[target].name == "__init__.py" else target.rpartition(".")[0]
                if tpkg != pkg:
                    out.append((mod, f"{target}.{a.name}"))
    return sorted(out)


def test_the_floor_and_privacy_checks_find_what_they_look_for(tmp_path):
    """The checkers themselves, on a made-up package: p.low imports p.high (up a floor), p.sub.a imports p.b's
    private name (across packages) and p.sub's own private module (allowed), p.c imports p.sub's private module."""
    (tmp_path / "p" / "sub").mkdir(parents=True)
    files = {"p/__init__.py": "", "p/high.py": "from . import low\n", "p/low.py": "def f():\n    from . import high\n",
             "p/b.py": "_x = 1\n", "p/sub/__init__.py": "", "p/sub/_own.py": "",
             "p/sub/a.py": "from ..b import _x\nfrom . import _own\n", "p/c.py": "from .sub import _own\n"}
    for f, text in files.items():
        (tmp_path / f).write_text(text)
    mods = {"p": tmp_path / "p/__init__.py", "p.high": tmp_path / "p/high.py", "p.low": tmp_path / "p/low.py",
            "p.b": tmp_path / "p/b.py", "p.sub": tmp_path / "p/sub/__init__.py",
            "p.sub._own": tmp_path / "p/sub/_own.py", "p.sub.a": tmp_path / "p/sub/a.py", "p.c": tmp_path / "p/c.py"}
    floors = [("top", ["p.high", "p.sub", "p.c"]), ("bottom", ["p.low", "p.b"])]
    assert upward_imports(import_graph(mods), floors) == [("p.low", "p.high")]
    assert private_imports(mods) == [("p.c", "p.sub._own"), ("p.sub.a", "p.b._x")]


def test_every_module_is_on_a_floor_and_imports_none_above_it():
    g = import_graph()
    lost = sorted(m for m in g if m.startswith("fp4sim") and floor_of(m) is None)
    assert not lost, f"modules on no floor of FLOORS (add them where their imports put them): {lost}"
    up = upward_imports({m: d for m, d in g.items() if m.startswith("fp4sim")})
    assert not up, "imports up the floors: " + "; ".join(f"{m} -> {d} ({FLOORS[floor_of(d)][0]} is above "
                                                         f"{FLOORS[floor_of(m)][0]})" for m, d in up)


def test_no_private_name_is_imported_across_packages():
    found = private_imports({m: p for m, p in MODULES.items() if m.startswith("fp4sim")})
    assert not found, "private names imported across packages: " + "; ".join(f"{m} imports {n}" for m, n in found)


def test_the_docs_show_the_floors_of_the_test():
    """docs/layout.md's table of floors lists the floors of :data:`FLOORS`, in order, each with its modules."""
    text = (ROOT / "docs" / "layout.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| floor") and "`fp4sim" in r]
    got = [(r.split("|")[1].strip(), re.findall(r"`(fp4sim[\w.]*)`", r.split("|")[2])) for r in rows]
    got = [(name, mods) for name, mods in got if mods]
    assert got == [(name, mods) for name, mods in FLOORS]


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
