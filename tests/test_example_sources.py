"""The sources of ``examples/``: lsn_ext is imported before laplace-torch (so that lsn_ext's
torchvision message and its one warning filter come first, and the imports pass ``python -W
error``), and the only warnings filtered are upstream ones named by message and category.

The examples' runs in ``tests/test_examples.py`` check the imports as they happen: each script
runs under ``python -W error``, with laplace-torch first imported by ``lsn_ext._laplace``.
"""

import ast
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py"))


def _tree(name: str) -> ast.Module:
    return ast.parse((EXAMPLES / f"{name}.py").read_text())


def _imports(name: str) -> list[tuple[str, list[str]]]:
    """The module-level imports in order: ``(module, names)`` (``names`` empty for ``import m``)."""
    found = []
    for node in _tree(name).body:
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _imports_laplace(name: str) -> bool:
    return any(module.split(".")[0] == "laplace" for module, _ in _imports(name))


WITH_LAPLACE = [n for n in NAMES if _imports_laplace(n)]


def test_the_examples_that_use_laplace_torch():
    assert WITH_LAPLACE == ["laplace_quickstart", "monai_3d"]


@pytest.mark.parametrize("name", WITH_LAPLACE)
def test_names_from_lsn_ext_are_imported_before_laplace(name):
    """A ``from lsn_ext import ...`` (not just the lazy ``import lsn_ext``) comes first."""
    imports = _imports(name)
    first_laplace = next(i for i, (m, _) in enumerate(imports) if m.split(".")[0] == "laplace")
    first_names = next(i for i, (m, names) in enumerate(imports) if m == "lsn_ext" and names)
    assert first_names < first_laplace, imports


def _warning_filters(name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(_tree(name))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "warnings"
        and node.func.attr in ("filterwarnings", "simplefilter")
    ]


def test_examples_filter_warnings():
    assert {n: len(_warning_filters(n)) for n in NAMES} == {
        "backpack_quickstart": 1,
        "laplace_quickstart": 1,
        "monai_3d": 1,
    }


@pytest.mark.parametrize("name", NAMES)
def test_only_named_upstream_warnings_are_filtered(name):
    """Each filter names its message and category; none is a blanket one, none is lsn_ext's."""
    for call in _warning_filters(name):
        where = f"{name}.py:{call.lineno}"
        assert call.func.attr == "filterwarnings", f"{where}: simplefilter filters every warning"
        options = {k.arg: k.value for k in call.keywords}
        message = options.get("message", call.args[1] if len(call.args) > 1 else None)
        assert isinstance(message, ast.Constant), f"{where}: no message"
        assert len(message.value) >= 10, f"{where}: message {message.value!r} is too broad"
        assert isinstance(options.get("category"), ast.Name), f"{where}: no category"
        assert options["category"].id != "Warning", f"{where}: every category"
        assert "lsn_ext" not in ast.unparse(call), f"{where}: filters lsn_ext's own warnings"
