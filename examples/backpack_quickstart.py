"""BackPACK quick start: GGN diagonals of segmentation networks, DB and Monte Carlo
==================================================================================

What it shows, for per-pixel cross-entropy (logits `[N, C, H, W]`, targets `[N, H, W]`):

1. A fully convolutional network without skip connections, which BackPACK handles itself:
   `backpack.extend` the network and the loss, then one backward pass each
   `with backpack(DiagGGNExact())`, `with backpack(DiagGGNMC(mc_samples=S))` and `with
   backpack(DiagBackpropExtension())` (lsn_ext's diagonal backpropagation, savefield
   `diag_backprop`).
2. A U-Net with `torch.cat` skips (`lsn_ext.models.UNet`), where BackPACK's converter stops:
   `lsn_ext.backpack_ext.convert` makes an extended copy with `Cat` modules, and `with
   backpack(DiagBackpropExtension())` gives the DB diagonal, equal to `lsn_ext.diag_backprop`.
   The unbiased Monte-Carlo diagonal comes from lsn_ext's own engine
   (`lsn_ext.ggn_diagonal(..., estimator="mc")`, BackPACK's `DiagGGNMC` estimator), the
   exact one from `lsn_ext.exact.exact_ggn_diagonal` (a reference for small images).

Every estimate is compared with the exact diagonal: the relative error over all weights and the
ratio of traces per parameter tensor (printed, and drawn for the U-Net in `trace_ratios.png`).
DB is exact for the last layer and biased below it; Monte Carlo is unbiased, with an error that
shrinks with the samples. The diagonals are saved as `diagonals.pt` and the comparison as
`summary.json`.

Each step prints what it runs and how long it took. Run from the repository root:

```bash
.venv/bin/python examples/backpack_quickstart.py --out examples_out/backpack_quickstart
.venv/bin/python examples/backpack_quickstart.py --quick   # seconds: 8×8 images
LSN_EXT_QUICK=1 .venv/bin/python examples/backpack_quickstart.py   # the same as --quick
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

CLASSES = 3
# Sizes of the full run and of --quick; a flag given on the command line overrides either.
FULL = {"size": 24, "mc_samples": 16}
QUICK = {"size": 8, "mc_samples": 4}
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
    parser.add_argument("--out", type=Path, default=Path("examples_out/backpack_quickstart"))
    parser.add_argument(
        "--size",
        type=int_at_least(4, 4),
        default=argparse.SUPPRESS,
        help=f"image edge, a multiple of 4 (default {FULL['size']}; --quick: {QUICK['size']})",
    )
    parser.add_argument("--batch", type=int_at_least(1), default=2)
    parser.add_argument(
        "--mc-samples",
        type=int_at_least(1),
        default=argparse.SUPPRESS,
        help=f"Monte-Carlo vectors (default {FULL['mc_samples']}; --quick: {QUICK['mc_samples']})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"8×8 images (for tests; also {QUICK_ENV}=1)",
    )
    args = parser.parse_args(argv)
    args.quick = getattr(args, "quick", False) or quick_from_environment(parser)
    return fill_sizes(args, FULL, QUICK)


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

import copy
import json
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
from backpack import backpack, extend
from backpack.extensions import DiagGGNExact, DiagGGNMC
from torch import nn

import lsn_ext
from lsn_ext.backpack_ext import DiagBackpropExtension, convert, diagonals
from lsn_ext.exact import exact_ggn_diagonal
from lsn_ext.models import UNet


def with_backpack(net: nn.Module, x, y, extension, savefield: str) -> dict[str, torch.Tensor]:
    """One backward pass of the summed cross-entropy with ``extension``; ``{name: diagonal}``."""
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    net.zero_grad()
    with backpack(extension):
        lossfunc(net(x), y).backward()
    return {name: getattr(p, savefield).detach().clone() for name, p in net.named_parameters()}


def compare(estimates: dict[str, dict], exact: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Relative error over all weights and the trace ratio per tensor, against ``exact``."""
    flat = torch.cat([v.flatten() for v in exact.values()])
    out = {}
    for name, diag in estimates.items():
        got = torch.cat([diag[k].flatten() for k in exact])
        out[name] = {
            "relative_error": ((got - flat).norm() / flat.norm()).item(),
            "trace_ratio": {k: (diag[k].sum() / exact[k].sum()).item() for k in exact},
        }
    return out


def report(title: str, errors: dict[str, dict]) -> None:
    """Print the relative errors and the per-tensor trace ratios."""
    names = list(errors)
    print(f"\n{title}")
    print(
        "relative error over all weights: "
        + ", ".join(f"{n} {e['relative_error']:.3f}" for n, e in errors.items())
    )
    print(f"{'trace / exact trace':28s}" + "".join(f"{n:>14s}" for n in names))
    for tensor in errors[names[0]]["trace_ratio"]:
        ratios = "".join(f"{errors[n]['trace_ratio'][tensor]:14.3g}" for n in names)
        print(f"  {tensor:26s}{ratios}")


def figure(errors: dict[str, dict], title: str) -> plt.Figure:
    """Bars from 1 to ``trace / exact trace`` per parameter tensor, one colour per estimate."""
    names = list(errors)
    tensors = list(errors[names[0]]["trace_ratio"])
    rows = np.arange(len(tensors))
    height = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.22 * len(tensors)), layout="constrained")
    for i, name in enumerate(names):
        ratios = [errors[name]["trace_ratio"][t] for t in tensors]
        offsets = [r - 1 for r in ratios]
        ax.barh(rows + (i - (len(names) - 1) / 2) * height, offsets, height, left=1, label=name)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(rows, tensors, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("trace of the estimate / trace of the exact GGN diagonal (1: exact)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(args: argparse.Namespace) -> dict:
    """Run both parts; return the summary that is also written to ``summary.json``."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(args.seed)
    plt.switch_backend("Agg")  # files only, no display needed
    # torch notes that BackPACK's full backward hooks fire on module outputs when the input needs
    # no gradient, which is how BackPACK computes its quantities here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = Steps(4)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, CLASSES, (args.batch, args.size, args.size))
    mc = f"MC: {args.mc_samples} samples"

    plain_title = (
        f"1. conv-tanh-conv-tanh-conv, input {tuple(x.shape)}: against BackPACK's DiagGGNExact "
        f"({mc})"
    )
    with steps("plain", "conv-tanh-conv-tanh-conv: DiagGGNExact, DB and DiagGGNMC (BackPACK)"):
        plain = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(8, CLASSES, 1),
        )
        extended = extend(copy.deepcopy(plain))
        plain_exact = with_backpack(extended, x, y, DiagGGNExact(), "diag_ggn_exact")
        plain_diags = {
            "DB": with_backpack(extended, x, y, DiagBackpropExtension(), "diag_backprop"),
            "BackPACK MC": with_backpack(
                extended, x, y, DiagGGNMC(mc_samples=args.mc_samples), "diag_ggn_mc"
            ),
        }
        plain_errors = compare(plain_diags, plain_exact)

    unet = UNet(3, CLASSES, widths=(4, 8, 16)).eval()
    unet_db_step = "U-Net 4-8-16: DB through BackPACK (convert) and lsn_ext.diag_backprop"
    with steps("unet_db", unet_db_step):
        converted = convert(unet, x)  # extended copy; unet itself is untouched
        lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
        with backpack(DiagBackpropExtension()):
            lossfunc(converted(x), y).backward()
        unet_db = {k: v.detach().clone() for k, v in diagonals(converted).items()}
        native = lsn_ext.diag_backprop(unet, x, y, "ce").diagonals
        same_as_native = max(
            ((unet_db[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item()
            for k, v in native.items()
        )

    with steps("unet_mc_exact", f"U-Net: lsn_ext's Monte-Carlo diagonal ({mc}), exact diagonal"):
        unet_mc = lsn_ext.ggn_diagonal(
            unet,
            x,
            y,
            "ce",
            estimator="mc",
            mc_samples=args.mc_samples,
            generator=torch.Generator().manual_seed(args.seed),
        ).diagonals
        unet_exact = exact_ggn_diagonal(unet, x, y, "ce")
        unet_errors = compare({"DB": unet_db, "lsn_ext MC": unet_mc}, unet_exact)

    path, png = args.out / "diagonals.pt", args.out / "trace_ratios.png"
    unet_title = (
        f"2. U-Net 4-8-16 with torch.cat skips, input {tuple(x.shape)}: against "
        f"lsn_ext.exact.exact_ggn_diagonal ({mc})"
    )
    with steps("write", f"write: {path.name} and {png.name} in {args.out}"):
        torch.save(
            {
                "plain": {"exact": plain_exact, **plain_diags},
                "unet": {"exact": unet_exact, "DB": unet_db, "lsn_ext MC": unet_mc},
            },
            path,
        )
        title = f"U-Net 4-8-16 with torch.cat skips, input {tuple(x.shape)}, {mc}"
        fig = figure(unet_errors, title)
        fig.savefig(png, dpi=80)
        plt.close(fig)

    report(plain_title, plain_errors)
    report(unet_title, unet_errors)
    print(
        f"DB through BackPACK vs lsn_ext.diag_backprop: max relative difference "
        f"{same_as_native:.1e}"
    )
    summary = {
        "input_shape": list(x.shape),
        "mc_samples": args.mc_samples,
        "plain": plain_errors,
        "unet": unet_errors,
        "db_backpack_vs_native": same_as_native,
        "files": {"diagonals": str(path), "figure": str(png)},
        "seconds": steps.seconds,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in steps.seconds.items()))
    print(f"figure {png}; diagonals.pt and summary.json in {args.out}")
    return summary


if __name__ == "__main__":
    main(ARGS)
