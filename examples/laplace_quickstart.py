"""laplace-torch quick start: a Laplace approximation of a 2-D segmentation U-Net
================================================================================

What it shows:

1. Synthetic images with three classes (background, discs, squares) under noise, as an
   ordinary `TensorDataset`: images `[N, 1, H, W]`, class indices `[N, H, W]`.
2. `lsn_ext.models.UNet` (plain `nn.Module`, `torch.cat` skips) trained for a few steps with
   cross-entropy.
3. `Laplace(unet, "classification", subset_of_weights="all", hessian_structure="diag",
   backend=DiagBackprop)`, `fit` on the training loader (the unbiased Monte-Carlo GGN diagonal),
   `optimize_prior_precision(method="marglik")`.
4. Per-pixel maps of held-out images with `lsn_ext.predict`: predictive mean, epistemic
   variance, predictive entropy and mutual information; a figure of them (one colour scale and
   colorbar per column), the maps as `maps.npz`, and a summary (accuracy; mean entropy on wrong
   and right pixels, on class boundaries and away from them) printed and written to
   `summary.json`.

Each step prints what it runs and how long it took; training, fit, prior and prediction show
tqdm progress bars on stderr (`--no-progress` hides them). Run from the repository root:

```bash
.venv/bin/python examples/laplace_quickstart.py --out examples_out/laplace_quickstart
.venv/bin/python examples/laplace_quickstart.py --quick   # seconds: small images, few steps
LSN_EXT_QUICK=1 .venv/bin/python examples/laplace_quickstart.py   # the same as --quick
```

The flags are checked before torch is imported, so `--help` and a mistyped flag answer at once.
`LSN_EXT_QUICK=1` selects the quick sizes without arguments (for a documentation build that runs
the examples).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CLASSES = ("background", "disc", "square")
# Sizes of the full run and of --quick; a flag given on the command line overrides either.
FULL = {"size": 64, "train": 64, "test": 8, "widths": (8, 16, 32), "steps": 120, "samples": 30}
QUICK = {"size": 32, "train": 16, "test": 4, "widths": (4, 8, 16), "steps": 10, "samples": 4}
QUICK_ENV = "LSN_EXT_QUICK"  # "1": --quick's sizes without arguments (documentation builds)


def int_at_least(low: int, multiple: int = 1) -> Callable[[str], int]:
    """An argparse type: an int ``>= low`` that is a multiple of ``multiple``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or value % multiple:
            also = f" and a multiple of {multiple}" if multiple > 1 else ""
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{also}, got {value}")
        return value

    return parse


def quick_from_environment(parser: argparse.ArgumentParser) -> bool:
    """Whether ``LSN_EXT_QUICK`` asks for the quick sizes (``1``); unset, empty or ``0``: no."""
    value = os.environ.get(QUICK_ENV, "")
    if value not in ("", "0", "1"):
        parser.error(f"{QUICK_ENV} must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def fill_sizes(args: argparse.Namespace, full: dict, quick: dict) -> argparse.Namespace:
    """The flags left out get ``--quick``'s sizes (with ``--quick``) or the full run's.

    A flag given on the command line is kept: ``--quick`` never overrides it.
    """
    for name, value in (quick if args.quick else full).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything runs; ``--quick`` fills only the flags left out."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def sized(flag: str, kind: Callable[[str], int], what: str, **kwargs) -> None:
        """A flag whose default is FULL's or QUICK's entry, filled in by fill_sizes."""
        name = flag[2:]
        full, quick = (
            " ".join(map(str, v)) if isinstance(v, tuple) else v for v in (FULL[name], QUICK[name])
        )
        parser.add_argument(
            flag,
            type=kind,
            default=argparse.SUPPRESS,
            help=f"{what} (default {full}; --quick: {quick})",
            **kwargs,
        )

    parser.add_argument("--out", type=Path, default=Path("examples_out/laplace_quickstart"))
    sized("--size", int_at_least(4), "image edge, divisible by 2**(levels - 1)")
    sized("--train", int_at_least(1), "training images")
    sized("--test", int_at_least(1), "held-out images")
    sized("--widths", int_at_least(1), "U-Net widths, one per level", nargs="+")
    sized("--steps", int_at_least(1), "training steps")
    parser.add_argument("--batch", type=int_at_least(1), default=8)
    sized("--samples", int_at_least(2), "posterior samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"small images and few steps (for tests; also {QUICK_ENV}=1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.quick = getattr(args, "quick", False) or quick_from_environment(parser)
    args = fill_sizes(args, FULL, QUICK)
    divisor = 2 ** (len(args.widths) - 1)
    if args.size % divisor:
        parser.error(
            f"--size {args.size} must be divisible by 2**{len(args.widths) - 1} = {divisor} "
            f"for a U-Net of {len(args.widths)} levels (--widths {' '.join(map(str, args.widths))})"
        )
    return args


class Steps:
    """Prints each step when it starts (``[k/n] what``) and its wall-clock seconds when it ends."""

    def __init__(self, total: int):
        self.total = total
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str, what: str) -> Iterator[None]:
        """One step, timed as ``seconds[name]``."""
        number = len(self.seconds) + 1
        print(f"[{number}/{self.total}] {what}", flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        print(f"[{number}/{self.total}] done in {self.seconds[name]:.1f} s", flush=True)


if __name__ == "__main__":
    ARGS = parse_args()  # before the imports below: --help and bad flags answer without torch

import itertools
import json
import math
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

# lsn_ext before laplace-torch: importing an lsn_ext name that needs laplace-torch (DiagBackprop)
# imports laplace-torch through lsn_ext, which explains a torchvision that does not match torch
# and silences only asdl's `torch.jit.script` deprecation warning. (`import lsn_ext` alone is
# lazy and imports nothing yet.)
from lsn_ext import DiagBackprop, SegmentationPrediction, predict
from lsn_ext.models import UNet

# isort: split
from laplace import Laplace

CLASS_COLOURS = ListedColormap(["black", "tab:orange", "tab:cyan"])


def synthetic_images(n: int, size: int, generator: torch.Generator):
    """``n`` noisy images ``[n, 1, size, size]`` with their class maps ``[n, size, size]``.

    Each image holds two to four shapes, each a disc (class 1, intensity 1) or a square (class 2,
    intensity 2) on a background of intensity 0, under Gaussian noise.
    """
    rows = torch.arange(size).view(-1, 1).float()
    cols = torch.arange(size).view(1, -1).float()
    labels = torch.zeros(n, size, size, dtype=torch.long)
    for i in range(n):
        for _ in range(int(torch.randint(2, 5, (1,), generator=generator))):
            r = size * (0.08 + 0.1 * torch.rand(1, generator=generator)).item()
            cy, cx = (r + (size - 2 * r) * torch.rand(2, generator=generator)).tolist()
            if torch.rand(1, generator=generator).item() < 0.5:
                shape = (rows - cy) ** 2 + (cols - cx) ** 2 <= r**2
                labels[i][shape] = 1
            else:
                shape = ((rows - cy).abs() <= r) & ((cols - cx).abs() <= r)
                labels[i][shape] = 2
    brightness = torch.tensor([0.0, 1.0, 2.0])[labels]
    images = brightness + 0.35 * torch.randn(n, size, size, generator=generator)
    return images[:, None], labels


def boundary(labels: torch.Tensor) -> torch.Tensor:
    """Pixels of ``labels [N, H, W]`` with a pixel of another class in their 3×3 block."""
    x = labels[:, None].float()
    dilated = F.max_pool2d(x, 3, stride=1, padding=1)
    eroded = -F.max_pool2d(-x, 3, stride=1, padding=1)
    return (dilated != eroded)[:, 0]


def figure(images, labels, maps: SegmentationPrediction, rows: int) -> plt.Figure:
    """One row per image: input, truth, prediction, entropy, mutual information, variance.

    Each column has one colour scale over its rows and a colorbar below it.
    """
    classes = {"cmap": CLASS_COLOURS, "vmin": -0.5, "vmax": len(CLASSES) - 0.5}
    variance = maps.variance.sum(1)
    columns = {
        "image": (images[:, 0], {"cmap": "gray"}),
        "ground truth": (labels, classes),
        "prediction": (maps.mean.argmax(1), classes),
        "predictive entropy (nats)": (maps.entropy, {"vmin": 0, "vmax": math.log(len(CLASSES))}),
        "mutual information (nats)": (
            maps.mutual_information,
            {"vmin": 0, "vmax": maps.mutual_information[:rows].max().item()},
        ),
        "Var p, summed over classes": (variance, {"vmin": 0, "vmax": variance[:rows].max().item()}),
    }
    fig, axes = plt.subplots(
        rows,
        len(columns),
        figsize=(2.3 * len(columns), 2.2 * rows + 0.9),
        layout="constrained",
        squeeze=False,
    )
    for j, (title, (values, style)) in enumerate(columns.items()):
        for i in range(rows):
            shown = axes[i, j].imshow(values[i].numpy(), interpolation="nearest", **style)
            axes[i, j].set_axis_off()
        axes[0, j].set_title(title, fontsize=9)
        bar = fig.colorbar(shown, ax=axes[:, j], orientation="horizontal", shrink=0.9)
        bar.ax.tick_params(labelsize=7)
        if style.get("cmap") is CLASS_COLOURS:
            bar.set_ticks(range(len(CLASSES)), labels=CLASSES)
    return fig


def main(args: argparse.Namespace) -> dict:
    """Run the quick start; return the summary that is also written to ``summary.json``."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(args.seed)
    plt.switch_backend("Agg")  # files only, no display needed
    args.out.mkdir(parents=True, exist_ok=True)
    steps, progress = Steps(5), not args.no_progress

    data = f"{args.train} training and {args.test} held-out images of {args.size}×{args.size}"
    with steps("data", f"data: {data}, classes {', '.join(CLASSES)}"):
        g = torch.Generator().manual_seed(args.seed)
        images, labels = synthetic_images(args.train, args.size, g)
        test_images, test_labels = synthetic_images(args.test, args.size, g)
        train_loader = DataLoader(
            TensorDataset(images, labels), batch_size=args.batch, shuffle=True
        )

    widths = " ".join(map(str, args.widths))
    with steps("train", f"train: U-Net (widths {widths}), {args.steps} steps of Adam"):
        unet = UNet(1, len(CLASSES), widths=tuple(args.widths))
        optimiser = torch.optim.Adam(unet.parameters(), lr=1e-2)
        unet.train()
        batches = (batch for _ in itertools.count() for batch in train_loader)
        losses = []
        bar = tqdm(range(args.steps), desc="train", unit="step", disable=not progress)
        for _ in bar:
            x, y = next(batches)
            optimiser.zero_grad()
            loss = F.cross_entropy(unet(x), y)
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        print(f"trained {args.steps} steps: cross-entropy {losses[0]:.3f} -> {losses[-1]:.3f}")

    with steps("laplace", "Laplace: GGN diagonal (DiagBackprop), marglik prior precision"):
        unet.eval()
        la = Laplace(
            unet,
            "classification",
            subset_of_weights="all",
            hessian_structure="diag",
            backend=DiagBackprop,
        )
        fit_loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch)
        la.fit(fit_loader, progress_bar=progress)
        with warnings.catch_warnings():
            # laplace-torch reminds that its own `la(x)` defaults to link_approx="probit"; this
            # example predicts with lsn_ext's predict, which takes the link approximation itself.
            warnings.filterwarnings(
                "ignore",
                message=r"By default `link_approx` is `probit`",
                category=UserWarning,
                module=r"laplace\.baselaplace",
            )
            la.optimize_prior_precision(
                method="marglik", prior_structure="scalar", progress_bar=progress
            )
        prior = la.prior_precision.item()
        print(f"Laplace on {la.n_params} weights, marglik prior precision {prior:.4g}")

    with steps("predict", f"predict: {args.test} held-out images, {args.samples} samples"):
        maps = predict(
            la,
            test_images,
            args.samples,
            generator=torch.Generator().manual_seed(args.seed),
            progress_bar=progress,
        )

    wrong = maps.mean.argmax(1) != test_labels
    edge = boundary(test_labels)
    regions = {"wrong": wrong, "right": ~wrong, "boundary": edge, "interior": ~edge}
    png = args.out / "uncertainty.png"
    with steps("write", f"write: maps.npz and {png.name} in {args.out}"):
        np.savez(
            args.out / "maps.npz",
            image=test_images.numpy(),
            label=test_labels.numpy(),
            mean=maps.mean.numpy(),
            variance=maps.variance.numpy(),
            entropy=maps.entropy.numpy(),
            mutual_information=maps.mutual_information.numpy(),
        )
        fig = figure(test_images, test_labels, maps, rows=min(3, args.test))
        fig.savefig(png, dpi=80)
        plt.close(fig)
    summary = {
        "accuracy": 1.0 - wrong.float().mean().item(),
        "prior_precision": prior,
        "n_params": la.n_params,
        "train_loss": [losses[0], losses[-1]],
        "entropy": {k: maps.entropy[m].mean().item() for k, m in regions.items() if m.any()},
        "mutual_information": {
            k: maps.mutual_information[m].mean().item() for k, m in regions.items() if m.any()
        },
        "pixels": {k: int(m.sum()) for k, m in regions.items()},
        "files": {"figure": str(png), "maps": str(args.out / "maps.npz")},
        "seconds": steps.seconds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    print(
        f"{args.test} held-out images, {args.samples} posterior samples: pixel accuracy "
        f"{summary['accuracy']:.3f}"
    )
    for name in ("entropy", "mutual_information"):
        parts = "  ".join(f"{k} {v:.4f}" for k, v in summary[name].items())
        print(f"mean {name:18s} {parts}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in steps.seconds.items()))
    print(f"figure {png}; maps.npz and summary.json in {args.out}")
    return summary


if __name__ == "__main__":
    main(ARGS)
