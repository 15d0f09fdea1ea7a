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
