"""The documentation site (mkdocs.yml over docs/) builds with `mkdocs build --strict`: every page in its nav, every
link and anchor found; the README stays a front page that points to each page."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def nav_pages(entries) -> list[str]:
    """The pages a mkdocs nav lists, in order (sections opened)."""
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def setup_commands(page: Path) -> list[str]:
    return [line for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
            for line in block.splitlines() if line.startswith("python3 -m venv")]


def test_the_site_builds_strict(tmp_path):
    """Strict: a page left out of the nav, a broken link or a broken anchor is an error (mkdocs.yml's validation)."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]' installs it; the test extra includes it)")
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]
    for page in sorted(DOCS.glob("*.md")):
        built = tmp_path / "site" / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), page.name


def test_every_page_is_in_the_nav_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["site_name"] == "evalkit" and config["theme"]["name"] == "material"
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md")), "docs/*.md and mkdocs.yml's nav differ"
    assert len(pages) == len(set(pages)) and pages[0] == "index.md"


def test_the_readme_is_a_front_page_that_points_to_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for section in ("## Two commands", "## First result", "## A short tour", "## Documentation", "## Dependencies"):
        assert f"\n{section}\n" in text, section
    for page in DOCS.glob("*.md"):
        assert f"](docs/{page.name})" in text, f"the README does not link docs/{page.name}"
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link
    assert "Tested versions: see docs/dependencies.md." in text


def test_the_overview_page_shows_the_readmes_two_commands():
    """docs/index.md repeats the README's setup commands (tests/test_readme.py and .ci/run hold the README's): the
    same, so the site and the README never disagree."""
    readme = setup_commands(README)
    assert len(readme) == 2 and setup_commands(DOCS / "index.md") == readme
