"""The documentation site's sources (mkdocs.yml, docs/): an API entry for every public name,
every page in the navigation, every example in the gallery. `./dev docs` builds the site itself
(mkdocs --strict); these checks run without the docs tools."""

import importlib
import re
from pathlib import Path

import pytest

import lsn_ext

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ENTRY = re.compile(r"^::: (?P<path>[\w.]+)\s*$", re.M)


def api_entries() -> dict[str, Path]:
    """``::: dotted.path`` -> the API page that renders it."""
    return {
        m.group("path"): page
        for page in (DOCS / "api").glob("*.md")
        for m in ENTRY.finditer(page.read_text())
    }


def nav_pages() -> list[str]:
    """The Markdown files named in mkdocs.yml's ``nav`` (relative to docs/)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:\n") :]
    return re.findall(r"(?::|-)\s+([\w/.-]+\.md)\s*$", nav, re.M)


def test_every_public_name_has_an_api_entry():
    entries = api_entries()
    missing = [name for name in lsn_ext.__all__ if f"lsn_ext.{name}" not in entries]
    assert missing == [], f"no '::: lsn_ext.NAME' entry in docs/api/ for {missing}"


def _resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("path", sorted(api_entries()))
def test_every_api_entry_names_an_existing_object(path):
    assert _resolve(path) is not None


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    nav = nav_pages()
    assert "index.md" in nav
    assert "api/index.md" in nav
    assert [p for p in nav if not (DOCS / p).is_file()] == []
    pages = {
        p.relative_to(DOCS).as_posix()
        for p in DOCS.rglob("*.md")
        if p.relative_to(DOCS).parts[0] not in {"generated", "gallery"}
    }
    assert sorted(pages - set(nav)) == []


def test_the_gallery_has_a_page_for_every_example():
    examples = {p.stem for p in (ROOT / "examples").glob("*.py")}
    wrappers = {p.stem for p in (DOCS / "gallery").glob("*.py")}
    assert examples
    assert wrappers == examples
    for name in sorted(wrappers):
        text = (DOCS / "gallery" / f"{name}.py").read_text()
        assert f'--8<-- "examples/{name}.py"' in text  # the page shows the script itself
        assert '"--quick"' in text  # and runs it at its quick sizes
