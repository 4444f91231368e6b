"""laplace-torch quick start: a Laplace approximation of a 2-D segmentation U-Net.

What it shows:

1. Synthetic images with three classes (background, discs, squares) under noise, as an
   ordinary ``TensorDataset``: images ``[N, 1, H, W]``, class indices ``[N, H, W]``.
2. ``lsn_ext.models.UNet`` (plain ``nn.Module``, ``torch.cat`` skips) trained for a few steps with
   cross-entropy.
3. ``Laplace(unet, "classification", subset_of_weights="all", hessian_structure="diag",
   backend=lsn_ext.DiagBackprop)``, ``fit`` on the training loader (the unbiased Monte-Carlo GGN
   diagonal), ``optimize_prior_precision(method="marglik")``.
4. Per-pixel maps of held-out images with ``lsn_ext.predict``: predictive mean, epistemic
   variance, predictive entropy and mutual information; a PNG figure of them, the maps as
   ``maps.npz``, and a summary (accuracy; mean entropy on wrong and right pixels, on class
   boundaries and away from them) printed and written to ``summary.json``.

Run from the repository root (CPU, float32; about 1.5 minutes on two cores at the defaults)::

    .venv/bin/python examples/laplace_quickstart.py --out examples_out/laplace_quickstart
    .venv/bin/python examples/laplace_quickstart.py --quick   # seconds: small images, few steps
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import lsn_ext
from lsn_ext.models import UNet

CLASSES = ("background", "disc", "square")
# Sizes of the full run and of --quick; a flag given on the command line overrides either.
FULL = {"size": 64, "train": 64, "test": 8, "widths": (8, 16, 32), "steps": 120, "samples": 30}
QUICK = {"size": 32, "train": 16, "test": 4, "widths": (4, 8, 16), "steps": 10, "samples": 4}


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


def fill_sizes(args: argparse.Namespace, full: dict, quick: dict) -> argparse.Namespace:
    """The flags left out get ``--quick``'s sizes (with ``--quick``) or the full run's.

    A flag given on the command line is kept: ``--quick`` never overrides it.
    """
    for name, value in (quick if args.quick else full).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


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


def figure(images, labels, maps, path: Path, rows: int) -> None:
    """One row per image: input, truth, prediction, entropy, mutual information, variance."""
    columns = {
        "image": images[:, 0],
        "ground truth": labels,
        "prediction": maps.mean.argmax(1),
        "predictive entropy": maps.entropy,
        "mutual information": maps.mutual_information,
        "Var p (sum over classes)": maps.variance.sum(1),
    }
    plt.switch_backend("Agg")  # files only, no display needed
    fig, axes = plt.subplots(rows, len(columns), figsize=(2.2 * len(columns), 2.2 * rows))
    axes = np.atleast_2d(axes)
    for j, (title, values) in enumerate(columns.items()):
        for i in range(rows):
            cmap = "viridis" if j > 2 else ("gray" if j == 0 else "tab10")
            kwargs = {"vmin": 0, "vmax": 9} if cmap == "tab10" else {}
            axes[i, j].imshow(values[i].numpy(), cmap=cmap, interpolation="nearest", **kwargs)
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
        axes[0, j].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


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
        "--quick", action="store_true", help="small images and few steps (for tests)"
    )
    args = fill_sizes(parser.parse_args(argv), FULL, QUICK)
    divisor = 2 ** (len(args.widths) - 1)
    if args.size % divisor:
        parser.error(
            f"--size {args.size} must be divisible by 2**{len(args.widths) - 1} = {divisor} "
            f"for a U-Net of {len(args.widths)} levels (--widths {' '.join(map(str, args.widths))})"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the quick start; return the summary that is also written to ``summary.json``."""
    args = parse_args(argv)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(args.seed)
    warnings.filterwarnings("ignore", category=UserWarning)  # laplace-torch's notes
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    g = torch.Generator().manual_seed(args.seed)
    images, labels = synthetic_images(args.train, args.size, g)
    test_images, test_labels = synthetic_images(args.test, args.size, g)
    train_loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch, shuffle=True)

    unet = UNet(1, len(CLASSES), widths=tuple(args.widths))
    optimiser = torch.optim.Adam(unet.parameters(), lr=1e-2)
    unet.train()
    step, losses = 0, []
    while step < args.steps:
        for x, y in train_loader:
            optimiser.zero_grad()
            loss = F.cross_entropy(unet(x), y)
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
    t_train = time.perf_counter() - start
    print(f"trained {args.steps} steps: cross-entropy {losses[0]:.3f} -> {losses[-1]:.3f}")

    unet.eval()
    la = Laplace(
        unet,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=lsn_ext.DiagBackprop,
    )
    la.fit(DataLoader(TensorDataset(images, labels), batch_size=args.batch))
    la.optimize_prior_precision(method="marglik", prior_structure="scalar")
    prior = la.prior_precision.item()
    t_laplace = time.perf_counter() - start - t_train
    print(f"Laplace on {la.n_params} weights, marglik prior precision {prior:.4g}")

    maps = lsn_ext.predict(
        la, test_images, args.samples, generator=torch.Generator().manual_seed(args.seed)
    )
    t_predict = time.perf_counter() - start - t_train - t_laplace

    np.savez(
        args.out / "maps.npz",
        image=test_images.numpy(),
        label=test_labels.numpy(),
        mean=maps.mean.numpy(),
        variance=maps.variance.numpy(),
        entropy=maps.entropy.numpy(),
        mutual_information=maps.mutual_information.numpy(),
    )
    png = args.out / "uncertainty.png"
    figure(test_images, test_labels, maps, png, rows=min(3, args.test))

    wrong = maps.mean.argmax(1) != test_labels
    edge = boundary(test_labels)
    regions = {"wrong": wrong, "right": ~wrong, "boundary": edge, "interior": ~edge}
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
        "seconds": {"train": t_train, "laplace": t_laplace, "predict": t_predict},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    print(
        f"{args.test} held-out images, {args.samples} posterior samples: pixel accuracy "
        f"{summary['accuracy']:.3f}"
    )
    for name in ("entropy", "mutual_information"):
        parts = "  ".join(f"{k} {v:.4f}" for k, v in summary[name].items())
        print(f"mean {name:18s} {parts}")
    print(f"time: train {t_train:.1f} s, Laplace {t_laplace:.1f} s, predict {t_predict:.1f} s")
    print(f"figure {png}; maps.npz and summary.json in {args.out}")
    return summary


if __name__ == "__main__":
    main()
