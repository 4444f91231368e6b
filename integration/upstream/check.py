"""Apply the upstream patches to copies of the installed packages and run their tests, offline.

Usage::

    .venv/bin/python integration/upstream/check.py [stochman] [backpack] [laplace]

For each package (all three by default): copy the installed package directory from
site-packages into a temporary directory laid out like the upstream repository (the package
directory at the root), apply ``integration/upstream/<package>/NNNN-*.patch`` in order with
``git apply -p1`` (``patch -p1`` if git is missing), then run the test files the patches add in
one pytest subprocess whose ``PYTHONPATH`` starts with the temporary directory, so that the
patched package shadows the installed one. Prints a Markdown table, one row per patch, and
exits 1 if any patch fails to apply or any of its tests fails (2 for bad arguments).
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

# folder under integration/upstream -> importable package that the patches modify
PACKAGES = {"stochman": "stochman", "backpack": "backpack", "laplace": "laplace"}
TEST_DIRS = ("tests/", "test/")


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

    @property
    def ok(self) -> bool:
        return bool(self.applies) and self.failed == 0 and self.passed > 0


def _tests_of(patch: Path) -> list[str]:
    """Test files that ``patch`` creates or changes (``b/`` paths under ``tests/`` or ``test/``)."""
    files = re.findall(r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), flags=re.M)
    return [f for f in files if f.startswith(TEST_DIRS) and Path(f).name.startswith("test_")]


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


def check(package: str, timeout: float, verbose: bool) -> list[Row]:
    """Apply and test every patch of ``package``; one :class:`Row` per patch."""
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
        if not files:
            return rows
        outcomes, log = _run_tests(root, files, timeout)
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
    return rows


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows``."""
    lines = [
        "| package | patch | applies | tests pass | passed / failed / skipped |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        applies = {True: "yes", False: "**no**", None: "not tried"}[r.applies]
        passes = "yes" if r.ok else "**no**"
        counts = f"{r.passed} / {r.failed} / {r.skipped}" + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.package} | `{r.patch}` | {applies} | {passes} | {counts} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", choices=[*PACKAGES, []], metavar="package",
                        help=f"any of {', '.join(PACKAGES)} (default: all)")  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="pytest timeout per package, s"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print the pytest logs")
    args = parser.parse_args(argv)
    rows = [
        r for p in (args.packages or list(PACKAGES)) for r in check(p, args.timeout, args.verbose)
    ]
    print(table(rows))
    return 0 if rows and all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
