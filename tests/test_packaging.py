"""Packaging: what the sdist and the wheel carry, and what ``import lsn_ext`` costs.

The release is built once per module, as for PyPI: ``python -m build --no-isolation`` (the sdist,
then the wheel from the unpacked sdist) from a copy of the source tree in a temporary folder
(nothing is written into the checkout, no network). The content checks, the install into a fresh
venv and ``twine check`` all read that one sdist and wheel.
"""

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import lsn_ext

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "laplace", "backpack", "stochman", "torchmetrics", "scipy")
DATA = (
    "img2d.tif",
    "mask2d.tif",
    "img3d.tif",
    "mask3d.tif",
    "histo.jpg",
    "PROVENANCE.md",
    "LICENSE",
)
# ".cache": integration/results/.cache, the experiments' run cache (git-ignored, hundreds of MB).
_SKIP = shutil.ignore_patterns(
    ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", ".*_cache", ".cache",
    ".hypothesis",
)  # fmt: skip


def _run(code: str, cwd: Path = ROOT) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _source_copy(dest: Path) -> Path:
    """A copy of the source tree without build outputs, caches and the venv."""
    shutil.copytree(ROOT, dest, ignore=_SKIP)
    return dest


@dataclass(frozen=True)
class Release:
    """The built sdist and wheel, and the build's output."""

    sdist: Path
    wheel: Path
    log: str


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Release:
    """``python -m build --no-isolation`` on a copy of the tree: the sdist, the wheel from it.

    Without ``build`` (the dev extra), setuptools' backend builds both from the tree (``log`` is
    then empty, and the twine test skips).
    """
    tmp = tmp_path_factory.mktemp("release")
    src, out = _source_copy(tmp / "src"), tmp / "dist"
    if importlib.util.find_spec("build") is None:
        log = ""
        _run(
            f"""
            from setuptools import build_meta
            build_meta.build_sdist({str(out)!r})
            build_meta.build_wheel({str(out)!r})
            """,
            cwd=src,
        )
    else:
        built = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), "."],
            cwd=src,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, built.stderr[-3000:]
        log = built.stdout + built.stderr
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Release(sdist, wheel, log)


@pytest.fixture(scope="module")
def dists(release) -> dict[str, set[str]]:
    """The member names of the sdist (sans top dir) and of the wheel, and the wheel's METADATA."""
    with tarfile.open(release.sdist) as tar:
        sdist_names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    with zipfile.ZipFile(release.wheel) as zf:
        wheel_names = set(zf.namelist())
        (metadata,) = (n for n in wheel_names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(metadata).decode()
    return {"sdist": sdist_names, "wheel": wheel_names, "metadata": set(meta.splitlines())}


def _test_imports() -> set[str]:
    """The files under tests/ that some test file imports (``tests.x`` or ``from tests import``)."""
    needed = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[0] != "tests":
                    continue
                base = ROOT / Path(*name.split("."))
                for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                    if candidate.is_file():
                        needed.add(candidate.relative_to(ROOT).as_posix())
    return needed


@pytest.mark.slow
def test_sdist_carries_the_whole_test_suite(dists):
    tests = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    imported = _test_imports()
    assert {"tests/conftest.py", "tests/reference.py", "tests/rules/__init__.py"} <= tests
    assert "tests/networks.py" in imported
    assert not (tests | imported) - dists["sdist"]
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in dists["sdist"])


@pytest.mark.slow
def test_sdist_carries_licences_docs_and_data(dists):
    top = {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "MANIFEST.in", "dev"}
    assert not top - dists["sdist"]
    assert not {f"lsn_ext/data/nuclei_files/{f}" for f in DATA} - dists["sdist"]
    assert "integration/harness.py" in dists["sdist"]
    examples = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.py")}
    assert {"examples/monai_3d.py", "examples/laplace_quickstart.py"} <= examples
    assert not examples - dists["sdist"]
    assert not any(n.startswith("examples_out/") for n in dists["sdist"])
    assert not any(n.startswith("integration/results/") for n in dists["sdist"])


@pytest.mark.slow
def test_wheel_carries_data_and_licences(dists):
    wheel = dists["wheel"]
    assert not {f"lsn_ext/data/nuclei_files/{f}" for f in DATA} - wheel
    assert "lsn_ext/py.typed" in wheel  # PEP 561
    licences = {n.split(".dist-info/", 1)[1] for n in wheel if ".dist-info/licenses/" in n}
    assert licences == {"licenses/LICENSE", "licenses/lsn_ext/data/nuclei_files/LICENSE"}
    assert not any(n.startswith("tests/") for n in wheel)
    assert "License-Expression: MIT" in dists["metadata"]
    assert "License-File: lsn_ext/data/nuclei_files/LICENSE" in dists["metadata"]
    # lsn_ext itself does not need torchvision (laplace-torch and BackPACK declare it)
    assert not any(line.startswith("Requires-Dist: torchvision") for line in dists["metadata"])


def test_licence_files_say_what_they_cover():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "lsn_ext/data/nuclei_files/LICENSE").read_text()
    assert "BSD 3-Clause License" in notice
    assert "Uwe Schmidt, Martin Weigert" in notice
    for name in ("img2d.tif", "mask2d.tif", "histo.jpg"):
        assert name in notice


def test_import_is_light():
    out = _run(
        f"""
        import sys
        import lsn_ext
        assert lsn_ext.__version__
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
        """
    )
    assert out.strip() == "[]"


def test_cli_help_is_light():
    out = _run(
        f"""
        import contextlib, io, sys
        from lsn_ext.__main__ import main
        with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
            main(["--help"])
        assert "demo" in text.getvalue(), text.getvalue()
        with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
            main(["--version"])
        assert text.getvalue().strip() == "lsn-ext " + __import__("lsn_ext").__version__
        with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
            main(["demo", "--help"])
        assert "(default: marglik)" in text.getvalue(), text.getvalue()
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
        """
    )
    assert out.strip() == "[]"


@pytest.mark.slow
def test_package_names_register_stochman_layers():
    """README, StochMan: using the package's names makes ``nnj`` layers known to the rule table."""
    out = _run(
        """
        import lsn_ext
        from stochman import nnj
        print(type(lsn_ext.get_rule(nnj.Conv2d(1, 1, 3))).__name__)
        print(lsn_ext.metrics.__name__)  # any submodule, public name or not, on first access
        """
    )
    assert out.split() == ["ConvRule", "lsn_ext.metrics"]


@pytest.mark.slow
def test_engines_register_stochman_layers_without_the_package_names():
    """Importing an engine module directly still finds the rules of ``nnj`` layers."""
    out = _run(
        """
        import sys
        import torch
        from stochman import nnj
        from lsn_ext.engine import diag_backprop
        from lsn_ext.estimators import ggn_diagonal

        net = nnj.Sequential(nnj.Conv2d(1, 2, 3, padding=1), nnj.Tanh(), nnj.Conv2d(2, 1, 1))
        x, y = torch.randn(2, 1, 4, 4), torch.ones(2, 1, 4, 4)
        for d in (diag_backprop(net, x, y, "bce"), ggn_diagonal(net, x, y, "bce")):
            print(len(d.diagonals), bool(torch.isfinite(d.vector).all()))
        print("lsn_ext.stochman_ext" in sys.modules)
        """
    )
    assert out.split() == ["4", "True", "4", "True", "True"]


def test_every_public_name_resolves():
    namespace = {}
    exec("from lsn_ext import *", namespace)
    assert set(lsn_ext.__all__) <= set(namespace)
    for name in lsn_ext.__all__:
        value = getattr(lsn_ext, name)
        assert value is namespace[name]
        if name == "__version__":
            continue
        source = importlib.import_module(lsn_ext._LAZY[name])
        assert value is (source if isinstance(value, ModuleType) else getattr(source, name))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = lsn_ext.not_a_name
    assert not hasattr(lsn_ext, "not.a.name")


def test_lazy_table_all_and_type_checking_imports_agree():
    tree = ast.parse((ROOT / "lsn_ext/__init__.py").read_text())
    (block,) = (
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    typed = {a.asname or a.name for n in block.body for a in n.names}
    assert set(lsn_ext._LAZY) == typed
    assert set(lsn_ext.__all__) == typed | {"__version__"}


@pytest.mark.slow
def test_the_public_api_imports_with_warnings_as_errors():
    code = (
        "import lsn_ext; lsn_ext.DiagBackprop; lsn_ext.predict; lsn_ext.laplace_bridge; "
        "import lsn_ext.lsn, lsn_ext.vi"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_broken_torchvision_gets_an_error_that_names_it_and_the_fix(tmp_path):
    """PyPI's CUDA torchvision beside a CPU torch fails inside ``import laplace`` (torchmetrics)."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    info = tmp_path / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    done = subprocess.run(
        [sys.executable, "-c", "import lsn_ext; lsn_ext.DiagBackprop"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lsn_ext could not import laplace-torch")
    assert "torchvision 0.28.0" in last
    assert "operator torchvision::nms does not exist" in last
    assert "pip uninstall torchvision" in last


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_quick_start(tmp_path, release):
    """The built wheel, installed offline into a new venv, runs a Laplace fit from outside the repo.

    The new venv reaches the dependencies through a ``.pth`` line to this environment's
    site-packages (no network), so what is tested is the wheel: its files, data, entry point and
    metadata, imported from the new venv's own site-packages. The venv has no pip of its own
    (seeding one costs seconds); this environment's pip installs into it (``pip --python``).
    """
    import site

    venv = tmp_path / "fresh"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    py = venv / "bin" / "python"
    (new_site,) = (venv / "lib").glob("python*/site-packages")
    (new_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "install", "--no-index", "--no-deps", str(release.wheel)], check=True, timeout=300
    )
    quick_start = textwrap.dedent(
        """
        import lsn_ext, torch
        from laplace import Laplace
        from torch.utils.data import DataLoader, TensorDataset
        from lsn_ext.models import UNet

        torch.manual_seed(0)
        x = torch.randn(4, 3, 16, 16)
        y = torch.randint(0, 3, (4, 16, 16))
        unet = UNet(3, 3, widths=(4, 8)).eval()
        la = Laplace(unet, "classification", subset_of_weights="all",
                     hessian_structure="diag", backend=lsn_ext.DiagBackprop)
        la.fit(DataLoader(TensorDataset(x, y), batch_size=2))
        assert bool((la.H >= 0).all()) and la.H.numel() == sum(p.numel() for p in unet.parameters())
        print(lsn_ext.__file__)
        from lsn_ext.data import load_nuclei

        print(type(load_nuclei()).__name__)
        """
    )
    ran = subprocess.run(
        [str(py), "-c", quick_start], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert Path(ran.stdout.splitlines()[0]).is_relative_to(new_site)
    version = subprocess.run(
        [str(venv / "bin" / "lsn-ext"), "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.stdout.strip().endswith(lsn_ext.__version__), version.stderr


@pytest.mark.slow
def test_the_release_builds_cleanly_and_passes_twine_check(release):
    """``python -m build`` without warnings, and ``twine check`` (PyPI's rendering of README)."""
    pytest.importorskip("build", reason="build is in the dev extra")
    pytest.importorskip("twine", reason="twine is in the dev extra")
    assert "WARNING" not in release.log, release.log[-3000:]
    names = sorted(p.name for p in release.sdist.parent.iterdir())
    assert names == [
        f"lsn_ext-{lsn_ext.__version__}-py3-none-any.whl",
        f"lsn_ext-{lsn_ext.__version__}.tar.gz",
    ]
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            str(release.sdist),
            str(release.wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert checked.stdout.count("PASSED") == 2
