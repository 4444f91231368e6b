"""The two tiers of the suite: ``./dev test`` (everything, CI) and ``./dev test --fast``.

The fast tier is ``pytest -m "not slow"``. It must still touch every package: every test module
outside ``tests/integration/`` (where tests run the benchmark and experiment scripts) keeps at
least one test that is not marked slow, except the modules listed in ``ALL_SLOW``.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Modules whose every test is an end-to-end run in a subprocess.
ALL_SLOW = {
    "tests/test_examples.py": "runs each example script at --quick",
    "tests/test_typing.py": "runs mypy --strict on a user's script",
}


def _slow(node: ast.expr) -> bool:
    return ast.unparse(node) == "pytest.mark.slow"


def _module_is_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            return any(_slow(m) for m in marks)
    return False


def _fast_tests(path: Path) -> list[str]:
    """Test functions of a module that ``-m "not slow"`` keeps (whole functions, by name)."""
    tree = ast.parse(path.read_text())
    if _module_is_slow(tree):
        return []
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test")
        and not any(_slow(d) for d in node.decorator_list)
    ]


def test_every_test_module_keeps_a_fast_test():
    modules = sorted(
        p
        for p in (ROOT / "tests").rglob("test_*.py")
        if "integration" not in p.relative_to(ROOT / "tests").parts
    )
    assert len(modules) > 50
    only_slow = [p.relative_to(ROOT).as_posix() for p in modules if not _fast_tests(p)]
    assert sorted(only_slow) == sorted(ALL_SLOW), (
        "a test module with no test outside the slow tier leaves its package out of "
        "./dev test --fast: keep a cheap test fast, or list the module in ALL_SLOW with why"
    )


def test_the_checker_sees_module_and_function_marks(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text("import pytest\npytestmark = [pytest.mark.slow]\ndef test_a():\n    pass\n")
    assert _fast_tests(module) == []
    module.write_text(
        "import pytest\n@pytest.mark.slow\ndef test_a():\n    pass\ndef test_b():\n    pass\n"
    )
    assert _fast_tests(module) == ["test_b"]


def test_the_slow_marker_is_registered_strictly_and_dev_test_fast_deselects_it():
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    ini = pyproject.split("[tool.pytest.ini_options]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^addopts = ".*--strict-markers', ini, re.M)
    assert re.search(r'^ *"slow: .*--fast', ini, re.M)
    dev = (ROOT / "dev").read_text()
    assert 'if [ "${1:-}" = "--fast" ]; then shift; tier=(-m "not slow"); fi' in dev
