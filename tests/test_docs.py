"""The documentation: every Python code block in README.md and docs/*.md runs, every link points into the repository,
the README stays a front page, and the Sphinx site builds with warnings as errors (``make docs``)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in CODE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            yield pytest.param(m.group(1), id=f"{page.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_python_code_block_runs(code, tmp_path):
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the code block fails:\n{code}\n{result.stderr[-3000:]}"


def test_every_link_points_into_the_repository():
    """Relative links resolve to files of the repository (users have nothing beside it: no ../shared, no papers/)."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in path.parents and path != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_no_references_outside_the_repository():
    outside = re.compile(r"\.\./shared|\bseeds/|\bpapers/0\d")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in PAGES for m in outside.finditer(p.read_text())]
    assert not found, found


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the detail to docs/"
    assert lines[0] == "# fastdp"
    text = "\n".join(lines[:20])
    assert "make demo" in text and "make test" in text, "the two commands open the README"


@pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None, reason="sphinx not installed (pip install -e '.[docs]')"
)
def test_sphinx_site_builds_without_warnings(tmp_path):
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"make docs fails:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert (tmp_path / "index.html").exists() and (tmp_path / "api.html").exists()
