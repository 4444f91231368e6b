"""The command lines of ``examples/`` and of ``lsn-ext demo``: checked before any work (the
examples' before torch is imported), and an explicitly given flag is never silently replaced by
``--quick``'s sizes (nor by ``LSN_EXT_QUICK=1``'s).

The examples' ``parse_args`` run in this process (no training); their full runs are in
``tests/test_examples.py``.
"""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lsn_ext.__main__ import main as cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py"))


@pytest.fixture(autouse=True)
def _no_quick_environment(monkeypatch):
    """The full sizes unless a test asks for ``LSN_EXT_QUICK``."""
    monkeypatch.delenv("LSN_EXT_QUICK", raising=False)


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BAD = {
    "backpack-quick-zero-mc-samples": (
        "backpack_quickstart",
        ["--quick", "--mc-samples", "0"],
        "argument --mc-samples: must be an integer >= 1, got 0",
    ),
    "backpack-zero-mc-samples": (
        "backpack_quickstart",
        ["--mc-samples", "0"],
        "argument --mc-samples: must be an integer >= 1, got 0",
    ),
    "backpack-size-not-multiple-of-4": (
        "backpack_quickstart",
        ["--size", "10"],
        "argument --size: must be an integer >= 4 and a multiple of 4, got 10",
    ),
    "backpack-zero-batch": ("backpack_quickstart", ["--batch", "0"], "argument --batch"),
    "backpack-text": (
        "backpack_quickstart",
        ["--mc-samples", "many"],
        "argument --mc-samples: expected an integer, got 'many'",
    ),
    "laplace-one-sample": (
        "laplace_quickstart",
        ["--quick", "--samples", "1"],
        "argument --samples: must be an integer >= 2, got 1",
    ),
    "laplace-zero-width": ("laplace_quickstart", ["--widths", "4", "0"], "argument --widths"),
    "laplace-size-for-the-levels": (
        "laplace_quickstart",
        ["--quick", "--size", "30"],
        "--size 30 must be divisible by 2**2 = 4 for a U-Net of 3 levels",
    ),
    "monai-zero-steps": ("monai_3d", ["--quick", "--steps", "0"], "argument --steps"),
    "monai-zero-test-size": ("monai_3d", ["--test-size", "0", "8", "8"], "argument --test-size"),
    "monai-crop-beyond-volume": (
        "monai_3d",
        ["--quick", "--crop", "40"],
        "--crop 40 exceeds --size 36",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_examples_refuse_bad_flags_before_any_work(case, capsys):
    name, argv, message = case
    module = _example(name)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


KEPT = {
    "backpack": ("backpack_quickstart", ["--mc-samples", "2"], {"mc_samples": 2, "size": 8}),
    "laplace": (
        "laplace_quickstart",
        ["--steps", "3", "--widths", "2", "4"],
        {"steps": 3, "widths": [2, 4], "size": 32, "samples": 4},
    ),
    "monai": ("monai_3d", ["--samples", "6"], {"samples": 6, "cases": 2, "crop": 32}),
}


@pytest.mark.parametrize("case", KEPT.values(), ids=KEPT.keys())
def test_quick_keeps_the_flags_given_and_fills_the_rest(case):
    """``--quick --mc-samples 0`` once ran with 4 vectors; ``--quick --mc-samples 2`` too."""
    name, argv, expected = case
    module = _example(name)
    quick = vars(module.parse_args(["--quick", *argv]))
    assert {k: quick[k] for k in expected} == expected
    assert {k: quick[k] for k in module.QUICK if k not in expected} == {
        k: v for k, v in module.QUICK.items() if k not in expected
    }
    full = vars(module.parse_args([]))
    assert {k: full[k] for k in module.FULL} == module.FULL


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--samples", "10"], "--quick runs 3 epistemic samples, not --samples 10"),
        (["--logit-samples", "20"], "--quick runs 3 aleatoric samples, not --logit-samples 20"),
        (["--epochs", "5"], "--quick trains 1 epoch, not --epochs 5"),
        (["--rank", "10"], "--quick uses rank 2 at most, not --rank 10"),
        (["--ensemble", "3"], "--quick trains 2 ensemble members at most, not --ensemble 3"),
    ],
    ids=["samples", "logit-samples", "epochs", "rank", "ensemble"],
)
def test_demo_refuses_a_flag_that_quick_would_replace(argv, message, capsys):
    start = time.process_time()
    with pytest.raises(SystemExit):
        cli(["demo", "--quick", *argv])
    assert message in capsys.readouterr().err
    assert time.process_time() - start < 5  # refused up front, not after the training


@pytest.mark.parametrize("name", ["backpack_quickstart", "laplace_quickstart", "monai_3d"])
def test_quick_environment_variable_selects_the_quick_sizes(name, monkeypatch):
    """``LSN_EXT_QUICK=1``: a runner without arguments (the docs gallery) gets the quick sizes."""
    module = _example(name)
    monkeypatch.setenv("LSN_EXT_QUICK", "1")
    args = vars(module.parse_args([]))
    assert args["quick"] is True
    assert {k: args[k] for k in module.QUICK} == module.QUICK
    monkeypatch.setenv("LSN_EXT_QUICK", "0")
    args = vars(module.parse_args([]))
    assert args["quick"] is False
    assert {k: args[k] for k in module.FULL} == module.FULL


def test_quick_environment_variable_refuses_other_values(monkeypatch, capsys):
    monkeypatch.setenv("LSN_EXT_QUICK", "yes")
    with pytest.raises(SystemExit) as exit_info:
        _example("laplace_quickstart").parse_args([])
    assert exit_info.value.code == 2
    assert "LSN_EXT_QUICK must be 0 or 1 (or unset), got 'yes'" in capsys.readouterr().err


HEAVY = ("torch", "numpy", "matplotlib", "lsn_ext", "laplace", "backpack", "monai", "nibabel")


def _run_without_heavy_imports(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python -X importtime examples/<name>.py *argv``; fails if it imported a heavy module."""
    env = {k: v for k, v in os.environ.items() if k != "LSN_EXT_QUICK"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(EXAMPLES / f"{name}.py"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    # -X importtime: one line per imported module, "import time: self | cumulative | name"
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "argparse" in imported  # the listing was read
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, f"{name} {' '.join(argv)} imported {heavy[:5]}"
    return done


@pytest.mark.parametrize("name", NAMES)
def test_help_answers_without_importing_torch(name):
    done = _run_without_heavy_imports(name, ["--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")
    assert "--quick" in done.stdout
    assert "LSN_EXT_QUICK=1" in done.stdout


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_flag_is_refused_without_importing_torch(name):
    done = _run_without_heavy_imports(name, ["--seed", "one"])
    assert done.returncode == 2
    assert "argument --seed: invalid int value: 'one'" in done.stderr
