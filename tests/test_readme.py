"""The README and the pages of docs/ as written: every Python block runs, in order, after its
page's set-up block; every table and number they mark as copied from a committed result equals
that result; Python blocks import lsn_ext before laplace-torch; the README stays a front page."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent> *)```python\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)
NOT_RUN = "not run by tests/test_readme.py"
SET_UP = "# set-up"
README_LINES = 300


def pages() -> list[Path]:
    """README.md and the Markdown pages of docs/ (not the gallery's generated pages)."""
    docs = sorted(p for p in DOCS.rglob("*.md") if "generated" not in p.relative_to(DOCS).parts)
    return [README, *docs]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every Python block of ``page``, dedented (blocks inside list items)."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        code = "\n".join(line[indent:] for line in m.group("body").splitlines())
        out.append((text[: m.start()].count("\n") + 1, code))
    return out


def _runs(code: str) -> bool:
    return NOT_RUN not in code.splitlines()[0]


PAGES_WITH_CODE = [p for p in pages() if any(_runs(code) for _, code in blocks(p))]


def test_each_page_starts_with_its_set_up_and_only_marked_blocks_are_skipped():
    assert {README, DOCS / "getting-started.md", DOCS / "guide" / "monai.md"} <= set(
        PAGES_WITH_CODE
    )
    for page in PAGES_WITH_CODE:
        first = next(code for _, code in blocks(page) if _runs(code))
        assert first.startswith(SET_UP), f"{_name(page)}: the first block that runs is no set-up"
    found = [(p, code) for p in pages() for _, code in blocks(p)]
    assert len(found) >= 20
    skipped = [p for p, code in found if not _runs(code)]
    assert skipped == [DOCS / "guide" / "distributed.md"]  # the torchrun example


# What each page has computed at its end (its last names), as a check that every block ran.
LAST = {
    "README.md": lambda ns: ns["maps"].entropy.shape == (4, 32, 32),  # the MONAI quick start
    "docs/getting-started.md": lambda ns: ns["maps"].entropy.shape == (4, 32, 32),
    "docs/demo.md": lambda ns: ns["maps"].entropy.shape == (8, 32, 32),
    "docs/guide/monai.md": lambda ns: ns["maps3d"].entropy.shape == (1, 48, 32, 32),
}


# The pages whose blocks fit and predict for several seconds (an SSN's prior search, a 3-D
# sliding-window prediction): in the whole suite, not in the fast tier.
SLOW_PAGES = {"docs/demo.md", "docs/guide/monai.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.slow) if _name(p) in SLOW_PAGES else p
        for p in PAGES_WITH_CODE
    ],
    ids=_name,
)
def test_every_block_of_the_page_runs_in_order(page):
    pytest.importorskip("monai")
    torch.set_default_dtype(torch.float32)  # as a user runs them
    namespace: dict = {"__name__": "readme"}
    ran = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # laplace-torch's notes; errors are what counts here
        for line, code in blocks(page):
            if not _runs(code):
                continue
            try:
                exec(compile(code, f"{_name(page)}, block at line {line}", "exec"), namespace)
            except Exception as err:
                pytest.fail(
                    f"{_name(page)}, block at line {line} fails: {type(err).__name__}: {err}"
                )
            ran += 1
    assert ran == sum(_runs(code) for _, code in blocks(page))
    assert LAST.get(_name(page), lambda ns: True)(namespace)


IMPORT = re.compile(r"^\s*(?:import|from)\s+(?P<module>[\w.]+)(?P<names>\s+import\b)?", re.M)


def import_order_problems(page: Path) -> list[str]:
    """Blocks of ``page`` that import laplace-torch before a name from lsn_ext.

    ``import lsn_ext`` alone is lazy (PEP 562): it imports nothing of laplace-torch, so only a
    ``from lsn_ext... import name`` runs lsn_ext's torchvision check and warning filter first.
    """
    problems = []
    for line, code in blocks(page):
        found = [
            (m.group("module").split(".")[0], bool(m.group("names"))) for m in IMPORT.finditer(code)
        ]
        modules = [module for module, _ in found]
        if "laplace" not in modules:
            continue
        before = found[: modules.index("laplace")]
        if ("lsn_ext", True) not in before:
            problems.append(
                f"{_name(page)}, block at line {line}: laplace before a name from lsn_ext"
            )
    return problems


def test_python_blocks_import_lsn_ext_before_laplace():
    assert sum(len(import_order_problems(p)) for p in pages()) == 0, [
        problem for p in pages() for problem in import_order_problems(p)
    ]


def test_the_import_order_check_catches_laplace_first(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nfrom laplace import Laplace\nimport lsn_ext\n```\n")
    assert len(import_order_problems(page)) == 1
    page.write_text("```python\nimport lsn_ext\nfrom laplace import Laplace\n```\n")
    assert len(import_order_problems(page)) == 1  # lazy: imports nothing of laplace-torch
    ordered = "import lsn_ext\nfrom lsn_ext import DiagBackprop\nfrom laplace import Laplace\n"
    page.write_text(f"```python\n{ordered}```\n")
    assert import_order_problems(page) == []


@pytest.mark.slow  # a second interpreter importing torch, laplace-torch and lsn_ext
def test_importing_a_name_from_lsn_ext_first_passes_python_w_error():
    """The documented order works under ``python -W error`` (laplace-torch's asdl import warns)."""
    code = "import lsn_ext\nfrom lsn_ext import DiagBackprop\nfrom laplace import Laplace\n"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (at most {README_LINES})"
    for heading in ("## Install", "## Quick start", "## Development"):
        assert heading in lines
    links = set(re.findall(r"\]\((docs/[\w/-]+\.md)(?:#[\w-]+)?\)", README.read_text()))
    assert links, "the README links to no page of docs/"
    assert all((ROOT / link).is_file() for link in links), links


# A table copied from a committed result is marked on the line just before it:
#   <!-- table from: integration/results/X.md#heading/subheading -->
# "#heading/..." names the table in that file: the first table after a line that starts with
# "heading" (after its "#" or "**"), then "subheading" after that; no fragment: the file's first
# table. The page may leave out columns (matched by header) and rows, but every cell it shows is
# the committed cell, verbatim, with the rows in the committed order.
# A paragraph, list item or table that quotes measured numbers ends with
#   <!-- numbers from: integration/results/X.md [more files] -->
# (indented like the list item's text for one item); every decimal number in it must occur in one
# of the named files.
MARK = re.compile(r"^(?P<indent> *)<!-- (?P<kind>table|numbers) from: (?P<refs>.+?) -->$")
DECIMAL = re.compile(r"\d+\.\d+")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(lines: list[str], start: int) -> list[list[str]]:
    """Header and body rows (without the rule) of the table starting at ``lines[start]``."""
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows[:1] + rows[2:]


def _committed_table(ref: str) -> list[list[str]]:
    path, _, fragment = ref.partition("#")
    lines = (ROOT / path).read_text().splitlines()
    at = 0
    for part in filter(None, fragment.split("/")):
        at = next(
            i
            for i in range(at, len(lines))
            if lines[i].lstrip("#* ").startswith(part) and not lines[i].startswith("|")
        )
    return _table(lines, next(i for i in range(at, len(lines)) if lines[i].startswith("|")))


def _marks(text: str, kind: str) -> list[tuple[int, int, str]]:
    """``(index, indent, refs)`` of every marker of ``kind`` in ``text``'s lines."""
    return [
        (i, len(m.group("indent")), m.group("refs"))
        for i, line in enumerate(text.splitlines())
        if (m := MARK.match(line)) and m.group("kind") == kind
    ]


def table_problems(text: str) -> list[str]:
    """Every difference between a marked table and the committed table it copies."""
    lines, problems = text.splitlines(), []
    for i, _, ref in _marks(text, "table"):
        shown, committed = _table(lines, i + 1), _committed_table(ref)
        if len(shown) < 2:
            problems.append(f"line {i + 1}: no table after the marker for {ref}")
            continue
        unknown = [h for h in shown[0] if h not in committed[0]]
        if unknown:
            problems.append(f"line {i + 1}: columns {unknown} are not in {ref}")
            continue
        columns = [committed[0].index(h) for h in shown[0]]
        rows = iter([[row[c] for c in columns] for row in committed[1:]])
        for row in shown[1:]:
            if row not in rows:  # consumes ``rows``: the order must be the committed one
                problems.append(f"line {i + 1}: {row} is not a row of {ref} (in order)")
                break
    return problems


def _paragraph_above(lines: list[str], i: int, indent: int) -> list[str]:
    """The paragraph, list item (marker indented) or table that ends just above ``lines[i]``."""
    out = []
    for line in reversed(lines[:i]):
        if not line.strip() or line.lstrip().startswith(("#", "<!--")):
            break
        out.append(line)
        if indent and line.startswith(" " * (indent - 2) + "- "):
            break
    return out[::-1]


def number_problems(text: str) -> list[str]:
    """Every decimal number of a marked paragraph that its committed files do not contain."""
    lines, problems = text.splitlines(), []
    for i, indent, refs in _marks(text, "numbers"):
        committed = "\n".join((ROOT / ref).read_text() for ref in refs.split())
        numbers = DECIMAL.findall("\n".join(_paragraph_above(lines, i, indent)))
        if not numbers:
            problems.append(f"line {i + 1}: no decimal number above the marker for {refs}")
        for number in numbers:
            if not re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", committed):
                problems.append(f"line {i + 1}: {number} is in none of {refs}")
    return problems


def _all_marks(kind: str) -> int:
    return sum(len(_marks(p.read_text(), kind)) for p in pages())


def test_every_marked_table_is_the_committed_table():
    assert _all_marks("table") >= 4
    problems = [f"{_name(p)}: {x}" for p in pages() for x in table_problems(p.read_text())]
    assert problems == []


def test_every_number_of_a_marked_paragraph_is_in_its_committed_file():
    assert _all_marks("numbers") >= 30
    assert len(_marks(README.read_text(), "numbers")) >= 3  # the recommendation
    problems = [f"{_name(p)}: {x}" for p in pages() for x in number_problems(p.read_text())]
    assert problems == []


@pytest.mark.parametrize("page", [README, DOCS / "cost.md"], ids=_name)
def test_the_checks_catch_a_changed_number(page):
    text = page.read_text()
    paragraph_end = _marks(text, "numbers")[0][0] - 1
    lines = text.splitlines()
    lines[paragraph_end] += " 0.123456"
    assert number_problems("\n".join(lines)) == [
        f"line {paragraph_end + 2}: 0.123456 is in none of {_marks(text, 'numbers')[0][2]}"
    ]
    if not _marks(text, "table"):
        return
    table_line = _marks(text, "table")[0][0] + 3  # the first body row of the first marked table
    lines = text.splitlines()
    cells = lines[table_line].split("|")
    cells[2] = " 0.123456 "
    lines[table_line] = "|".join(cells)
    assert table_problems("\n".join(lines))
