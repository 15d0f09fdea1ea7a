"""README.md stays true: its format table is the code's own, and its first command block has two commands."""
import re
from pathlib import Path

from fp4sim.formats import spec_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_format_table_is_generated_from_the_code():
    text = README.read_text()
    m = re.search(r"<!-- spec:begin -->\n(.*?)<!-- spec:end -->", text, re.S)
    assert m, "README.md lost its spec markers"
    assert m.group(1) == spec_markdown(), "README format table drifted: run `python -m fp4sim --spec`"


def test_readme_starts_with_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# ")
    assert lines[2].startswith("```")
    block = lines[3:lines.index("```", 3)]
    assert len(block) == 2 and "python -m" in block[0] and "pytest" in block[1]


def test_readme_python_examples_run():
    """The README's element and block-scaled examples run as written (one namespace, in order), so none
    uses a name it does not define."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    runnable = [b for b in blocks if "import fp4sim as fs" in b or b.lstrip().startswith("q = fs.quantize")]
    assert len(runnable) >= 2
    ns = {}
    for b in runnable:
        exec(compile(b, "README.md", "exec"), ns)  # noqa: S102 - the project's own documentation
    assert ns["q"].scheme.name == "mxfp4" and ns["y"].shape == ns["g"].shape


def test_readme_recipe_table_is_generated_from_the_code():
    from fp4sim.training import presets_markdown
    m = re.search(r"<!-- recipes:begin -->\n(.*?)<!-- recipes:end -->", README.read_text(), re.S)
    assert m, "README.md lost its recipe markers"
    assert m.group(1) == presets_markdown(), "README recipe table drifted: run `python -m fp4sim --recipes`"
