"""The shape of ``integration/`` (``integration/README.md``): three role folders, a handful of
files at the top, no file over 700 lines, and imports only downward: the harness imports no other
integration module, the experiment kit and the tables only each other and the harness, a
benchmark only the harness, a check nothing of ``integration``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTEGRATION = ROOT / "integration"
FILES = sorted(p for p in INTEGRATION.rglob("*.py") if "results" not in p.parts)


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _integration_imports(path: Path) -> set[str]:
    """The ``integration`` modules a file imports (``from integration import harness`` counts as
    ``integration.harness``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("integration")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("integration"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    modules = {_name(p) for p in FILES}
    return {m for m in found if m in modules and m != "integration"}


def _allowed(name: str) -> tuple[str, ...]:
    """The module prefixes a module may import from, by where it lives."""
    if name == "integration.harness":
        return ()
    if name.startswith(("integration.experiments.kit", "integration.experiments.tables")):
        return (
            "integration.harness",
            "integration.experiments.kit",
            "integration.experiments.tables",
        )
    if name.startswith("integration.experiments."):
        package = ".".join(name.split(".")[:3])  # an experiment's own package
        return ("integration.harness", "integration.experiments.kit",
                "integration.experiments.tables", package)  # fmt: skip
    if name.startswith("integration.benchmarks."):
        return ("integration.harness",)
    return ()  # checks, and the package files


def test_the_top_of_integration_holds_a_handful_of_files():
    top = {p.name for p in INTEGRATION.iterdir() if p.is_file()}
    assert top <= {"__init__.py", "harness.py", "README.md"}, top
    folders = {p.name for p in INTEGRATION.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"benchmarks", "experiments", "checks", "results"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(INTEGRATION)))
def test_imports_point_down_and_files_stay_small(path):
    name = _name(path)
    allowed = _allowed(name)
    wrong = sorted(
        m for m in _integration_imports(path) if not m.startswith(allowed) or not allowed
    )
    assert not wrong, f"{name} may import only {allowed or 'nothing'} of integration: {wrong}"
    lines = len(path.read_text().splitlines())
    assert lines <= 700, f"{name} has {lines} lines: split it (integration/README.md)"


def test_every_script_sits_in_a_role_folder():
    """``./dev bench NAME`` finds ``bench_NAME`` or ``NAME`` in the role folders only."""
    scripts = [p for p in FILES if 'if __name__ == "__main__"' in p.read_text()]
    assert scripts
    for path in scripts:
        role = path.relative_to(INTEGRATION).parts[0]
        assert role in {"benchmarks", "experiments", "checks"}, path
