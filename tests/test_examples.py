"""``examples/``: each script runs at its ``--quick`` sizes as a user runs it (a subprocess,
float32) and writes the maps, figures and numbers it promises; it prints every step with its
time, shows its progress bars on stderr and lets no warning through. The same run, under
``python -W error``, checks the examples' imports: laplace-torch is first imported by
``lsn_ext._laplace`` (``tests/test_example_sources.py`` checks the order in the sources)."""

import json
import math
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow  # three subprocesses, about 30 s of CPU together (one thread each)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUMBER = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf)"
FIRST_IMPORTS = "laplace-torch imported by: "
THROUGH_LSN_EXT = ["lsn_ext._laplace", "laplace"]  # lsn_ext._laplace first, then laplace-torch

# Runs the example as ``python examples/<name>.py ARGS`` does (``__main__``, the script's folder
# first on sys.path) and prints, last, which of laplace-torch and lsn_ext._laplace were first
# imported, in order (laplace-torch's submodules come later, through these).
RUN = f"""
import os, runpy, sys
order = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in ("laplace", "lsn_ext._laplace"):
            order.append(name)
sys.meta_path.insert(0, Spy())
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(sys.argv[0])
runpy.run_path(sys.argv[0], run_name="__main__")
print({FIRST_IMPORTS!r} + repr(order))
"""


def run_example(
    name: str, out: Path, steps: int, bars: tuple[str, ...], imports: list[str]
) -> tuple[str, dict]:
    """Run ``examples/<name>.py --quick --out out`` under ``python -W error``; its stdout and
    ``summary.json``.

    The CPU time of the child is bounded (wall-clock time depends on what else runs); it runs
    on the suite's torch threads (one unless ``$LSN_EXT_TEST_THREADS``, see
    ``tests/conftest.py``: on a busy machine a second OpenMP thread spin-waits). No warning is
    raised, shown or not (``-W error``: the examples filter only the upstream warnings they
    name). laplace-torch and ``lsn_ext._laplace`` are first imported in the order ``imports``
    (``[]``: neither). Its stdout names ``steps`` steps, each with its time, in order; its
    stderr holds the progress ``bars``, each run to the end, and no warning.
    """
    threads = os.environ.get("LSN_EXT_TEST_THREADS", "1")
    argv = [str(EXAMPLES / f"{name}.py"), "--quick", "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", RUN, *argv],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only: on a loaded machine monai_3d took 631 s for 36 s of CPU
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": threads},
    )
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before
    assert done.returncode == 0, done.stderr[-3000:]
    assert cpu < 60, f"{name} --quick took {cpu:.0f} s of CPU time"
    assert done.stdout.splitlines()[-1] == FIRST_IMPORTS + repr(imports), done.stdout[-2000:]
    started = re.findall(rf"^\[(\d+)/{steps}\] (?!done in)\S", done.stdout, re.MULTILINE)
    ended = re.findall(rf"^\[(\d+)/{steps}\] done in {NUMBER} s$", done.stdout, re.MULTILINE)
    assert started == ended == [str(k) for k in range(1, steps + 1)], done.stdout
    for bar in bars:
        assert re.search(rf"{re.escape(bar)}: 100%", done.stderr), (bar, done.stderr[-2000:])
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["seconds"]) == steps  # each step's wall-clock seconds
    assert all(v >= 0 for v in summary["seconds"].values())
    return done.stdout, summary


LAPLACE_BARS = ("train", "[Computing Hessian]", "[Optimizing marginal likelihood]")


def printed(stdout: str, prefix: str) -> list[float]:
    """The numbers on the printed lines that start with ``prefix``."""
    lines = [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]
    assert lines, f"no line starts with {prefix!r}:\n{stdout}"
    return [float(v) for line in lines for v in re.findall(NUMBER, line)]


def test_laplace_quickstart(tmp_path):
    out = tmp_path / "quickstart"
    stdout, summary = run_example(
        "laplace_quickstart", out, 5, (*LAPLACE_BARS, "predict: posterior draws"), THROUGH_LSN_EXT
    )
    maps = np.load(out / "maps.npz")
    assert maps["image"].shape == (4, 1, 32, 32)
    assert maps["mean"].shape == maps["variance"].shape == (4, 3, 32, 32)
    assert maps["entropy"].shape == maps["mutual_information"].shape == (4, 32, 32)
    assert all(maps[k].dtype == np.float32 for k in ("mean", "variance", "entropy"))
    np.testing.assert_allclose(maps["mean"].sum(1), 1.0, atol=1e-5)
    assert (maps["variance"] >= 0).all()
    assert (maps["entropy"] >= 0).all()
    assert (maps["entropy"] <= math.log(3) + 1e-5).all()
    assert (maps["mutual_information"] >= -1e-6).all()
    assert (maps["mutual_information"] <= maps["entropy"] + 1e-5).all()
    image = matplotlib.image.imread(out / "uncertainty.png")
    assert image.shape[0] > 100
    assert image.shape[1] > 300
    assert 0 <= summary["accuracy"] <= 1
    assert summary["prior_precision"] > 0
    assert set(summary["entropy"]) == {"wrong", "right", "boundary", "interior"}
    assert summary["entropy"]["boundary"] == pytest.approx(
        float(maps["entropy"][_boundary(maps["label"])].mean()), rel=1e-5
    )
    values = printed(stdout, "mean entropy")
    assert len(values) == 4
    assert all(math.isfinite(v) and v >= 0 for v in values)
    assert printed(stdout, "Laplace on")[1] == pytest.approx(summary["prior_precision"], rel=1e-3)


def _boundary(labels: np.ndarray) -> np.ndarray:
    """Pixels with a different label among their 8 neighbours (edge-padded)."""
    padded = np.pad(labels, ((0, 0), (1, 1), (1, 1)), mode="edge")
    h, w = labels.shape[1:]
    shifts = [padded[:, i : i + h, j : j + w] for i in range(3) for j in range(3)]
    return np.any([s != labels for s in shifts], axis=0)


def test_backpack_quickstart(tmp_path):
    out = tmp_path / "backpack"
    stdout, summary = run_example("backpack_quickstart", out, 4, (), [])
    saved = torch.load(out / "diagonals.pt")
    for part, ref in (("plain", "exact"), ("unet", "exact")):
        exact = saved[part][ref]
        for diags in saved[part].values():
            assert diags.keys() == exact.keys()
            for k, v in diags.items():
                assert v.shape == exact[k].shape
                assert v.dtype == torch.float32
                assert (v >= 0).all()
                assert torch.isfinite(v).all()
    assert len(saved["unet"]["exact"]) == 22  # U-Net 4-8-16: 10 convolutions + head
    assert summary["db_backpack_vs_native"] < 1e-5
    for part, last in (("plain", "4"), ("unet", "head")):
        for name, errors in summary[part].items():
            assert math.isfinite(errors["relative_error"])
            if name == "DB":  # exact for the last layer
                for suffix in ("weight", "bias"):
                    assert errors["trace_ratio"][f"{last}.{suffix}"] == pytest.approx(1, rel=1e-4)
    assert summary["unet"]["DB"]["trace_ratio"]["encoders.1.0.bias"] != pytest.approx(1, rel=0.01)
    assert "max relative difference" in stdout
    assert len(printed(stdout, "relative error over all weights:")) == 4
    image = matplotlib.image.imread(summary["files"]["figure"])
    assert image.shape[0] > 200


def test_monai_3d(tmp_path):
    pytest.importorskip("monai", reason="examples/monai_3d.py needs monai")
    nib = pytest.importorskip("nibabel", reason="examples/monai_3d.py writes NIfTI with nibabel")
    out = tmp_path / "monai"
    bars = (*LAPLACE_BARS, "predict: posterior draws")
    stdout, summary = run_example("monai_3d", out, 6, bars, THROUGH_LSN_EXT)
    assert summary["test_shape"] == [32, 32, 48]
    maps = {k: nib.load(p) for k, p in summary["files"]["maps"].items()}
    volumes = {k: np.asarray(m.dataobj) for k, m in maps.items()}
    assert set(volumes) == {
        "prob_foreground",
        "variance_foreground",
        "entropy",
        "mutual_information",
    }
    label = np.asarray(nib.load(out / "test_label.nii.gz").dataobj)
    scan = nib.load(out / "test_image.nii.gz")
    image = np.asarray(scan.dataobj)
    # SaveImage wrote every map with the scan's affine (anisotropic, flipped, shifted), not eye(4)
    assert not np.allclose(scan.affine, np.eye(4))
    for name, written in maps.items():
        np.testing.assert_allclose(written.affine, scan.affine, rtol=0, atol=1e-6, err_msg=name)
    assert label.shape == image.shape == (32, 32, 48)
    assert set(np.unique(label)) == {0, 1}
    for name, v in volumes.items():
        assert v.shape == (32, 32, 48), name
        assert v.dtype == np.float32, name
        assert np.isfinite(v).all(), name
        assert (v >= -1e-6).all(), name
    assert (volumes["prob_foreground"] <= 1).all()
    assert (volumes["entropy"] <= math.log(2) + 1e-5).all()
    assert (volumes["mutual_information"] <= volumes["entropy"] + 1e-5).all()
    assert len(list((out / "data").glob("case*_image.nii.gz"))) == 2
    for name in ("entropy", "mutual_information"):
        assert set(summary[name]) == {"inside", "outside", "boundary"}
        assert all(math.isfinite(v) and v >= 0 for v in summary[name].values())
    assert summary["entropy"]["inside"] == pytest.approx(
        float(volumes["entropy"][(label == 1) & ~_boundary3d(label)].mean()), rel=1e-5
    )
    assert all(n > 0 for n in summary["voxels"].values())
    assert sum(summary["voxels"].values()) == label.size
    assert 0 <= summary["dice"] <= 1
    # DiceMetric's foreground Dice, recomputed from the written maps (voxel for voxel on the label)
    pred = volumes["prob_foreground"] > 0.5
    dice = 2 * (pred & (label == 1)).sum() / (pred.sum() + (label == 1).sum())
    assert summary["dice"] == pytest.approx(float(dice), rel=1e-5)
    assert matplotlib.image.imread(summary["files"]["figure"]).shape[1] > 600
    assert summary["prior_precision"] > 0
    assert printed(stdout, "mean entropy") == pytest.approx(
        list(summary["entropy"].values()), abs=1e-4
    )


def _boundary3d(label: np.ndarray) -> np.ndarray:
    """Voxels with a different label in their 3×3×3 neighbourhood (edge-padded)."""
    padded = np.pad(label, 1, mode="edge")
    d, h, w = label.shape
    shifts = [
        padded[i : i + d, j : j + h, k : k + w]
        for i in range(3)
        for j in range(3)
        for k in range(3)
    ]
    return np.any([s != label for s in shifts], axis=0)
