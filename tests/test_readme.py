"""Every Python block of the README runs as written, in order, after the README's set-up block."""

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


def _table_rows(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_the_demo_table_is_the_committed_demo_output():
    committed = README.parent / "integration" / "results" / "demo" / "table.md"
    header = committed.read_text().splitlines()[0]
    want = _table_rows(committed.read_text(), header)
    assert len(want) == 7  # header, rule, five models
    assert _table_rows(README.read_text(), header) == want
