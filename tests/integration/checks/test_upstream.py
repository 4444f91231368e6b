"""The patches of ``integration/checks/upstream`` apply to the installed release, pass, are styled.

The style check runs each upstream's own linters and formatters (black, isort, flake8 or ruff,
from the ``dev`` extra) on the files the patches touch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from integration.checks.upstream import check

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = ROOT / "integration" / "checks" / "upstream"
PATCHES = sorted((UPSTREAM / "stochman").glob("[0-9]*.patch"))

needs_git = pytest.mark.skipif(
    shutil.which("git") is None and shutil.which("patch") is None,
    reason="check.py applies the patches with git or patch; neither is installed",
)


@pytest.mark.slow
@needs_git
def test_stochman_patches_apply_pass_and_follow_upstream_style():
    res = subprocess.run(
        [sys.executable, "-m", "integration.checks.upstream.check", "stochman"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {
        m.group(1): m.group(2, 3, 4, 5)
        for m in re.finditer(
            r"^\| stochman \| `([^`]+)` \| (\S+) \| (\S+) \| (\S+) \| (\d+) / 0 / ",
            res.stdout,
            re.M,
        )
    }
    assert sorted(rows) == [p.name for p in PATCHES], res.stdout
    for name, (applies, passes, style, n_passed) in rows.items():
        assert (applies, passes, style) == ("yes", "yes", "yes"), f"{name}: {res.stdout}"
        assert int(n_passed) > 0, f"{name} ran no tests"


MISFORMATTED = "import sys\nimport os\nx=[1,2 ,3]\n"  # unsorted, unused, unformatted
FORMATTED = "x = [1, 2, 3]\n"


@pytest.mark.slow  # black, isort, flake8 and ruff in subprocesses
@pytest.mark.parametrize(
    ("package", "tools"),
    [
        ("backpack", ["black", "isort", "flake8"]),
        ("stochman", ["black", "isort", "flake8"]),
        ("laplace", ["ruff check", "ruff format"]),
    ],
)
def test_style_check_reports_misformatted_file(tmp_path, package, tools):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text(MISFORMATTED)
    (tmp_path / "pkg" / "good.py").write_text(FORMATTED)
    problems = check.style_problems(package, tmp_path, ["pkg/bad.py", "pkg/good.py"])
    assert problems == {"pkg/bad.py": tools, "pkg/good.py": []}


@pytest.mark.slow
def test_style_check_uses_upstream_line_length(tmp_path):
    """A 97-character line: too long for BackPACK (black: 88, B950: 96), fine for StochMan."""
    line = "x = " + " + ".join(["1"] * 24) + "\n"
    assert 95 < len(line) < 110
    (tmp_path / "long.py").write_text(line)
    assert check.style_problems("backpack", tmp_path, ["long.py"]) == {
        "long.py": ["black", "flake8"]
    }
    assert check.style_problems("stochman", tmp_path, ["long.py"]) == {"long.py": []}


def test_table_marks_style_problems():
    row = check.Row("backpack", "0001-x.patch", True, passed=3, style=["black: a.py"])
    assert not row.ok
    assert "| yes | yes | **no**: black: a.py | 3 / 0 / 0 |" in check.table([row])
