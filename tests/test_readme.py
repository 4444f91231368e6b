"""Every Python block of the README runs as written, in order, after the README's set-up block;
every table and number the README marks as copied from a committed result equals that result."""

import re
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^(?P<indent> *)```python\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)
NOT_RUN = "not run by tests/test_readme.py"


def blocks() -> list[tuple[int, str]]:
    """``(line, code)`` of every Python block, dedented (blocks inside list items)."""
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        code = "\n".join(line[indent:] for line in m.group("body").splitlines())
        out.append((text[: m.start()].count("\n") + 1, code))
    return out


def test_the_set_up_comes_first_and_only_marked_blocks_are_skipped():
    found = blocks()
    assert len(found) >= 10
    assert found[0][1].startswith("# README set-up")
    skipped = [line for line, code in found if NOT_RUN in code.splitlines()[0]]
    assert len(skipped) == 1  # the torchrun example


def test_every_block_runs_in_order():
    pytest.importorskip("monai")
    torch.set_default_dtype(torch.float32)  # as a user runs them
    namespace: dict = {"__name__": "readme"}
    ran = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # laplace-torch's notes; errors are what counts here
        for line, code in blocks():
            if NOT_RUN in code.splitlines()[0]:
                continue
            try:
                exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
            except Exception as err:
                pytest.fail(f"README block at line {line} fails: {type(err).__name__}: {err}")
            ran += 1
    assert ran == len(blocks()) - 1
    assert namespace["maps"].entropy.shape == (8, 32, 32)  # the last block: the LSN maps


ROOT = README.parent
# A README table copied from a committed result is marked on the line just before it:
#   <!-- table from: integration/results/X.md#heading/subheading -->
# "#heading/..." names the table in that file: the first table after a line that starts with
# "heading" (after its "#" or "**"), then "subheading" after that; no fragment: the file's first
# table. The README may leave out columns (matched by header) and rows, but every cell it shows is
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
    """Every difference between a marked README table and the committed table it copies."""
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


def test_every_marked_table_is_the_committed_table():
    text = README.read_text()
    assert len(_marks(text, "table")) >= 4
    assert table_problems(text) == []


def test_every_number_of_a_marked_paragraph_is_in_its_committed_file():
    text = README.read_text()
    assert len(_marks(text, "numbers")) >= 30
    assert number_problems(text) == []


def test_the_checks_catch_a_changed_number():
    text = README.read_text()
    table_line = _marks(text, "table")[0][0] + 3  # the first body row of the first marked table
    lines = text.splitlines()
    cells = lines[table_line].split("|")
    cells[2] = " 0.123456 "
    lines[table_line] = "|".join(cells)
    assert table_problems("\n".join(lines))
    paragraph_end = _marks(text, "numbers")[0][0] - 1
    lines = text.splitlines()
    lines[paragraph_end] += " 0.123456"
    assert number_problems("\n".join(lines)) == [
        f"line {paragraph_end + 2}: 0.123456 is in none of {_marks(text, 'numbers')[0][2]}"
    ]
