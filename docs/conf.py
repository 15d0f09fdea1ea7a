"""Sphinx configuration of fp4sim's documentation: the pages are Markdown (MyST), the API reference is
generated from the docstrings by autodoc. Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                       # an uninstalled checkout documents itself

project = "fp4sim"
author = "the fp4sim authors"
copyright = "the fp4sim authors, Apache-2.0"
from fp4sim import __version__ as release          # noqa: E402

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = f"fp4sim {release}"
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": False}
autodoc_typehints = "description"
napoleon_numpy_docstring = True
napoleon_google_docstring = False
