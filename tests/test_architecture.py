"""The house rules of ARCHITECTURE.md, checked on the source.

- every ``lsn_ext`` module imports only from its own layer or lower ones (no upward import, no
  circle between packages), and never ``integration`` or ``tests``;
- no module of ``lsn_ext`` or ``integration`` imports another module's underscore names;
- no file of ``lsn_ext`` is over 800 lines;
- in ``integration/``, no module imports a script (a module that runs as ``__main__``);
- every public name and every documented module path still imports.

Each check reads the files with :mod:`ast`, so it sees imports inside functions too.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lsn_ext"

# ARCHITECTURE.md's table, lowest layer first: a module may import only from its own layer or lower.
LAYERS: list[tuple[str, ...]] = [
    (
        "_functional",
        "_kernels",
        "_memory",
        "_fingerprint",
        "_laplace",
        "outputs",
        "sliding",
        "links",
        "moments",
        "distributed",
        "metrics",
        "models",
        "data",
    ),
    ("rules",),
    ("engine", "forward"),
    ("estimators", "exact", "glm"),
    ("bridge", "vi", "backpack_ext", "stochman_ext", "laplace_ext", "kron", "lowrank"),
    ("lsn", "mixture"),
    ("demo", "__main__", "__init__"),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

PUBLIC_NAMES = {
    "BCEWithLogits",
    "BridgeDirichlet",
    "CrossEntropy",
    "DiagBackprop",
    "DiagBackpropResult",
    "ESTIMATORS",
    "ExpectedBCE",
    "GaussianMixture",
    "GridSearchResult",
    "Laplace",
    "LaplaceBridge",
    "LogsumexpBCE",
    "Loss",
    "MSE",
    "SegmentationPrediction",
    "SelectInput",
    "SelectOutput",
    "SlidingWindow",
    "StructuredGaussian",
    "TopK",
    "VariationalPosterior",
    "__version__",
    "backpack_ext",
    "bridge_predictive",
    "diag_backprop",
    "dirichlet_to_gaussian",
    "get_rule",
    "ggn_diagonal",
    "gridsearch_prior_precision",
    "laplace_bridge",
    "linearized_variance",
    "predict",
    "register_rule",
    "rules",
    "stochman_ext",
    "supported_modules",
    "vi",
}

# Module paths and names the README and the examples import.
DOCUMENTED = [
    ("lsn_ext.backpack_ext", ("DiagBackpropExtension", "convert", "diagonals")),
    ("lsn_ext.bridge", ("LaplaceBridge", "laplace_bridge", "dirichlet_to_gaussian", "TopK")),
    ("lsn_ext.data", ("lesion_dataset",)),
    ("lsn_ext.distributed", ("check_loader",)),
    ("lsn_ext.engine", ("diag_backprop", "DiagBackpropResult")),
    ("lsn_ext.estimators", ("ggn_diagonal", "ESTIMATORS")),
    ("lsn_ext.exact", ("exact_ggn_diagonal",)),
    ("lsn_ext.forward", ("linearized_variance",)),
    ("lsn_ext.laplace_ext", ("DiagBackprop", "predict", "gridsearch_prior_precision")),
    ("lsn_ext.lsn", ("fit_lsn", "predict_lsn")),
    ("lsn_ext.metrics", ()),
    ("lsn_ext.models", ("SSN", "UNet", "ssn_loss")),
    ("lsn_ext.rules", ("get_rule", "register_rule", "supported_modules")),
    ("lsn_ext.rules.ssn_likelihood", ("ExpectedBCE", "LogsumexpBCE")),
    ("lsn_ext.stochman_ext", ()),
    ("lsn_ext.vi", ("GaussianMixture", "StructuredGaussian", "VariationalPosterior")),
]


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` of every import in the file, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def _top(name: str) -> str:
    """``lsn_ext.engine.driver`` -> ``engine``; ``lsn_ext`` -> ``__init__``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


LSN_MODULES = _modules(PACKAGE)


def _targets(module: str, names: list[str]) -> list[str]:
    """The lsn_ext modules an import reaches (``from lsn_ext import rules`` reaches ``rules``)."""
    if module == "lsn_ext":
        return [f"lsn_ext.{n}" for n in names if f"lsn_ext.{n}" in LSN_MODULES] or ["lsn_ext"]
    return [module] if module.startswith("lsn_ext") else []


def test_every_module_has_a_layer():
    missing = sorted({_top(m) for m in LSN_MODULES} - LAYER_OF.keys())
    assert not missing, f"add {missing} to ARCHITECTURE.md's layer table and to LAYERS here"


@pytest.mark.parametrize("name", sorted(LSN_MODULES), ids=str)
def test_no_upward_import(name):
    here = _top(name)
    upward = []
    for module, names, line in _imports(name, LSN_MODULES[name]):
        if module.split(".")[0] in {"integration", "tests"}:
            upward.append(f"line {line}: {module}")
        for target in _targets(module, names):
            there = _top(target)
            if there != here and LAYER_OF[there] > LAYER_OF[here] and here != "__init__":
                upward.append(f"line {line}: {target} (layer {LAYER_OF[there]})")
    assert not upward, f"{name} (layer {LAYER_OF[here]}) imports upward: {upward}"


def test_no_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for name, path in LSN_MODULES.items():
        here = _top(name)
        if here == "__init__":
            continue
        for module, names, _ in _imports(name, path):
            for target in _targets(module, names):
                there = _top(target)
                if there not in {here, "__init__"}:
                    graph.setdefault(here, set()).add(there)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(p for p in graph if reaches(p, p, {p}))
    assert not circles, f"packages on an import circle: {circles}"


def _private_imports(modules: dict[str, Path], prefix: str) -> list[str]:
    bad = []
    for name, path in modules.items():
        for module, names, line in _imports(name, path):
            if module.startswith(prefix) and module != name:
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                bad += [f"{path.relative_to(ROOT)}:{line} {module}.{n}" for n in private]
    return bad


def test_no_module_imports_another_modules_underscore_names():
    bad = _private_imports(LSN_MODULES, "lsn_ext")
    integration = ROOT / "integration"
    bad += _private_imports(_modules(integration), "integration")
    assert not bad, f"make these public inside their package: {bad}"


@pytest.mark.parametrize("name", sorted(LSN_MODULES), ids=str)
def test_file_size(name):
    lines = len(LSN_MODULES[name].read_text().splitlines())
    assert lines <= 800, f"{name} has {lines} lines: split it by job (ARCHITECTURE.md)"


def test_no_integration_script_imports_another_script():
    modules = _modules(ROOT / "integration")
    scripts = {
        name for name, path in modules.items() if 'if __name__ == "__main__"' in path.read_text()
    }
    # a script that puts its folder on sys.path imports a sibling by its bare name
    bare = {name.rpartition(".")[2]: name for name in scripts}
    bad = []
    for name, path in modules.items():
        for module, names, line in _imports(name, path):
            reached = {module} | {f"{module}.{n}" for n in names}
            reached |= {bare[m] for m in reached if m in bare}
            bad += [f"{name}:{line} imports {m}" for m in sorted(reached & scripts) if m != name]
    assert not bad, f"move what they share into a kit or harness module: {bad}"


def test_public_names_kept():
    import lsn_ext

    assert set(lsn_ext.__all__) == PUBLIC_NAMES
    for name in PUBLIC_NAMES:
        assert getattr(lsn_ext, name) is not None


@pytest.mark.parametrize(("module", "names"), DOCUMENTED, ids=[m for m, _ in DOCUMENTED])
def test_documented_paths_import(module, names):
    imported = importlib.import_module(module)
    for name in names:
        assert hasattr(imported, name), f"{module}.{name} is documented but gone"
