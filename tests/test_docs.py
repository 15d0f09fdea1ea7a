"""README.md and docs/ stay true: the format and recipe tables are the code's own, README's first code block
has its two commands, the documentation builds with warnings as errors, and every Python example and console
session in README.md and docs/ runs as written (console output, where shown, is compared exactly)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fp4sim.formats import spec_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README] + sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _table(path, name):
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", path.read_text(), re.S)
    assert m, f"{path.name} lost its {name} markers"
    return m.group(1)


def test_format_table_is_generated_from_the_code():
    assert _table(DOCS / "formats.md", "spec") == spec_markdown(), "format table drifted: run `python -m fp4sim --spec`"


def test_recipe_table_is_generated_from_the_code():
    from fp4sim.training import presets_markdown
    assert _table(DOCS / "training.md", "recipes") == presets_markdown(), \
        "recipe table drifted: run `python -m fp4sim --recipes`"


def test_readme_starts_with_two_commands_and_stays_short():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ")
    assert lines[2].startswith("```")
    block = lines[3:lines.index("```", 3)]
    assert len(block) == 2 and "python -m" in block[0] and "pytest" in block[1]
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move reference material into docs/"


def test_every_link_to_a_file_points_at_one():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def _examples(page):
    """(kind, text) of the page's Python and console blocks, in order."""
    return [(k, t) for k, t in FENCE.findall(page.read_text()) if k in ("python", "console")]


def _run_console(text, cwd, where):
    """Each `$ CMD` line runs in ``cwd`` (a leading `python` is this interpreter); output lines after it, if
    any, must be the command's stdout exactly; a command shown without output must exit 0."""
    cmds = []
    for line in text.splitlines():
        if line.startswith("$ "):
            cmds.append([line[2:], []])
        else:
            assert cmds, f"{where}: console output before any command"
            cmds[-1][1].append(line)
    for cmd, want in cmds:
        argv = shlex.split(cmd)
        if argv[0] == "python":
            argv[0] = sys.executable
        r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        if want:
            got = [ln.rstrip() for ln in r.stdout.rstrip("\n").splitlines()]
            assert got == [ln.rstrip() for ln in want], f"{where}: `{cmd}` printed\n{r.stdout}{r.stderr[-2000:]}"
        else:
            assert r.returncode == 0, f"{where}: `{cmd}` exited {r.returncode}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("page", [p for p in PAGES if _examples(p)], ids=lambda p: p.name)
def test_every_example_of_the_page_runs(page, tmp_path, monkeypatch):
    """The page's examples run in order in one namespace, in a fresh working directory (files an example
    writes are there for the console sessions after it)."""
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__docs__"}
    for i, (kind, text) in enumerate(_examples(page)):
        where = f"{page.name} example {i + 1}"
        if kind == "python":
            exec(compile(text, where, "exec"), ns)  # noqa: S102 - the project's own documentation
        else:
            _run_console(text, tmp_path, where)


def test_the_documentation_builds_with_warnings_as_errors(tmp_path):
    """The command docs/install.md gives, API reference included (autodoc imports every documented module)."""
    pytest.importorskip("sphinx", reason="the [docs] extra (part of [test]) installs Sphinx")
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                        str(tmp_path / "html")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    assert r.returncode == 0, r.stderr[-4000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("fp4sim.quantize", "fp4sim.gemm", "fp4sim.training.Recipe", "fp4sim.torch.module.QuantLinear",
                 "fp4sim.validate.compare", "fp4sim.analyze.analyze"):
        assert f'id="{name}"' in api, f"the API reference lost {name}"


PROBE = '''import json as _json, os as _os
import torch.distributed as _dist
_destroy = _dist.destroy_process_group


def _probe(*a, **k):                  # what the page's processes were, read before the page ends its group
    with open(f"probe{_os.environ.get('RANK', 'alone')}.json", "w") as f:
        _json.dump({"world": _dist.get_world_size(), "rank": _dist.get_rank()}, f)
    return _destroy(*a, **k)


_dist.destroy_process_group = _probe
'''


@pytest.mark.slow
def test_the_scale_pages_examples_run_data_parallel_under_torchrun(tmp_path):
    """docs/scale.md's examples, as one script under `torchrun --nproc_per_node 2` (gloo): the two processes are
    ranks 0 and 1 of one world of 2 (not two groups of one), and the distributed checkpoint holds both ranks'
    shards."""
    blocks = [t for k, t in _examples(DOCS / "scale.md") if k == "python"]
    script = tmp_path / "train.py"
    script.write_text(PROBE + "\n".join(blocks))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    import json
    got = {r_: json.loads((tmp_path / f"probe{r_}.json").read_text()) for r_ in ("0", "1")}
    assert got == {"0": {"world": 2, "rank": 0}, "1": {"world": 2, "rank": 1}}, got
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "step-1").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards


def test_the_docs_tables_of_rules_and_faults_are_the_registrys():
    """docs/validation.md shows the exporter rules and the layout faults as the registry renders them."""
    from fp4sim.checkpoints import faults_table, rules_table
    text = (ROOT / "docs" / "validation.md").read_text()
    for what, table in (("rules", rules_table()), ("faults", faults_table())):
        m = re.search(rf"<!-- {what}: generated by [^>]*-->\n(.*?)\n<!-- end of {what} -->", text, re.S)
        assert m, f"docs/validation.md has no generated {what} table"
        assert m.group(1) == table, f"docs/validation.md's {what} table differs from the registry's: regenerate it"
