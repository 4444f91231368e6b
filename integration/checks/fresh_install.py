"""The README's install commands, run in a new venv, then the quick start from outside the clone.

Usage::

    .venv/bin/python -m integration.checks.fresh_install            # README's CUDA pair
    .venv/bin/python -m integration.checks.fresh_install --torch torch==2.14.1 \\
        --torchvision torchvision==0.29.1                           # another matching pair
    .venv/bin/python -m integration.checks.fresh_install \\
        --index-url https://download.pytorch.org/whl/cpu

Steps, each timed: ``python -m venv``; ``pip install TORCH TORCHVISION [--index-url URL]`` (the
README's first line); ``pip install SOURCE`` (the second line: this repository, or a built wheel
or sdist); then, from a temporary folder outside the repository, the checks a new user would
make: the torch build is still the one installed first (pip did not swap it), torchvision
imports, ``python -W error -c "import lsn_ext; lsn_ext.DiagBackprop"``, ``lsn-ext --version``,
and a quick start (a ``Laplace`` fit of a U-Net with ``DiagBackprop``, marglik and
``lsn_ext.predict``). Writes ``integration/results/fresh_install.md`` (``--out``) with each
step's time, the versions installed and the venv's size. Needs the package index (PyPI, or the
``--index-url``); nothing else is downloaded.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "integration" / "results"

QUICK_START = textwrap.dedent(
    """
    import torch
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    import lsn_ext
    from lsn_ext.models import UNet

    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8, 32, 32))
    unet = UNet(3, 3, widths=(8, 16)).eval()
    la = Laplace(unet, "classification", subset_of_weights="all", hessian_structure="diag",
                 backend=lsn_ext.DiagBackprop)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=4))
    la.optimize_prior_precision(method="marglik", n_steps=20)
    maps = lsn_ext.predict(la, x[:2], n_samples=8)
    assert maps.variance.shape == (2, 3, 32, 32) and bool((maps.variance >= 0).all())
    print("quick start ok: lsn_ext", lsn_ext.__version__, "from", lsn_ext.__file__)
    """
)


@dataclass
class Step:
    """One command of the run: what it was, how long it took, and its last output line."""

    name: str
    command: str
    seconds: float
    ok: bool
    tail: str


def run_step(name: str, argv: list[str], cwd: Path) -> Step:
    """Run ``argv`` in ``cwd``; a failed step is recorded, not raised (the report shows it)."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    # the outcome's line: the last of stdout on success, of stderr (the error) on failure
    lines = (
        (done.stdout if done.returncode == 0 else done.stderr or done.stdout).strip().splitlines()
    )
    return Step(
        name,
        " ".join(argv),
        time.perf_counter() - start,
        done.returncode == 0,
        _cell(lines[-1] if lines else ""),
    )


def _cell(text: str, width: int = 160) -> str:
    """``text`` as one markdown table cell: pipes escaped, cut to ``width`` characters."""
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def folder_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def install_steps(
    venv: Path, torch: str, torchvision: str, index_url: str | None, source: str
) -> list[tuple[str, list[str]]]:
    """The README's two install lines for ``venv``, as (name, argv) pairs."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    first = [*pip, torch, torchvision] + (["--index-url", index_url] if index_url else [])
    return [("install torch + torchvision", first), ("install lsn_ext", [*pip, source])]


def check_steps(venv: Path, script: Path) -> list[tuple[str, list[str]]]:
    """What a new user checks after the install, as (name, argv) pairs."""
    py = str(venv / "bin" / "python")
    return [
        ("torchvision imports", [py, "-c", "import torchvision; print(torchvision.__version__)"]),
        (
            "import, warnings as errors",
            [py, "-W", "error", "-c", "import lsn_ext; lsn_ext.DiagBackprop"],
        ),
        ("lsn-ext --version", [str(venv / "bin" / "lsn-ext"), "--version"]),
        ("quick start", [py, str(script)]),
    ]


def report(steps: list[Step], versions: str, size: int, args: argparse.Namespace) -> str:
    """The markdown report."""
    ok = all(s.ok for s in steps)
    rows = [
        f"| {s.name} | `{s.command}` | {s.seconds:.0f} | {'ok' if s.ok else 'FAILED'} | {s.tail} |"
        for s in steps
    ]
    return "\n".join(
        [
            "# A fresh install from the README's commands",
            "",
            "Generated by `integration/checks/fresh_install.py`; Python "
            f"{platform.python_version()}, {platform.machine()}. Commands: "
            f"`pip install {args.torch} {args.torchvision}`"
            + (f" `--index-url {args.index_url}`" if args.index_url else "")
            + f", then `pip install {args.source_name}`. Result: "
            + ("every step passed." if ok else "a step FAILED (below)."),
            "",
            "| step | command | seconds | result | last output line |",
            "|---|---|---:|---|---|",
            *rows,
            "",
            f"Installed: {versions}. Size of the venv: {size / 2**30:.2f} GiB.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="torch==2.13.0", help="(default: %(default)s)")
    parser.add_argument(
        "--torchvision", default="torchvision==0.28.0", help="(default: %(default)s)"
    )
    parser.add_argument("--index-url", default=None, help="torch's index (default: PyPI)")
    parser.add_argument(
        "--source", default=str(ROOT), help="what `pip install` gets (default: this repository)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.source_name = "." if Path(args.source).resolve() == ROOT else Path(args.source).name
    work = Path(tempfile.mkdtemp(prefix="lsn-fresh-"))
    try:
        venv = work / "venv"
        steps = [run_step("python -m venv", [sys.executable, "-m", "venv", str(venv)], work)]
        py = str(venv / "bin" / "python")
        first, second = install_steps(
            venv, args.torch, args.torchvision, args.index_url, args.source
        )
        steps.append(run_step(*first, work))
        steps.append(
            run_step("torch installed", [py, "-c", "import torch; print(torch.__version__)"], work)
        )
        steps.append(run_step(*second, work))
        same = f"import torch; assert torch.__version__ == {steps[-2].tail!r}, torch.__version__"
        steps.append(
            run_step("torch not swapped by pip", [py, "-c", same + "; print('same torch')"], work)
        )
        script = work / "quick_start.py"
        script.write_text(QUICK_START)
        steps += [run_step(name, cmd, work) for name, cmd in check_steps(venv, script)]
        freeze = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True
        ).stdout.splitlines()
        wanted = ("torch==", "torchvision==", "laplace-torch==", "backpack-for-pytorch==", "lsn")
        versions = ", ".join(line for line in freeze if line.lower().startswith(wanted))
        text = report(steps, versions, folder_size(venv), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fresh_install.md"
    path.write_text(text)
    print(text)
    return path


if __name__ == "__main__":
    main()
