"""Sphinx configuration of fastdp's documentation (``make docs``: HTML in docs/_build/html, warnings as errors)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "fastdp"
author = "the fastdp developers"
copyright = "2026, the fastdp developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]
# Links from the docs to files of the repository that are not pages (benchmark results, examples, sources) are
# checked by tests/test_docs.py (each must exist); Sphinx cannot resolve them as documents.
suppress_warnings = ["myst.xref_missing"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_typehints = "none"
autodoc_mock_imports = ["triton"]
html_theme = "alabaster"
html_static_path = []
html_theme_options = {"description": "Differentially private training at the speed of non-private training"}


def _verbatim_docstring(app, what, name, obj, options, lines):
    """fastdp's docstrings are plain text (units, formulas with ``|x|`` and ``*``), not reStructuredText: show each one
    as written, in a literal block, rather than let reST misread it."""
    if any(line.strip() for line in lines):
        lines[:] = ["::", ""] + [f"    {line}" if line.strip() else "" for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim_docstring)
