"""The command lines of ``examples/`` and of ``lsn-ext demo``: checked before any work, and an
explicitly given flag is never silently replaced by ``--quick``'s sizes.

The examples' ``parse_args`` run in this process (no training); their full runs are in
``tests/test_examples.py``.
"""

import importlib.util
import time
from pathlib import Path

import pytest

from lsn_ext.__main__ import main as cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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
