"""Apply the upstream patches to copies of the installed packages and run their tests, offline.

Usage::

    .venv/bin/python -m integration.checks.upstream.check [stochman] [backpack] [laplace]

For each package (all three by default): copy the installed package directory from
site-packages into a temporary directory laid out like the upstream repository (the package
directory at the root), apply ``integration/checks/upstream/<package>/NNNN-*.patch`` in order
with ``git apply -p1`` (``patch -p1`` if git is missing), then run the test files the patches add in
one pytest subprocess whose ``PYTHONPATH`` starts with the temporary directory, so that the
patched package shadows the installed one. Then it checks the Python files the patches touch
with the upstream's own linters and formatters and settings (:data:`STYLE`): black, isort and
flake8 for BackPACK and StochMan, ruff for laplace-torch. Prints a Markdown table, one row per
patch, and exits 1 if any patch fails to apply, any of its tests fails or any of its files fails
a style check (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# folder under integration/checks/upstream -> importable package that the patches modify
PACKAGES = {"stochman": "stochman", "backpack": "backpack", "laplace": "laplace"}
TEST_DIRS = ("tests/", "test/")


@dataclass(frozen=True)
class Tool:
    """A linter or formatter run as ``python -m <module> <args> <file>`` in the patched tree."""

    name: str
    module: str
    args: tuple[str, ...]


# Each upstream's lint and format settings, copied from its default branch (BackPACK 366bcd6:
# black.toml, setup.cfg [flake8], pyproject.toml [tool.isort]; StochMan b0acd1e: setup.cfg
# [flake8], pyproject.toml [tool.black] and [tool.isort]; laplace-torch 44ea62a: pyproject.toml
# [tool.ruff.lint]), written into the temporary tree under the upstream's file names, and the
# tools its CI or makefile runs: BackPACK `make black-check isort-check flake8`, StochMan
# `flake8 .` and `isort . --sp=pyproject.toml -c` (and black, configured but not in its CI),
# laplace-torch `ruff check` and `ruff format --check`.
STYLE: dict[str, tuple[dict[str, str], tuple[Tool, ...]]] = {
    "backpack": (
        {
            "black.toml": "[tool.black]\nline-length = 88\n"
            "target-version = ['py35', 'py36', 'py37']\ninclude = '\\.pyi?$'\n",
            "setup.cfg": "[flake8]\nselect = B,C,E,F,P,W,B9\nmax-line-length = 88\n"
            "max-complexity = 10\nignore = E501,C408,E203,E231,W291,W503,W504,B905,B028\n",
            "pyproject.toml": '[tool.isort]\nprofile = "black"\nmulti_line_output = 3\n'
            "include_trailing_comma = true\nforce_grid_wrap = 0\nuse_parentheses = true\n",
        },
        (
            Tool("black", "black", ("--config=black.toml", "--check", "--quiet")),
            Tool("isort", "isort", ("--settings-path", ".", "--check-only", "--quiet")),
            Tool("flake8", "flake8", ()),
        ),
    ),
    "stochman": (
        {
            "setup.cfg": "[flake8]\nmax-line-length = 110\n"
            "exclude = .tox,*.egg,build,temp,docs,setup.py\nselect = E,W,F\ndoctests = True\n"
            "ignore = E731,W504,F401,F841,E722,W503,E203\n",
            "pyproject.toml": '[tool.black]\nline-length = 110\ntarget-version = ["py38"]\n\n'
            '[tool.isort]\nprofile = "black"\nline_length = 110\n'
            'force_sort_within_sections = "False"\norder_by_type = "False"\n',
        },
        (
            Tool("black", "black", ("--config=pyproject.toml", "--check", "--quiet")),
            Tool("isort", "isort", ("--sp", "pyproject.toml", "--check-only", "--quiet")),
            Tool("flake8", "flake8", ()),
        ),
    ),
    "laplace": (
        {
            "pyproject.toml": "[tool.ruff.lint]\n"
            'select = ["E4", "E7", "E9", "F", "I", "PLE", "PLW"]\nignore = ["PLW2901", "E402"]\n',
        },
        (
            Tool("ruff check", "ruff", ("check", "--config", "pyproject.toml", "--quiet")),
            Tool("ruff format", "ruff", ("format", "--config", "pyproject.toml", "--check", "-q")),
        ),
    ),
}


@dataclass
class Row:
    """The outcome of one patch."""

    package: str
    patch: str
    applies: bool | None = None  # None: not tried (an earlier patch failed)
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    note: str = ""
    style: list[str] | None = None  # None: not checked; else "tool: file" for each problem

    @property
    def ok(self) -> bool:
        return bool(self.applies) and self.failed == 0 and self.passed > 0 and not self.style


def _tests_of(patch: Path) -> list[str]:
    """Test files that ``patch`` creates or changes (``b/`` paths under ``tests/`` or ``test/``)."""
    files = re.findall(r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), flags=re.M)
    return [f for f in files if f.startswith(TEST_DIRS) and Path(f).name.startswith("test_")]


def _python_files_of(patch: Path) -> list[str]:
    """Python files that ``patch`` creates or changes (not those it deletes)."""
    files = re.findall(r"^\+\+\+ b/(\S+\.py)\s*$", patch.read_text(), flags=re.M)
    return list(dict.fromkeys(files))


def style_problems(package: str, root: Path, files: list[str]) -> dict[str, list[str]]:
    """The upstream tools of ``package`` that reject each of ``files`` (paths under ``root``).

    Writes the upstream's configuration files into ``root`` and runs every tool of
    :data:`STYLE` on each file; a tool that is not installed is reported for every file.
    """
    configs, tools = STYLE[package]
    for name, text in configs.items():
        (root / name).write_text(text)
    problems: dict[str, list[str]] = {f: [] for f in files}
    for tool in tools:
        if importlib.util.find_spec(tool.module) is None:
            for f in files:
                problems[f].append(f"{tool.name} (not installed)")
            continue
        for f in files:
            cmd = [sys.executable, "-m", tool.module, *tool.args, f]
            if subprocess.run(cmd, cwd=root, capture_output=True).returncode != 0:
                problems[f].append(tool.name)
    return problems


def _apply(patch: Path, root: Path) -> tuple[bool, str]:
    if shutil.which("git"):
        cmd = ["git", "apply", "-p1", "--whitespace=nowarn", str(patch)]
    elif shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(patch)]
    else:
        return False, "neither git nor patch is installed"
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    return res.returncode == 0, (res.stderr or res.stdout).strip()


def _run_tests(root: Path, files: list[str], timeout: float) -> tuple[dict[str, list[str]], str]:
    """Run pytest on ``files`` in ``root``; per file the outcomes ('passed', 'failed', ...)."""
    (root / "pytest.ini").write_text("[pytest]\n")  # keep this project's pytest configuration out
    report = root / "report.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "pytest.ini",
        "--rootdir", str(root), f"--junitxml={report}", "-o", "junit_family=xunit1", *files,
    ]  # fmt: skip
    try:
        res = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
        log = res.stdout + res.stderr
    except subprocess.TimeoutExpired:
        return {}, f"pytest timed out after {timeout:.0f} s"
    outcomes: dict[str, list[str]] = {f: [] for f in files}
    if not report.exists():
        return outcomes, log
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("file") or ""
        kinds = {child.tag for child in case}
        outcome = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        match = next((f for f in files if path and (path.endswith(f) or f.endswith(path))), None)
        if match is None:  # older junit files: classname is the dotted module path
            mod = (case.get("classname") or "").split("::")[0]
            match = next((f for f in files if mod.startswith(f[:-3].replace("/", "."))), None)
        if match is not None:
            outcomes[match].append(outcome)
    return outcomes, log


def check(package: str, timeout: float, verbose: bool, style: bool = True) -> list[Row]:
    """Apply, test and (with ``style``) style-check every patch of ``package``; a row each."""
    patches = sorted((HERE / package).glob("[0-9][0-9][0-9][0-9]-*.patch"))
    spec = importlib.util.find_spec(PACKAGES[package])
    if spec is None or spec.origin is None:
        return [
            Row(package, p.name, False, note=f"{PACKAGES[package]} is not installed")
            for p in patches
        ]
    installed = Path(spec.origin).parent
    rows = [Row(package, p.name) for p in patches]
    with tempfile.TemporaryDirectory(prefix=f"upstream-{package}-") as tmp:
        root = Path(tmp)
        shutil.copytree(
            installed, root / installed.name, ignore=shutil.ignore_patterns("__pycache__")
        )
        if shutil.which("git"):
            subprocess.run(["git", "init", "-q"], cwd=root, check=True)
        tests: dict[str, list[str]] = {}
        for row, patch in zip(rows, patches, strict=True):
            row.applies, message = _apply(patch, root)
            if not row.applies:
                row.note = message.splitlines()[0] if message else "does not apply"
                break
            tests[row.patch] = _tests_of(patch)
        files = [f for fs in tests.values() for f in fs]
        if files:
            _record_tests(rows, tests, *_run_tests(root, files, timeout), verbose)
        if style and all(r.applies for r in rows):
            touched = {r.patch: _python_files_of(HERE / package / r.patch) for r in rows}
            problems = style_problems(
                package, root, sorted({f for fs in touched.values() for f in fs})
            )
            for row in rows:
                row.style = [f"{t}: {f}" for f in touched[row.patch] for t in problems[f]]
    return rows


def _record_tests(
    rows: list[Row],
    tests: dict[str, list[str]],
    outcomes: dict[str, list[str]],
    log: str,
    verbose: bool,
) -> None:
    """Count each row's test outcomes (pytest's log printed when asked or when none came)."""
    if verbose or not outcomes:
        print(log)
    for row in rows:
        for f in tests.get(row.patch, []):
            results = outcomes.get(f, [])
            row.passed += results.count("passed")
            row.failed += results.count("failed")
            row.skipped += results.count("skipped")
        if row.applies and not tests.get(row.patch):
            row.note = "adds no tests"
        elif row.applies and row.passed + row.failed == 0:
            row.note = "no test results (see the pytest log above)"
            print(log)


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows``."""
    lines = [
        "| package | patch | applies | tests pass | upstream style | passed / failed / skipped |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        applies = {True: "yes", False: "**no**", None: "not tried"}[r.applies]
        passes = "yes" if r.applies and r.failed == 0 and r.passed > 0 else "**no**"
        style = (
            "not checked"
            if r.style is None
            else "**no**: " + "; ".join(r.style)
            if r.style
            else "yes"
        )
        counts = f"{r.passed} / {r.failed} / {r.skipped}" + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.package} | `{r.patch}` | {applies} | {passes} | {style} | {counts} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", choices=[*PACKAGES, []], metavar="package",
                        help=f"any of {', '.join(PACKAGES)} (default: all)")  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="pytest timeout per package, s"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print the pytest logs")
    parser.add_argument(
        "--no-style", action="store_true", help="skip the upstream linters and formatters"
    )
    args = parser.parse_args(argv)
    rows = [
        r
        for p in (args.packages or list(PACKAGES))
        for r in check(p, args.timeout, args.verbose, style=not args.no_style)
    ]
    print(table(rows))
    return 0 if rows and all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
